"""vllm-ascend's MooncakeLayerwiseConnector: decode first, prefill when decode asks.

The proxy sends decode the request with `do_remote_prefill` and a metaserver URL of
its own made for this request alone (`/v1/metaserver/<token>`, the token random and
known only to the proxy and that decode instance). Decode's scheduler allocates blocks
and POSTs them there (its `kv_transfer_params` for prefill: block ids, host, port,
engine id, ...), naming the request by the id vLLM derived from our `X-Request-Id`
(`chatcmpl-<id>`, `cmpl-<id>-0`), which must match. The proxy then runs prefill with
exactly those parameters and the same `X-Request-Id`; prefill pushes each layer into
decode's memory and decode answers. A POST to any other URL, or naming another
request, is refused: nobody but that decode instance can point prefill's KV anywhere.
What decode is sent and what it reports are the structs of protocols/ascend_layerwise.py
(vllm-ascend's own keys); a report that does not match fails the request with a 502
naming the field.
Written against vllm-ascend's connector and example proxy; exercised here with fake
instances that speak the protocol, not on an NPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from epd_serve.protocols.ascend_layerwise import BlocksReport, DecodeParams
from epd_serve.protocols.params import ParamsError, from_dict, to_dict
from epd_serve.proxy.errors import ProxyError, malformed_params
from epd_serve.proxy.handoff.base import Handoff, cancel_and_wait, decode_body
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import single_token


@dataclasses.dataclass
class PendingPrefill:
    path: str
    body: dict
    trip: Trip
    prefill: list[InstanceState]
    done: asyncio.Future
    engine_request_id: str  # what decode must name
    metaserver_url: str  # where decode reports its blocks, for this request only


class AscendLayerwise(Handoff):
    name = "ascend-layerwise"

    def __init__(self, upstream, config):
        super().__init__(upstream, config)
        if config.host in ("0.0.0.0", "::", ""):
            raise ValueError("the ascend-layerwise hand-off gives decode instances the proxy's "
                             "address to call back: bind the proxy to a reachable address, "
                             f"not {config.host!r}")
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.metaserver_base = f"http://{host}:{config.port}/v1/metaserver"
        self._pending: dict[str, PendingPrefill] = {}  # token -> the request it is for

    @staticmethod
    def _decode_body(body: dict, pending: PendingPrefill) -> dict:
        return decode_body(body, to_dict(DecodeParams(metaserver=pending.metaserver_url)))

    @contextlib.asynccontextmanager
    async def _registered(self, path: str, body: dict, trip: Trip, prefill):
        token = random_hex(24)
        pending = PendingPrefill(path, body, trip, prefill,
                                 asyncio.get_running_loop().create_future(),
                                 _engine_request_id(path, body, trip.request_id),
                                 f"{self.metaserver_base}/{token}")
        self._pending[token] = pending
        try:
            yield pending
        finally:
            self._pending.pop(token, None)

    async def complete(self, path, body, trip, prefill):
        async with self._registered(path, body, trip, prefill) as pending:
            decoding = asyncio.create_task(
                self.upstream.post("D", path, self._decode_body(body, pending), trip))
            try:
                # Decode answers once prefill has pushed the KV; a prefill that fails
                # first ends the request (and decode's, which would wait for nothing).
                await asyncio.wait({pending.done, decoding},
                                   return_when=asyncio.FIRST_COMPLETED)
                if not decoding.done() and pending.done.exception() is not None:
                    raise pending.done.exception()
                return (await decoding)[1]
            except BaseException:
                if not decoding.done():  # asyncio.wait leaves it running when we leave
                    await cancel_and_wait(decoding)
                raise

    async def stream(self, path, body, trip, prefill) -> AsyncIterator[bytes]:
        async with self._registered(path, body, trip, prefill) as pending:
            stream = await self.upstream.open_stream("D", path,
                                                     self._decode_body(body, pending), trip)
            try:
                # Nothing reaches the client before prefill has run: a failed prefill
                # is still an error status, not a broken stream.
                await asyncio.wait_for(pending.done, self.config.request_timeout_s)
            except BaseException:
                await stream.close()
                raise
        return stream.relay()

    def expects_report(self, token: str) -> bool:
        return token in self._pending

    async def metaserver(self, token: str, body: dict) -> dict:
        pending = self._pending.get(token)
        if pending is None:
            raise ProxyError(404, "no request is waiting for its blocks at this metaserver "
                             "URL", "invalid_request_error", reason="unknown_metaserver")
        if body.get("request_id") != pending.engine_request_id:
            raise ProxyError(403, "this metaserver URL belongs to another request",
                             "permission_error", reason="forged_metaserver")
        try:
            try:
                report = from_dict(BlocksReport, body, "metaserver report")
            except ParamsError as err:
                # Decode is waiting for KV that prefill cannot be told where to write:
                # the request fails, naming the field, rather than hang until it times out.
                raise malformed_params(err, "decode") from None
            prefill_body = single_token(pending.body, kv_transfer_params=to_dict(report),
                                        min_tokens=1)
            if "max_completion_tokens" in pending.body:
                prefill_body["max_completion_tokens"] = 1
            await self.upstream.post("P", pending.path, prefill_body, pending.trip,
                                     pending.prefill)
        except ProxyError as err:
            if not pending.done.done():
                pending.done.set_exception(err)
            raise
        if not pending.done.done():
            pending.done.set_result(None)
        return {"status": "ok"}


def _engine_request_id(path: str, body: dict, request_id: str) -> str:
    """The id vLLM gives the request for our X-Request-Id, as decode reports it."""
    if path.endswith("/chat/completions"):
        return f"chatcmpl-{request_id}"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
        raise ProxyError(400, "the ascend-layerwise hand-off takes one prompt per completion "
                              "request", "invalid_request_error")
    return f"cmpl-{request_id}-0"
