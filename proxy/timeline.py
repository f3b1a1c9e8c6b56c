"""Where a request's time went: its timeline across the proxy and the instances.

Runs inside the proxy process. Each request carries one W3C trace id (the client's
`traceparent`, or a new one), and every hop sends the engine a `traceparent` naming
that trace and the hop as parent. The proxy records its own spans from the trip
(received, each hop's send / first byte / done, the tokens it relayed); the engines
export theirs over OTLP/HTTP (vLLM's `--otlp-traces-endpoint`) to the proxy's own
`/v1/traces`, so spans are collected here, on the host, with no outside service.
`TraceStore` keeps the last requests' timelines; `epd-serve trace` and the load tool
read them from `/v1/traces/{id}` as JSON:

    {"trace_id", "request_id", "engine_request_id", "status", "start_ns", "end_ns",
     "spans": [{"name", "source", "start_ns", "end_ns", "span_id", "parent_id",
                "attrs", "events": [[name, ns], ...]}, ...]}

Times are wall-clock nanoseconds (time.time_ns), so the engines' spans line up with
the proxy's on one host.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd_serve.proxy.trip import Trip

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# vLLM's request span and the durations it carries (seconds), in the order they happen.
ENGINE_SPAN = "llm_request"
QUEUE = "gen_ai.latency.time_in_queue"
PREFILL = "gen_ai.latency.time_in_model_prefill"
DECODE = "gen_ai.latency.time_in_model_decode"
FIRST_TOKEN = "gen_ai.latency.time_to_first_token"

__all__ = ["Span", "Timeline", "TraceStore", "engine_phases", "hop_traceparent",
           "new_span_id", "parse_otlp", "timeline_of", "trace_id_of"]


def new_span_id() -> str:
    return secrets.token_hex(8)


def trace_id_of(header: str | None) -> str:
    """The trace id of a client's valid `traceparent`, else a new one."""
    match = TRACEPARENT.match((header or "").strip().lower())
    if match and match[1] != "0" * 32:
        return match[1]
    return secrets.token_hex(16)


def hop_traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"  # sampled: vLLM exports only sampled spans


@dataclasses.dataclass
class Span:
    name: str
    source: str  # "proxy", or the instance (the engine's OTel service name)
    start_ns: int
    end_ns: int
    span_id: str = ""
    parent_id: str = ""
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Timeline:
    trace_id: str
    request_id: str
    engine_request_id: str
    start_ns: int
    end_ns: int = 0
    status: int = 0
    spans: list[Span] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["spans"] = sorted(out["spans"], key=lambda s: (s["start_ns"], s["end_ns"]))
        return out


def engine_phases(span: Span) -> list[Span]:
    """vLLM's request span split into what happened inside the engine, from the
    durations it reports: preprocessing (the API server, then the engine core taking
    the request in), queueing, prefill up to the first token, decode. Laid out so that
    prefill ends at the first token."""
    attrs = span.attrs
    if span.name != ENGINE_SPAN or FIRST_TOKEN not in attrs:
        return []
    ns = 1e9
    first = span.start_ns + int(attrs[FIRST_TOKEN] * ns)
    prefill_at = first - int(attrs.get(PREFILL, 0.0) * ns)
    queued_at = prefill_at - int(attrs.get(QUEUE, 0.0) * ns)
    decode_end = first + int(attrs.get(DECODE, 0.0) * ns)
    phases = [("preprocess", span.start_ns, queued_at), ("queue", queued_at, prefill_at),
              ("prefill", prefill_at, first), ("decode", first, decode_end)]
    return [Span(name, span.source, max(span.start_ns, start), max(start, end),
                 parent_id=span.span_id) for name, start, end in phases]


def parse_otlp(body: bytes) -> list[tuple[str, Span]]:
    """(trace id, span) for each span of an OTLP/HTTP protobuf export request. The
    source is the exporting process's `service.name` (the launcher sets it to the
    instance's name)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes, MessageToDict)
        source = str(resource.get("service.name", "engine"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append((span.trace_id.hex(), Span(
                    span.name, source, span.start_time_unix_nano, span.end_time_unix_nano,
                    span.span_id.hex(), span.parent_span_id.hex(),
                    _attributes(span.attributes, MessageToDict),
                    [(e.name, e.time_unix_nano) for e in span.events])))
    return out


def _attributes(key_values, to_dict) -> dict[str, Any]:
    out = {}
    for kv in key_values:
        value = to_dict(kv.value)  # {"doubleValue": 0.1} and the like
        out[kv.key] = next(iter(value.values()), None) if value else None
        if "intValue" in value:
            out[kv.key] = int(value["intValue"])  # JSON mapping sends int64 as a string
    return out


class TraceStore:
    """The timelines of the last `capacity` requests, found by trace id, the client's
    request id or the engines' request id. Engine spans that arrive before their
    request has ended wait (a bounded number of them) until it does."""

    def __init__(self, capacity: int = 2000):
        self.capacity = capacity
        self._timelines: collections.OrderedDict[str, Timeline] = collections.OrderedDict()
        self._by_request: dict[str, str] = {}
        self._early: collections.OrderedDict[str, list[Span]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._timelines)

    def add(self, timeline: Timeline) -> None:
        timeline.spans += self._early.pop(timeline.trace_id, [])
        self._timelines[timeline.trace_id] = timeline
        self._by_request[timeline.request_id] = timeline.trace_id
        self._by_request[timeline.engine_request_id] = timeline.trace_id
        while len(self._timelines) > self.capacity:
            _, old = self._timelines.popitem(last=False)
            for key in (old.request_id, old.engine_request_id):
                if self._by_request.get(key) == old.trace_id:
                    del self._by_request[key]

    def add_engine_spans(self, spans: list[tuple[str, Span]]) -> int:
        """File spans an engine exported; returns how many belong to a known request
        (the others wait for their request to end, or are dropped past the limit)."""
        known = 0
        for trace_id, span in spans:
            pieces = [span, *engine_phases(span)]
            timeline = self._timelines.get(trace_id)
            if timeline is not None:
                timeline.spans += pieces
                known += 1
                continue
            self._early.setdefault(trace_id, []).extend(pieces)
            while len(self._early) > self.capacity:
                self._early.popitem(last=False)
        return known

    def get(self, key: str) -> Timeline | None:
        """By trace id, or by a request id (the client's or the engines')."""
        timeline = self._timelines.get(key)
        if timeline is None and key in self._by_request:
            timeline = self._timelines.get(self._by_request[key])
        return timeline

    def recent(self, n: int) -> list[Timeline]:
        return list(self._timelines.values())[-n:][::-1]


def timeline_of(trip: "Trip", request_id: str, status: int, received_ns: int) -> Timeline:
    """The proxy's own spans of a request that has ended: the request as a whole (with
    each chunk relayed to the client as an event) and one span per hop attempt, with
    its send, first byte and end."""
    end = time.time_ns()
    timeline = Timeline(trip.trace_id, request_id, trip.request_id, received_ns, end, status)
    timeline.spans.append(Span(
        "request", "proxy", received_ns, end, attrs={
            "status": status, "stages": trip.header(), "multimodal": trip.multimodal},
        events=[("relayed", ns) for ns in trip.relayed_ns]))
    for record in trip.stages + trip.encodes:
        if not record.sent_ns:  # all image batches' E (in `encodes`), or E not run
            continue
        events = [("sent", record.sent_ns)]
        if record.first_byte_ns:
            events.append(("first byte", record.first_byte_ns))
        attrs: dict[str, Any] = {"instance": record.instance, "failed": record.failed}
        if record.stage in ("D", "PD") and trip.kv:
            attrs.update({f"kv.{k}": v for k, v in trip.kv.items()
                          if isinstance(v, (int, float, str))})
        timeline.spans.append(Span(
            f"{record.stage} hop", "proxy", record.sent_ns, record.done_ns or end,
            record.span_id, attrs=attrs, events=events))
    return timeline
