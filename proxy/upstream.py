"""Sending one hop of a request to an instance, with the proxy's one fail-over path.

Runs inside the proxy process (asyncio; hops are sent with hop_client.py, liveness
checks and KV bootstrap queries with aiohttp's client). Plain and streamed hops share
`_send`: instances are tried in the router's order; one that cannot be reached, or
that answers 5xx before anything was relayed, is recorded as a failed attempt and the
hop goes to the next (at most one retry after a 5xx, since a request that breaks one
engine would break the next). Each attempt holds a state.Lease on its instance, closed
here and nowhere else, which also feeds the hop metrics. An instance that refuses a
connection is taken out of routing at once (its process is gone), as a probe would; a
connection the proxy itself cannot open (out of file descriptors or local ports) fails
the request with a 503 and leaves the instance alone.

An instance can also be there and silent: a stopped process (SIGSTOP, a wedged host)
still has its connections accepted by the kernel, and would hold every request sent to
it for request_timeout_s. So each wait on an instance has a deadline (config.Deadlines:
a hop's first byte, then the silence inside its answer); past it the instance must
answer a liveness check, one per instance at a time, shared by every hop waiting on
it: its /health, then (vLLM's /health being green while its engine core is stopped) a
one-token request (liveness.py). An instance that answers is slow, not hung, and is
waited for; one that does not is hung (`Hung`): out of routing at once, as a refused
connection is, and the hop fails the way a refused connection fails it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import time
import weakref
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import msgspec

from epd_serve.proxy.config import Deadlines
from epd_serve.proxy.errors import ProxyError, no_instance
from epd_serve.proxy.hop_client import HopClient, HopResponse, Origin, Patience
from epd_serve.proxy.liveness import engine_silent
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.routing import Router
from epd_serve.proxy.state import InstanceState, Lease
from epd_serve.proxy.timeline import hop_traceparent, new_span_id
from epd_serve.proxy.trip import StageRecord, Trip

log = logging.getLogger("epd_serve.proxy.upstream")

JSON = {"content-type": "application/json"}
_encode = msgspec.json.Encoder().encode


class Hung(Exception):
    """The instance went silent past a deadline and did not answer /health either."""


# Errors that mean the instance could not be reached, broke the connection, or stopped
# answering (hop_client's HopBroken is a ConnectionError, so an OSError).
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError,
                    asyncio.TimeoutError, Hung)
RETRIES_AFTER_5XX = 1
# A liveness check's good answer stands this long: the hops waiting on a busy instance
# ask its /health at most about once a second between them, however many they are.
ALIVE_FOR_S = 1.0
# Connect errors that are the proxy's own (its descriptors, ports, buffers), not the
# instance's: another instance would fail the same way.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.EADDRINUSE,
                          errno.ENOBUFS, errno.ENOMEM})

__all__ = ["Hung", "Stream", "Upstream", "connect_failure", "single_token"]


def connect_failure(err: BaseException) -> str | None:
    """"refused" (nothing listens: the instance's process is gone), "local" (the proxy
    could not open the connection itself), or None (anything else)."""
    os_error = err.os_error if isinstance(err, aiohttp.ClientConnectorError) else err
    code = getattr(os_error, "errno", None)
    if code == errno.ECONNREFUSED:
        return "refused"
    if code in LOCAL_ERRNOS:
        return "local"
    return None


def single_token(body: dict, **overrides: Any) -> dict:
    """The request as an encode or prefill stage runs it: one sequence of one token, not
    streamed (its `n` samples are decode's to draw; the prompt is computed once)."""
    out = {k: v for k, v in body.items()
           if k not in ("max_completion_tokens", "stream_options", "min_tokens")}
    out.update({"max_tokens": 1, "stream": False, "n": 1, **overrides})
    return out


def error_message(text: str) -> str:
    """The message inside an OpenAI-style error body, or the text itself."""
    try:
        parsed: Any = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        return str(err.get("message", text)) if isinstance(err, dict) else str(err)
    return text


def broken_off(inst: InstanceState, err: BaseException) -> ProxyError:
    """An answer that began and did not end: the connection broke, or the instance hung."""
    if isinstance(err, Hung):
        return ProxyError(502, f"instance {inst.name} stopped answering mid-answer: {err}",
                          "upstream_error", unreachable=True, reason="instance_hung")
    return ProxyError(502, f"instance {inst.name} broke off its answer: {type(err).__name__}",
                      "upstream_error", unreachable=True, reason="broken_answer")


def upstream_error(inst: InstanceState, status: int, text: str) -> ProxyError:
    """4xx is the client's request (vLLM validated it): passed on; 5xx is the instance's."""
    message = f"instance {inst.name} answered {status}: {error_message(text)}"
    if 400 <= status < 500:
        return ProxyError(status, message, "invalid_request_error", reason="rejected_by_engine")
    return ProxyError(502, message, "upstream_error", reason="instance_error")


class Upstream:
    def __init__(self, router: Router, session: aiohttp.ClientSession, metrics: ProxyMetrics,
                 deadlines: Deadlines | None = None, model: str = "",
                 hops: HopClient | None = None):
        self.router = router
        self.session = session  # liveness checks and KV bootstrap queries
        self.hops = hops or HopClient()  # the hops themselves
        self.metrics = metrics
        self.deadlines = deadlines or Deadlines()
        self.model = model  # what a one-token liveness request names
        first_byte = self.deadlines.first_byte_s
        # A merged PD instance answers as decode does.
        self._first_byte_s = {"E": first_byte.E, "P": first_byte.P, "D": first_byte.D,
                              "PD": first_byte.D}
        self._origins: dict[str, Origin] = {}
        self._checks: dict[InstanceState, asyncio.Task] = {}  # liveness checks under way
        self._alive_at: weakref.WeakKeyDictionary[InstanceState, float] = \
            weakref.WeakKeyDictionary()  # time.monotonic() of each one's last good check

    # -- leases ------------------------------------------------------------------------
    def _take(self, inst: InstanceState, hop: str, trip: Trip) -> Lease:
        lease = inst.lease(hop, trip.route.cost)
        if inst.stages != inst.entry.stages:  # a role switch moved it: the header says so
            trip.switched[inst.name] = f"{inst.entry.roles}>{inst.roles}"
        return lease

    def release(self, lease: Lease, trip: Trip, error: str | None = None,
                instance_fault: bool = True, record: StageRecord | None = None) -> None:
        """Close a hop's lease: counters, metrics and the trip's record of the hop."""
        if not lease.close(error, instance_fault):
            return
        inst = lease.inst
        ms = lease.elapsed_s * 1e3
        if error is not None and not instance_fault:
            return
        if error is None:
            self.metrics.hop_done(lease.hop, inst.name, lease.elapsed_s)
        if record is None:
            record = StageRecord(lease.hop, inst.name)
            trip.stages.append(record)
        record.ms, record.failed = ms, error is not None
        record.span_id, record.sent_ns = lease.span_id, lease.sent_ns
        record.first_byte_ns, record.done_ns = lease.first_byte_ns, time.time_ns()

    def _take_out(self, inst: InstanceState, error: str, why: str, hung: bool = False) -> None:
        """Take an instance that refused a connection, or hung, out now rather than at
        the next probes: the requests arriving meanwhile are routed (or planned)
        without it. The first probe it answers brings it back."""
        if inst.take_out(error, hung):
            log.warning("instance %s %s; out until it answers a probe", inst.name, why)
            self.metrics.healthy.labels(inst.name).set(0)

    # -- silence -----------------------------------------------------------------------
    def patience(self, inst: InstanceState, deadline_s: float) -> Patience:
        """How a wait on `inst` bears its silence (hop_client's patience): after each
        `deadline_s` without a byte, the instance must answer a liveness check, else
        the wait ends with Hung (and its caller closes the connection)."""
        return deadline_s, partial(self.still_alive, inst)

    async def still_alive(self, inst: InstanceState, silent_s: float, what: str) -> None:
        """Raise Hung unless `inst`, silent for `silent_s` where `what` was due, answers
        a liveness check. An instance already out of routing (a probe, or another hop's
        check, found it down) is not asked again: routing gave up on it, and so does
        the hop. One leaving the roster (draining) is asked: its hops are to finish."""
        if not (inst.healthy or inst.draining):
            raise Hung(f"sent no {what} within {silent_s:g} s and is out of routing "
                       f"({inst.last_error})")
        failed = await self._liveness(inst)
        if failed is not None:
            raise Hung(f"sent no {what} within {silent_s:g} s, and {failed}")

    async def _liveness(self, inst: InstanceState) -> str | None:
        """None if `inst` answers /health, else what went wrong. One check per
        instance at a time, shared by the hops waiting on it, and shielded: a client
        leaving does not cancel the others' check."""
        if time.monotonic() - self._alive_at.get(inst, -ALIVE_FOR_S) < ALIVE_FOR_S:
            return None
        check = self._checks.get(inst)
        if check is None:
            check = self._checks[inst] = asyncio.create_task(self._check(inst))
            check.add_done_callback(lambda _: self._checks.pop(inst, None))
        return await asyncio.shield(check)

    async def _check(self, inst: InstanceState) -> str | None:
        timeout = self.deadlines.alive_timeout_s
        failed = None
        try:
            async with self.session.get(inst.entry.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    failed = f"its /health answered {resp.status}"
        except TRANSPORT_ERRORS as err:
            if connect_failure(err) == "local":  # the proxy's own limit: no verdict
                return None
            failed = f"its /health did not answer within {timeout:g} s ({type(err).__name__})"
        if failed is None:
            failed = await engine_silent(self.session, inst, self.model,
                                         self.deadlines.core_timeout_s)
            if failed is None:
                self._alive_at[inst] = time.monotonic()
                return None
            inst.core_hung = True
        self.metrics.child(self.metrics.hung, inst.name).inc()
        self._take_out(inst, f"hung: silent past a deadline, and {failed}",
                       f"is hung (silent past a deadline, and {failed})", hung=True)
        return failed

    def note_retry(self, hop: str, trip: Trip) -> None:
        """A hop sent again to another instance (here, or by a KV hand-off's own loop)."""
        trip.retries += 1
        self.metrics.retries.labels(hop).inc()

    # -- hops --------------------------------------------------------------------------
    def choose(self, hop: str, trip: Trip) -> list[InstanceState]:
        """The healthy instances of `hop` for this request, in the order to try them."""
        return self.router.choose(hop, trip.route)

    async def post(self, hop: str, path: str, body: dict, trip: Trip,
                   candidates: list[InstanceState] | None = None) -> tuple[InstanceState, dict]:
        """Run `body` on an instance of `hop` and return its JSON answer."""
        lease, resp = await self._send(hop, path, body, trip, candidates)
        try:
            raw = await resp.read(self.patience(lease.inst, self.deadlines.stream_idle_s))
        except TRANSPORT_ERRORS as err:
            resp.close()
            self.release(lease, trip, f"answer broken off: {type(err).__name__}: {err}")
            raise broken_off(lease.inst, err) from None
        except BaseException:
            resp.close()  # the client left: closing the connection aborts the engine's work
            self.release(lease, trip, "cancelled", instance_fault=False)
            raise
        resp.release()
        if resp.status >= 400:
            text = raw.decode(errors="replace")
            self.release(lease, trip, f"HTTP {resp.status}: {error_message(text)}",
                         instance_fault=resp.status >= 500)
            raise upstream_error(lease.inst, resp.status, text)
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            self.release(lease, trip, "answer is not JSON")
            raise ProxyError(502, f"instance {lease.inst.name} answered something that is not "
                             "JSON", "upstream_error", reason="bad_answer") from None
        self.release(lease, trip)
        return lease.inst, answer

    async def open_stream(self, hop: str, path: str, body: dict, trip: Trip,
                          candidates: list[InstanceState] | None = None) -> "Stream":
        """Start `body` as a stream; errors before its first byte raise ProxyError."""
        lease, resp = await self._send(hop, path, body, trip, candidates)
        if resp.status >= 400:
            text = (await resp.read()).decode(errors="replace")
            resp.release()
            self.release(lease, trip, f"HTTP {resp.status}: {error_message(text)}",
                         instance_fault=resp.status >= 500)
            raise upstream_error(lease.inst, resp.status, text)
        record = StageRecord(hop, lease.inst.name)
        trip.stages.append(record)
        return Stream(self, lease, resp, record, trip)

    async def get_json(self, url: str, timeout_s: float = 10.0) -> tuple[int, Any]:
        """A plain GET (KV bootstrap queries); transport errors raise."""
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            try:
                return resp.status, msgspec.json.decode(raw)
            except msgspec.DecodeError:
                return resp.status, raw.decode(errors="replace")

    async def _send(self, hop: str, path: str, body: dict, trip: Trip,
                    candidates: list[InstanceState] | None
                    ) -> tuple[Lease, HopResponse]:
        """Send to the first instance of `hop` that takes the request; returns its lease
        and its answer (body not read yet). The caller releases the lease."""
        order = self.choose(hop, trip) if candidates is None else candidates
        if not order:
            raise no_instance(hop)
        payload = _encode(body)
        last, retries_after_5xx, reached = "", RETRIES_AFTER_5XX, False
        for index, inst in enumerate(order):
            hung = False  # whether this attempt's instance held the request, silent
            if index:
                self.note_retry(hop, trip)
            lease = self._take(inst, hop, trip)
            # Each attempt is a span of the request's trace; the engine's spans name it
            # as their parent.
            lease.span_id = new_span_id()
            headers = {**JSON, "X-Request-Id": trip.request_id,
                       "traceparent": hop_traceparent(trip.trace_id, lease.span_id)}
            try:
                resp = await self._request(inst, path, payload, headers,
                                           self.patience(inst, self._first_byte_s[hop]))
                lease.first_byte_ns = time.time_ns()
            except TRANSPORT_ERRORS as err:
                last = f"{inst.name}: {type(err).__name__}: {err}"
                hung = isinstance(err, Hung)
                failure = connect_failure(err)
                if failure == "local":
                    self.release(lease, trip, last, instance_fault=False)
                    log.error("could not open a connection to %s: %s", inst.name, err)
                    raise ProxyError(503, "the proxy is out of connections (its own file "
                                     "descriptors or local ports, not the instance's): "
                                     "retry shortly", "service_unavailable",
                                     reason="proxy_resources") from None
                self.release(lease, trip, last)
                if failure == "refused":
                    self._take_out(inst, last, "refused a connection")
                continue
            except BaseException:
                self.release(lease, trip, "cancelled", instance_fault=False)
                raise
            more = index + 1 < len(order)
            if resp.status >= 500 and more and retries_after_5xx:
                # Nothing reached the client yet: another instance may well serve it.
                retries_after_5xx -= 1
                reached = True
                text = (await resp.read()).decode(errors="replace")
                resp.release()
                last = f"{inst.name}: HTTP {resp.status}: {error_message(text)[:200]}"
                self.release(lease, trip, last)
                continue
            return lease, resp
        if hung:  # the last one held the request, silent: a gateway timeout
            raise ProxyError(504, f"every {hop} instance failed; last error: {last}",
                             "upstream_error", unreachable=not reached, reason="instance_hung")
        raise ProxyError(502, f"every {hop} instance failed; last error: {last}",
                         "upstream_error", unreachable=not reached, reason="instances_failed")

    async def _request(self, inst: InstanceState, path: str, payload: bytes, headers: dict,
                       patience: Patience) -> HopResponse:
        origin = self._origins.get(inst.entry.url)
        if origin is None:  # parsed once per instance, not per request
            origin = self._origins[inst.entry.url] = Origin(inst.entry.url)
        return await self.hops.post(origin, path, payload, headers, patience)


@dataclasses.dataclass
class Stream:
    """An answer being streamed from an instance. Iterating `relay()` passes it on;
    `finish()` reads it here; `close()` drops it (the engine then aborts the request).
    Each ends the hop's lease exactly once."""

    upstream: Upstream
    lease: Lease
    response: HopResponse
    record: StageRecord
    trip: Trip

    @property
    def inst(self) -> InstanceState:
        return self.lease.inst

    async def finish(self) -> None:
        """Read the rest of the stream here (not relayed); raises ProxyError if the
        instance broke off or reported an error inside it."""
        upstream = self.upstream
        try:
            raw = await self.response.read(
                upstream.patience(self.inst, upstream.deadlines.stream_idle_s))
            text = raw.decode(errors="replace")
        except TRANSPORT_ERRORS as err:
            self.response.close()
            self._end(f"stream broken off: {type(err).__name__}: {err}")
            raise broken_off(self.inst, err) from None
        except BaseException:
            self.response.close()
            self._end("cancelled", instance_fault=False)
            raise
        self.response.release()
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = msgspec.json.decode(line[6:]).get("error")
                if error:
                    status = int(error.get("code") or 500)
                    self._end(f"error in stream: {error.get('message')}", status >= 500)
                    raise upstream_error(self.inst, status, msgspec.json.encode(error).decode())
        self._end(None)

    async def close(self) -> None:
        self.response.close()
        self._end("closed by the proxy", instance_fault=False)

    async def relay(self) -> AsyncIterator[bytes]:
        error: str | None = "relay stopped"
        fault = False
        response = self.response
        # A silent stream is given stream_idle_s, then its instance must prove it is
        # alive (a long prefill of another request can pause a decode stream).
        patience = self.upstream.patience(self.inst, self.upstream.deadlines.stream_idle_s)
        try:
            while chunk := await response.readany(patience):
                yield chunk
            error = None
        except TRANSPORT_ERRORS as err:
            error, fault = f"stream broken off: {type(err).__name__}: {err}", True
            raise broken_off(self.inst, err) from None
        finally:
            if error is None:
                self.response.release()
            else:
                self.response.close()  # the client left or the relay broke: abort upstream
            self._end(error, instance_fault=fault)

    def _end(self, error: str | None, instance_fault: bool = True) -> None:
        self.upstream.release(self.lease, self.trip, error, instance_fault, self.record)
