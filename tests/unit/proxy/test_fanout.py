"""Requests for several sequences: a list of prompts split into one request each, `n`
split where decode cannot sample it from one transfer (each sample seeded as vLLM seeds
it), and the answers merged into the one an engine gives (choices in order, usage with
each prompt once, one id, one usage event and one [DONE] in a stream)."""

from __future__ import annotations

import asyncio
import json

import pytest

from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.fanout import merge, merged_stream, split


def test_one_sequence_is_not_split():
    assert split({"prompt": "a"}, None, 1, True) is None
    assert split({"prompt": "a", "n": 3}, None, 3, False) is None  # decode samples n


def test_prompts_are_split_and_samples_too_where_decode_cannot_share_a_transfer():
    body = {"prompt": ["a", "b"], "n": 2, "seed": 10}
    shared = split(body, ["a", "b"], 2, False)
    assert [(p.body["prompt"], p.body["n"], p.first_choice, p.counts_prompt)
            for p in shared] == [("a", 2, 0, True), ("b", 2, 2, True)]
    fanned = split(body, ["a", "b"], 2, True)
    assert [(p.body["prompt"], p.body["n"], p.body["seed"], p.first_choice, p.counts_prompt)
            for p in fanned] == [("a", 1, 10, 0, True), ("a", 1, 11, 1, False),
                                 ("b", 1, 10, 2, True), ("b", 1, 11, 3, False)]
    unseeded = split({"messages": [], "n": 2}, None, 2, True)
    assert all("seed" not in p.body for p in unseeded)


def answer(text: str, prompt_tokens: int, completion_tokens: int, id_: str = "x") -> dict:
    return {"id": id_, "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def test_answers_merge_in_order_with_each_prompt_counted_once():
    parts = split({"prompt": ["a", "b"], "n": 2}, ["a", "b"], 2, True)
    answers = [answer("a0", 5, 3, "first"), answer("a1", 5, 3), answer("b0", 7, 3),
               answer("b1", 7, 3)]
    merged = merge(parts, answers)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == \
        [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24}
    assert merged["id"] == "first"


async def events(*chunks: bytes, fail: Exception | None = None):
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk
    if fail is not None:
        raise fail


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(id_: str, text: str, index: int = 0) -> bytes:
    return sse({"id": id_, "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": index, "text": text}]})


def usage(prompt: int, completion: int) -> bytes:
    return sse({"id": "u", "object": "text_completion", "created": 1, "model": "m",
                "choices": [], "usage": {"prompt_tokens": prompt,
                                         "completion_tokens": completion}})


async def collect(stream) -> list:
    out = []
    async for piece in stream:
        out.append(piece)
    return out


def test_streams_merge_renumbered_under_one_id_with_one_usage_and_one_done():
    parts = split({"prompt": ["a", "b"]}, ["a", "b"], 1, False)
    # The first stream's events arrive split mid-event, as network reads do.
    whole = chunk("one", "a") + usage(4, 1) + b"data: [DONE]\n\n"
    streams = [events(whole[:17], whole[17:]),
               events(chunk("two", "b"), usage(6, 1), b"data: [DONE]\n\n")]
    out = asyncio.run(collect(merged_stream(parts, streams, include_usage=True)))
    assert out[-1] == b"data: [DONE]\n\n"
    objs = [json.loads(piece[6:]) for piece in out[:-1]]
    texts = {o["choices"][0]["index"]: o["choices"][0]["text"] for o in objs if o["choices"]}
    assert texts == {0: "a", 1: "b"}
    assert {o["id"] for o in objs} == {objs[0]["id"]}  # one id, the first event's
    assert objs[-1]["choices"] == [] and objs[-1]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert sum(1 for o in objs if "usage" in o) == 1


def test_a_part_that_breaks_off_raises_after_what_was_passed_on():
    parts = split({"prompt": ["a", "b"]}, ["a", "b"], 1, False)
    broken = ProxyError(502, "instance d0 broke off", "upstream_error")

    async def run():
        got = []
        with pytest.raises(ProxyError, match="broke off"):
            async for piece in merged_stream(parts, [events(chunk("one", "a"), fail=broken),
                                                     events(chunk("two", "b"))], False):
                got.append(piece)
        return got

    assert all(b"[DONE]" not in piece for piece in asyncio.run(run()))
