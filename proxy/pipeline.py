"""One request's trip through the stages: E -> P -> D, or P -> D for text.

Runs inside the proxy process (asyncio). Talks to vLLM instances over their
OpenAI-compatible HTTP API with httpx; the E->P hand-off is vLLM's EC connector (only
the feature hash travels, inside the request), the P->D hand-off is the KV connector,
driven by `kv_transfer_params`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

import httpx

from epd_serve.proxy.state import InstanceState, InstanceTable

MULTIMODAL_PART_TYPES = {"image_url", "image", "input_image", "video_url", "video", "image_embeds"}


class ProxyError(Exception):
    """An error with the HTTP status the client gets; nothing else escapes a route."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


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
class StageRecord:
    stage: str
    instance: str
    ms: float | None = None  # None while the stage is still streaming


@dataclasses.dataclass
class Trip:
    """What happened to one request, per stage; sent back in the x-epd-stages header."""

    request_id: str
    multimodal: bool
    stages: list[StageRecord] = dataclasses.field(default_factory=list)

    def header(self) -> str:
        parts = []
        for rec in self.stages:
            timing = f":{rec.ms:.1f}ms" if rec.ms is not None else ""
            parts.append(f"{rec.stage}={rec.instance}{timing}")
        return ";".join(parts)


class Pipeline:
    def __init__(self, table: InstanceTable, client: httpx.AsyncClient):
        self.table = table
        self.client = client

    # -- helpers ------------------------------------------------------------
    async def _post_json(self, inst: InstanceState, path: str, body: dict, request_id: str) -> dict:
        resp = await self.client.post(
            inst.entry.url + path, json=body, headers={"X-Request-Id": request_id}
        )
        if resp.status_code >= 400:
            raise _upstream_error(inst, resp.status_code, resp.text)
        return resp.json()

    async def _run_stage(
        self, stage: str, path: str, body: dict, trip: Trip,
        order: list[InstanceState] | None = None,
    ) -> tuple[InstanceState, dict]:
        """Send `body` to an instance of `stage`, failing over to the next one when an
        instance cannot be reached, so an accepted request survives one instance dying."""
        order = self.table.order(stage) if order is None else order
        if not order:
            raise ProxyError(503, f"no healthy instance runs stage {stage}", "service_unavailable")
        last = ""
        for inst in order:
            start = time.perf_counter()
            inst.in_flight += 1
            try:
                result = await self._post_with_reconnect(inst, path, body, trip.request_id)
            except httpx.TransportError as err:
                inst.failures += 1
                inst.last_error = last = f"{type(err).__name__}: {err}"
                continue
            finally:
                inst.in_flight -= 1
            inst.served += 1
            trip.stages.append(StageRecord(stage, inst.name, (time.perf_counter() - start) * 1e3))
            return inst, result
        raise ProxyError(502, f"every {stage} instance failed; last error: {last}", "upstream_error")

    async def _post_with_reconnect(self, inst: InstanceState, path: str, body: dict,
                                   request_id: str) -> dict:
        """A pooled keep-alive connection that the instance closed just as we reused it
        fails before the request is read; one retry on a fresh connection is safe."""
        try:
            return await self._post_json(inst, path, body, request_id)
        except httpx.RemoteProtocolError:
            return await self._post_json(inst, path, body, request_id)

    async def _kv_engine_id(self, inst: InstanceState) -> str:
        """The prefill engine's id, from its Mooncake bootstrap server (cached)."""
        if inst.kv_engine_id is None:
            if not inst.entry.kv_bootstrap_url:
                raise ProxyError(500, f"prefill instance {inst.name} has no KV bootstrap URL")
            try:
                resp = await self.client.get(inst.entry.kv_bootstrap_url + "/query")
            except httpx.TransportError as err:
                raise ProxyError(502, f"KV bootstrap of prefill instance {inst.name} is "
                                      f"unreachable: {err}", "upstream_error") from None
            if resp.status_code != 200:
                raise _upstream_error(inst, resp.status_code, resp.text)
            workers = resp.json()
            if not workers:
                raise ProxyError(503, f"prefill instance {inst.name} has no KV worker registered yet")
            inst.kv_engine_id = next(iter(workers.values()))["engine_id"]
        return inst.kv_engine_id

    # -- the flow -----------------------------------------------------------
    async def prepare(self, path: str, body: dict) -> tuple[Trip, list[InstanceState], dict]:
        """Run every stage before the one that streams tokens back; return the
        instances that can run the final stage (in turn order) and the body to send."""
        trip = Trip(request_id=f"epd-{uuid.uuid4().hex}", multimodal=is_multimodal(body))
        final_body = copy.deepcopy(body)

        if trip.multimodal and self.table.encoders():
            try:
                _, encoded = await self._run_stage("E", path, _single_token(body), trip)
            except ProxyError as err:
                if err.status < 500:
                    raise
                # No encoder could take it: prefill misses the feature and encodes the
                # image itself, slower but the request is not lost.
                trip.stages.append(StageRecord("E", "skipped"))
            else:
                if encoded.get("ec_transfer_params"):
                    final_body["ec_transfer_params"] = encoded["ec_transfer_params"]

        # Round-robin over every instance that can prefill; if it also decodes, the
        # request stays there (no KV transfer), otherwise P -> D.
        prefill_order = self.table.order("P")
        if not prefill_order:
            raise ProxyError(503, "no healthy instance runs stage P", "service_unavailable")
        if prefill_order[0].runs("D"):
            return trip, [i for i in prefill_order if i.runs("D")], final_body

        transfer_id = uuid.uuid4().hex
        prefill_body = _single_token(final_body)
        prefill_body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        p_inst, _ = await self._run_stage("P", path, prefill_body, trip, prefill_order)
        final_body.pop("ec_transfer_params", None)
        final_body["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": p_inst.entry.kv_bootstrap_url,
            "remote_engine_id": await self._kv_engine_id(p_inst),
            "transfer_id": transfer_id,
        }
        # Any decode instance can pull this transfer, so all of them are candidates.
        order = self.table.order("D")
        if not order:
            raise ProxyError(503, "no healthy instance runs stage D", "service_unavailable")
        return trip, order, final_body

    async def complete(self, path: str, body: dict) -> tuple[Trip, dict]:
        trip, candidates, final_body = await self.prepare(path, body)
        _, result = await self._run_stage(_final_stage(candidates[0]), path, final_body, trip,
                                          candidates)
        return trip, result

    async def open_stream(self, path: str, body: dict) -> tuple[Trip, AsyncIterator[bytes]]:
        """Start the final stage as a stream; errors before the first byte raise
        ProxyError (the client still gets a proper status)."""
        trip, candidates, final_body = await self.prepare(path, body)
        last: Exception | None = None
        for inst in candidates:
            request = self.client.build_request(
                "POST", inst.entry.url + path, json=final_body,
                headers={"X-Request-Id": trip.request_id},
            )
            inst.in_flight += 1
            try:
                resp = await self.client.send(request, stream=True)
            except httpx.TransportError as err:
                inst.in_flight -= 1
                inst.failures += 1
                inst.last_error = f"{type(err).__name__}: {err}"
                last = err
                continue
            break
        else:
            raise ProxyError(502, f"every {_final_stage(candidates[0])} instance failed; "
                                  f"last error: {last}", "upstream_error")
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            inst.in_flight -= 1
            raise _upstream_error(inst, resp.status_code, text)
        trip.stages.append(StageRecord(_final_stage(inst), inst.name))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
                inst.served += 1
            finally:
                inst.in_flight -= 1
                await resp.aclose()

        return trip, relay()


def _final_stage(inst: InstanceState) -> str:
    """Label of the stage that produces the answer: D, or PD for a merged instance."""
    return "D" if not inst.runs("P") else "PD"


def _single_token(body: dict) -> dict:
    """A copy of the request that stops after one token and does not stream: what an
    encode or prefill stage needs to run before handing off."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def _upstream_error(inst: InstanceState, status: int, text: str) -> ProxyError:
    message = text
    try:
        parsed: Any = json.loads(text)
        if isinstance(parsed, dict):
            err = parsed.get("error", parsed)
            message = err.get("message", text) if isinstance(err, dict) else str(err)
    except ValueError:
        pass
    # 4xx is the client's request (vLLM validated it): pass it on; 5xx is the instance's.
    if 400 <= status < 500:
        code = status
    else:
        code = 502
        inst.failures += 1
        inst.last_error = f"HTTP {status}: {message[:200]}"
    return ProxyError(code, f"instance {inst.name} answered {status}: {message}", "upstream_error")
