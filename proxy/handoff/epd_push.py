"""Our connector (epd_serve/connectors/epd_kv): decode and prefill start together.

Prefill runs the request with `do_remote_decode`, streamed: its answer's headers say it
has parsed the request and handed it to its engine. Then decode gets the request with
`do_remote_prefill` and the prefill instance's side channel; it allocates blocks and
reserves them with that prefill worker, which writes each layer group into them as it
computes (groups computed before the reservation leave at once when it arrives). So
decode's own parsing overlaps prefill's compute, not prefill's parsing, which on a
small host competes for the same cores. The answer is decode's; it is released to the
client once prefill has succeeded. If prefill fails, decode's request is closed (the engine aborts it and
frees its blocks) and the pair is retried on the next prefill instance; a 4xx from
prefill is the client's error and is returned as is. When the last prefill instance
cannot be reached at all (it died), decode's request is kept: decode notices the dead
peer and computes the prompt itself, so the request is slower but not lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from epd_serve.proxy.handoff.base import Handoff, cancel_and_wait, decode_body
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import single_token

# Keys of kv_transfer_params a client may set to steer our connector per request
# (transfer mode, fault injection where the deployment allows it); passed to prefill.
MODE_KEY, FAULT_KEY = "epd_mode", "epd_fault"
PASSTHROUGH_KEYS = (MODE_KEY, FAULT_KEY)


class EPDPush(Handoff):
    name = "epd"
    client_kv_keys = frozenset({MODE_KEY})
    fault_kv_keys = frozenset({FAULT_KEY})

    async def complete(self, path, body, trip, prefill):
        async def decode(request):
            return (await self.upstream.post("D", path, request, trip))[1]

        result = await self._run(path, body, trip, prefill, decode, _discard_result)
        trip.kv = (result.get("kv_transfer_params") or {}).get("epd_kv")
        return result

    async def stream(self, path, body, trip, prefill) -> AsyncIterator[bytes]:
        async def decode(request):
            return await self.upstream.open_stream("D", path, request, trip)

        async def close(stream):
            await stream.close()

        return (await self._run(path, body, trip, prefill, decode, close)).relay()

    async def _run(self, path: str, body: dict, trip: Trip, prefill: list[InstanceState],
                   decode: Callable[[dict], Awaitable], discard: Callable[[object], Awaitable]):
        last: ProxyError | None = None
        steering = {k: v for k, v in (body.get("kv_transfer_params") or {}).items()
                    if k in PASSTHROUGH_KEYS}
        for index, p_inst in enumerate(prefill):
            if index:
                self.upstream.note_retry("P", trip)
            host, _, port = (p_inst.entry.kv_endpoint or "").rpartition(":")
            if not host:
                raise ProxyError(500, f"prefill instance {p_inst.name} has no KV side channel")
            transfer_id = random_hex(16)
            decode_request = decode_body(body, {
                "do_remote_prefill": True, "do_remote_decode": False,
                "transfer_id": transfer_id, "remote_host": host, "remote_port": int(port)})
            prefill_body = single_token(body, stream=True, kv_transfer_params={
                "do_remote_decode": True, "do_remote_prefill": False,
                "transfer_id": transfer_id, **steering})
            decoding = None
            try:
                prefilling = await self.upstream.open_stream("P", path, prefill_body, trip,
                                                             [p_inst])
                decoding = asyncio.create_task(decode(decode_request))
                await prefilling.finish()
            except ProxyError as err:
                if decoding is None:  # prefill never took it: nothing started on decode
                    if err.status < 500:
                        raise
                    last = err
                    continue
                if err.unreachable and index == len(prefill) - 1:
                    return await decoding
                await _cancel(decoding, discard)
                if err.status < 500:
                    raise
                last = err
                continue
            except BaseException:
                if decoding is not None:
                    await _cancel(decoding, discard)
                raise
            return await decoding
        raise last or ProxyError(503, "no healthy instance runs stage P", "service_unavailable")


async def _discard_result(_result) -> None:
    return None


async def _cancel(task: asyncio.Task, discard: Callable[[object], Awaitable]) -> None:
    """Stop a decode request whose prefill failed: cancelling closes its connection,
    which makes the engine abort it; an answer it already has is discarded."""
    try:
        if not task.done():
            await cancel_and_wait(task)
    finally:
        if task.done() and not task.cancelled() and task.exception() is None:
            await discard(task.result())
