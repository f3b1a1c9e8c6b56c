"""Our connectors' events as spans of the request they served.

vLLM exports one span per request (`llm_request`, from the API server) to its
`--otlp-traces-endpoint`; what our connectors do for the request (the KV arriving group
by group, say) happens in the engine core and its workers, which vLLM does not trace.
Where a request's trace context is known (the scheduler side sees it; the MM Store
connector's scheduler passes it to its workers with each load), our connectors export
those events to the same endpoint under the same service name: the proxy files them
under the request's trace beside the engine's own span (proxy/timeline.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger("vllm.epd_serve.spans")


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock ns (spans are in wall-clock time)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class ConnectorSpans:
    """An OpenTelemetry tracer of its own (vLLM's lives in the API server process), its
    spans batched and exported over OTLP/HTTP protobuf in the background."""

    def __init__(self, endpoint: str, service: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("epd_serve.connectors")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def of(cls, vllm_config) -> "ConnectorSpans | None":
        """Spans where the engine exports its own (the deployment's `engine_traces`),
        else None."""
        observability = getattr(vllm_config, "observability_config", None)
        endpoint = getattr(observability, "otlp_traces_endpoint", None)
        if not endpoint:
            return None
        try:
            return cls(endpoint, os.environ.get("OTEL_SERVICE_NAME", "engine"))
        except ImportError as err:  # vLLM itself needs the same packages to trace
            logger.warning("epd-serve: connector spans off, OpenTelemetry is missing (%s)", err)
            return None

    def record(self, name: str, trace_headers: Mapping[str, str] | None, start_ns: int,
               end_ns: int, attributes: Mapping[str, Any],
               events: Iterable[tuple[str, int]] = ()) -> None:
        """One finished span, a child of the hop that sent the request (its
        `traceparent`); nothing for a request that came without one."""
        if not trace_headers or "traceparent" not in trace_headers:
            return
        context = self._propagator.extract(dict(trace_headers))
        span = self._tracer.start_span(name, context=context, start_time=start_ns,
                                       attributes=dict(attributes))
        for event, ns in events:
            span.add_event(event, timestamp=ns)
        span.end(end_time=end_ns)

    def close(self) -> None:
        self._provider.shutdown()  # exports what is still batched
