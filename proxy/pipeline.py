"""One request's trip through the stages: E, then prefill and decode.

Runs inside the proxy process (asyncio). The encoder gets the request first when it
carries an image (only the feature hash travels on, in `ec_transfer_params`); a merged
prefill+decode instance then answers it directly; otherwise the deployment's KV
hand-off (proxy/handoff/) runs prefill and decode.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx

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


class Pipeline:
    def __init__(self, table: InstanceTable, client: httpx.AsyncClient, config: ProxyConfig):
        self.table = table
        self.upstream = Upstream(table, client)
        self.handoff = make_handoff(config.kv_protocol, self.upstream, config)

    async def _encode(self, path: str, body: dict, trip: Trip) -> dict:
        """Run the encoder for an image request; returns the body the next stages get."""
        if not (trip.multimodal and self.table.encoders()):
            return body
        try:
            _, encoded = await self.upstream.post("E", path, single_token(body), trip)
        except ProxyError as err:
            if err.status < 500:
                raise
            # No encoder could take it: prefill misses the feature and encodes the
            # image itself, slower but the request is not lost.
            trip.stages.append(StageRecord("E", "skipped"))
            return body
        if encoded.get("ec_transfer_params"):
            return {**body, "ec_transfer_params": encoded["ec_transfer_params"]}
        return body

    async def _start(self, path: str, body: dict) -> tuple[Trip, dict, list[InstanceState]]:
        trip = Trip(request_id=f"epd-{uuid.uuid4().hex}", multimodal=is_multimodal(body))
        body = await self._encode(path, body, trip)
        # Every instance that can prefill, in turn order; if the first also decodes the
        # request stays there (no KV hand-off).
        prefill = self.table.order("P")
        if not prefill:
            raise ProxyError(503, "no healthy instance runs stage P", "service_unavailable")
        return trip, body, prefill

    @staticmethod
    def _merged(prefill: list[InstanceState]) -> list[InstanceState] | None:
        return [i for i in prefill if i.runs("D")] if prefill[0].runs("D") else None

    async def complete(self, path: str, body: dict) -> tuple[Trip, dict]:
        trip, body, prefill = await self._start(path, body)
        if merged := self._merged(prefill):
            _, result = await self.upstream.post(final_stage(merged[0]), path, body, trip, merged)
            return trip, result
        return trip, await self.handoff.complete(path, body, trip, prefill)

    async def open_stream(self, path: str, body: dict) -> tuple[Trip, AsyncIterator[bytes]]:
        """Start the answer as a stream; errors before the first byte raise ProxyError
        (the client still gets a proper status)."""
        trip, body, prefill = await self._start(path, body)
        if merged := self._merged(prefill):
            stream = await self.upstream.open_stream(final_stage(merged[0]), path, body, trip,
                                                     merged)
            return trip, stream.relay()
        return trip, await self.handoff.stream(path, body, trip, prefill)
