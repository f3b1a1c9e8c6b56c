"""The proxy against fake OpenAI-compatible instances: stages by modality, the KV
hand-off parameters, per-image encoder fan-out, fail-over, cancellation, membership,
keys, metrics and errors. Each fake and the proxy are real HTTP servers on loopback."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os

import httpx
import pytest

from epd_serve.instances.payloads import chat_body
from epd_serve.proxy import ProxyConfig, create_app
from epd_serve.proxy.tenancy import image_key
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from tests.waiting import wait_for
from .harness import IMAGE, ProxyThread, ascend_deployment, chat, deployment, tiny_image


# -- stages and the KV hand-off ------------------------------------------------------
@pytest.mark.parametrize("protocol", ["epd", "mooncake"])
def test_image_request_goes_e_then_p_then_d_with_handoff_params(protocol):
    with deployment(["E", "P", "D"], protocol=protocol) as d:
        resp = chat(d, "what is this", [IMAGE], max_tokens=5)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert stages.startswith("E=e0:") and "P=p1:" in stages and "D=d2" in stages
        (enc,), (pre,), (dec,) = d.seen("e0"), d.seen("p1"), d.seen("d2")
        # E and P stop after one token and do not stream; D produces the answer.
        assert enc["body"]["max_tokens"] == 1 and enc["body"]["stream"] is False
        # The encoder gets only the image, tagged with its content key.
        (part,) = enc["body"]["messages"][0]["content"]
        assert part["uuid"] == image_key("fake", IMAGE)
        assert pre["body"]["max_tokens"] == 1
        assert image_key("fake", IMAGE) in pre["body"]["ec_transfer_params"]
        assert "ec_transfer_params" not in dec["body"]  # decode needs the KV, not the feature
        kv_p = pre["body"]["kv_transfer_params"]
        assert kv_p["do_remote_decode"] is True and kv_p["do_remote_prefill"] is False
        kv_d = dec["body"]["kv_transfer_params"]
        assert kv_d["do_remote_prefill"] is True
        assert kv_d["transfer_id"] == kv_p["transfer_id"]
        if protocol == "mooncake":  # decode pulls from prefill's bootstrap server
            assert kv_d["remote_engine_id"] == "engine-p1"
            assert kv_d["remote_bootstrap_addr"].startswith("http://127.0.0.1:")
        else:  # decode reserves blocks with prefill's side channel
            assert (kv_d["remote_host"], kv_d["remote_port"]) == ("127.0.0.1", 30101)
        assert dec["body"]["max_tokens"] == 5
        # One request id follows the request through every stage.
        assert enc["request_id"] == pre["request_id"] == dec["request_id"]
        assert resp.headers["x-request-id"] == dec["request_id"]
        assert resp.json()["usage"]["completion_tokens"] == 5


def test_a_client_request_id_is_echoed_and_leads_the_engines_id_and_a_bad_one_replaced():
    with deployment(["P", "D"]) as d:
        resp = chat(d, "x", headers={"x-request-id": "client-7"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "client-7"
        engine_id = d.seen("p0")[0]["request_id"]
        # The engines get an id of the proxy's own (unique per request), led by the client's.
        assert engine_id == d.seen("d1")[0]["request_id"] and engine_id.startswith("client-7-")
        resp = chat(d, "x", headers={"x-request-id": "bad id\twith spaces"})
        assert resp.headers["x-request-id"].startswith("epd-")
        assert d.seen("p0")[1]["request_id"] == resp.headers["x-request-id"]
    # A line break cannot come in a header, but the id is a hop's header: never let one in.
    from epd_serve.proxy.context import Proxy
    assert Proxy.request_ids_for("client-7\n")[0].startswith("epd-")
    assert Proxy.request_ids_for("client-7")[1].startswith("client-7-epd-")


def test_epd_handoff_reports_the_transfer_in_the_stages_header():
    with deployment(["P", "D"]) as d:
        resp = chat(d, "x", max_tokens=2)
        assert resp.status_code == 200
        assert resp.headers["x-epd-stages"].endswith(
            ";KV=done:bytes=65536B:transfer=0.5ms:exposed=0.0ms:groups=2")


def test_epd_handoff_passes_the_transfer_mode_to_prefill_only():
    with deployment(["P", "D"]) as d:
        body = chat_body("fake", "x", max_tokens=2)
        # Where the KV goes is the proxy's to say: such a key is refused, not dropped.
        body["kv_transfer_params"] = {"epd_mode": "layer", "do_remote_prefill": True}
        refused = d.client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "do_remote_prefill" in refused.text
        assert d.seen("p0") == d.seen("d1") == []
        body["kv_transfer_params"] = {"epd_mode": "layer"}
        assert d.client.post("/v1/chat/completions", json=body).status_code == 200
        kv_p = d.seen("p0")[0]["body"]["kv_transfer_params"]
        assert kv_p["epd_mode"] == "layer" and kv_p["do_remote_decode"] is True
        assert "epd_mode" not in d.seen("d1")[0]["body"]["kv_transfer_params"]


def test_a_transfer_mode_the_connector_does_not_know_is_the_clients_400_naming_it():
    with deployment(["P", "D"]) as d:
        body = chat_body("fake", "x", max_tokens=2)
        body["kv_transfer_params"] = {"epd_mode": "warp"}
        refused = d.client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400, refused.text
        assert "epd_mode" in refused.json()["error"]["message"]
        assert d.seen("p0") == d.seen("d1") == []  # refused before any engine saw it


@pytest.mark.parametrize("stream", [False, True])
def test_epd_handoff_retries_a_failed_prefill_with_a_fresh_decode_request(stream):
    with deployment(["P", "P", "D"], failing={"p0": 500},
                    routing={"P": "round-robin"}) as d:
        resp = chat(d, "x", max_tokens=3, stream=stream)
        assert resp.status_code == 200
        assert "P=p0!" in resp.headers["x-epd-stages"]  # the failed attempt is shown
        assert "P=p1:" in resp.headers["x-epd-stages"]
        (failed,), (served,) = d.seen("p0"), d.seen("p1")
        # Decode is sent the request once prefill has taken it: only for p1.
        (decode,) = d.seen("d2")
        assert decode["body"]["kv_transfer_params"]["remote_port"] == 30101
        assert decode["body"]["kv_transfer_params"]["transfer_id"] == \
            served["body"]["kv_transfer_params"]["transfer_id"] != \
            failed["body"]["kv_transfer_params"]["transfer_id"]
        assert served["body"]["stream"] is True and served["body"]["max_tokens"] == 1


def test_epd_handoff_keeps_decode_when_the_only_prefill_dies_under_the_request():
    # p0 takes the request, then its answer breaks off, as when the instance dies:
    # decode already has the request and will compute the prompt itself.
    with deployment(["P", "D"]) as d:
        d.apps["p0"].state.break_streams = True
        resp = chat(d, "x", max_tokens=3)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert len(d.seen("d1")) == 1


def test_epd_handoff_sends_decode_nothing_when_no_prefill_takes_the_request():
    # p0 counts as healthy (no probe has noticed yet) but refuses connections. (With the
    # default handoff_fallback, decode then runs the request whole: test_proxy_degraded.)
    with deployment(["P", "D"], health_interval_s=60,
                    routing={"handoff_fallback": "refuse"}) as d:
        d.proxy.call(lambda: setattr(d.proxy.proxy.table.get("p0").entry, "url",
                                     "http://127.0.0.1:9"))
        resp = chat(d, "x", max_tokens=3)
        assert resp.status_code == 502 and "every P instance failed" in resp.json()["error"]["message"]
        assert d.seen("d1") == []


def test_epd_handoff_returns_a_prefill_client_error_as_is():
    with deployment(["P", "D"], failing={"p0": 400}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 400 and "p0" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False),
                                          ("/v1/chat/completions", True),
                                          ("/v1/completions", False)])
def test_ascend_layerwise_decode_first_then_prefill_with_decodes_blocks(path, stream):
    with ascend_deployment(["P", "D"]) as d:
        if path == "/v1/completions":
            body = {"model": "fake", "prompt": "hi", "max_tokens": 4, "stream": stream}
        else:
            body = chat_body("fake", "x", max_tokens=4, stream=stream)
        resp = d.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        (dec,), (pre,) = d.seen("d1"), d.seen("p0")
        kv_d = dec["body"]["kv_transfer_params"]
        metaserver = kv_d.pop("metaserver")
        assert kv_d == {"do_remote_decode": False, "do_remote_prefill": True}
        # A URL of the proxy's made for this request alone: nobody else can report at it.
        base = f"{d.client.base_url}/v1/metaserver/"
        assert metaserver.startswith(base) and len(metaserver) - len(base) >= 32
        assert dec["body"]["stream"] is stream and dec["body"]["max_tokens"] == 4
        # Prefill ran with exactly what decode reported, under the same request id.
        kv_p = pre["body"]["kv_transfer_params"]
        assert kv_p["remote_block_ids"] == [[7, 8, 9]] and kv_p["remote_engine_id"] == "engine-d1"
        assert kv_p["do_remote_decode"] is True and kv_p["remote_cached_tokens"] == 0
        assert pre["request_id"] == dec["request_id"]
        assert pre["body"]["max_tokens"] == 1 and pre["body"]["min_tokens"] == 1
        assert pre["body"]["stream"] is False and "stream_options" not in pre["body"]
        assert resp.headers["x-epd-stages"].startswith("P=p0:")
        assert ";D=d1" in resp.headers["x-epd-stages"]


def test_ascend_layerwise_prefill_failure_fails_the_request():
    with ascend_deployment(["P", "D"], failing={"p0": 500}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 502 and "p0" in resp.json()["error"]["message"]


def test_metaserver_refuses_unknown_urls_and_other_protocols():
    with ascend_deployment(["P", "D"]) as d:
        assert d.client.post("/v1/metaserver", json={"request_id": "chatcmpl-x"}
                             ).status_code == 404
        resp = d.client.post("/v1/metaserver/guessed", json={"request_id": "chatcmpl-x"})
        assert resp.status_code == 404 and "no request" in resp.json()["error"]["message"]
        assert d.seen("p0") == []
    with deployment(["P", "D"]) as d:
        assert d.client.post("/v1/metaserver/x", json={"request_id": "x"}).status_code == 404


# -- modality routing ------------------------------------------------------------------
def test_text_request_never_touches_the_encoder():
    with deployment(["E", "P", "D"]) as d:
        resp = chat(d, "hello", max_tokens=3)
        assert resp.status_code == 200
        assert d.seen("e0") == []
        assert len(d.seen("p1")) == 1 and len(d.seen("d2")) == 1
        assert resp.headers["x-epd-stages"].startswith("P=p1:")


def test_merged_prefill_decode_instance_gets_the_request_directly():
    with deployment(["E", "PD"]) as d:
        resp = chat(d, "look", [IMAGE], max_tokens=4)
        assert resp.status_code == 200
        (req,) = d.seen("pd1")
        assert "kv_transfer_params" not in req["body"]
        assert req["body"]["max_tokens"] == 4
        assert image_key("fake", IMAGE) in req["body"]["ec_transfer_params"]


def test_without_encoders_prefill_gets_the_pixels():
    with deployment(["EP", "D"]) as d:
        resp = chat(d, "look", [IMAGE], max_tokens=2)
        assert resp.status_code == 200 and "E=" not in resp.headers["x-epd-stages"]
        (pre,) = d.seen("ep0")
        assert pre["body"]["messages"][0]["content"][0]["image_url"]["url"] == IMAGE


def test_round_robin_spreads_over_prefill_and_decode_instances():
    with deployment(["P", "P", "D", "D"],
                    routing={"P": "round-robin", "D": "round-robin"}) as d:
        for _ in range(4):
            assert chat(d, "x").status_code == 200
        assert [len(d.seen(n)) for n in ("p0", "p1", "d2", "d3")] == [2, 2, 2, 2]


def test_least_loaded_avoids_the_instance_whose_engine_reports_a_queue():
    with deployment(["P", "D", "D"], routing={"D": "least-loaded",
                                              "metrics_interval_s": 0.05}) as d:
        d.apps["d1"].state.reported_load = (6, 10, 0.9)
        wait_for(lambda: (next(i for i in d.client.get("/status").json()["instances"]
                               if i["name"] == "d1")["engine"] or {}).get("waiting") == 10,
                 "engine load read")
        for _ in range(5):
            assert chat(d, "x").status_code == 200
        assert len(d.seen("d1")) == 0 and len(d.seen("d2")) == 5


def test_only_instances_routing_chooses_among_have_their_engine_load_read():
    # One P, two D: the periodic read goes to the decoders only; /status reads the
    # prefill's numbers when it has none, so the table still shows them.
    with deployment(["P", "D", "D"], routing={"metrics_interval_s": 0.02}) as d:
        before = d.apps["p0"].state.metrics_reads  # the helper's /status calls
        start = {n: d.apps[n].state.metrics_reads for n in ("d1", "d2")}
        wait_for(lambda: all(d.apps[n].state.metrics_reads >= start[n] + 5
                             for n in ("d1", "d2")), "decoders' engine load read")
        assert d.apps["p0"].state.metrics_reads == before
        d.apps["p0"].state.reported_load = (1, 2, 0.5)
        prefill = next(i for i in d.proxy.proxy.table.instances if i.name == "p0")
        d.proxy.call(setattr, prefill, "engine", None)  # nothing known: /status reads it
        rows = {i["name"]: i for i in d.client.get("/status").json()["instances"]}
        assert rows["p0"]["engine"] == {"running": 1, "waiting": 2, "kv_cache_usage": 0.5}
        assert d.apps["p0"].state.metrics_reads == before + 1


def test_streaming_relays_every_chunk():
    with deployment(["E", "P", "D"]) as d:
        body = chat_body("fake", "look", [IMAGE], max_tokens=6, stream=True)
        with d.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        contents = [json.loads(e[6:])["choices"] for e in events[:-1]]
        assert sum(1 for c in contents if c) == 6
        assert d.seen("d2")[0]["body"]["stream"] is True
        # Prefill answers one token, streamed only so the proxy knows when it took it.
        prefill = d.seen("p1")[0]["body"]
        assert prefill["max_tokens"] == 1 and "stream_options" not in prefill


# -- per-image fan-out -------------------------------------------------------------------
def test_images_of_one_request_are_encoded_on_both_encoders_at_once():
    images = [tiny_image(seed) for seed in range(4)]
    with deployment(["E", "E", "P", "D"], routing={"E": "least-loaded", "encoder_batch": 1}) as d:
        for app in ("e0", "e1"):
            d.apps[app].state.hold = True  # no encoder answers until all four are sent
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(chat, d, "four", images, max_tokens=2)
            # All four batches are at the encoders while none has answered: they were
            # sent at once, not one after another.
            wait_for(lambda: len(d.seen("e0")) == 2 and len(d.seen("e1")) == 2,
                     "four encoder requests in flight at once")
            assert d.seen("p2") == []
            for app in ("e0", "e1"):
                d.apps[app].state.hold = False
            resp = answer.result(timeout=30)
        assert resp.status_code == 200, resp.text
        assert "E=e0+e1:" in resp.headers["x-epd-stages"]
        sent = {p["uuid"] for r in d.seen("e0") + d.seen("e1")
                for p in r["body"]["messages"][0]["content"]}
        keys = {image_key("fake", url) for url in images}
        assert sent == keys
        assert set(d.seen("p2")[0]["body"]["ec_transfer_params"]) == keys


def test_without_fan_out_every_image_of_a_request_goes_to_one_encoder():
    images = [tiny_image(seed) for seed in range(4)]
    with deployment(["E", "E", "P", "D"], routing={"E": "least-loaded", "fan_out": False,
                                                   "encoder_batch": 8}) as d:
        resp = chat(d, "four", images)
        assert resp.status_code == 200, resp.text
        sent = [len(r["body"]["messages"][0]["content"]) for r in d.seen("e0") + d.seen("e1")]
        assert sent == [4]


def test_encoder_batches_hold_at_most_the_configured_number_of_images():
    images = [tiny_image(seed) for seed in range(5)]
    with deployment(["E", "P", "D"], routing={"encoder_batch": 2}) as d:
        assert chat(d, "five", images).status_code == 200
        assert sorted(len(r["body"]["messages"][0]["content"]) for r in d.seen("e0")) == [1, 2, 2]


def test_hash_affinity_sends_the_same_image_to_the_same_encoder():
    images = [tiny_image(seed) for seed in range(6)]
    with deployment(["E", "E", "P", "D"]) as d:  # hash-affinity is the E default
        for url in images + images:
            assert chat(d, "x", [url]).status_code == 200
        by_key = {}
        for name in ("e0", "e1"):
            for r in d.seen(name):
                by_key.setdefault(r["body"]["messages"][0]["content"][0]["uuid"], set()).add(name)
        assert len(by_key) == 6 and all(len(names) == 1 for names in by_key.values())
        assert d.seen("e0") and d.seen("e1")  # six keys do not all hash to one encoder


def test_a_failing_encoder_batch_is_retried_on_the_other_encoder():
    images = [tiny_image(seed) for seed in range(4)]
    with deployment(["E", "E", "P", "D"], failing={"e0": 500},
                    routing={"E": "round-robin", "encoder_batch": 1}) as d:
        resp = chat(d, "x", images)
        assert resp.status_code == 200, resp.text
        assert "E=e0!" in resp.headers["x-epd-stages"]
        assert len(d.seen("e1")) == 4


def test_an_encoder_failing_everywhere_fails_the_request_with_a_reason():
    with deployment(["E", "P", "D"], failing={"e0": 500},
                    routing={"encode_fallback": "refuse"}) as d:
        resp = chat(d, "x", [IMAGE])
        assert resp.status_code == 502 and "could not be encoded" in resp.json()["error"]["message"]
        assert d.seen("p1") == []


def test_encoder_fallback_to_prefill_when_the_deployment_asks_for_it():
    with deployment(["E", "P", "D"], failing={"e0": 500},
                    routing={"encode_fallback": "prefill"}) as d:
        resp = chat(d, "x", [IMAGE])
        assert resp.status_code == 200
        assert "E=skipped" in resp.headers["x-epd-stages"]
        assert "ec_transfer_params" not in d.seen("p1")[0]["body"]


def test_with_every_encoder_down_and_fallback_refused_images_get_503_and_text_flows():
    with deployment(["E", "P", "D"], dead={"e0"}, routing={"encode_fallback": "refuse"}) as d:
        resp = chat(d, "x", [IMAGE])
        assert resp.status_code == 503 and resp.headers["retry-after"]
        assert "no healthy encoder" in resp.json()["error"]["message"]
        assert chat(d, "just text").status_code == 200
        assert d.client.get("/health").json()["status"] == "degraded"
        # Not ready: a launcher waits until every instance has answered a probe.
        ready = d.client.get("/ready")
        assert ready.status_code == 503 and ready.json()["waiting_for"] == ["e0"]


def test_ready_once_every_instance_answered_a_probe():
    with deployment(["E", "P", "D"]) as d:
        wait_for(lambda: d.client.get("/ready").status_code == 200, "proxy ready")
        assert d.client.get("/ready").json() == {"status": "ready"}


# -- fail-over and errors ----------------------------------------------------------------
def test_unreachable_prefill_instance_fails_over_without_losing_the_request():
    with deployment(["P", "P", "D"], dead={"p0"}) as d:
        for _ in range(3):
            assert chat(d, "x").status_code == 200
        assert len(d.seen("p1")) == 3


def test_unreachable_decode_instance_fails_over_for_plain_and_streamed_answers():
    with deployment(["P", "D", "D"], dead={"d1"}, health_interval_s=60) as d:
        d.proxy.call(lambda: setattr(d.proxy.proxy.table.get("d1"), "healthy", True))
        for stream in (False, True, False):
            assert chat(d, "x", stream=stream).status_code == 200
        assert len(d.seen("d2")) == 3


def test_a_decode_500_is_retried_once_on_another_decode_instance():
    with deployment(["PD", "PD", "PD"], failing={"pd0": 500, "pd1": 500},
                    routing={"D": "round-robin"}) as d:
        resp = chat(d, "x")
        # pd0 fails, pd1 (the one retry) fails too: the error is returned, pd2 never tried.
        assert resp.status_code == 502 and d.seen("pd2") == []
        resp = chat(d, "x")  # now pd1 is first: pd1 fails, pd2 serves
        assert resp.status_code == 200 and len(d.seen("pd2")) == 1


def test_client_errors_from_an_instance_keep_their_status():
    with deployment(["P", "D"], failing={"d1": 404}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 404
        assert "d1" in resp.json()["error"]["message"]


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "fake"}', "messages"),
    (b'{"model": "fake", "messages": []}', "messages"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": [{"text": "x"}]}]}', "type"),
])
def test_bad_requests_get_a_400_with_a_message_before_any_engine(raw, fragment):
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", content=raw,
                             headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert fragment in resp.json()["error"]["message"]
        assert d.seen("p0") == [] and d.seen("d1") == []


def test_hostile_images_and_urls_are_refused_fast_and_never_reach_an_engine():
    import zlib

    def png(width: int, height: int) -> str:
        import base64
        import struct
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                    + struct.pack(">I", zlib.crc32(kind + data)))
        raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
               + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
        return "data:image/png;base64," + base64.b64encode(raw).decode()

    hostile = [png(30000, 30000), "file:///etc/passwd", "http://169.254.169.254/latest",
               "https://example.com/cat.png", "data:image/png;base64,@@@not-base64",
               "data:image/png;base64,aGVsbG8gd29ybGQ="]
    with deployment(["E", "P", "D"]) as d:
        for app in d.apps.values():
            app.state.hold = True  # an engine would not answer: the refusals cannot wait on one
        for url in hostile:
            resp = chat(d, "x", [url])
            assert resp.status_code in (400, 413), (url[:40], resp.text)
            assert resp.json()["error"]["message"]
        assert d.seen("e0") == d.seen("p1") == d.seen("d2") == []
        for app in d.apps.values():
            app.state.hold = False
        assert chat(d, "x", [IMAGE]).status_code == 200  # and it keeps serving


def test_too_many_images_and_too_large_bodies_are_refused():
    with deployment(["E", "P", "D"], limits={"max_images": 2, "max_body_bytes": 4096}) as d:
        resp = chat(d, "x", [IMAGE] * 3)
        assert resp.status_code == 400 and "image" in resp.json()["error"]["message"]
        resp = chat(d, "x" * 10000)
        assert resp.status_code == 413 and "max_body_bytes" in resp.json()["error"]["message"]


def test_no_decode_instance_and_fallback_refused_means_503_and_unhealthy():
    with deployment(["P", "D"], dead={"d1"}, routing={"handoff_fallback": "refuse"}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 503
        assert "stage D" in resp.json()["error"]["message"]
        assert d.client.get("/health").status_code == 503


def test_models_and_completions_endpoints():
    with deployment(["P", "D"]) as d:
        assert d.client.get("/v1/models").json()["data"][0]["id"] == "fake"
        resp = d.client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                      "max_tokens": 2})
        assert resp.status_code == 200
        assert d.seen("d1")[0]["path"] == "/v1/completions"


# -- cancellation ------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_the_work_on_the_instance(stream):
    with deployment(["PD"]) as d:
        engine = d.apps["pd0"].state
        engine.hold = True  # it computes until the client has left, however long that takes
        try:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(d.proxy.url + "/v1/chat/completions", timeout=0.3,
                           headers={"x-request-id": "leaving"},
                           json=chat_body("fake", "x", stream=stream))
            # Held, the engine can only end the request by noticing the client left.
            wait_for(lambda: any(rid.startswith("leaving-") for rid in engine.cancelled),
                     "the engine saw the connection close")
            wait_for(lambda: d.client.get("/status").json()["instances"][0]["in_flight"] == 0,
                     "the lease released")
        finally:
            engine.hold = False


# -- membership --------------------------------------------------------------------------
def test_instances_register_serve_and_leave_with_the_admin_key(monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_ADMIN_KEY", "s3cret")
    roster = tmp_path / "roster.json"
    late = create_fake_app("d-late")
    with deployment(["P", "D"], roster_path=str(roster)) as d, ThreadedServer(late) as server:
        entry = {"name": "d9", "roles": "D", "url": server.url}
        assert d.client.post("/instances", json=entry).status_code == 401
        assert d.client.post("/instances", json=entry,
                             headers={"authorization": "Bearer wrong"}).status_code == 401
        admin = {"authorization": "Bearer s3cret"}
        assert d.client.post("/instances", json={**entry, "roles": "X"},
                             headers=admin).status_code == 400
        assert d.client.post("/instances", json=entry, headers=admin).status_code == 201
        assert d.client.post("/instances", json=entry, headers=admin).status_code == 409
        wait_for(lambda: all(i["healthy"] for i in d.client.get("/instances").json()),
                 "the new instance probed healthy")
        for _ in range(4):
            assert chat(d, "x").status_code == 200
        assert late.state.requests  # least-loaded shares decode with the newcomer
        assert 'epd_proxy_instance_role{instance="d9",role="D"} 1.0' in d.client.get(
            "/metrics").text
        assert [r["entry"]["name"] for r in json.loads(roster.read_text())] == ["p0", "d1", "d9"]

        # A restarted proxy starts from the kept roster.
        config = ProxyConfig(model="fake", instances=[], roster_path=str(roster),
                             health_interval_s=0.05)
        with ProxyThread(create_app(config)) as again:
            names = [i["name"] for i in httpx.get(again.url + "/status").json()["instances"]]
            assert names == ["p0", "d1", "d9"]

        assert d.client.delete("/instances/d9", headers=admin).status_code == 200
        assert d.client.delete("/instances/d9", headers=admin).status_code == 404
        served = len(late.state.requests)
        for _ in range(2):
            assert chat(d, "x").status_code == 200
        assert len(late.state.requests) == served
        assert "d9" not in roster.read_text()


def test_registration_is_off_without_an_admin_key(monkeypatch):
    monkeypatch.delenv("EPD_ADMIN_KEY", raising=False)
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/instances", json={"name": "x", "roles": "D",
                                                 "url": "http://127.0.0.1:9"})
        assert resp.status_code == 403 and "EPD_ADMIN_KEY" in resp.json()["error"]["message"]


def test_an_instance_is_taken_out_after_failed_probes_and_back_when_it_answers():
    with deployment(["P", "D", "D"], unhealthy_after=2) as d:
        def status() -> dict[str, bool]:
            return {i["name"]: i["healthy"] for i in d.client.get("/status").json()["instances"]}

        assert status()["d1"]
        # A refused connection takes it out at once; answering again puts it back.
        original = d.proxy.proxy.table.get("d1").entry.url
        d.proxy.call(lambda: setattr(d.proxy.proxy.table.get("d1").entry, "url",
                                     "http://127.0.0.1:9"))
        wait_for(lambda: not status()["d1"], "d1 out")
        for _ in range(3):
            assert chat(d, "x").status_code == 200
        d.proxy.call(lambda: setattr(d.proxy.proxy.table.get("d1").entry, "url", original))
        wait_for(lambda: status()["d1"], "d1 back")


def test_slow_probes_do_not_take_a_busy_instance_out_at_once():
    import asyncio

    import aiohttp

    from epd_serve.proxy.config import InstanceEntry
    from epd_serve.proxy.membership import Membership
    from epd_serve.proxy.metrics import ProxyMetrics
    from epd_serve.proxy.state import InstanceTable

    class Session:
        def __init__(self, error):
            self.error = error

        def get(self, url, timeout=None):
            raise self.error

    async def run(error, probes):
        table = InstanceTable([InstanceEntry(name="d0", roles="D", url="http://d0")])
        inst = table.get("d0")
        inst.healthy = True
        config = ProxyConfig(model="m", instances=[], unhealthy_after=3)
        membership = Membership(table, Session(error), ProxyMetrics(), config)
        states = []
        for _ in range(probes):
            await membership.probe(inst)
            states.append(inst.healthy)
        return states

    assert asyncio.run(run(asyncio.TimeoutError(), 3)) == [True, True, False]
    assert asyncio.run(run(aiohttp.ServerDisconnectedError(), 3)) == [True, True, False]
    assert asyncio.run(run(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), 1)) == [False]
    # The proxy out of descriptors or ports says nothing about the instance.
    for code in (errno.EMFILE, errno.EADDRNOTAVAIL):
        assert asyncio.run(run(OSError(code, os.strerror(code)), 5)) == [True] * 5


# -- keys and metrics --------------------------------------------------------------------
def test_an_api_key_guards_the_openai_routes(monkeypatch):
    monkeypatch.setenv("EPD_TEST_API_KEY", "k1")
    with deployment(["P", "D"], api_key_env="EPD_TEST_API_KEY",
                    client_headers={"authorization": "Bearer k1"}) as d:
        assert chat(d, "x").status_code == 200
        assert chat(d, "x", headers={"authorization": "Bearer k2"}).status_code == 401
        resp = httpx.post(d.proxy.url + "/v1/chat/completions", json=chat_body("fake", "x"))
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
        assert httpx.get(d.proxy.url + "/status").status_code == 401
        assert httpx.get(d.proxy.url + "/health").status_code == 200  # probes need no key


def test_metrics_count_hops_per_stage_and_instance_retries_and_failures():
    with deployment(["E", "P", "P", "D"], dead={"p1"}, health_interval_s=60,
                    routing={"P": "round-robin"}) as d:
        d.proxy.call(lambda: setattr(d.proxy.proxy.table.get("p1"), "healthy", True))
        assert chat(d, "x", [IMAGE], stream=True).status_code == 200
        assert chat(d, "x").status_code == 200
        assert chat(d, "x", ["file:///etc/passwd"]).status_code == 400
        text = d.client.get("/metrics").text
        for line in ('epd_proxy_stage_seconds_count{instance="e0",stage="encode"} 1.0',
                     'epd_proxy_stage_seconds_count{instance="p2",stage="prefill"} 2.0',
                     'epd_proxy_stage_seconds_count{instance="d3",stage="decode"} 2.0',
                     'epd_proxy_retries_total{stage="P"} 1.0',
                     'epd_proxy_failures_total{reason="forbidden_url"} 1.0',
                     'epd_proxy_requests_total{modality="multimodal",status="200"} 1.0',
                     'epd_proxy_first_token_seconds_count{instance="d3"} 1.0',
                     'epd_proxy_kv_transfer_seconds_count{instance="d3"} 1.0'):
            assert line in text, line


def test_a_named_but_unset_api_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv("EPD_UNSET_KEY", raising=False)
    config = ProxyConfig(model="fake", instances=[], api_key_env="EPD_UNSET_KEY")
    with pytest.raises(ValueError, match="EPD_UNSET_KEY"):
        create_app(config)
