"""Admission: how much the proxy takes on at once. A request is admitted before its body
is read, or refused with a 503 (and Retry-After) when it would take the proxy past
`limits.max_requests_in_flight` requests or `limits.max_body_bytes_in_flight` bytes of
request bodies; an admitted request is served to the end whatever arrives after it.

Runs inside the proxy process, on its event loop (one thread: no locks). A body is
counted at its Content-Length (at `max_body_bytes` when it has none, as with a chunked
upload, since the server layer reads up to that much).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.metrics import ProxyMetrics


class Admission:
    def __init__(self, limits: Limits, metrics: ProxyMetrics):
        self.limits = limits
        self.metrics = metrics
        self.requests = 0
        self.body_bytes = 0

    @contextlib.contextmanager
    def admit(self, content_length: int | None) -> Iterator[None]:
        """Hold the request's share of the limits for the `with` block (for a streamed
        answer, until its last byte is relayed), or raise a 503 naming the limit it
        would pass."""
        size = self.limits.max_body_bytes if content_length is None \
            else min(content_length, self.limits.max_body_bytes)
        if self.requests + 1 > self.limits.max_requests_in_flight:
            self._refuse("max_requests_in_flight", f"{self.requests} requests in flight")
        if self.body_bytes + size > self.limits.max_body_bytes_in_flight:
            self._refuse("max_body_bytes_in_flight",
                         f"{self.body_bytes} bytes of request bodies held, {size} more asked")
        self._change(1, size)
        try:
            yield
        finally:
            self._change(-1, -size)

    def _refuse(self, limit: str, state: str) -> None:
        self.metrics.refused.labels(limit).inc()
        raise ProxyError(503, f"the proxy is at its limit ({state}; proxy.limits.{limit} is "
                         f"{getattr(self.limits, limit)}): retry shortly",
                         "service_unavailable", reason="overloaded")

    def _change(self, requests: int, body_bytes: int) -> None:
        self.requests += requests
        self.body_bytes += body_bytes
        self.metrics.requests_in_flight.set(self.requests)
        self.metrics.body_bytes_in_flight.set(self.body_bytes)
