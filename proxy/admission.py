"""Admission: how much the proxy takes on at once, and reading what it took on.

A request is admitted, or refused before its body is read: with a 503 (and
Retry-After) when it would take the proxy past `limits.max_requests_in_flight`
requests, or, once the proxy is `fair_share_above` full, its tenant past its weighted
share of them (`tenant_weights`: a tenant that floods leaves the others room to be
served); with a 429 when its client address already has `max_requests_per_client` in
flight. The body
is then read here, and what it holds counts as it arrives: the byte budget
(`max_body_bytes_in_flight`) counts bytes actually received, never a Content-Length a
client only announced; after `upload_grace_s` an upload must average
`min_upload_bytes_per_s` or it ends with 408, giving its bytes back; one client address
may send at most `max_uploads_per_client` bodies at once (429). The remote media a
request downloads count against the same byte budget (`Ticket.charge`). The bytes are
given back once the request has been sent on to its stages (`Ticket.sent`: a stream a
client never reads holds no body budget), its place when it ends; an admitted request
is served to the end whatever arrives after it.

Each request needs file descriptors (its client's connection and one per hop in
flight): `descriptor_budget` raises the process's limit as far as the system allows,
and `requests_for_descriptors` says how many requests that carries.

Runs inside the proxy process, on its event loop (one thread: no locks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import resource
from collections.abc import Iterable, Iterator

from aiohttp import StreamReader, web

from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.tenancy import Tenant

log = logging.getLogger("epd_serve.proxy.admission")

# Descriptors one request holds at a time, as requests usually go: the client's
# connection, prefill's and decode's (they overlap), and one encoder's.
DESCRIPTORS_PER_REQUEST = 4
# Kept for everything else: the listening socket, probes, the store, logs, libraries.
DESCRIPTORS_RESERVED = 256


class Ticket:
    """What one admitted request holds of the byte budget."""

    def __init__(self, admission: "Admission"):
        self._admission = admission
        self.body_bytes = 0

    def charge(self, size: int) -> None:
        """Count `size` more bytes held for this request (503 past the budget)."""
        self._admission._charge(self, size)

    def sent(self) -> None:
        """The request is with its stages: the proxy no longer holds its body's bytes
        for it (a streamed answer can last as long as its client takes to read)."""
        self._admission._change(0, -self.body_bytes)
        self.body_bytes = 0


class Admission:
    def __init__(self, limits: Limits, metrics: ProxyMetrics, max_requests: int | None = None,
                 tenants: Iterable[Tenant] = ()):
        self.limits = limits
        self.metrics = metrics
        self.max_requests = max_requests or limits.max_requests_in_flight
        self.requests = 0
        self.body_bytes = 0
        self.uploads: collections.Counter[str] = collections.Counter()  # address -> bodies
        self.by_address: collections.Counter[str] = collections.Counter()  # -> requests
        self.by_tenant: collections.Counter[str] = collections.Counter()  # tenant id -> requests
        weights = {t.id: limits.tenant_weights.get(t.name, 1.0) for t in tenants}
        total = sum(weights.values())
        # Each tenant's share of the requests in flight, by its weight among all tenants.
        self.shares = {tenant: self.max_requests * w / total for tenant, w in weights.items()}
        metrics.requests_in_flight.set_function(lambda: self.requests)
        metrics.body_bytes_in_flight.set_function(lambda: self.body_bytes)

    @contextlib.contextmanager
    def admit(self, tenant: Tenant | None = None, address: str = "unknown") -> Iterator[Ticket]:
        """Hold a place for one request of `tenant` from `address` for the `with` block
        (for a streamed answer, until its last byte is relayed), or raise a 503 or 429
        naming the limit. None: an engine's call (span exports), bounded only in all."""
        if self.requests + 1 > self.max_requests:
            self._refuse("max_requests_in_flight", f"{self.requests} requests in flight",
                         self.max_requests)
        if tenant is not None:
            self._check_client(tenant, address)
        ticket = Ticket(self)
        self._change(1, 0)
        if tenant is not None:
            self.by_tenant[tenant.id] += 1
            self.by_address[address] += 1
        try:
            yield ticket
        finally:
            self._change(-1, -ticket.body_bytes)
            if tenant is not None:
                _decrement(self.by_tenant, tenant.id)
                _decrement(self.by_address, address)

    def _check_client(self, tenant: Tenant, address: str) -> None:
        if self.by_address[address] >= self.limits.max_requests_per_client:
            self.metrics.refused.labels("max_requests_per_client").inc()
            raise ProxyError(429, f"this address has {self.by_address[address]} requests in "
                             "flight already (proxy.limits.max_requests_per_client); retry "
                             "when one is done", "rate_limit_error",
                             reason="too_many_requests")
        share = self.shares.get(tenant.id)
        contended = self.requests + 1 > self.limits.fair_share_above * self.max_requests
        if share is not None and contended and self.by_tenant[tenant.id] + 1 > share:
            # Past its share while others may want theirs: the room left is theirs.
            self.metrics.refused.labels("tenant_share").inc()
            raise ProxyError(503, f"the proxy is busy ({self.requests} requests in flight) "
                             f"and this key has {self.by_tenant[tenant.id]} of them, its "
                             f"share being {share:.0f} (proxy.limits.tenant_weights): retry "
                             "shortly", "service_unavailable", reason="overloaded")

    async def read_body(self, request: web.Request, ticket: Ticket, max_bytes: int) -> bytearray:
        """The request's body, counted against the budget as it arrives. 413 past
        `max_bytes` (at once when the Content-Length says so), 408 for an upload
        slower than the limits allow, 429 past the client's uploads at once."""
        length = request.content_length
        if length is not None and length > max_bytes:
            raise _too_large(max_bytes)
        peer = request.remote or "unknown"
        if self.uploads[peer] >= self.limits.max_uploads_per_client:
            self.metrics.refused.labels("max_uploads_per_client").inc()
            raise ProxyError(429, f"this address is already sending "
                             f"{self.uploads[peer]} request bodies at once "
                             f"(proxy.limits.max_uploads_per_client); retry when one is done",
                             "rate_limit_error", reason="too_many_uploads")
        self.uploads[peer] += 1
        try:
            return await self._read(request.content, ticket, max_bytes)
        finally:
            _decrement(self.uploads, peer)

    async def _read(self, content: StreamReader, ticket: Ticket, max_bytes: int) -> bytearray:
        loop = asyncio.get_running_loop()
        start = loop.time()
        grace, rate = self.limits.upload_grace_s, self.limits.min_upload_bytes_per_s
        body = bytearray()
        while True:
            chunk = content.read_nowait()  # what has arrived already: no wait, no timer
            if not chunk:
                if content.at_eof():
                    break
                # The slowest upload allowed has this many bytes by then.
                due = start + grace + len(body) / rate
                try:
                    chunk = await asyncio.wait_for(content.readany(), due - loop.time())
                except (asyncio.TimeoutError, TimeoutError):
                    raise bad_request(
                        f"the request body arrived too slowly ({len(body)} bytes in "
                        f"{loop.time() - start:.1f} s; this deployment needs at least "
                        f"{rate} bytes a second after {grace:g} s)", "slow_upload",
                        408) from None
                if not chunk:
                    break
            if len(body) + len(chunk) > max_bytes:
                raise _too_large(max_bytes)
            ticket.charge(len(chunk))
            body += chunk
        return body

    def _charge(self, ticket: Ticket, size: int) -> None:
        if self.body_bytes + size > self.limits.max_body_bytes_in_flight:
            self._refuse("max_body_bytes_in_flight",
                         f"{self.body_bytes} bytes of request bodies held, {size} more "
                         "arriving", self.limits.max_body_bytes_in_flight)
        ticket.body_bytes += size
        self._change(0, size)

    def _refuse(self, limit: str, state: str, value: int) -> None:
        self.metrics.refused.labels(limit).inc()
        raise ProxyError(503, f"the proxy is at its limit ({state}; proxy.limits.{limit} is "
                         f"{value}): retry shortly", "service_unavailable", reason="overloaded")

    def _change(self, requests: int, body_bytes: int) -> None:
        self.requests += requests
        self.body_bytes += body_bytes


def _decrement(counter: collections.Counter, key: str) -> None:
    counter[key] -= 1
    if not counter[key]:
        del counter[key]  # only keys with requests in flight are kept


def _too_large(max_bytes: int) -> ProxyError:
    return bad_request(f"request body is larger than {max_bytes} bytes (proxy.limits: "
                       "max_body_bytes, or max_trace_body_bytes for span exports)",
                       "body_too_large", 413)


def descriptor_budget() -> int:
    """Raise this process's open-file limit to the most the system allows; the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:  # a container may refuse it
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft


def requests_for_descriptors(limits: Limits, descriptors: int) -> int:
    """The most requests in flight that `descriptors` open files carry, at most the
    configured limit; a lower number is logged with how to raise it."""
    fits = max(1, (descriptors - DESCRIPTORS_RESERVED) // DESCRIPTORS_PER_REQUEST)
    if fits < limits.max_requests_in_flight:
        log.warning("proxy.limits.max_requests_in_flight is %d, but %d open files carry "
                    "%d requests (%d each, %d kept): admitting %d at once; raise the "
                    "limit (ulimit -n, or LimitNOFILE in a systemd unit) to admit more",
                    limits.max_requests_in_flight, descriptors, fits,
                    DESCRIPTORS_PER_REQUEST, DESCRIPTORS_RESERVED, fits)
        return fits
    return limits.max_requests_in_flight
