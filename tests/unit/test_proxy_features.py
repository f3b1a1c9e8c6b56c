"""The proxy with an MM Store, against fake instances and a real shared-memory store:
image keys, references instead of pixels for prefill and decode, prefetch hints, the
encoder skipped for images the store holds, and the pixel retry when a reference fails."""

from __future__ import annotations

import contextlib
import time

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from epd_serve.engines.payloads import chat_body
from epd_serve.mmstore import FeatureMeta, StoreSpec, open_store
from epd_serve.proxy import ProxyConfig, create_app
from epd_serve.proxy.features import image_key
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from ..stores import started_shm_store
from .proxy_harness import ProxyThread, tiny_image

IMAGE = tiny_image(1)
OTHER_IMAGE = tiny_image(2)
DROPPED_IMAGE = tiny_image(3)


@pytest.fixture(scope="module")
def store_spec():
    with started_shm_store("proxy-unit", 4 << 20, port_start=28000) as spec:
        yield spec


@contextlib.contextmanager
def deployment(spec: StoreSpec, fault_injection: bool = False):
    """Fake E, P and D behind a proxy with the store; yields the client, the apps and
    a socket that receives prefill's prefetch hints."""
    ctx = zmq.Context()
    hints = ctx.socket(zmq.PULL)
    hint_port = hints.bind_to_random_port("tcp://127.0.0.1")
    with contextlib.ExitStack() as stack:
        apps = {name: create_fake_app(name) for name in ("e0", "p1", "d2")}
        urls = {name: stack.enter_context(ThreadedServer(app)).url for name, app in apps.items()}
        config = ProxyConfig(
            model="fake", mm_store=spec.to_json(), fault_injection=fault_injection,
            health_interval_s=0.05, kv_protocol="epd", instances=[
                {"name": "e0", "roles": "E", "url": urls["e0"]},
                {"name": "p1", "roles": "P", "url": urls["p1"], "kv_endpoint": "127.0.0.1:30101",
                 "prefetch_endpoint": f"127.0.0.1:{hint_port}"},
                {"name": "d2", "roles": "D", "url": urls["d2"]}])
        proxy = stack.enter_context(ProxyThread(create_app(config)))
        client = stack.enter_context(httpx.Client(base_url=proxy.url, timeout=30))
        deadline = time.monotonic() + 5
        while not all(i["healthy"] for i in client.get("/status").json()["instances"]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        try:
            yield client, apps, hints
        finally:
            hints.close()
            ctx.term()


def parts(request: dict) -> list[dict]:
    return request["body"]["messages"][0]["content"]


def test_prefill_and_decode_get_references_and_prefill_a_hint_first(store_spec):
    key = image_key("fake", IMAGE)
    with deployment(store_spec) as (client, apps, hints):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "what is this", [IMAGE], max_tokens=3))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].startswith("E=e0:")
        assert resp.headers["x-epd-stages"].endswith("IMG=ref")
        (enc,), (pre,), (dec,) = (apps[n].state.requests for n in ("e0", "p1", "d2"))
        # The encoder gets the pixels, tagged with the content key.
        assert parts(enc)[0] == {"type": "image_url", "image_url": {"url": IMAGE}, "uuid": key}
        # Prefill and decode get a reference: the key and the grid, no pixels.
        reference = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]},
                     "uuid": key}
        for request in (pre, dec):
            assert parts(request)[0] == reference
            assert IMAGE not in str(request["body"])
        assert hints.poll(2000)
        assert msgspec.msgpack.decode(hints.recv()) == [key]


def test_an_image_the_store_holds_skips_the_encoder(store_spec):
    key = image_key("fake", OTHER_IMAGE)
    with open_store(store_spec) as store:
        store.put(key, np.zeros(64, np.uint8),
                  FeatureMeta((4, 16), "bfloat16", {"image_grid_thw": [1, 4, 4]}))
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "again", [OTHER_IMAGE], max_tokens=2))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].startswith("E=store:")
        assert apps["e0"].state.requests == []
        assert parts(apps["p1"].state.requests[0])[0]["type"] == "image_embeds"


def test_only_the_images_the_store_lacks_go_to_the_encoder(store_spec):
    held, new = tiny_image(4), tiny_image(5)
    with open_store(store_spec) as store:
        store.put(image_key("fake", held), np.zeros(64, np.uint8),
                  FeatureMeta((4, 16), "bfloat16", {"image_grid_thw": [1, 4, 4]}))
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "one old one new", [held, new], max_tokens=2))
        assert resp.status_code == 200, resp.text
        (enc,) = apps["e0"].state.requests
        assert [p["uuid"] for p in parts(enc)] == [image_key("fake", new)]
        assert resp.headers["x-epd-stages"].endswith("IMG=ref")
        assert [p["type"] for p in parts(apps["p1"].state.requests[0])][:2] == \
            ["image_embeds", "image_embeds"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_reference_is_sent_again_with_the_pixels(store_spec, stream):
    with deployment(store_spec) as (client, apps, _):
        apps["p1"].state.reject_references = True
        body = chat_body("fake", f"lost feature {stream}", [IMAGE], max_tokens=2, stream=stream)
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("IMG=recompute")
        first, second = apps["p1"].state.requests
        assert parts(first)[0]["type"] == "image_embeds"
        assert parts(second)[0]["image_url"] == {"url": IMAGE}  # prefill encodes it itself


def test_dropped_features_are_injected_only_where_the_deployment_allows(store_spec):
    body = chat_body("fake", "drop", [DROPPED_IMAGE], max_tokens=2)
    key = image_key("fake", DROPPED_IMAGE)
    with open_store(store_spec) as store:
        for allowed in (False, True):
            store.put(key, np.zeros(64, np.uint8), FeatureMeta((4, 16), "bfloat16",
                                                              {"image_grid_thw": [1, 4, 4]}))
            with deployment(store_spec, fault_injection=allowed) as (client, _, _):
                resp = client.post("/v1/chat/completions", json=body,
                                   headers={"x-epd-fault": "drop-features"})
                assert resp.status_code == 200
            assert (store.lookup(key) is None) == allowed


def test_an_image_part_without_a_url_is_a_400(store_spec):
    body = chat_body("fake", "x", [IMAGE], max_tokens=2)
    body["messages"][0]["content"][0] = {"type": "image_url", "image_url": {}}
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and "url" in resp.json()["error"]["message"]
        assert apps["e0"].state.requests == []
