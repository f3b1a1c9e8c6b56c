"""One request's trip through the stages, read straight down: plan the stages, encode
the images and videos (or take them from the MM Store), then prefill and decode.

Runs inside the proxy process (asyncio). routing.plan_stages decides the hops; the
images and the videos' chunks of frames go to the encoders at once (encoding.py),
which put their features in the MM Store; prefill is hinted to prefetch them, and
prefill and decode get references instead of pixels (features.py), or, where their
engine takes no reference (`feature_refs: pixels`) and for a video whose encoders
published no grid, the pixels tagged with the features' keys. A merged
prefill+decode instance answers directly; otherwise the deployment's KV hand-off
(handoff/) runs prefill and decode. If prefill fails on a reference (its feature went
missing), the request runs once more with the pixels: prefill recomputes (with the
pixels from the start, it does so without failing).

A stage with no healthy instance is stood in for (routing.with_stand_in, counted in
epd_proxy_fallbacks_total and shown as FALLBACK=... in x-epd-stages): with every P down
a decode instance runs the request whole, computing the prompt; with every D down a
prefill instance decodes it; with no encoder the instance computing the prompt gets
the pixels (routing.encode_fallback). A hand-off whose end dies under a request (its
connection refused, or it hung: upstream.py) is planned again once with the live table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from epd_serve.mmstore import StoreSpec
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.encoding import Encoder, NoEncoder
from epd_serve.proxy.errors import HandoffError, ProxyError, no_instance
from epd_serve.proxy.features import EncodeItems, FeatureDirectory
from epd_serve.proxy.handoff import make_handoff
from epd_serve.proxy.request import ParsedRequest
from epd_serve.proxy.routing import (
    Router,
    RouteRequest,
    StagePlan,
    computing_hop,
    down_hops,
    plan_stages,
    with_stand_in,
)
from epd_serve.proxy.state import InstanceTable
from epd_serve.proxy.trip import StageRecord, Trip
from epd_serve.proxy.upstream import Upstream

# Qwen-VL: one prompt token per 28x28 pixels after the 2x2 merge; text: ~4 chars a token.
PIXELS_PER_TOKEN = 28 * 28
CHARS_PER_TOKEN = 4

__all__ = ["Pipeline", "Request"]


@dataclasses.dataclass
class Request:
    """A request admitted, parsed and sealed (request.py): every media part keyed."""

    parsed: ParsedRequest
    request_id: str  # what the engines get: unique per request (context.Proxy.request_ids_for)
    fault: str | None = None
    trace_id: str = ""  # W3C trace id every hop sends (timeline.py)
    timeline_id: str = ""  # where its timeline is filed (GET /v1/traces/{timeline_id})

    @property
    def path(self) -> str:
        return self.parsed.path

    @property
    def body(self) -> dict:
        return self.parsed.sent

    @property
    def stream(self) -> bool:
        return self.parsed.stream


@dataclasses.dataclass
class Prepared:
    """A request ready for prefill and decode."""

    body: dict  # what prefill and decode get: image references where possible
    pixel_body: dict | None = None  # the fallback when `body` holds references


def whole_request(body: dict, hop: str) -> dict:
    """The request as one instance runs it whole. A P or D standing in for the other
    gets no KV hand-off; a D gets no encoder hand-off either (it takes image references
    from the MM Store like prefill, and without the store it is no EC consumer: it
    encodes the pixels in the body). A merged PD instance gets the body as it is."""
    if hop == "PD":
        return body
    drop = ("kv_transfer_params", "ec_transfer_params") if hop == "D" \
        else ("kv_transfer_params",)
    return {k: v for k, v in body.items() if k not in drop}


class Pipeline:
    def __init__(self, table: InstanceTable, router: Router, upstream: Upstream,
                 config: ProxyConfig):
        self.table = table
        self.router = router
        self.upstream = upstream
        self.metrics = upstream.metrics
        self.config = config
        self.stand_in = config.routing.handoff_fallback == "stand-in"
        self.local_prefill_max_tokens = config.routing.local_prefill_max_tokens  # 0: off
        self.handoff = make_handoff(config.kv_protocol, upstream, config)
        self.encoder = Encoder(upstream, router, config.routing.encoder_batch,
                               config.routing.fan_out)
        self.features = None
        # The engines take no metadata-only reference: prefill and decode get the pixels.
        self.send_pixels = config.feature_refs == "pixels"
        if config.mm_store:
            endpoints = [i.prefetch_endpoint for i in config.instances if i.prefetch_endpoint]
            self.features = FeatureDirectory(StoreSpec.from_json(config.mm_store), endpoints)

    async def run(self, req: Request) -> tuple[Trip, dict | AsyncIterator[bytes]]:
        """Serve the request: the JSON answer, or the stream to relay."""
        parsed = req.parsed
        encodable = parsed.images + parsed.videos
        tokens = (parsed.text_chars / CHARS_PER_TOKEN
                  + sum(i.pixels for i in encodable) / PIXELS_PER_TOKEN)
        trip = Trip(req.request_id, multimodal=bool(parsed.media),
                    route=RouteRequest(cost=max(1.0, tokens)), trace_id=req.trace_id)
        work = EncodeItems(parsed) if encodable else None
        stored = await self._stored(work)
        plan = plan_stages(len(stored), stored, parsed.other_media, self.table.roster,
                           self._down(), self.stand_in)
        if parsed.whole_prompt and plan.final == "P+D":
            # vLLM computes such a prompt itself wherever it is answered (it reads no
            # prompt KV then): decode does it alone, prefill is not asked for nothing.
            plan = dataclasses.replace(plan, final="D")
            trip.whole_prompt = parsed.whole_prompt
        elif plan.final == "P+D" and 0 < self.local_prefill_max_tokens and \
                tokens <= self.local_prefill_max_tokens:
            # Short enough that decode computes it sooner than the hand-off would bring it.
            plan = dataclasses.replace(plan, final="D")
            trip.whole_prompt = "short"
        self._stood_in(trip, plan.stand_ins)
        prepared = await self._encode(req, plan, work, trip)
        # Requests whose images prefill encodes for want of an encoder: the work of an
        # empty E stage, which the role controller weighs (role_control.py).
        encoded_by_prefill = any(missing == "E" for missing, _ in trip.stand_ins)
        self.table.stood_in["E"] += encoded_by_prefill
        try:
            return trip, await self._prefill_decode(req, plan, prepared, trip, work)
        except ProxyError as err:
            # An instance stopped answering under this request (it died, or hung: either
            # took it out of the table). Planned once more from the table as it is now:
            # the other end of the hand-off stands in, as it does for every request
            # planned from now on, or another instance of the stage serves it (one that
            # came up while this one waited: a restart, or a role switch refilling it).
            if not err.unreachable:
                raise
            down = self._down()
            again = with_stand_in(plan, down) if self.stand_in else plan
            # Its images are encoded already: only prefill and decode run again.
            if again == plan and down & (set(plan.hops) - {"E"}):
                raise
            self._stood_in(trip, again.stand_ins)
            return trip, await self._prefill_decode(req, again, prepared, trip, work)
        finally:
            self.table.stood_in["E"] -= encoded_by_prefill

    def _down(self) -> frozenset[str]:
        return down_hops(self.table.instances, self.table.roster)

    def _stood_in(self, trip: Trip, stand_ins: Iterable[tuple[str, str]]) -> None:
        """Record (and count) stages whose work another stage does for this request."""
        for missing, standin in stand_ins:
            if (missing, standin) not in trip.stand_ins:
                trip.stand_ins.append((missing, standin))
                self.metrics.fallbacks.labels(missing, standin).inc()

    async def _stored(self, work: EncodeItems | None) -> list[bool]:
        if work is None:
            return []
        if self.features is None:
            return [False] * len(work)
        found = await self.features.stored(work.keys)
        work.placeholders.update(found)
        # Sent with its pixels, an image needs only its feature in the store (a video
        # always is); sent as a reference, also the placeholder metadata (the grid) the
        # encoder published.
        return [k in found if self.send_pixels or work.is_chunk(i) else bool(found.get(k))
                for i, k in enumerate(work.keys)]

    async def _encode(self, req: Request, plan: StagePlan, work: EncodeItems | None,
                      trip: Trip) -> Prepared:
        """Get the features of the request's media; the body prefill and decode get."""
        if not trip.multimodal or not (plan.encode or plan.stored):
            return Prepared(req.body)  # text, or a deployment whose prefill encodes
        pixel_body = work.pixel_body if work else req.body
        try:
            if plan.pixels_to_prefill:  # video or audio: encoders take the request whole
                params = await self.encoder.encode_whole(req.path, pixel_body, trip)
                trip.images = "pixels"
                return Prepared({**pixel_body, "ec_transfer_params": params} if params
                                else pixel_body)
            if plan.encode:
                await self.encoder.encode(req.path, work, list(plan.encode), trip)
            else:
                trip.stages.append(StageRecord("E", "store", 0.0))  # every item seen before
        except NoEncoder:
            if self.config.routing.encode_fallback != "prefill":
                raise
            trip.stages.append(StageRecord("E", "skipped"))
            self._stood_in(trip, [("E", computing_hop(plan))])
            trip.images = "pixels"
            return Prepared(pixel_body)  # prefill (or its stand-in) encodes the images
        if self.features is None:  # vLLM's file connector: the hashes travel in the body
            trip.images = "pixels"
            return Prepared({**pixel_body, "ec_transfer_params": work.ec_params})
        if req.fault == "drop-features" and self.config.fault_injection:
            await self.features.drop(work.keys)
        if self.send_pixels or (work.has_video and not work.complete):
            # Each medium carries its key as uuid: the engine loads the stored feature
            # (a video's chunks, joined) and encodes only a medium whose feature it
            # cannot get, so there is nothing to send again.
            trip.images = "keyed"
            return Prepared(work.keyed_body())
        if not work.complete:  # the encoder published no metadata: send the pixels
            trip.images = "pixels"
            return Prepared(pixel_body)
        trip.images = "ref"
        return Prepared(work.reference_body(), work.keyed_body())

    async def _prefill_decode(self, req: Request, plan: StagePlan, prepared: Prepared,
                              trip: Trip, work: EncodeItems | None):
        return await self._with_recompute(prepared, trip,
                                          self._final_hop(req, plan, trip, work))

    def _final_hop(self, req: Request, plan: StagePlan, trip: Trip,
                   work: EncodeItems | None) -> Callable[[dict], Awaitable]:
        """Prefill and decode: through the KV hand-off, or on one instance that runs the
        request whole (a merged PD instance, or a P or D standing in for the other)."""
        hop = computing_hop(plan)
        candidates = self.router.choose(hop, trip.route)
        if not candidates:
            raise no_instance(hop)
        trip.final_hop = "D" if plan.final == "P+D" else plan.final
        if plan.final != "P+D":
            if req.stream:
                async def run(body: dict):
                    stream = await self.upstream.open_stream(
                        hop, req.path, whole_request(body, hop), trip, candidates)
                    return stream.relay()
            else:
                async def run(body: dict):
                    return (await self.upstream.post(hop, req.path, whole_request(body, hop),
                                                     trip, candidates))[1]
        elif req.stream:
            async def run(body: dict):
                return await self.handoff.stream(req.path, body, trip, candidates)
        else:
            async def run(body: dict):
                return await self.handoff.complete(req.path, body, trip, candidates)
        if self.features is not None and trip.images in ("ref", "keyed"):
            # Tell the likely prefill instance which features to pull, ahead of the request.
            self.features.hint(candidates[0].entry.prefetch_endpoint, work.prefill_keys)
        return run

    async def _with_recompute(self, prepared: Prepared, trip: Trip,
                              run: Callable[[dict], Awaitable]):
        try:
            return await run(prepared.body)
        except ProxyError as err:
            if prepared.pixel_body is None or err.status < 500 or err.unreachable \
                    or isinstance(err, HandoffError):  # the pixels would not mend that
                raise
            # Prefill could not get a feature it was sent a reference to (evicted or
            # lost): send the pixels so it encodes the image itself.
            trip.images = "recompute"
            return await run(prepared.pixel_body)

    def close(self) -> None:
        if self.features is not None:
            self.features.close()
