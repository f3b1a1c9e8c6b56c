"""The proxy against fake OpenAI-compatible instances: routing by modality, the
E->P->D hand-off parameters, fail-over, errors."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from epd_serve.fake_server import ThreadedServer, create_fake_app
from epd_serve.payloads import chat_body
from epd_serve.proxy import ProxyConfig, create_app

from ..ports import free_port_block

IMAGE = "data:image/png;base64,iVBORw0KGgo="


@contextlib.contextmanager
def deployment(roles: list[str], dead: set[str] = frozenset(), failing: dict | None = None,
               protocol: str = "epd"):
    """Fake instances for `roles` (e.g. ["E", "P", "D"]) behind a proxy that hands KV off
    with `protocol`."""
    failing = failing or {}
    with contextlib.ExitStack() as stack:
        entries, apps = [], {}
        for i, role in enumerate(roles):
            name = f"{role.lower()}{i}"
            app = create_fake_app(name, fail_status=failing.get(name))
            apps[name] = app
            if name in dead:
                url = "http://127.0.0.1:9"  # nothing listens: connection refused
            else:
                url = stack.enter_context(ThreadedServer(app)).url
            entry = {"name": name, "roles": role, "url": url}
            if "P" in role and "D" not in role:
                # mooncake: the bootstrap server (the fake answers /query itself);
                # epd: the side channel, which only decode instances talk to.
                entry["kv_endpoint"] = url if protocol == "mooncake" else f"127.0.0.1:{30100 + i}"
            entries.append(entry)
        config = ProxyConfig(model="fake", instances=entries, health_interval_s=0.05,
                             kv_protocol=protocol)
        client = stack.enter_context(TestClient(create_app(config)))
        deadline = time.monotonic() + 5
        alive = [e["name"] for e in entries if e["name"] not in dead]
        while True:
            status = {i["name"]: i["healthy"] for i in client.get("/status").json()["instances"]}
            if all(status[n] for n in alive):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.02)
        yield client, apps


def seen(app) -> list[dict]:
    return app.state.requests


@pytest.mark.parametrize("protocol", ["epd", "mooncake"])
def test_image_request_goes_e_then_p_then_d_with_handoff_params(protocol):
    with deployment(["E", "P", "D"], protocol=protocol) as (client, apps):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "what is this", [IMAGE], max_tokens=5))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].startswith("E=e0:")
        assert "P=p1:" in resp.headers["x-epd-stages"] and "D=d2" in resp.headers["x-epd-stages"]
        (enc,), (pre,), (dec,) = seen(apps["e0"]), seen(apps["p1"]), seen(apps["d2"])
        # E and P stop after one token and do not stream; D produces the answer.
        assert enc["body"]["max_tokens"] == 1 and enc["body"]["stream"] is False
        assert pre["body"]["max_tokens"] == 1
        assert pre["body"]["ec_transfer_params"] == {"served_by": "e0"}
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
        assert resp.json()["usage"]["completion_tokens"] == 5


def test_epd_handoff_reports_the_transfer_in_the_stages_header():
    with deployment(["P", "D"]) as (client, _):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x", max_tokens=2))
        assert resp.status_code == 200
        assert resp.headers["x-epd-stages"].endswith(
            ";KV=done:bytes=65536B:transfer=0.5ms:exposed=0.0ms:groups=2")


def test_epd_handoff_passes_the_transfer_mode_to_prefill_only():
    with deployment(["P", "D"]) as (client, apps):
        body = chat_body("fake", "x", max_tokens=2)
        body["kv_transfer_params"] = {"epd_mode": "layer", "do_remote_prefill": True}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        kv_p = seen(apps["p0"])[0]["body"]["kv_transfer_params"]
        assert kv_p["epd_mode"] == "layer" and kv_p["do_remote_decode"] is True
        assert "epd_mode" not in seen(apps["d1"])[0]["body"]["kv_transfer_params"]


@pytest.mark.parametrize("stream", [False, True])
def test_epd_handoff_retries_a_failed_prefill_with_a_fresh_decode_request(stream):
    with deployment(["P", "P", "D"], failing={"p0": 500}) as (client, apps):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "x", max_tokens=3, stream=stream))
        assert resp.status_code == 200
        assert "P=p1:" in resp.headers["x-epd-stages"]
        (failed,), (served,) = seen(apps["p0"]), seen(apps["p1"])
        # Decode is sent the request once prefill has taken it: only for p1.
        (decode,) = seen(apps["d2"])
        assert decode["body"]["kv_transfer_params"]["remote_port"] == 30101
        assert decode["body"]["kv_transfer_params"]["transfer_id"] == \
            served["body"]["kv_transfer_params"]["transfer_id"] != \
            failed["body"]["kv_transfer_params"]["transfer_id"]
        assert served["body"]["stream"] is True and served["body"]["max_tokens"] == 1


def test_epd_handoff_keeps_decode_when_the_only_prefill_dies_under_the_request():
    # p0 takes the request, then its answer breaks off, as when the instance dies:
    # decode already has the request and will compute the prompt itself.
    with deployment(["P", "D"]) as (client, apps):
        apps["p0"].state.break_streams = True
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x", max_tokens=3))
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert len(seen(apps["d1"])) == 1


def test_epd_handoff_sends_decode_nothing_when_no_prefill_takes_the_request():
    # p0 counts as healthy (the poller has not noticed yet) but refuses connections.
    with deployment(["P", "D"]) as (client, apps):
        client.app.state.table.instances[0].entry.url = "http://127.0.0.1:9"
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x", max_tokens=3))
        assert resp.status_code == 502 and "every P instance failed" in resp.json()["error"]["message"]
        assert seen(apps["d1"]) == []


def test_epd_handoff_returns_a_prefill_client_error_as_is():
    with deployment(["P", "D"], failing={"p0": 400}) as (client, _):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x"))
        assert resp.status_code == 400 and "p0" in resp.json()["error"]["message"]


@contextlib.contextmanager
def ascend_deployment(roles: list[str], failing: dict | None = None):
    """Fake instances speaking vllm-ascend's layerwise protocol, behind a real proxy
    server: decode instances call its /v1/metaserver back."""
    failing = failing or {}
    with contextlib.ExitStack() as stack:
        entries, apps = [], {}
        for i, role in enumerate(roles):
            name = f"{role.lower()}{i}"
            apps[name] = create_fake_app(name, fail_status=failing.get(name))
            url = stack.enter_context(ThreadedServer(apps[name])).url
            entries.append({"name": name, "roles": role, "url": url})
        port = free_port_block(1, start=31000)
        config = ProxyConfig(model="fake", instances=entries, health_interval_s=0.05,
                             kv_protocol="ascend-layerwise", port=port)
        stack.enter_context(ThreadedServer(create_app(config), port=port))
        client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                  timeout=30))
        deadline = time.monotonic() + 5
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield client, apps


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False),
                                          ("/v1/chat/completions", True),
                                          ("/v1/completions", False)])
def test_ascend_layerwise_decode_first_then_prefill_with_decodes_blocks(path, stream):
    with ascend_deployment(["P", "D"]) as (client, apps):
        if path == "/v1/completions":
            body = {"model": "fake", "prompt": "hi", "max_tokens": 4, "stream": stream}
        else:
            body = chat_body("fake", "x", max_tokens=4, stream=stream)
        resp = client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        (dec,), (pre,) = seen(apps["d1"]), seen(apps["p0"])
        kv_d = dec["body"]["kv_transfer_params"]
        assert kv_d == {"do_remote_decode": False, "do_remote_prefill": True,
                        "metaserver": f"{client.base_url}/v1/metaserver"}
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
    with ascend_deployment(["P", "D"], failing={"p0": 500}) as (client, apps):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x"))
        assert resp.status_code == 502 and "p0" in resp.json()["error"]["message"]


def test_metaserver_refuses_unknown_requests_and_other_protocols():
    with ascend_deployment(["P", "D"]) as (client, _):
        resp = client.post("/v1/metaserver", json={"request_id": "chatcmpl-nobody"})
        assert resp.status_code == 404 and "nobody" in resp.json()["error"]["message"]
    with deployment(["P", "D"]) as (client, _):
        assert client.post("/v1/metaserver", json={"request_id": "x"}).status_code == 404


def test_text_request_never_touches_the_encoder():
    with deployment(["E", "P", "D"]) as (client, apps):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "hello", max_tokens=3))
        assert resp.status_code == 200
        assert seen(apps["e0"]) == []
        assert len(seen(apps["p1"])) == 1 and len(seen(apps["d2"])) == 1
        assert resp.headers["x-epd-stages"].startswith("P=p1:")


def test_merged_prefill_decode_instance_gets_the_request_directly():
    with deployment(["E", "PD"]) as (client, apps):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "look", [IMAGE], max_tokens=4))
        assert resp.status_code == 200
        (req,) = seen(apps["pd1"])
        assert "kv_transfer_params" not in req["body"]
        assert req["body"]["max_tokens"] == 4
        assert req["body"]["ec_transfer_params"] == {"served_by": "e0"}


def test_round_robin_spreads_over_prefill_and_decode_instances():
    with deployment(["P", "P", "D", "D"]) as (client, apps):
        for _ in range(4):
            assert client.post("/v1/chat/completions", json=chat_body("fake", "x")).status_code == 200
        assert [len(seen(apps[n])) for n in ("p0", "p1", "d2", "d3")] == [2, 2, 2, 2]


def test_streaming_relays_every_chunk():
    with deployment(["E", "P", "D"]) as (client, apps):
        body = chat_body("fake", "look", [IMAGE], max_tokens=6, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [l for l in resp.iter_lines() if l.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        contents = [json.loads(e[6:])["choices"] for e in events[:-1]]
        assert sum(1 for c in contents if c) == 6
        assert seen(apps["d2"])[0]["body"]["stream"] is True
        # Prefill answers one token, streamed only so the proxy knows when it took it.
        prefill = seen(apps["p1"])[0]["body"]
        assert prefill["max_tokens"] == 1 and "stream_options" not in prefill


def test_unreachable_prefill_instance_fails_over_without_losing_the_request():
    with deployment(["P", "P", "D"], dead={"p0"}) as (client, apps):
        for _ in range(3):
            resp = client.post("/v1/chat/completions", json=chat_body("fake", "x"))
            assert resp.status_code == 200
        assert len(seen(apps["p1"])) == 3


def test_encoder_failure_falls_back_to_prefill_encoding():
    with deployment(["E", "P", "D"], failing={"e0": 500}) as (client, apps):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x", [IMAGE]))
        assert resp.status_code == 200
        assert "E=skipped" in resp.headers["x-epd-stages"]
        assert "ec_transfer_params" not in seen(apps["p1"])[0]["body"]


def test_client_errors_from_an_instance_keep_their_status():
    with deployment(["P", "D"], failing={"d1": 404}) as (client, _):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x"))
        assert resp.status_code == 404
        assert "d1" in resp.json()["error"]["message"]


@pytest.mark.parametrize("raw, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "fake"}', 400, "'messages' is required"),
    (b'{"model": "fake", "messages": []}', 400, "'messages' is required"),
])
def test_bad_requests_get_a_400_with_a_message(raw, status, fragment):
    with deployment(["P", "D"]) as (client, _):
        resp = client.post("/v1/chat/completions", content=raw,
                           headers={"content-type": "application/json"})
        assert resp.status_code == status
        assert fragment in resp.json()["error"]["message"]


def test_no_decode_instance_means_503_and_unhealthy():
    with deployment(["P", "D"], dead={"d1"}) as (client, _):
        resp = client.post("/v1/chat/completions", json=chat_body("fake", "x"))
        assert resp.status_code == 503
        assert "stage D" in resp.json()["error"]["message"]
        assert client.get("/health").status_code == 503


def test_models_and_completions_endpoints():
    with deployment(["P", "D"]) as (client, apps):
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake"
        resp = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200
        assert seen(apps["d1"])[0]["path"] == "/v1/completions"


def test_slow_health_answers_do_not_take_a_busy_instance_out_at_once():
    import asyncio

    from epd_serve.proxy.app import _check_health
    from epd_serve.proxy.state import InstanceEntry, InstanceState

    def transport(behaviour):
        def handler(request):
            if behaviour == "timeout":
                raise httpx.ReadTimeout("slow", request=request)
            raise httpx.ConnectError("refused", request=request)
        return httpx.MockTransport(handler)

    async def run(behaviour, checks):
        inst = InstanceState(InstanceEntry(name="d0", roles="D", url="http://d0"), healthy=True)
        async with httpx.AsyncClient(transport=transport(behaviour)) as client:
            states = []
            for _ in range(checks):
                await _check_health(inst, client, unhealthy_after=3)
                states.append(inst.healthy)
        return states

    assert asyncio.run(run("timeout", 3)) == [True, True, False]
    assert asyncio.run(run("refused", 1)) == [False]


def test_unreachable_decode_instance_fails_over_for_plain_and_streamed_answers():
    with deployment(["P", "D", "D"], dead={"d1"}) as (client, apps):
        for stream in (False, True, False):
            resp = client.post("/v1/chat/completions", json=chat_body("fake", "x", stream=stream))
            assert resp.status_code == 200
        assert len(seen(apps["d2"])) == 3


def test_a_connection_closed_under_a_request_is_retried_once():
    import asyncio

    from epd_serve.proxy.state import InstanceEntry, InstanceTable
    from epd_serve.proxy.upstream import Trip, Upstream

    calls = []

    def handler(request):
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"ok": True})

    async def run():
        table = InstanceTable([InstanceEntry(name="p0", roles="P", url="http://p0")])
        table.instances[0].healthy = True
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await Upstream(table, client).post("P", "/v1/x", {}, Trip("r", False))

    inst, result = asyncio.run(run())
    assert result == {"ok": True} and len(calls) == 2 and inst.failures == 0
    assert inst.in_flight == 0 and inst.served == 1
