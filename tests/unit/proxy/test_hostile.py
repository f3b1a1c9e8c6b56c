"""The proxy against hostile clients, in front of fake instances that record what they
are sent: media identities and cache salts only the proxy writes, tenants that share
nothing, a forged metaserver report, slow uploads, a flood of span exports, the
proxy's own connection limits, and engine request ids nobody can guess."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import re
import select
import socket
import threading
import types

import httpx
import pytest

from epd_serve.instances.payloads import chat_body
from epd_serve.proxy import admission as admission_mod
from epd_serve.proxy.admission import requests_for_descriptors
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.handoff.ascend_layerwise import AscendLayerwise
from epd_serve.proxy.routing import RouteRequest
from epd_serve.proxy.tenancy import Tenants, image_key
from epd_serve.proxy.trip import Trip

from tests.waiting import wait_for
from .harness import IMAGE, chat, deployment, tiny_image

OTHER = tiny_image(seed=9)


def parts_sent(d, name: str) -> list[dict]:
    return [p for r in d.seen(name) for m in r["body"].get("messages", [])
            if isinstance(m.get("content"), list) for p in m["content"]
            if p.get("type") != "text"]


# -- identities -------------------------------------------------------------------------
def test_no_uuid_a_client_writes_reaches_any_instance():
    target = image_key("fake", OTHER)
    body = chat_body("fake", "look", max_tokens=2)
    body["messages"][0]["content"] = [
        {"type": "image_url", "image_url": {"url": IMAGE}, "uuid": target},
        {"type": "input_image", "image_url": IMAGE, "uuid": target},
        {"type": "image", "image": IMAGE, "uuid": target},
        {"type": "text", "text": "look"}]
    with deployment(["E", "P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        sent = [p for name in ("e0", "p1", "d2") for p in parts_sent(d, name)]
        assert sent and {p["uuid"] for p in sent} == {image_key("fake", IMAGE)}
        assert all(p["type"] == "image_url" for p in sent)
        # The encoder computed each image once, under the proxy's key.
        assert len(d.seen("e0")) == 1


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "$.messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "ec_transfer_params": {}}, "ec_transfer"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]},
         "uuid": "0" * 64}]}]}, "image_embeds"),
])
def test_bad_and_forged_requests_are_refused_before_any_instance(body, words):
    with deployment(["E", "P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", json={"model": "fake", **body})
        assert resp.status_code == 400 and words in resp.json()["error"]["message"]
        assert d.seen("e0") == d.seen("p1") == d.seen("d2") == []


def test_tenants_get_their_own_keys_and_cache_salts(monkeypatch):
    monkeypatch.setenv("EPD_TEST_KEYS", "alice,bob")
    with deployment(["E", "P", "D"], api_key_env="EPD_TEST_KEYS",
                    client_headers={"authorization": "Bearer alice"}) as d:
        sent = {}
        for who in ("alice", "bob"):
            resp = chat(d, "look", [IMAGE], max_tokens=2,
                        headers={"authorization": f"Bearer {who}"})
            assert resp.status_code == 200, resp.text
            sent[who] = (parts_sent(d, "e0")[-1]["uuid"], d.seen("p1")[-1]["body"]["cache_salt"],
                         d.seen("d2")[-1]["body"]["cache_salt"])
        tenants = Tenants(["alice", "bob"], isolate=True)
        for who in ("alice", "bob"):
            tenant = tenants.for_key(who)
            assert sent[who] == (image_key("fake", IMAGE, tenant), tenant.cache_salt(None),
                                 tenant.cache_salt(None))
        assert len({sent["alice"][0], sent["bob"][0], image_key("fake", IMAGE)}) == 3
        assert sent["alice"][1] != sent["bob"][1]
        assert chat(d, "x", headers={"authorization": "Bearer carol"}).status_code == 401


def test_tenant_isolation_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EPD_TEST_KEYS", "alice")
    with deployment(["E", "P", "D"], api_key_env="EPD_TEST_KEYS", tenant_isolation=False,
                    client_headers={"authorization": "Bearer alice"}) as d:
        assert chat(d, "look", [IMAGE], max_tokens=2).status_code == 200
        assert parts_sent(d, "e0")[0]["uuid"] == image_key("fake", IMAGE)
        assert "cache_salt" not in d.seen("p1")[0]["body"]


def test_a_clients_own_cache_salt_salts_its_media_keys_too():
    """Salted, a client shares no stored feature with anyone who does not send its
    salt: else `E=store` or a fast answer would tell it another client sent the image."""
    with deployment(["E", "P", "D"]) as d:
        keys = []
        for salt in (None, "mine", "mine", "theirs"):
            body = chat_body("fake", "look", [IMAGE], max_tokens=2)
            if salt:
                body["cache_salt"] = salt
            assert d.client.post("/v1/chat/completions", json=body).status_code == 200
            keys.append(parts_sent(d, "e0")[-1]["uuid"])
        assert keys[0] == image_key("fake", IMAGE)
        assert keys[1] == keys[2] == image_key("fake", IMAGE, client_salt="mine")
        assert len({keys[0], keys[1], keys[3]}) == 3


# -- doors ------------------------------------------------------------------------------
def test_which_stages_served_a_request_is_the_operators_by_default(monkeypatch):
    """x-epd-stages and timelines tell a client whether an image was stored already,
    by anyone sharing its caches: by default only the admin key (or the deployment's
    internal token, its own warm-up) is shown them."""
    monkeypatch.setenv("EPD_ADMIN_KEY", "operator")
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", "engines-only")
    with deployment(["E", "P", "D"], stage_headers="operator") as d:
        for _ in range(2):
            client = chat(d, "look", [IMAGE], max_tokens=2)
            assert client.status_code == 200 and "x-epd-stages" not in client.headers
        trace = client.headers["x-epd-trace-id"]
        assert d.client.get(f"/v1/traces/{trace}").status_code == 403
        for operator in ({"x-epd-admin-key": "operator"},
                         {"x-epd-internal-token": "engines-only"}):
            shown = chat(d, "look", [IMAGE], max_tokens=2, headers=operator)
            assert shown.headers["x-epd-stages"].startswith("E=")
            assert d.client.get(f"/v1/traces/{trace}", headers=operator).status_code == 200



def test_prompt_embeds_are_refused_with_a_prompt_beside_them():
    body = {"model": "fake", "prompt": "hi", "prompt_embeds": "AAAA", "max_tokens": 2}
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/completions", json=body)
        assert resp.status_code == 400 and "prompt_embeds" in resp.text
        assert d.seen("p0") == d.seen("d1") == []


def test_every_method_of_the_instance_list_takes_a_key(monkeypatch):
    monkeypatch.setenv("EPD_TEST_KEYS", "alice")
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEYS",
                    client_headers={"authorization": "Bearer alice"}) as d:
        assert d.client.head("/instances").status_code == 200
        for method in ("GET", "HEAD"):
            assert httpx.request(method, f"{d.proxy.url}/instances").status_code == 401


def test_span_exports_are_off_without_the_internal_token(monkeypatch):
    monkeypatch.delenv("EPD_INTERNAL_TOKEN", raising=False)
    monkeypatch.setenv("EPD_TEST_KEYS", "alice")
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEYS",
                    client_headers={"authorization": "Bearer alice"}) as d:
        export = d.client.post("/v1/traces", content=b"\0",
                               headers={"content-type": "application/x-protobuf"})
        assert export.status_code == 403 and "internal token" in export.text


def test_engine_request_ids_are_unguessable():
    with deployment(["P", "D"]) as d:
        ids = []
        for _ in range(3):
            assert chat(d, "x").status_code == 200
            ids.append(d.seen("p0")[-1]["request_id"])
        assert all(re.fullmatch(r"epd-[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 3


# -- the KV metaserver ----------------------------------------------------------------
class HeldDecode:
    """An upstream whose decode hop waits until released; prefill hops are recorded."""

    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.prefills: list[dict] = []

    async def post(self, hop, path, body, trip, candidates=None):
        if hop == "P":
            self.prefills.append(body)
            return types.SimpleNamespace(name="p0"), {}
        self.started.set()
        await self.release.wait()
        return types.SimpleNamespace(name="d0"), {"choices": []}


# A whole report of vllm-ascend's decode scheduler (protocols/ascend_layerwise.py).
BLOCKS = {"token_ids": [], "remote_block_ids": [[1]], "remote_block_size": [128],
          "remote_engine_id": "e", "remote_port": 1, "remote_tp_size": 1,
          "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_cached_tokens": 0}


def test_a_forged_metaserver_report_is_refused():
    async def scenario():
        upstream = HeldDecode()
        handoff = AscendLayerwise(upstream, ProxyConfig(model="m", instances=[],
                                                        host="127.0.0.1"))
        trip = Trip("client-epd-0123456789abcdef01234567", False, RouteRequest())
        request = asyncio.create_task(handoff.complete("/v1/chat/completions",
                                                       {"messages": []}, trip, []))
        await upstream.started.wait()
        (token,) = handoff._pending
        real_id = f"chatcmpl-{trip.request_id}"
        forged = {"request_id": real_id, "remote_host": "10.6.6.6", "remote_port": 1}
        # Knowing the request's id is not enough: the report is taken only at the URL
        # made for it, and only for that request.
        with pytest.raises(ProxyError) as elsewhere:
            await handoff.metaserver("guessed-token", forged)
        with pytest.raises(ProxyError) as other_request:
            await handoff.metaserver(token, {**forged, "request_id": "chatcmpl-other"})
        assert (elsewhere.value.status, other_request.value.status) == (404, 403)
        assert upstream.prefills == []
        await handoff.metaserver(token, {**BLOCKS, "request_id": real_id,
                                         "remote_host": "10.0.0.2"})
        assert upstream.prefills[0]["kv_transfer_params"]["remote_host"] == "10.0.0.2"
        upstream.release.set()
        await request

    asyncio.run(scenario())


# -- admission ----------------------------------------------------------------------------
def slow_upload(url: str, announced: int) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {announced}\r\n\r\n"
                 '{"messages": ['.encode())
    return sock


def status_line(sock: socket.socket) -> bytes:
    with sock:
        return sock.recv(256).split(b"\r\n", 1)[0]


def test_slow_uploads_hold_only_what_they_sent_and_are_cut_off():
    limits = {"max_body_bytes": 8 << 20, "max_body_bytes_in_flight": 16 << 20,
              "upload_grace_s": 1.0, "min_upload_bytes_per_s": 1024}
    with deployment(["P", "D"], limits=limits) as d:
        # Eight uploads announcing 8 MiB each: four times the byte budget, if announced
        # bytes counted. They hold only what they sent.
        slow = [slow_upload(d.proxy.url, 8 << 20) for _ in range(8)]
        for _ in range(3):
            assert chat(d, "x").status_code == 200
        # Served while the uploads hang: none of them has an answer yet, and what they
        # sent is still held.
        assert select.select(slow, [], [], 0)[0] == []
        assert 0 < d.proxy.proxy.admission.body_bytes < 1024
        # Cut off by the slow-upload rule (the clients would wait 30 s for anything else).
        assert {status_line(s) for s in slow} == {b"HTTP/1.1 408 Request Timeout"}
        wait_for(lambda: d.proxy.proxy.admission.body_bytes == 0, "bytes given back")


def test_one_address_may_send_only_so_many_bodies_at_once():
    with deployment(["P", "D"], limits={"max_uploads_per_client": 2, "upload_grace_s": 2.0}) as d:
        slow = [slow_upload(d.proxy.url, 1 << 20) for _ in range(2)]
        wait_for(lambda: sum(d.proxy.proxy.admission.uploads.values()) == 2, "uploads open")
        resp = chat(d, "x")
        assert resp.status_code == 429 and "max_uploads_per_client" in resp.text
        for sock in slow:
            status_line(sock)
        assert chat(d, "x").status_code == 200


def never_reading_stream(url: str, body: dict) -> socket.socket:
    """A streamed request sent whole, whose answer is never read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
                 .encode() + raw)
    return sock


def test_a_stream_nobody_reads_gives_its_body_back_once_sent_and_is_dropped_in_time():
    limits = {"client_write_timeout_s": 2.0}
    with deployment(["P", "D"], limits=limits) as d:
        admission = d.proxy.proxy.admission
        # A large body and a long answer the client never reads. Once the answer flows
        # the body is with the stages: the proxy's byte budget is free again while the
        # request still runs.
        sock = never_reading_stream(d.proxy.url, chat_body("fake", "x" * (2 << 20),
                                                           max_tokens=200_000, stream=True))
        wait_for(lambda: admission.requests == 1 and admission.body_bytes == 0,
                 "the body given back while the answer flows")
        # Past the write deadline the connection is dropped and the request ends (its
        # place, and decode's work, freed).
        wait_for(lambda: admission.requests == 0, "the request ended", timeout=15)
        assert 'reason="client_not_reading"' in d.client.get("/metrics").text
        sock.close()
        assert chat(d, "x").status_code == 200


def test_a_whole_answer_nobody_reads_is_dropped_in_time_within_its_admission():
    with deployment(["P", "D"], limits={"client_write_timeout_s": 2.0}) as d:
        admission = d.proxy.proxy.admission
        # About 17 MB of answer, far more than the socket buffers between the two hold.
        sock = never_reading_stream(d.proxy.url, chat_body("fake", "x", max_tokens=2_000_000))
        # Sent by the handler, so the request holds its place while its answer waits
        # for the client (aiohttp would send it after the handler, with no deadline).
        wait_for(lambda: admission.requests == 1, "the request in flight")
        wait_for(lambda: admission.requests == 0, "the client dropped", timeout=15)
        assert 'reason="client_not_reading"' in d.client.get("/metrics").text
        sock.close()
        assert chat(d, "x").status_code == 200


def test_one_address_may_have_only_so_many_requests_in_flight():
    with deployment(["P", "D"], limits={"max_requests_per_client": 2}) as d:
        d.apps["d1"].state.hold = True
        waiting = [never_reading_stream(d.proxy.url, chat_body("fake", f"q{i}", stream=True))
                   for i in range(2)]
        wait_for(lambda: d.proxy.proxy.admission.requests == 2, "two requests in flight")
        resp = chat(d, "x")
        assert resp.status_code == 429 and "max_requests_per_client" in resp.text
        d.apps["d1"].state.hold = False
        for sock in waiting:
            sock.close()
        wait_for(lambda: d.proxy.proxy.admission.requests == 0, "the two ended")
        assert chat(d, "x").status_code == 200


def test_a_tenant_that_floods_leaves_the_others_their_share(monkeypatch):
    monkeypatch.setenv("EPD_TEST_KEYS", "alice,bob")
    limits = {"max_requests_in_flight": 8, "tenant_weights": {}}
    with deployment(["P", "D"], api_key_env="EPD_TEST_KEYS", limits=limits,
                    client_headers={"authorization": "Bearer alice"}) as d:
        d.apps["d1"].state.hold = True
        alice = {"authorization": "Bearer alice"}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            flood = [pool.submit(chat, d, f"a{i}", headers=alice) for i in range(8)]
            # Past 6 of 8 places (fair_share_above 0.75) alice is over her share (4).
            wait_for(lambda: sum(f.done() for f in flood) == 2, "alice refused past 6")
            assert all(f.result().status_code == 503 for f in flood if f.done())
            assert "share" in next(f for f in flood if f.done()).result().text
            seen = len(d.seen("p0"))
            bob = pool.submit(chat, d, "b", headers={"authorization": "Bearer bob"})
            wait_for(lambda: len(d.seen("p0")) > seen, "bob's request reached prefill")
            d.apps["d1"].state.hold = False
            assert bob.result().status_code == 200
            assert sorted(f.result().status_code for f in flood) == [200] * 6 + [503] * 2


def test_tenant_weights_size_the_shares():
    from epd_serve.proxy.admission import Admission
    from epd_serve.proxy.metrics import ProxyMetrics

    tenants = Tenants(["alice", "bob"], isolate=True)
    alice, bob = tenants.for_key("alice"), tenants.for_key("bob")
    admission = Admission(Limits(max_requests_in_flight=12, tenant_weights={alice.name: 2}),
                          ProxyMetrics(), tenants=tenants.all)
    assert admission.shares == {alice.id: 8, bob.id: 4}
    with pytest.raises(Exception, match="greater than 0"):
        Limits(tenant_weights={alice.name: 0})


def test_a_body_larger_than_announced_or_allowed_is_refused():
    with deployment(["P", "D"], limits={"max_body_bytes": 4096}) as d:
        chunked = d.client.post("/v1/chat/completions",
                                content=iter([b'{"messages": [' + b" " * 5000, b"]}"]),
                                headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and "max_body_bytes" in chunked.text
        assert d.seen("p0") == []


def test_a_flood_of_span_exports_is_refused_without_the_token_and_bounded_with_it(
        monkeypatch):
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", "engines-only")
    with deployment(["P", "D"], limits={"max_trace_body_bytes": 64 << 10}) as d:
        url = f"{d.proxy.url}/v1/traces"
        protobuf = {"content-type": "application/x-protobuf"}
        stop = threading.Event()
        codes: list[int] = []

        def flood():
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    for headers in (protobuf, {**protobuf, "x-epd-internal-token":
                                               "engines-only"}):
                        try:
                            codes.append(client.post(url, content=b"\0" * (1 << 20),
                                                     headers=headers).status_code)
                        except httpx.TransportError:
                            # Refused before its body was read: the proxy may close the
                            # connection while the flooder is still writing.
                            codes.append(0)

        flooders = [threading.Thread(target=flood) for _ in range(4)]
        for t in flooders:
            t.start()
        try:
            wait_for(lambda: len(codes) >= 8, "the flood under way")
            for _ in range(5):
                assert chat(d, "x").status_code == 200
        finally:
            stop.set()
            for t in flooders:
                t.join()
        assert {401, 413} <= set(codes) <= {0, 401, 413}, set(codes)
        assert d.proxy.proxy.admission.body_bytes == 0


# -- the proxy's own limits -----------------------------------------------------------
def test_the_proxys_own_connection_failure_fails_the_request_and_spares_the_instance():
    with deployment(["P", "D"]) as d:
        hops = d.proxy.proxy.pipeline.upstream.hops
        real = hops._connect
        calls = []

        async def out_of_descriptors(origin, pool):
            calls.append(origin.port)
            if len(calls) == 1:  # what connect() raises when the process has no descriptor left
                raise OSError(errno.EMFILE, "Too many open files")
            return await real(origin, pool)

        d.proxy.call(hops.close)  # no idle connection: the next hop connects
        d.proxy.call(setattr, hops, "_connect", out_of_descriptors)
        resp = chat(d, "x")
        assert resp.status_code == 503 and "out of connections" in resp.json()["error"]["message"]
        assert resp.headers["retry-after"]
        assert all(i["healthy"] for i in d.client.get("/status").json()["instances"])
        assert chat(d, "x").status_code == 200


def test_admission_is_sized_to_the_descriptors_the_process_may_open(monkeypatch):
    assert requests_for_descriptors(Limits(), 1 << 20) == 4096
    assert requests_for_descriptors(Limits(), 1024) == (1024 - 256) // 4
    calls = []
    monkeypatch.setattr(admission_mod.resource, "getrlimit", lambda which: (1024, 65536))
    monkeypatch.setattr(admission_mod.resource, "setrlimit",
                        lambda which, limits: calls.append(limits))
    assert admission_mod.descriptor_budget() == 65536 and calls == [(65536, 65536)]


def test_unknown_roles_are_a_400_naming_the_field():
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", content=json.dumps(
            {"model": "fake", "messages": [{"role": "user", "content": "hi"},
                                           {"role": "wizard", "content": "obey"}]}),
            headers={"content-type": "application/json"})
        assert resp.status_code == 400
        assert "`$.messages[1].role`" in resp.json()["error"]["message"]


def test_keys_come_from_one_variable_and_the_deployments_tools_send_the_first(monkeypatch):
    from epd_serve.proxy.tenancy import keys_in, own_key

    monkeypatch.setenv("EPD_TEST_KEYS", " alice , bob,,")
    assert keys_in("EPD_TEST_KEYS") == ["alice", "bob"] and own_key("EPD_TEST_KEYS") == "alice"
    assert keys_in(None) == [] and own_key(None) is None
    # A deployment that names a variable must not serve openly when it is empty.
    monkeypatch.setenv("EPD_TEST_KEYS", " , ")
    with pytest.raises(ValueError, match="EPD_TEST_KEYS"):
        Tenants.from_env("EPD_TEST_KEYS", None)
