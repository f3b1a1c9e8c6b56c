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
peer and computes the prompt itself, so the request is slower but not lost. A decoder
that went out after the request was planned, leaving none, ends prefill's hop at once
and the request is planned again (prefill standing in where the deployment allows it),
rather than refused once prefill has finished for nothing. A prefill
found hung is not dead (its worker may answer decode while its engine core computes
nothing): decode's hop ends too, and the request is planned again without it; so does
a decode hop still waiting when the prefill that answered it is found hung (its KV
writes held back, decode's blocks fenced until they end).
What both are sent and the transfer report decode answers with are the structs of
protocols/epd_push.py; a report that does not match, or that says decode refused what
it was sent (a field missing or renamed), fails the request with a 502 naming the
field, rather than pass for a transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from epd_serve.protocols.epd_push import (
    FAULT_KEY,
    MODE_KEY,
    REPORT_KEY,
    VERSION_KEY,
    DecodeParams,
    PrefillParams,
    Steering,
    TransferReport,
)
from epd_serve.protocols.params import ParamsError, from_dict, to_dict
from epd_serve.proxy.errors import (
    HandoffError,
    ProxyError,
    bad_request,
    malformed_params,
    no_instance,
)
from epd_serve.proxy.handoff.base import Handoff, cancel_and_wait, decode_body
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import single_token

# Keys of kv_transfer_params a client may set to steer our connector per request
# (transfer mode, fault injection where the deployment allows it); passed to prefill.
PASSTHROUGH_KEYS = (MODE_KEY, FAULT_KEY)
HUNG_WATCH_S = 0.5  # how often decode's wait looks whether its prefill was found hung


class EPDPush(Handoff):
    name = "epd"
    client_kv_keys = frozenset({MODE_KEY})
    fault_kv_keys = frozenset({FAULT_KEY})
    decode_samples = True  # its samples share the transfer (connectors/epd_kv/scheduler.py)

    async def complete(self, path, body, trip, prefill):
        async def decode(request, decoders):
            return (await self.upstream.post("D", path, request, trip, decoders))[1]

        result = await self._run(path, body, trip, prefill, decode, _discard_result)
        report = read_report(result)
        # What the timeline and x-epd-stages show: the measures, not the wire's version.
        trip.kv = {k: v for k, v in to_dict(report).items() if k != VERSION_KEY} \
            if report is not None else None
        if report is not None and report.outcome == "refused":
            raise HandoffError(f"decode refused the KV hand-off parameters it was sent: "
                               f"{report.reason}")
        return result

    async def stream(self, path, body, trip, prefill) -> AsyncIterator[bytes]:
        async def decode(request, decoders):
            return await self.upstream.open_stream("D", path, request, trip, decoders)

        async def close(stream):
            await stream.close()

        return (await self._run(path, body, trip, prefill, decode, close)).relay()

    async def _run(self, path: str, body: dict, trip: Trip, prefill: list[InstanceState],
                   decode: Callable[[dict], Awaitable], discard: Callable[[object], Awaitable]):
        last: ProxyError | None = None
        steering = client_steering(body)
        for index, p_inst in enumerate(prefill):
            if index:
                self.upstream.note_retry("P", trip)
            host, _, port = (p_inst.entry.kv_endpoint or "").rpartition(":")
            if not host or not port.isdigit():
                raise ProxyError(500, f"prefill instance {p_inst.name} has no KV side channel "
                                 "(host:port)")
            transfer_id = random_hex(16)
            decode_request = decode_body(body, to_dict(DecodeParams(
                transfer_id=transfer_id, remote_host=host, remote_port=int(port))))
            prefill_body = single_token(body, stream=True, kv_transfer_params=to_dict(
                PrefillParams(transfer_id=transfer_id, epd_mode=steering.epd_mode,
                              epd_fault=steering.epd_fault)))
            try:
                prefilling = await self.upstream.open_stream("P", path, prefill_body, trip,
                                                             [p_inst])
            except ProxyError as err:  # prefill never took it: nothing started on decode
                if err.status < 500:
                    raise
                last = err
                continue
            decoders = self.upstream.choose("D", trip)
            if not decoders:
                # The last decoder went out since the request was planned: prefill is
                # stopped now, not left to finish before the request is refused, and the
                # pipeline plans the request again (prefill standing in, where allowed).
                await prefilling.close()
                raise no_instance("D", unreachable=True)
            decoding = asyncio.create_task(decode(decode_request, decoders))
            try:
                await prefilling.finish()
            except ProxyError as err:
                if err.unreachable and err.reason != "instance_hung" \
                        and index == len(prefill) - 1:
                    # Prefill is gone: decode notices its dead peer and computes the
                    # prompt. (A hung prefill is not: its worker may still answer decode
                    # while its engine computes nothing, so decode's hop is ended too.)
                    return await decoding
                await _cancel(decoding, discard)
                if err.status < 500:
                    raise
                last = err
                continue
            except BaseException:
                await _cancel(decoding, discard)
                raise
            return await _unless_hung(decoding, p_inst, discard)
        raise last or ProxyError(503, "no healthy instance runs stage P", "service_unavailable")


def client_steering(body: dict) -> Steering:
    """The keys of the client's kv_transfer_params that steer our connector (request.py
    has refused every other); a wrong value is the client's to fix."""
    given = {k: v for k, v in (body.get("kv_transfer_params") or {}).items()
             if k in PASSTHROUGH_KEYS}
    try:
        return from_dict(Steering, given, "kv_transfer_params")
    except ParamsError as err:
        raise bad_request(str(err), "bad_kv_transfer_params") from None


def read_report(result: dict) -> TransferReport | None:
    """Decode's transfer report from its answer, None where it gave none (it computed
    the prompt itself without a transfer, e.g. prefill was unreachable)."""
    params = result.get("kv_transfer_params")
    raw = params.get(REPORT_KEY) if isinstance(params, dict) else params
    if raw is None:
        return None
    try:
        return from_dict(TransferReport, raw, f"kv_transfer_params.{REPORT_KEY}")
    except ParamsError as err:
        raise malformed_params(err, "decode") from None


async def _discard_result(_result) -> None:
    return None


async def _unless_hung(decoding: asyncio.Task, prefill: InstanceState,
                       discard: Callable[[object], Awaitable]):
    """Decode's answer, unless the prefill that wrote its KV is found hung first (a
    prefill stopped after it answered, with writes still queued). Decode then holds the
    request until that prefill says its writes ended (its blocks fenced:
    connectors/epd_kv/receiver.py), for as long as it stays stopped; closed and planned
    again instead, the request is served at once without it. (A stream's answer is
    decode's once its headers came: it waits.)"""
    while True:
        done, _ = await asyncio.wait((decoding,), timeout=HUNG_WATCH_S)
        if done:
            return decoding.result()
        if prefill.hung_since is not None:
            await _cancel(decoding, discard)
            raise ProxyError(502, f"prefill instance {prefill.name} hung with this request's "
                             "KV still to write", "upstream_error", unreachable=True,
                             reason="instance_hung")


async def _cancel(task: asyncio.Task, discard: Callable[[object], Awaitable]) -> None:
    """Stop a decode request whose prefill failed: cancelling closes its connection,
    which makes the engine abort it; an answer it already has is discarded."""
    try:
        if not task.done():
            await cancel_and_wait(task)
    finally:
        if task.done() and not task.cancelled() and task.exception() is None:
            await discard(task.result())
