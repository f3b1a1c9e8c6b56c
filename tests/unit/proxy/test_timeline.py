"""A request's timeline: an id the proxy issues, one W3C trace id from the client (or
the proxy) to every hop, the proxy's own spans of each hop, the engines' spans received
over OTLP/HTTP with the internal token and filed under the request whose hop is their
parent, bounded retention, and the waterfall and per-stage parts read from it."""

from __future__ import annotations

import re
import types

import httpx
import pytest

from epd_serve.bench import waterfall as view
from epd_serve.connectors.spans import ConnectorSpans
from epd_serve.proxy import timeline
from epd_serve.proxy.tenancy import Tenants
from epd_serve.proxy.trip import StageRecord, Trip

from .harness import IMAGE, chat, deployment

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
HEX16 = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def engine_export(traceparent: str, service: str, start_ns: int, ttft_s: float,
                  queue_s: float, prefill_s: float, decode_s: float) -> bytes:
    """What vLLM's output processor exports for one finished request (`llm_request`,
    its latency attributes, the parent from the request's traceparent), encoded by
    OpenTelemetry's own OTLP/HTTP protobuf encoder."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span = provider.get_tracer("vllm").start_span(
        "llm_request", context=context, kind=SpanKind.SERVER, start_time=start_ns,
        attributes={"gen_ai.latency.time_to_first_token": ttft_s,
                    "gen_ai.latency.time_in_queue": queue_s,
                    "gen_ai.latency.time_in_model_prefill": prefill_s,
                    "gen_ai.latency.time_in_model_decode": decode_s,
                    "gen_ai.usage.prompt_tokens": 20, "gen_ai.usage.completion_tokens": 4})
    span.end(end_time=start_ns + int((ttft_s + decode_s) * 1e9) + 1_000_000)
    return encode_spans(exporter.get_finished_spans()).SerializeToString()


def test_a_valid_traceparent_keeps_its_trace_and_every_request_gets_an_id_of_its_own():
    assert timeline.client_trace_id(f"00-{TRACE}-00f067aa0ba902b7-01") == TRACE
    for bad in (None, "", "garbage", f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE}-xyz-01"):
        assert timeline.client_trace_id(bad) is None
    new = timeline.new_timeline_id()
    assert re.fullmatch(r"[0-9a-f]{32}", new) and new != timeline.new_timeline_id()


def test_engine_phases_end_prefill_at_the_first_token():
    span = timeline.Span("llm_request", "p0", 1_000_000_000, 1_200_000_000, "ab" * 8, attrs={
        timeline.FIRST_TOKEN: 0.1, timeline.QUEUE: 0.02, timeline.PREFILL: 0.05,
        timeline.DECODE: 0.08})
    phases = {p.name: (p.start_ns, p.end_ns) for p in timeline.engine_phases(span)}
    assert phases["prefill"] == (1_050_000_000, 1_100_000_000)
    assert phases["queue"] == (1_030_000_000, 1_050_000_000)
    assert phases["preprocess"] == (1_000_000_000, 1_030_000_000)
    assert phases["decode"] == (1_100_000_000, 1_180_000_000)
    assert timeline.engine_phases(timeline.Span("other", "p0", 0, 1)) == []


def test_otlp_spans_are_read_with_their_trace_parent_source_and_attributes():
    body = engine_export(f"00-{TRACE}-00f067aa0ba902b7-01", "p0", 10**18, 0.1, 0.01, 0.05, 0.2)
    ((trace_id, span),) = timeline.parse_otlp(body)
    assert trace_id == TRACE and span.parent_id == "00f067aa0ba902b7"
    assert span.name == "llm_request" and span.source == "p0" and span.start_ns == 10**18
    assert span.attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.1)
    assert span.attrs["gen_ai.usage.prompt_tokens"] == 20


def hop_span(span_id: str) -> timeline.Span:
    return timeline.Span("P hop", "proxy", 0, 9, span_id)


def test_the_store_files_engine_spans_under_their_hop_and_forgets_the_oldest():
    store = timeline.TraceStore(capacity=2)
    early = timeline.Span("llm_request", "d0", 5, 9, parent_id="a" * 16)
    assert store.add_engine_spans([(TRACE, early)]) == 0  # its request has not ended yet
    first = timeline.Timeline("t1", TRACE, "client-1", "client-1-epd-x", 0,
                              spans=[hop_span("a" * 16)], tenant="anonymous")
    store.add(first)
    assert early in store.get("t1", "anonymous").spans
    assert store.get("client-1", "anonymous") is store.get("client-1-epd-x", "anonymous") \
        is first
    assert store.get("t1", "key-1") is None  # another tenant's: not there for it
    # A second request of the same trace (the client's traceparent) keeps its own.
    late = timeline.Span("llm_request", "d0", 6, 8, parent_id="b" * 16)
    store.add(timeline.Timeline("t2", TRACE, "c2", "e2", 0, spans=[hop_span("b" * 16)],
                                tenant="anonymous"))
    assert store.add_engine_spans([(TRACE, late)]) == 1
    assert late not in first.spans and late in store.get("t2", "anonymous").spans
    store.add(timeline.Timeline("t3", "c" * 32, "c3", "e3", 0, tenant="anonymous"))
    assert store.get("t1", "anonymous") is None and store.get("client-1", "anonymous") is None
    assert [t.id for t in store.recent(5, "anonymous")] == ["t3", "t2"]
    assert store.recent(5, "key-1") == []


def test_a_timeline_files_engine_spans_before_its_proxy_spans_are_built_on_read():
    sent = [StageRecord("P", "p0", 3.0, span_id="a" * 16, sent_ns=10, first_byte_ns=12,
                        done_ns=13),
            StageRecord("D", "d1", 5.0, span_id="b" * 16, sent_ns=11, done_ns=20),
            StageRecord("E", "e2", 1.0)]  # the images' one E record: no send of its own
    trip = Trip("engine-1", True, stages=sent, kv={"outcome": "done", "bytes": 64},
                relayed_ns=[15, 19], trace_id=TRACE)
    store = timeline.TraceStore()
    ended = timeline.timeline_of(trip, "t1", "anonymous", "client-1", 200, 5)
    store.add(ended)
    assert ended.hop_span_ids() == ["a" * 16, "b" * 16]
    late = timeline.Span("llm_request", "d1", 12, 19, parent_id="b" * 16)
    assert store.add_engine_spans([(TRACE, late)]) == 1  # filed under D's hop, unread
    read = store.get("t1", "anonymous")
    assert read.hop_span_ids() == ["a" * 16, "b" * 16]
    spans = {s.name: s for s in read.spans}
    assert set(spans) == {"request", "P hop", "D hop", "llm_request"}
    assert spans["request"].attrs["stages"] == trip.header()
    assert spans["request"].events == [("relayed", 15), ("relayed", 19)]
    assert spans["P hop"].events == [("sent", 10), ("first byte", 12)]
    assert spans["D hop"].attrs["kv.bytes"] == 64 and "kv.bytes" not in spans["P hop"].attrs
    assert [s["name"] for s in read.to_dict()["spans"]] == [
        "request", "P hop", "D hop", "llm_request"]


def test_retention_stays_bounded_whatever_ids_clients_and_exports_send():
    store = timeline.TraceStore(capacity=50, max_waiting=100, max_spans=4)
    for n in range(10_000):  # one trace id, one client request id, for every request
        store.add(timeline.Timeline(f"t{n}", TRACE, "same", f"e{n}", 0,
                                    spans=[hop_span(f"{n:016x}")], tenant="anonymous"))
    assert len(store) == 50
    assert len(store._by_hop) == len(store._by_engine_id) == 50
    assert len(store._by_client_id) == 1 and store.get("same", "anonymous").id == "t9999"
    # Spans naming hops nobody has (yet): at most max_waiting wait; the rest are dropped.
    flood = [(TRACE, timeline.Span("x", "d0", 0, 1, parent_id=f"{n:016x}ff"))
             for n in range(1000)]
    store.add_engine_spans(flood)
    assert store._waiting_spans == 100 and store.dropped_spans == 900
    # A timeline takes at most max_spans of an engine's spans.
    store.add_engine_spans([(TRACE, timeline.Span("x", "d0", 0, 1, parent_id=f"{9999:016x}"))
                            for _ in range(10)])
    assert store.get("t9999", "anonymous").engine_spans == 4


INTERNAL = {"x-epd-internal-token": "engines-only"}


@pytest.fixture
def internal_token(monkeypatch):
    """The deployment's internal token, as the launcher hands it to the proxy and the
    engines (whose OTLP exporters send it as a header)."""
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", "engines-only")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-epd-internal-token=engines-only")


@pytest.mark.parametrize("stream", [False, True])
def test_every_hop_carries_the_clients_trace_and_the_timeline_holds_each_hop(
        stream, internal_token):
    with deployment(["E", "P", "D"]) as d:
        resp = chat(d, "what is this", [IMAGE], max_tokens=4, stream=stream,
                    headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01",
                             "x-request-id": "client-9"})
        assert resp.status_code == 200
        timeline_id = resp.headers["x-epd-trace-id"]  # the proxy's own, not the client's
        assert re.fullmatch(r"[0-9a-f]{32}", timeline_id) and timeline_id != TRACE
        parents = {}
        for name in ("e0", "p1", "d2"):
            (seen,) = d.seen(name)
            match = HEX16.match(seen["traceparent"])
            assert match and match[1] == TRACE, seen["traceparent"]
            parents[name] = seen["traceparent"].split("-")[2]
        assert len(set(parents.values())) == 3  # one span per hop

        found = d.client.get(f"/v1/traces/{timeline_id}").json()
        assert found["trace_id"] == TRACE and found["status"] == 200
        hops = {s["name"]: s for s in found["spans"] if s["source"] == "proxy"}
        assert set(hops) == {"request", "E hop", "P hop", "D hop"}
        for hop, name in (("E hop", "e0"), ("P hop", "p1"), ("D hop", "d2")):
            span = hops[hop]
            assert span["span_id"] == parents[name] and span["attrs"]["instance"] == name
            sent, first = (ns for _, ns in span["events"])
            assert hops["request"]["start_ns"] <= sent <= first <= span["end_ns"]
        assert hops["E hop"]["end_ns"] <= hops["P hop"]["start_ns"]
        if stream:  # every chunk relayed to the client is on the request's span
            relayed = [ns for name, ns in hops["request"]["events"] if name == "relayed"]
            assert relayed and relayed == sorted(relayed)
            assert hops["D hop"]["start_ns"] < relayed[0] <= hops["request"]["end_ns"]
        # The engine exports its span; the proxy files it under the hop it belongs to.
        d2_start = hops["D hop"]["start_ns"] + 1_000_000
        body = engine_export(d.seen("d2")[0]["traceparent"], "d2", d2_start,
                             0.002, 0.0005, 0.001, 0.003)
        posted = httpx.post(f"{d.proxy.url}/v1/traces", content=body,
                            headers={"content-type": "application/x-protobuf", **INTERNAL})
        assert posted.status_code == 200
        # So does our KV connector in the engine core, for the transfer it received.
        spans = ConnectorSpans(f"{d.proxy.url}/v1/traces", "d2")
        spans.record("kv receive", {"traceparent": d.seen("d2")[0]["traceparent"]},
                     d2_start, d2_start + 500_000, {"epd.kv.outcome": "done",
                                                    "epd.kv.groups": 2, "epd.kv.bytes": 4096},
                     [("layers 0-1 landed", d2_start + 400_000)])
        spans.close()
        found = d.client.get(f"/v1/traces/{timeline_id}").json()
        engine = [s for s in found["spans"] if s["source"] == "d2"]
        assert {s["name"] for s in engine} == {"llm_request", "kv receive", *view.PHASES}
        waterfall = view.rows(found)
        labels = [r.label for r in waterfall]
        assert labels[0] == "request (proxy)"
        d_hop = labels.index("D hop -> d2")
        assert labels[d_hop + 1:d_hop + 7] == ["d2: kv receive", "d2: llm_request", *view.PHASES]
        assert waterfall[d_hop + 1].note == "outcome=done bytes=4096 groups=2"
        parts = view.stage_parts(found)
        assert parts["D decode"] == pytest.approx(3.0, abs=0.01)
        assert parts["D kv receive"] == pytest.approx(0.5, abs=0.001)
        llm = next(s for s in engine if s["name"] == "llm_request")
        assert parts["D outside engine"] == pytest.approx(  # vLLM's span only
            max(0.0, parts["D hop"] - (llm["end_ns"] - llm["start_ns"]) / 1e6))
        assert parts["total"] >= parts["D hop"]


def test_bad_exports_and_unknown_traces_get_clear_errors(internal_token, monkeypatch):
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    with deployment(["P", "D"], limits={"max_trace_body_bytes": 4096}) as d:
        url = f"{d.proxy.url}/v1/traces"
        json_export = httpx.post(url, json={"resourceSpans": []}, headers=INTERNAL)
        assert json_export.status_code == 415 and "protobuf" in json_export.text
        garbage = httpx.post(url, content=b"\xff\x00not protobuf",
                             headers={"content-type": "application/x-protobuf", **INTERNAL})
        assert garbage.status_code == 400 and "OTLP" in garbage.text
        huge = httpx.post(url, content=b"\0" * 5000,
                          headers={"content-type": "application/x-protobuf", **INTERNAL})
        assert huge.status_code == 413 and "max_trace_body_bytes" in huge.text
        missing = d.client.get("/v1/traces/nobody")
        assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
        assert chat(d, "x").status_code == 200
        (recent,) = d.client.get("/v1/traces", params={"last": 1},
                                 headers={"x-epd-admin-key": "operator"}).json()
        assert "spans" not in recent and recent["status"] == 200


def test_reading_traces_takes_a_key_and_shows_its_tenants_only_exporting_the_token(
        monkeypatch, internal_token):
    monkeypatch.setenv("EPD_TEST_KEY", "sekret,other")
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEY",
                    client_headers={"authorization": "Bearer sekret"}) as d:
        resp = chat(d, "x", headers={"x-request-id": "mine"})
        assert resp.status_code == 200
        assert httpx.get(f"{d.proxy.url}/v1/traces").status_code == 401
        assert [t["request_id"] for t in d.client.get("/v1/traces").json()] == ["mine"]
        other = {"authorization": "Bearer other"}
        assert d.client.get("/v1/traces", headers=other).json() == []
        for key in ("mine", resp.headers["x-epd-trace-id"]):
            assert d.client.get(f"/v1/traces/{key}").status_code == 200
            assert d.client.get(f"/v1/traces/{key}", headers=other).status_code == 404
            # The operator reads every tenant's, with the admin key and no tenant's.
            assert httpx.get(f"{d.proxy.url}/v1/traces/{key}", headers={
                "x-epd-admin-key": "operator"}).json()["request_id"] == "mine"
        operator_list = httpx.get(f"{d.proxy.url}/v1/traces",
                                  headers={"x-epd-admin-key": "operator"})
        assert [t["request_id"] for t in operator_list.json()] == ["mine"]
        assert httpx.get(f"{d.proxy.url}/v1/traces", headers={
            "x-epd-admin-key": "wrong"}).status_code == 401
        body = engine_export(f"00-{TRACE}-00f067aa0ba902b7-01", "p0", 10**18, 0.1, 0, 0, 0)
        protobuf = {"content-type": "application/x-protobuf"}
        url = f"{d.proxy.url}/v1/traces"
        assert httpx.post(url, content=body, headers=protobuf).status_code == 401
        # A client's key is no engine's token.
        assert httpx.post(url, content=body, headers={
            **protobuf, "authorization": "Bearer sekret"}).status_code == 401
        assert httpx.post(url, content=body, headers={**protobuf, **INTERNAL}).status_code == 200


def test_without_keys_a_client_reads_its_timeline_by_its_id_and_the_rest_is_the_operators(
        monkeypatch):
    """Every client of an open deployment is the one anonymous tenant: the list of
    requests, and lookups by the ids clients choose themselves, would show anyone what
    everyone sent. A timeline's own id (random, sent to its client) opens only it."""
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    with deployment(["P", "D"]) as d:
        mine = chat(d, "x", headers={"x-request-id": "req-1"})
        assert mine.status_code == 200
        listed = d.client.get("/v1/traces")
        assert listed.status_code == 403 and "admin key" in listed.json()["error"]["message"]
        assert d.client.get("/v1/traces/req-1").status_code == 404  # a guessable id
        own = d.client.get(f"/v1/traces/{mine.headers['x-epd-trace-id']}")
        assert own.status_code == 200 and own.json()["request_id"] == "req-1"
        operator = {"x-epd-admin-key": "operator"}
        assert [t["request_id"] for t in d.client.get("/v1/traces", headers=operator).json()
                ] == ["req-1"]
        assert d.client.get("/v1/traces/req-1", headers=operator).status_code == 200
        assert d.client.get("/v1/traces", headers={"x-epd-admin-key": "wrong"}
                            ).status_code == 403


def test_keys_of_two_tenants_never_share_a_timeline_name():
    """Timelines are filed under the whole hash of a tenant's key, not its 8-hex name."""
    tenants = Tenants([f"key{i}" for i in range(3)], isolate=False)
    ids = {tenants.for_key(f"key{i}").id for i in range(3)}
    assert len(ids) == 3 and all(len(i) == len("key-") + 64 for i in ids)
    assert all(tenants.for_key(f"key{i}").id.startswith(tenants.for_key(f"key{i}").name)
               for i in range(3))


def test_a_load_run_reports_where_the_median_request_went_and_its_tail(tmp_path):
    from rich.console import Console

    from epd_serve.bench import runner
    from epd_serve.bench.timings import SLO
    from epd_serve.bench.report import write_report

    with deployment(["E", "P", "D"]) as d:
        spec = runner.LoadSpec(url=d.proxy.url, model="fake", workload="tiny-mm",
                               num_requests=6, output_tokens=4, slo=SLO(2000, 200))
        console = Console(stderr=True, quiet=True)
        result = runner.run_once(spec, 20.0, runner.Bodies(spec, console), "fake E-P-D",
                                 console)
    timelines = result.summary["timelines"]
    assert timelines["requests"] == timelines["found"] == 6
    parts = timelines["median_parts"]
    assert {"total", "P hop", "D hop"} <= set(parts) and parts["total"] >= parts["D hop"]
    assert "E hop" in parts  # tiny-mm mixes image requests in
    assert timelines["median_request"]["status"] == 200
    tail = result.summary["slowest_over_median"]
    assert tail["all"] >= 1.0 and tail["text"] >= 1.0 and tail["multimodal"] >= 1.0
    assert "x the median E2EL" in runner._one_line("x", 20.0, result.summary)

    out = write_report([result], tmp_path, spec)
    page = (out / "report.html").read_text()
    assert "Where the median request" in page and "P hop" in page
    assert (out / "parts.png").stat().st_size > 0 and (out / "timeline_0.png").stat().st_size > 0


def test_the_load_tool_sends_the_keys_it_is_given_and_reports_stages_with_the_admin_key(
        monkeypatch):
    """A keyed deployment showing stages to the operator only: without keys every
    request is a 401; with the API key they are served but the per-stage report is
    empty; with the admin key too it is there (as `epd-serve bench run --api-key-env
    --admin-key-env` builds them)."""
    from rich.console import Console

    from epd_serve.bench import runner
    from epd_serve.bench.timings import SLO
    from epd_serve.cli.bench import key_headers

    monkeypatch.setenv("EPD_TEST_KEY", "sekret")
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    console = Console(stderr=True, quiet=True)
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEY", stage_headers="operator",
                    client_headers={"authorization": "Bearer sekret"}) as d:
        summaries = {}
        for name, variables in (("none", {}), ("api key", {"api_key_env": "EPD_TEST_KEY"}),
                                ("both", {"api_key_env": "EPD_TEST_KEY",
                                          "admin_key_env": "EPD_ADMIN_KEY"})):
            spec = runner.LoadSpec(url=d.proxy.url, model="fake", workload="text",
                                   num_requests=4, output_tokens=2, slo=SLO(2000, 200),
                                   headers=key_headers(types.SimpleNamespace(**variables)))
            summaries[name] = runner.run_once(spec, 50.0, runner.Bodies(spec, console),
                                              name, console).summary
    assert summaries["none"]["success_requests"] == 0
    assert summaries["api key"]["success_requests"] == 4
    assert not summaries["api key"].get("stage_breakdown")
    assert summaries["both"]["success_requests"] == 4
    assert summaries["both"]["stage_breakdown"]["stages"]["P"]["count"] == 4
    assert "sekret" not in repr(spec)
    with pytest.raises(ValueError, match="EPD_UNSET_KEY"):
        key_headers(types.SimpleNamespace(api_key_env="EPD_UNSET_KEY"))


def test_epd_serve_trace_shows_the_waterfall_of_a_request(tmp_path, capsys, monkeypatch):
    from epd_serve.cli.main import main

    # No API keys: request ids and the list are the operator's, as here.
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    with deployment(["P", "D"]) as d:
        assert chat(d, "x", headers={"x-request-id": "mine"}).status_code == 200
        assert main(["trace", "mine", "--url", d.proxy.url, "--png",
                     str(tmp_path / "w.png")]) == 0
        shown = capsys.readouterr().out
        assert "request mine" in shown and "P hop -> p0" in shown and "D hop -> d1" in shown
        assert (tmp_path / "w.png").stat().st_size > 0
        assert main(["trace", "--url", d.proxy.url]) == 0  # the last request by default
        assert "request mine" in capsys.readouterr().out
        assert main(["trace", "nobody", "--url", d.proxy.url]) == 2
        assert "no timeline of 'nobody'" in capsys.readouterr().err
