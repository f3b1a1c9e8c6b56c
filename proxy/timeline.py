"""Where a request's time went: its timeline across the proxy and the instances.

Runs inside the proxy process. Each request's timeline has an id the proxy issues
(`x-epd-trace-id`), and a W3C trace id that every hop sends the engine as its
`traceparent`, naming the hop as parent: the client's, when it sent a valid
`traceparent` (propagated, so its own tracing sees the engines' spans), else the
timeline's id. The proxy records its own spans from the trip (received, each hop's
send / first byte / done, the tokens it relayed); the engines export theirs over
OTLP/HTTP (vLLM's `--otlp-traces-endpoint`) to the proxy's own `/v1/traces`, with the
deployment's internal token, and each span is filed under the request whose hop is its
parent, so two requests that share a client's trace id never share a timeline.
`TraceStore` keeps the last requests' timelines in bounded memory; `epd-serve trace` and
the load tool read them from `/v1/traces/{id}` as JSON:

    {"id", "trace_id", "request_id", "engine_request_id", "status", "start_ns", "end_ns",
     "spans": [{"name", "source", "start_ns", "end_ns", "span_id", "parent_id",
                "attrs", "events": [[name, ns], ...]}, ...]}

Times are wall-clock nanoseconds (time.time_ns), so the engines' spans line up with
the proxy's on one host.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import TYPE_CHECKING, Any

from epd_serve.proxy.ids import random_hex

if TYPE_CHECKING:
    from epd_serve.proxy.trip import StageRecord, Trip

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# vLLM's request span and the durations it carries (seconds), in the order they happen.
ENGINE_SPAN = "llm_request"
QUEUE = "gen_ai.latency.time_in_queue"
PREFILL = "gen_ai.latency.time_in_model_prefill"
DECODE = "gen_ai.latency.time_in_model_decode"
FIRST_TOKEN = "gen_ai.latency.time_to_first_token"

__all__ = ["Span", "Timeline", "TraceStore", "client_trace_id", "engine_phases",
           "hop_traceparent", "new_span_id", "new_timeline_id", "parse_otlp", "timeline_of"]


def new_span_id() -> str:
    return random_hex(8)


def new_timeline_id() -> str:
    return random_hex(16)  # the shape of a W3C trace id, so it can serve as one


def client_trace_id(header: str | None) -> str | None:
    """The trace id of a client's valid `traceparent`, else None."""
    match = TRACEPARENT.match((header or "").strip().lower())
    if match and match[1] != "0" * 32:
        return match[1]
    return None


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
    id: str  # issued by the proxy, one per request
    trace_id: str
    request_id: str  # the client's
    engine_request_id: str
    start_ns: int
    end_ns: int = 0
    status: int = 0
    spans: list[Span] = dataclasses.field(default_factory=list)
    tenant: str = ""  # whose request it is: only that tenant reads it
    engine_spans: int = 0  # how many of `spans` engines exported
    # The request's trip, until the timeline is first read: the proxy's own spans are
    # built from it then (`read`), so the many requests nobody looks at cost none.
    trip: Trip | None = None

    def hop_span_ids(self) -> list[str]:
        """The proxy's hop spans, which the engines' spans name as their parent."""
        if self.trip is not None:
            return [r.span_id for r in _sent_hops(self.trip) if r.span_id]
        return [s.span_id for s in self.spans if s.source == "proxy" and s.span_id]

    def read(self) -> Timeline:
        """The timeline with the proxy's own spans (built on the first read)."""
        if self.trip is not None:
            self.spans[:0] = _proxy_spans(self.trip, self.start_ns, self.end_ns, self.status)
            self.trip = None
        return self

    def to_dict(self) -> dict:
        self.read()
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in ("tenant", "engine_spans", "trip")}
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
    """The timelines of the last `capacity` requests, found by the id the proxy issued,
    the engines' request id, or (within its tenant) the client's request id. Engine
    spans are filed under the request whose hop is their parent; those whose request has
    not ended yet wait, at most `max_waiting` of them (the oldest are dropped first), and
    a timeline holds at most `max_spans` engine spans. Evicting a timeline forgets every
    way to it, so memory stays bounded whatever ids clients send."""

    def __init__(self, capacity: int = 2000, max_waiting: int = 20_000, max_spans: int = 512):
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.max_spans = max_spans
        self._timelines: collections.OrderedDict[str, Timeline] = collections.OrderedDict()
        self._by_engine_id: dict[str, str] = {}
        self._by_client_id: dict[tuple[str, str], str] = {}  # (tenant, client's id)
        self._by_hop: dict[str, str] = {}  # hop span id -> timeline id
        self._waiting: collections.OrderedDict[str, list[Span]] = collections.OrderedDict()
        self._waiting_spans = 0
        self.dropped_spans = 0  # past the limits, or naming no hop of ours

    def __len__(self) -> int:
        return len(self._timelines)

    def add(self, timeline: Timeline) -> None:
        hops = timeline.hop_span_ids()
        for hop in hops:
            self._by_hop[hop] = timeline.id
        if self._waiting:  # engine spans that came before their request ended
            for hop in hops:
                waiting = self._waiting.pop(hop, [])
                self._waiting_spans -= len(waiting)
                self._attach(timeline, waiting)
        self._timelines[timeline.id] = timeline
        self._by_engine_id[timeline.engine_request_id] = timeline.id
        self._by_client_id[timeline.tenant, timeline.request_id] = timeline.id
        while len(self._timelines) > self.capacity:
            self._forget(self._timelines.popitem(last=False)[1])

    def _forget(self, old: Timeline) -> None:
        for hop in old.hop_span_ids():
            self._by_hop.pop(hop, None)
        if self._by_engine_id.get(old.engine_request_id) == old.id:
            del self._by_engine_id[old.engine_request_id]
        if self._by_client_id.get((old.tenant, old.request_id)) == old.id:
            del self._by_client_id[old.tenant, old.request_id]

    def _attach(self, timeline: Timeline, spans: list[Span]) -> None:
        room = max(0, self.max_spans - timeline.engine_spans)
        self.dropped_spans += max(0, len(spans) - room)
        timeline.spans += spans[:room]
        timeline.engine_spans += min(room, len(spans))

    def add_engine_spans(self, spans: list[tuple[str, Span]]) -> int:
        """File spans an engine exported; returns how many joined an ended request (the
        others wait for theirs to end, or are dropped past the limits)."""
        known = 0
        for _trace_id, span in spans:
            pieces = [span, *engine_phases(span)]
            timeline = self._timelines.get(self._by_hop.get(span.parent_id, ""))
            if timeline is not None:
                self._attach(timeline, pieces)
                known += 1
                continue
            if not span.parent_id:
                self.dropped_spans += len(pieces)  # a root span: no request of ours
                continue
            self._waiting.setdefault(span.parent_id, []).extend(pieces)
            self._waiting_spans += len(pieces)
            while self._waiting_spans > self.max_waiting:
                _, dropped = self._waiting.popitem(last=False)
                self._waiting_spans -= len(dropped)
                self.dropped_spans += len(dropped)
        return known

    def get(self, key: str, tenant: str | None, by_client_id: bool = True) -> Timeline | None:
        """By the proxy's id or the engines' request id, or (`by_client_id`) by the
        client's request id (its latest request of that id); only the tenant's own
        (None: any tenant's, for the operator)."""
        timeline_id = (key if key in self._timelines else self._by_engine_id.get(key)
                       or (self._by_client_id_of(tenant, key) if by_client_id else None))
        timeline = self._timelines.get(timeline_id or "")
        if timeline is None or tenant not in (None, timeline.tenant):
            return None
        return timeline.read()

    def _by_client_id_of(self, tenant: str | None, client_id: str) -> str | None:
        if tenant is not None:
            return self._by_client_id.get((tenant, client_id))
        return next((timeline_id for (_, cid), timeline_id in reversed(self._by_client_id.items())
                     if cid == client_id), None)

    def recent(self, n: int, tenant: str | None) -> list[Timeline]:
        """The tenant's last `n` requests (None: every tenant's), newest first."""
        found = []
        for timeline in reversed(self._timelines.values()):
            if len(found) >= n:
                break
            if tenant in (None, timeline.tenant):
                found.append(timeline.read())
        return found


def timeline_of(trip: Trip, timeline_id: str, tenant: str, request_id: str, status: int,
                received_ns: int) -> Timeline:
    """A request that has ended, as its timeline; the proxy's own spans are built from
    `trip` when the timeline is first read (`Timeline.read`)."""
    return Timeline(timeline_id, trip.trace_id, request_id, trip.request_id, received_ns,
                    time.time_ns(), status, tenant=tenant, trip=trip)


def _sent_hops(trip: Trip) -> list[StageRecord]:
    """The trip's hop attempts that were sent (each image batch's E is in `encodes`;
    `stages` holds one E record for all of them, with no send of its own)."""
    return [record for record in trip.stages + trip.encodes if record.sent_ns]


def _proxy_spans(trip: Trip, start_ns: int, end_ns: int, status: int) -> list[Span]:
    """The proxy's own spans of a request: the request as a whole (with each chunk
    relayed to the client as an event) and one span per hop attempt, with its send,
    first byte and end."""
    spans = [Span("request", "proxy", start_ns, end_ns, attrs={
        "status": status, "stages": trip.header(), "multimodal": trip.multimodal},
        events=[("relayed", ns) for ns in trip.relayed_ns])]
    for record in _sent_hops(trip):
        events = [("sent", record.sent_ns)]
        if record.first_byte_ns:
            events.append(("first byte", record.first_byte_ns))
        attrs: dict[str, Any] = {"instance": record.instance, "failed": record.failed}
        if record.stage in ("D", "PD") and trip.kv:
            attrs.update({f"kv.{k}": v for k, v in trip.kv.items()
                          if isinstance(v, (int, float, str))})
        spans.append(Span(f"{record.stage} hop", "proxy", record.sent_ns,
                          record.done_ns or end_ns, record.span_id, attrs=attrs,
                          events=events))
    return spans
