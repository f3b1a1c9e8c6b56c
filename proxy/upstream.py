"""Sending one stage's request to an instance that runs the stage, and what a request's
trip through the stages looked like.

Runs inside the proxy process (asyncio, httpx). One fail-over path serves plain and
streamed requests: an instance that cannot be reached is skipped for the next one of
the same stage, so an accepted request survives one instance dying.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from epd_serve.proxy.state import InstanceState, InstanceTable


class ProxyError(Exception):
    """An error with the HTTP status the client gets; nothing else escapes a route."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error",
                 unreachable: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.unreachable = unreachable  # no instance could be reached (none answered)

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


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
    kv: dict[str, Any] | None = None  # the KV hand-off's own report, where it gives one
    # How prefill and decode got the images: "ref" (feature references, no pixels),
    # "pixels", or "recompute" (references failed, then pixels); None for text.
    images: str | None = None

    def header(self) -> str:
        """Stages in pipeline order (prefill and decode may run at the same time)."""
        parts = []
        for rec in sorted(self.stages, key=lambda r: "EPD".find(r.stage[0])):
            timing = f":{rec.ms:.1f}ms" if rec.ms is not None else ""
            parts.append(f"{rec.stage}={rec.instance}{timing}")
        if self.kv:
            kv = self.kv
            fields = [str(kv.get("outcome", "?"))]
            for key, unit in (("bytes", "B"), ("transfer_ms", "ms"), ("exposed_ms", "ms"),
                              ("groups", "")):
                if key in kv:
                    fields.append(f"{key.removesuffix('_ms')}={kv[key]}{unit}")
            parts.append("KV=" + ":".join(fields))
        if self.images:
            parts.append(f"IMG={self.images}")
        return ";".join(parts)


def single_token(body: dict, **overrides: Any) -> dict:
    """The request as an encode or prefill stage runs it: one token, not streamed."""
    out = {k: v for k, v in body.items()
           if k not in ("max_completion_tokens", "stream_options", "min_tokens")}
    out.update({"max_tokens": 1, "stream": False, **overrides})
    return out


def final_stage(inst: InstanceState) -> str:
    """Label of the stage that produces the answer: D, or PD for a merged instance."""
    return "D" if not inst.runs("P") else "PD"


def upstream_error(inst: InstanceState, status: int, text: str) -> ProxyError:
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


class Upstream:
    def __init__(self, table: InstanceTable, client: httpx.AsyncClient):
        self.table = table
        self.client = client

    def _order(self, stage: str, order: list[InstanceState] | None) -> list[InstanceState]:
        order = self.table.order(stage) if order is None else order
        if not order:
            raise ProxyError(503, f"no healthy instance runs stage {stage}", "service_unavailable")
        return order

    async def post(self, stage: str, path: str, body: dict, trip: Trip,
                   order: list[InstanceState] | None = None) -> tuple[InstanceState, dict]:
        """Run `body` on an instance of `stage` and return its JSON answer."""
        inst, resp, start = await self._send(stage, path, body, trip, order)
        try:
            text = (await resp.aread()).decode(errors="replace")
        finally:
            inst.in_flight -= 1
            await resp.aclose()
        if resp.status_code >= 400:
            raise upstream_error(inst, resp.status_code, text)
        inst.served += 1
        trip.stages.append(StageRecord(stage, inst.name, (time.perf_counter() - start) * 1e3))
        return inst, json.loads(text)

    async def open_stream(self, stage: str, path: str, body: dict, trip: Trip,
                          order: list[InstanceState] | None = None) -> "Stream":
        """Start `body` as a stream; errors before its first byte raise ProxyError."""
        inst, resp, start = await self._send(stage, path, body, trip, order)
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            inst.in_flight -= 1
            await resp.aclose()
            raise upstream_error(inst, resp.status_code, text)
        record = StageRecord(stage, inst.name)
        trip.stages.append(record)
        return Stream(inst, resp, record, start)

    async def _send(self, stage: str, path: str, body: dict, trip: Trip,
                    order: list[InstanceState] | None) -> tuple[InstanceState, httpx.Response, float]:
        """Send to the first instance of `stage` that takes the request; returns it, its
        answer (body not read yet) and when it was sent. The caller owns the lease."""
        last = ""
        for inst in self._order(stage, order):
            start = time.perf_counter()
            inst.in_flight += 1
            try:
                resp = await self._send_with_reconnect(inst, path, body, trip.request_id)
            except httpx.TransportError as err:
                inst.in_flight -= 1
                inst.failures += 1
                inst.last_error = last = f"{type(err).__name__}: {err}"
                continue
            except BaseException:
                inst.in_flight -= 1
                raise
            return inst, resp, start
        raise ProxyError(502, f"every {stage} instance failed; last error: {last}",
                         "upstream_error", unreachable=True)

    async def _send_with_reconnect(self, inst: InstanceState, path: str, body: dict,
                                   request_id: str) -> httpx.Response:
        """A pooled keep-alive connection that the instance closed just as we reused it
        fails before the request is read; one retry on a fresh connection is safe."""
        request = self.client.build_request("POST", inst.entry.url + path, json=body,
                                            headers={"X-Request-Id": request_id})
        try:
            return await self.client.send(request, stream=True)
        except httpx.RemoteProtocolError:
            request = self.client.build_request("POST", inst.entry.url + path, json=body,
                                                headers={"X-Request-Id": request_id})
            return await self.client.send(request, stream=True)


@dataclasses.dataclass
class Stream:
    """An answer being streamed from an instance; `close()` ends it (the instance then
    aborts the request), iterating relays it and releases the instance's lease."""

    inst: InstanceState
    response: httpx.Response
    record: StageRecord
    started: float
    _released: bool = False

    async def finish(self) -> None:
        """Read the rest of the stream here (not relayed); raises ProxyError if the
        instance reported an error inside it."""
        try:
            text = (await self.response.aread()).decode(errors="replace")
        except httpx.TransportError as err:
            self.inst.failures += 1
            raise ProxyError(502, f"instance {self.inst.name} broke off its answer: {err}",
                             "upstream_error", unreachable=True) from None
        finally:
            self._release()
            await self.response.aclose()
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:]).get("error")
                if error:
                    raise upstream_error(self.inst, int(error.get("code") or 500), json.dumps(error))
        self.inst.served += 1
        self.record.ms = (time.perf_counter() - self.started) * 1e3

    async def close(self) -> None:
        await self.response.aclose()
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.inst.in_flight -= 1

    async def relay(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
            self.inst.served += 1
        finally:
            self._release()
            await self.response.aclose()
