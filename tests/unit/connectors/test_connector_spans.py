"""Our connectors' spans: exported over OTLP/HTTP as children of the hop that sent the
request; the decode scheduler's KV transfer span made from its worker's report; the
prefill worker's feature load, under the trace context its scheduler passed on."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import types

import pytest

from epd_serve.connectors.epd_ec.scheduler import ECStep
from epd_serve.connectors.epd_ec.settings import Settings as ECSettings
from epd_serve.connectors.epd_ec.worker import EPDECWorker
from epd_serve.connectors.epd_kv.messages import REPORT_TIMES_KEY
from epd_serve.connectors.epd_kv.metadata import TransferReport
from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.spans import ConnectorSpans
from proxy.timeline import parse_otlp

from .test_epd_ec import decided
from .test_epd_ec import feature as ec_feature
from .test_epd_ec import request as ec_request
from .test_epd_ec import scheduler as ec_scheduler
from .test_epd_ec import store_feature

TRACE, HOP = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE}-{HOP}-01"}


@pytest.fixture
def collector():
    """An OTLP/HTTP endpoint that keeps the bodies posted to it."""
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces", bodies
    server.shutdown()


def test_a_span_is_exported_under_the_hop_that_sent_the_request(collector):
    endpoint, bodies = collector
    spans = ConnectorSpans(endpoint, "d0")
    spans.record("kv receive", TRACEPARENT, 1_000, 9_000, {"epd.kv.bytes": 4096},
                 [("layers 0-13 landed", 5_000), ("layers 14-27 landed", 8_000)])
    spans.record("kv receive", {}, 1_000, 2_000, {})  # no trace context: not exported
    spans.close()
    exported = [span for body in bodies for span in parse_otlp(body)]
    assert len(exported) == 1
    trace_id, span = exported[0]
    assert (trace_id, span.parent_id, span.source) == (TRACE, HOP, "d0")
    assert (span.name, span.start_ns, span.end_ns) == ("kv receive", 1_000, 9_000)
    assert span.attrs == {"epd.kv.bytes": 4096}
    assert span.events == [("layers 0-13 landed", 5_000), ("layers 14-27 landed", 8_000)]


def test_spans_follow_the_engines_own_export_setting(collector):
    endpoint, _ = collector
    config = types.SimpleNamespace(observability_config=types.SimpleNamespace(
        otlp_traces_endpoint=None))
    assert ConnectorSpans.of(config) is None
    config.observability_config.otlp_traces_endpoint = endpoint
    spans = ConnectorSpans.of(config)
    assert isinstance(spans, ConnectorSpans)
    spans.close()


class RecordedSpans:
    def __init__(self):
        self.spans = []

    def record(self, *args):
        self.spans.append(args)

    def close(self):
        pass


def test_decode_turns_its_transfer_report_into_a_span_and_answers_without_the_times():
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=4),
                                   kv_transfer_config=types.SimpleNamespace(kv_role="kv_consumer"))
    scheduler = EPDKVScheduler(config, Settings())
    scheduler.spans = recorded = RecordedSpans()
    request = types.SimpleNamespace(
        request_id="r", prompt_token_ids=list(range(8)), trace_headers=TRACEPARENT,
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t",
                            "remote_host": "127.0.0.1", "remote_port": 9000})
    blocks = types.SimpleNamespace(get_unhashed_block_ids=lambda: [3, 4])
    scheduler.update_state_after_alloc(request, blocks, 8)
    stats = {"transfer_id": "t", "outcome": "done", "bytes": 4096, "groups": 2,
             REPORT_TIMES_KEY: {"reserved": 100, "concluded": 900,
                                "landed": [(400, 0, 13), (800, 14, 27)]}}
    scheduler.update_connector_output(types.SimpleNamespace(
        finished_sending=None, kv_connector_worker_meta=TransferReport({"r": stats})))
    ((name, headers, start, end, attributes, events),) = recorded.spans
    assert (name, headers, start, end) == ("kv receive", TRACEPARENT, 100, 900)
    assert attributes == {"epd.kv.transfer_id": "t", "epd.kv.outcome": "done",
                          "epd.kv.bytes": 4096, "epd.kv.groups": 2}
    assert events == [("layers 0-13 landed", 400), ("layers 14-27 landed", 800)]
    request.status = types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    _, params = scheduler.request_finished(request, [3, 4])
    assert params == {"epd_kv": {"epd_v": 1, "transfer_id": "t", "outcome": "done",
                                 "bytes": 4096, "groups": 2}}


def test_prefill_loads_a_feature_as_a_span_of_the_request_it_is_for(store_spec):
    # The scheduler hands the worker the trace context of the request a load is for...
    store_feature(store_spec, "img")
    sched = ec_scheduler(store_spec)
    traced = ec_request("r", ec_feature("img"))
    traced.trace_headers = TRACEPARENT
    assert decided(sched, traced)
    sched.update_state_after_alloc(traced, 0)
    step = sched.build_connector_meta(types.SimpleNamespace(finished_req_ids=set()))
    assert list(step.loads) == ["img"] and step.loads["img"].trace == TRACEPARENT
    # ... and the worker records the load under it, from when the request needed it.
    worker = EPDECWorker(ECSettings(store=store_spec), producer=False, consumer=True,
                         spans=RecordedSpans())
    try:
        cache = {}
        worker.start_load_caches(step, cache)
        untraced = dataclasses.replace(step.loads["img"], trace=None)
        worker.start_load_caches(ECStep(loads={"img": untraced}), {})  # no span
    finally:
        worker.shutdown()
        sched.shutdown()
    assert "img" in cache
    ((name, headers, start, end, attributes, events),) = worker.spans.spans
    assert (name, headers) == ("features load", TRACEPARENT)
    assert attributes == {"epd.ec.key": "img", "epd.ec.bytes": 64, "epd.ec.source": "on_demand"}
    assert events == [("needed", start)] and start <= end
