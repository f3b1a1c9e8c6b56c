"""One request's trip through the stages, read straight down: plan the stages, encode
the images (or take them from the MM Store), then prefill and decode.

Runs inside the proxy process (asyncio). routing.plan_stages decides the hops; the
images go to the encoders at once (encoding.py), which put their features in the MM
Store; prefill is hinted to prefetch them, and prefill and decode get references
instead of pixels (features.py). A merged prefill+decode instance answers directly;
otherwise the deployment's KV hand-off (handoff/) runs prefill and decode. If prefill
fails on a reference (its feature went missing), the request runs once more with the
pixels: prefill recomputes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from epd_serve.mmstore import StoreSpec
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.encoding import Encoder, NoEncoder
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.features import FeatureDirectory, Images, all_parts
from epd_serve.proxy.handoff import make_handoff
from epd_serve.proxy.routing import RouteRequest, Router, StagePlan, plan_stages
from epd_serve.proxy.state import InstanceTable
from epd_serve.proxy.trip import StageRecord, Trip
from epd_serve.proxy.upstream import Upstream

IMAGE_PARTS = {"image_url"}
OTHER_MEDIA_PARTS = {"image", "input_image", "video_url", "video", "input_audio", "audio_url",
                     "image_embeds"}
# Qwen-VL: one prompt token per 28x28 pixels after the 2x2 merge; text: ~4 chars a token.
PIXELS_PER_TOKEN = 28 * 28
CHARS_PER_TOKEN = 4

__all__ = ["Pipeline", "Request"]


@dataclasses.dataclass
class Request:
    """A request the guards admitted."""

    path: str
    body: dict
    request_id: str
    image_pixels: list[int]  # per image_url part, in prompt order (0: unknown)
    text_chars: int
    fault: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclasses.dataclass
class Prepared:
    """A request ready for prefill and decode."""

    body: dict  # what prefill and decode get: image references where possible
    pixel_body: dict | None = None  # the fallback when `body` holds references


def media_kinds(body: dict) -> tuple[int, bool]:
    """(image_url parts, whether other media parts are present) of a chat request."""
    kinds = [part.get("type") for part in all_parts(body)]
    return (sum(kind in IMAGE_PARTS for kind in kinds),
            any(kind in OTHER_MEDIA_PARTS for kind in kinds))


class Pipeline:
    def __init__(self, table: InstanceTable, router: Router, upstream: Upstream,
                 config: ProxyConfig):
        self.table = table
        self.router = router
        self.upstream = upstream
        self.config = config
        self.handoff = make_handoff(config.kv_protocol, upstream, config)
        self.encoder = Encoder(upstream, router, config.routing.encoder_batch,
                               config.routing.fan_out)
        self.features = None
        if config.mm_store:
            endpoints = [i.prefetch_endpoint for i in config.instances if i.prefetch_endpoint]
            self.features = FeatureDirectory(StoreSpec.from_json(config.mm_store), endpoints)

    async def run(self, req: Request) -> tuple[Trip, dict | AsyncIterator[bytes]]:
        """Serve the request: the JSON answer, or the stream to relay."""
        n_images, other_media = media_kinds(req.body)
        tokens = req.text_chars / CHARS_PER_TOKEN + sum(req.image_pixels) / PIXELS_PER_TOKEN
        trip = Trip(req.request_id, multimodal=bool(n_images or other_media),
                    route=RouteRequest(cost=max(1.0, tokens)))
        images = Images(req.body, self.config.model) if n_images else None
        stored = await self._stored(images)
        plan = plan_stages(n_images, stored, other_media, self.table.roster)
        prepared = await self._encode(req, plan, images, trip)
        final = self._final_hop(req, plan, trip, images)
        return trip, await self._with_recompute(prepared, trip, final)

    async def _stored(self, images: Images | None) -> list[bool]:
        if images is None:
            return []
        if self.features is None:
            return [False] * len(images.keys)
        found = await self.features.stored(images.keys)
        images.placeholders.update(found)
        return [k in found for k in images.keys]

    async def _encode(self, req: Request, plan: StagePlan, images: Images | None,
                      trip: Trip) -> Prepared:
        """Get the features of the request's media; the body prefill and decode get."""
        if not trip.multimodal or not (plan.encode or plan.stored):
            return Prepared(req.body)  # text, or a deployment whose prefill encodes
        pixel_body = images.pixel_body if images else req.body
        try:
            if plan.pixels_to_prefill:  # video or audio: encoders take the request whole
                params = await self.encoder.encode_whole(req.path, pixel_body, trip)
                trip.images = "pixels"
                return Prepared({**pixel_body, "ec_transfer_params": params} if params
                                else pixel_body)
            if plan.encode:
                sizes = [float(p or 1) for p in req.image_pixels]
                await self.encoder.encode_images(req.path, images, list(plan.encode), sizes,
                                                 trip)
            else:
                trip.stages.append(StageRecord("E", "store", 0.0))  # every image seen before
        except NoEncoder:
            if self.config.routing.encode_fallback != "prefill":
                raise
            trip.stages.append(StageRecord("E", "skipped"))
            trip.images = "pixels"
            return Prepared(pixel_body)  # prefill encodes the images itself
        if self.features is None:  # vLLM's file connector: the hashes travel in the body
            trip.images = "pixels"
            return Prepared({**pixel_body, "ec_transfer_params": images.ec_params})
        if not images.complete:  # the encoder published no metadata: send the pixels
            trip.images = "pixels"
            return Prepared(pixel_body)
        if req.fault == "drop-features" and self.config.fault_injection:
            await self.features.drop(images.keys)
        trip.images = "ref"
        return Prepared(images.reference_body(), pixel_body)

    def _final_hop(self, req: Request, plan: StagePlan, trip: Trip,
                   images: Images | None) -> Callable[[dict], Awaitable]:
        """Prefill and decode: on one merged instance, or through the KV hand-off."""
        hop = "PD" if plan.final == "PD" else "P"
        candidates = self.router.choose(hop, trip.route)
        if not candidates:
            raise ProxyError(503, f"no healthy instance runs stage {hop}",
                             "service_unavailable", reason=f"no_{hop}")
        if hop == "PD":
            if req.stream:
                async def run(body: dict):
                    stream = await self.upstream.open_stream("PD", req.path, body, trip,
                                                             candidates)
                    return stream.relay()
            else:
                async def run(body: dict):
                    return (await self.upstream.post("PD", req.path, body, trip, candidates))[1]
        elif req.stream:
            async def run(body: dict):
                return await self.handoff.stream(req.path, body, trip, candidates)
        else:
            async def run(body: dict):
                return await self.handoff.complete(req.path, body, trip, candidates)
        if self.features is not None and trip.images == "ref":
            # Tell the likely prefill instance which features to pull, ahead of the request.
            self.features.hint(candidates[0].entry.prefetch_endpoint, images.keys)
        return run

    async def _with_recompute(self, prepared: Prepared, trip: Trip,
                              run: Callable[[dict], Awaitable]):
        try:
            return await run(prepared.body)
        except ProxyError as err:
            if prepared.pixel_body is None or err.status < 500:
                raise
            # Prefill could not get a feature it was sent a reference to (evicted or
            # lost): send the pixels so it encodes the image itself.
            trip.images = "recompute"
            return await run(prepared.pixel_body)

    def close(self) -> None:
        if self.features is not None:
            self.features.close()
