"""vllm-ascend's MooncakeLayerwiseConnector: decode first, prefill when decode asks.

The proxy sends decode the request with `do_remote_prefill` and the URL of its own
`/v1/metaserver`. Decode's scheduler allocates blocks and POSTs them there (its
`kv_transfer_params` for prefill: block ids, host, port, engine id, ...), naming the
request by the id vLLM derived from our `X-Request-Id` (`chatcmpl-<id>`,
`cmpl-<id>-0`). The proxy then runs prefill with exactly those parameters and the same
`X-Request-Id`; prefill pushes each layer into decode's memory and decode answers.
Written against vllm-ascend's connector and example proxy; exercised here with fake
instances that speak the protocol, not on an NPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from epd_serve.proxy.handoff.base import Handoff, cancel_and_wait, decode_body
from epd_serve.proxy.errors import ProxyError
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


class AscendLayerwise(Handoff):
    name = "ascend-layerwise"

    def __init__(self, upstream, config):
        super().__init__(upstream, config)
        if config.host in ("0.0.0.0", "::", ""):
            raise ValueError("the ascend-layerwise hand-off gives decode instances the proxy's "
                             "address to call back: bind the proxy to a reachable address, "
                             f"not {config.host!r}")
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.metaserver_url = f"http://{host}:{config.port}/v1/metaserver"
        self._pending: dict[str, PendingPrefill] = {}

    def _decode_body(self, body: dict) -> dict:
        return decode_body(body, {"do_remote_decode": False, "do_remote_prefill": True,
                                  "metaserver": self.metaserver_url})

    @contextlib.asynccontextmanager
    async def _registered(self, path: str, body: dict, trip: Trip, prefill):
        key = _engine_request_id(path, body, trip.request_id)
        pending = PendingPrefill(path, body, trip, prefill,
                                 asyncio.get_running_loop().create_future())
        self._pending[key] = pending
        try:
            yield pending
        finally:
            self._pending.pop(key, None)

    async def complete(self, path, body, trip, prefill):
        async with self._registered(path, body, trip, prefill) as pending:
            decoding = asyncio.create_task(
                self.upstream.post("D", path, self._decode_body(body), trip))
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
            stream = await self.upstream.open_stream("D", path, self._decode_body(body), trip)
            try:
                # Nothing reaches the client before prefill has run: a failed prefill
                # is still an error status, not a broken stream.
                await asyncio.wait_for(pending.done, self.config.request_timeout_s)
            except BaseException:
                await stream.close()
                raise
        return stream.relay()

    async def metaserver(self, body: dict) -> dict:
        request_id = body.get("request_id")
        pending = self._pending.get(request_id) if isinstance(request_id, str) else None
        if pending is None:
            raise ProxyError(404, f"unknown metaserver request_id {request_id!r}",
                             "invalid_request_error")
        prefill_body = single_token(pending.body, kv_transfer_params=body, min_tokens=1)
        if "max_completion_tokens" in pending.body:
            prefill_body["max_completion_tokens"] = 1
        try:
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
