"""One request's trip through the stages: E, then prefill and decode.

Runs inside the proxy process (asyncio). An image request first gets its features: from
the MM Store when it already holds every image (the encoder is skipped), else from the
encoder, which puts them there. Prefill is then hinted to prefetch them, and prefill
and decode get references instead of pixels (proxy/features.py). A merged
prefill+decode instance answers directly; otherwise the deployment's KV hand-off
(proxy/handoff/) runs prefill and decode. If prefill fails on a reference (its feature
went missing), the request is run once more with the pixels: prefill recomputes.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from epd_serve.mmstore import StoreSpec
from epd_serve.proxy.features import FeatureDirectory, Images
from epd_serve.proxy.handoff import make_handoff
from epd_serve.proxy.state import InstanceState, InstanceTable, ProxyConfig
from epd_serve.proxy.upstream import (
    ProxyError,
    StageRecord,
    Trip,
    Upstream,
    final_stage,
    single_token,
)

MULTIMODAL_PART_TYPES = {"image_url", "image", "input_image", "video_url", "video", "image_embeds"}

__all__ = ["Pipeline", "ProxyError", "Trip", "is_multimodal"]


def is_multimodal(body: dict) -> bool:
    """True when any chat message carries an image or video part."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in MULTIMODAL_PART_TYPES:
                    return True
    return False


@dataclasses.dataclass
class Prepared:
    """A request ready for prefill and decode."""

    trip: Trip
    body: dict  # what prefill and decode get: image references where possible
    prefill: list[InstanceState]
    pixel_body: dict | None = None  # the fallback when `body` holds references


class Pipeline:
    def __init__(self, table: InstanceTable, client: httpx.AsyncClient, config: ProxyConfig):
        self.table = table
        self.model = config.model
        self.upstream = Upstream(table, client)
        self.handoff = make_handoff(config.kv_protocol, self.upstream, config)
        self.fault_injection = config.fault_injection
        self.features = None
        if config.mm_store:
            endpoints = [i.prefetch_endpoint for i in config.instances if i.prefetch_endpoint]
            self.features = FeatureDirectory(StoreSpec.from_json(config.mm_store), endpoints)

    async def _encode(self, path: str, body: dict, trip: Trip) -> dict | None:
        """Run the encoder; its `ec_transfer_params`, or None if no encoder could."""
        try:
            _, encoded = await self.upstream.post("E", path, single_token(body), trip)
        except ProxyError as err:
            if err.status < 500:
                raise
            # No encoder could take it: prefill misses the feature and encodes the
            # image itself, slower but the request is not lost.
            trip.stages.append(StageRecord("E", "skipped"))
            return None
        return encoded.get("ec_transfer_params")

    async def _start(self, path: str, body: dict, fault: str | None = None) -> Prepared:
        trip = Trip(request_id=f"epd-{uuid.uuid4().hex}", multimodal=is_multimodal(body))
        # Every instance that can prefill, in turn order; if the first also decodes the
        # request stays there (no KV hand-off).
        prefill = self.table.order("P")
        if not prefill:
            raise ProxyError(503, "no healthy instance runs stage P", "service_unavailable")
        if not (trip.multimodal and self.table.encoders()):
            return Prepared(trip, body, prefill)
        if self.features is None:  # vLLM's file connector: the hash travels in the body
            params = await self._encode(path, body, trip)
            return Prepared(trip, {**body, "ec_transfer_params": params} if params else body,
                            prefill)
        try:
            images = Images(body, self.model)
        except ValueError as err:
            raise ProxyError(400, str(err), "invalid_request_error") from None
        if images.keys:
            images.placeholders = await self.features.stored(images.keys)
        if images.complete:
            trip.stages.append(StageRecord("E", "store", 0.0))  # every image seen before
        else:
            images.learn(await self._encode(path, images.pixel_body, trip))
        if not images.complete:  # video, or the encoder failed: prefill gets the pixels
            trip.images = "pixels"
            return Prepared(trip, images.pixel_body, prefill)
        if fault == "drop-features" and self.fault_injection:
            await self.features.drop(images.keys)
        self.features.hint(prefill[0].entry.prefetch_endpoint, images.keys)
        trip.images = "ref"
        return Prepared(trip, images.reference_body(), prefill, images.pixel_body)

    async def _run(self, req: Prepared, run: Callable[[dict], Awaitable]):
        try:
            return await run(req.body)
        except ProxyError as err:
            if req.pixel_body is None or err.status < 500:
                raise
            # Prefill could not get a feature it was sent a reference to (evicted or
            # lost): send the pixels so it encodes the image itself.
            req.trip.images = "recompute"
            return await run(req.pixel_body)

    @staticmethod
    def _merged(prefill: list[InstanceState]) -> list[InstanceState] | None:
        return [i for i in prefill if i.runs("D")] if prefill[0].runs("D") else None

    async def complete(self, path: str, body: dict,
                       fault: str | None = None) -> tuple[Trip, dict]:
        req = await self._start(path, body, fault)
        if merged := self._merged(req.prefill):
            async def run(request: dict) -> dict:
                return (await self.upstream.post(final_stage(merged[0]), path, request,
                                                 req.trip, merged))[1]
        else:
            async def run(request: dict) -> dict:
                return await self.handoff.complete(path, request, req.trip, req.prefill)
        return req.trip, await self._run(req, run)

    async def open_stream(self, path: str, body: dict,
                          fault: str | None = None) -> tuple[Trip, AsyncIterator[bytes]]:
        """Start the answer as a stream; errors before the first byte raise ProxyError
        (the client still gets a proper status)."""
        req = await self._start(path, body, fault)
        if merged := self._merged(req.prefill):
            async def run(request: dict) -> AsyncIterator[bytes]:
                stream = await self.upstream.open_stream(final_stage(merged[0]), path, request,
                                                         req.trip, merged)
                return stream.relay()
        else:
            async def run(request: dict) -> AsyncIterator[bytes]:
                return await self.handoff.stream(path, request, req.trip, req.prefill)
        return req.trip, await self._run(req, run)

    def close(self) -> None:
        if self.features is not None:
            self.features.close()
