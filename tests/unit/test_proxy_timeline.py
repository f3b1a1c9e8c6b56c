"""A request's timeline: one W3C trace id from the client (or the proxy) to every hop,
the proxy's own spans of each hop, the engines' spans received over OTLP/HTTP and
filed under the request, and the waterfall and per-stage parts read from it."""

from __future__ import annotations

import re

import httpx
import pytest

from epd_serve.bench import timeline as view
from epd_serve.connectors.spans import ConnectorSpans
from epd_serve.proxy import timeline

from .test_proxy import IMAGE, chat, deployment

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


def test_a_valid_traceparent_keeps_its_trace_and_anything_else_gets_a_new_one():
    assert timeline.trace_id_of(f"00-{TRACE}-00f067aa0ba902b7-01") == TRACE
    for bad in (None, "", "garbage", f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE}-xyz-01"):
        new = timeline.trace_id_of(bad)
        assert re.fullmatch(r"[0-9a-f]{32}", new) and new != TRACE
    assert timeline.trace_id_of(None) != timeline.trace_id_of(None)


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


def test_the_store_files_early_spans_finds_by_any_id_and_forgets_the_oldest():
    store = timeline.TraceStore(capacity=2)
    early = timeline.Span("llm_request", "d0", 5, 9)
    assert store.add_engine_spans([("t1", early)]) == 0  # its request has not ended yet
    store.add(timeline.Timeline("t1", "client-1", "client-1-epd-x-1", 0))
    assert store.get("t1").spans == [early]
    assert store.get("client-1") is store.get("client-1-epd-x-1") is store.get("t1")
    store.add(timeline.Timeline("t2", "c2", "e2", 0))
    store.add(timeline.Timeline("t3", "c3", "e3", 0))
    assert store.get("t1") is None and store.get("client-1") is None
    assert [t.trace_id for t in store.recent(5)] == ["t3", "t2"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_hop_carries_the_clients_trace_and_the_timeline_holds_each_hop(stream):
    with deployment(["E", "P", "D"]) as d:
        resp = chat(d, "what is this", [IMAGE], max_tokens=4, stream=stream,
                    headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01",
                             "x-request-id": "client-9"})
        assert resp.status_code == 200 and resp.headers["x-epd-trace-id"] == TRACE
        parents = {}
        for name in ("e0", "p1", "d2"):
            (seen,) = d.seen(name)
            match = HEX16.match(seen["traceparent"])
            assert match and match[1] == TRACE, seen["traceparent"]
            parents[name] = seen["traceparent"].split("-")[2]
        assert len(set(parents.values())) == 3  # one span per hop

        found = d.client.get("/v1/traces/client-9").json()
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
                            headers={"content-type": "application/x-protobuf"})
        assert posted.status_code == 200
        # So does our KV connector in the engine core, for the transfer it received.
        spans = ConnectorSpans(f"{d.proxy.url}/v1/traces", "d2")
        spans.record("kv receive", {"traceparent": d.seen("d2")[0]["traceparent"]},
                     d2_start, d2_start + 500_000, {"epd.kv.outcome": "done",
                                                    "epd.kv.groups": 2, "epd.kv.bytes": 4096},
                     [("layers 0-1 landed", d2_start + 400_000)])
        spans.close()
        found = d.client.get(f"/v1/traces/{TRACE}").json()
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


def test_bad_exports_and_unknown_traces_get_clear_errors():
    with deployment(["P", "D"]) as d:
        url = f"{d.proxy.url}/v1/traces"
        json_export = httpx.post(url, json={"resourceSpans": []})
        assert json_export.status_code == 415 and "protobuf" in json_export.text
        garbage = httpx.post(url, content=b"\xff\x00not protobuf",
                             headers={"content-type": "application/x-protobuf"})
        assert garbage.status_code == 400 and "OTLP" in garbage.text
        missing = d.client.get("/v1/traces/nobody")
        assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
        assert chat(d, "x").status_code == 200
        (recent,) = d.client.get("/v1/traces", params={"last": 1}).json()
        assert "spans" not in recent and recent["status"] == 200


def test_reading_traces_takes_the_api_key_but_engines_export_without_it(monkeypatch):
    monkeypatch.setenv("EPD_TEST_KEY", "sekret")
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEY",
                    client_headers={"authorization": "Bearer sekret"}) as d:
        assert chat(d, "x").status_code == 200
        assert httpx.get(f"{d.proxy.url}/v1/traces").status_code == 401
        assert d.client.get("/v1/traces").status_code == 200
        body = engine_export(f"00-{TRACE}-00f067aa0ba902b7-01", "p0", 10**18, 0.1, 0, 0, 0)
        assert httpx.post(f"{d.proxy.url}/v1/traces", content=body, headers={
            "content-type": "application/x-protobuf"}).status_code == 200


def test_a_load_run_reports_where_the_median_request_went_and_its_tail(tmp_path):
    from rich.console import Console

    from epd_serve.bench import runner
    from epd_serve.bench.metrics import SLO
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


def test_epd_serve_trace_shows_the_waterfall_of_a_request(tmp_path, capsys):
    from epd_serve.cli.main import main

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
