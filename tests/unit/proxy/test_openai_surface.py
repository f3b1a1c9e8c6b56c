"""The OpenAI surface through the stages, against fake instances: what prefill and
decode are sent for `n`, a list of prompts, prompt log-probs and echo, and what is
refused before any engine sees it (the Responses API, `n` below 1, more sequences than
the deployment serves). The answers themselves are compared with one engine's on real
instances (tests/e2e/test_openai_surface.py)."""

from __future__ import annotations

import json

import pytest

from epd_serve.instances.payloads import chat_body, image_data_url, make_image

from .harness import deployment


def bodies(d, name: str, path: str) -> list[dict]:
    return [r["body"] for r in d.seen(name) if r["path"] == path]


def test_n_samples_are_drawn_on_decode_from_one_prefill_with_epd():
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", json={
            **chat_body("fake", "hi", max_tokens=3), "n": 3, "temperature": 0.8})
        assert resp.status_code == 200, resp.text
        (p,) = bodies(d, "p0", "/v1/chat/completions")
        (dec,) = bodies(d, "d1", "/v1/chat/completions")
    assert p["n"] == 1 and p["max_tokens"] == 1
    assert dec["n"] == 3 and dec["kv_transfer_params"]["transfer_id"] == \
        p["kv_transfer_params"]["transfer_id"]


def test_n_samples_are_requests_of_their_own_where_decode_cannot_share_a_transfer():
    with deployment(["P", "D"], protocol="mooncake") as d:
        resp = d.client.post("/v1/chat/completions", json={
            **chat_body("fake", "hi", max_tokens=3), "n": 2, "seed": 7, "temperature": 0.8})
        assert resp.status_code == 200, resp.text
        sent = bodies(d, "d1", "/v1/chat/completions")
        prefilled = bodies(d, "p0", "/v1/chat/completions")
    assert sorted(b["seed"] for b in sent) == [7, 8] and all(b["n"] == 1 for b in sent)
    assert len(prefilled) == 2
    assert len({b["kv_transfer_params"]["transfer_id"] for b in sent}) == 2
    answer = resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6
    assert " | " in resp.headers["x-epd-stages"]  # each sample's trip


@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_of_a_list_is_its_own_transfer_and_the_answers_come_in_order(stream):
    prompts = ["one", "two", "three"]
    with deployment(["P", "D"]) as d:
        body = {"model": "fake", "prompt": prompts, "max_tokens": 2, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        resp = d.client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        sent = bodies(d, "d1", "/v1/completions")
    assert sorted(b["prompt"] for b in sent) == sorted(prompts)
    assert len({b["kv_transfer_params"]["transfer_id"] for b in sent}) == 3
    if not stream:
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        return
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert resp.text.count("[DONE]") == 1
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1, 2}
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert usage["completion_tokens"] == 6
    assert len({e["id"] for e in events}) == 1


@pytest.mark.parametrize("field", [{"prompt_logprobs": 1}, {"echo": True}])
def test_a_request_for_prompt_log_probs_is_computed_whole_on_decode(field):
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                      "max_tokens": 2, **field})
        assert resp.status_code == 200, resp.text
        assert not bodies(d, "p0", "/v1/completions")  # prefill is not asked for nothing
        (sent,) = bodies(d, "d1", "/v1/completions")
    assert "kv_transfer_params" not in sent
    assert resp.headers["x-epd-stages"].endswith(f"WHOLE={next(iter(field))}")


def test_a_prompt_under_the_local_prefill_limit_is_computed_whole_on_decode():
    """routing.local_prefill_max_tokens: a short prompt skips the hand-off (decode
    computes it), a longer one is prefilled by P as before; an image still goes through
    E first. Tokens are estimated at 4 characters of text a token."""
    short, long_ = "x" * 200, "x" * 600  # ~50 and ~150 tokens
    with deployment(["E", "P", "D"], routing={"local_prefill_max_tokens": 100}) as d:
        for prompt in (short, long_):
            resp = d.client.post("/v1/chat/completions",
                                 json=chat_body("fake", prompt, max_tokens=2))
            assert resp.status_code == 200, resp.text
            stages = resp.headers["x-epd-stages"]
            assert ("WHOLE=short" in stages) == (prompt == short), stages
        prefilled = bodies(d, "p1", "/v1/chat/completions")
        decoded = bodies(d, "d2", "/v1/chat/completions")
        assert [len(b["messages"][0]["content"]) for b in prefilled] == [len(long_)]
        (whole,) = [b for b in decoded if "kv_transfer_params" not in b]
        assert whole["messages"][0]["content"] == short
        # A small image (16x16 px: under a token) with a short text: E, then decode alone.
        resp = d.client.post("/v1/chat/completions", json=chat_body(
            "fake", "hi", [image_data_url(make_image(16, 16, seed=3))], max_tokens=2))
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert stages.startswith("E=e0") and "P=" not in stages and "WHOLE=short" in stages
        assert len(bodies(d, "p1", "/v1/chat/completions")) == 1  # still only the long one
    # Off (0, the default): even a prompt estimated at no tokens (empty text) is
    # prefilled by P.
    with deployment(["P", "D"]) as d:
        resp = d.client.post("/v1/chat/completions", json=chat_body("fake", "", max_tokens=2))
        assert resp.status_code == 200, resp.text
        assert "WHOLE" not in resp.headers["x-epd-stages"]
        assert len(bodies(d, "p0", "/v1/chat/completions")) == 1


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/resp_1"])
def test_the_responses_api_is_refused_saying_why(path):
    with deployment(["P", "D"]) as d:
        resp = d.client.post(path, json={"model": "fake", "input": "hi"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert "/v1/responses" in error["message"] and "/v1/chat/completions" in error["message"]
        assert not bodies(d, "p0", path) and not bodies(d, "d1", path)


def test_n_below_one_and_too_many_sequences_are_refused_naming_them():
    with deployment(["P", "D"], limits={"max_sequences": 8}) as d:
        zero = d.client.post("/v1/completions", json={"model": "fake", "prompt": "x", "n": 0})
        assert zero.status_code == 400 and "'n'" in zero.json()["error"]["message"]
        many = d.client.post("/v1/completions", json={"model": "fake", "prompt": ["a"] * 5,
                                                      "n": 2})
        assert many.status_code == 400
        assert "10 sequences" in many.json()["error"]["message"]
        wrong = d.client.post("/v1/completions", json={"model": "fake", "prompt": "x",
                                                       "n": "2"})
        assert wrong.status_code == 400 and "$.n" in wrong.json()["error"]["message"]
        assert not d.seen("p0") and not d.seen("d1")
