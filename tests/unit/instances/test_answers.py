"""The answer fingerprint and the one rule for "the same answer": equal tokens and top-5
log-probs within the tolerance, a tie only where both answers' own log-probs say the two
tokens were level; and every way a wrong answer looks (another feature, another KV,
two answers crossed, a token more or less, a choice missing) is reported."""

from __future__ import annotations

import pytest

from epd_serve.instances.answers import (
    ROUNDING_STEP_TOLERANCE,
    TOLERANCE,
    NoFingerprint,
    Verdict,
    ask_for_fingerprint,
    compare,
    fingerprint,
    fingerprint_of_stream,
)

from tests.answers import assert_same_answer_from_decode


def chat_step(token: str, top: dict[str, float]) -> dict:
    return {"token": token, "logprob": top[token], "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for t, v in sorted(top.items(), key=lambda tv: -tv[1])]}


def chat_answer(*steps: tuple[str, dict[str, float]], index: int = 0) -> dict:
    return {"choices": [{"index": index, "message": {"content": "x"},
                         "logprobs": {"content": [chat_step(t, top) for t, top in steps]}}]}


TOP_A = {"a": -0.5, "b": -1.2, "c": -2.0, "d": -2.5, "e": -3.0}
TOP_B = {"b": -0.4, "a": -1.6, "c": -2.2, "d": -2.9, "f": -3.1}
ANSWER = chat_answer(("a", TOP_A), ("b", TOP_B))


def shifted(top: dict[str, float], by: float) -> dict[str, float]:
    return {t: v + by for t, v in top.items()}


def test_an_answer_is_the_same_as_itself_and_within_the_tolerance():
    assert compare(fingerprint(ANSWER), fingerprint(ANSWER)).verdict is Verdict.SAME
    nudged = chat_answer(("a", shifted(TOP_A, TOLERANCE / 2)), ("b", TOP_B))
    assert compare(fingerprint(nudged), fingerprint(ANSWER)).verdict is Verdict.SAME


def test_log_probs_moved_as_another_feature_or_kv_moves_them_are_a_different_answer():
    # Same greedy tokens, the distribution moved by a tenth of a nat: the text alone
    # would call this the same answer.
    moved = chat_answer(("a", shifted(TOP_A, -0.1)), ("b", TOP_B))
    result = compare(fingerprint(moved), fingerprint(ANSWER))
    assert result.verdict is Verdict.DIFFERENT and "step 0" in result.where
    # One alternative alone moved.
    alt = chat_answer(("a", TOP_A), ("b", {**TOP_B, "d": -2.7}))
    assert compare(fingerprint(alt), fingerprint(ANSWER)).verdict is Verdict.DIFFERENT
    # Another token in the top five, far from its edge.
    other = chat_answer(("a", TOP_A), ("b", {**{k: v for k, v in TOP_B.items() if k != "c"},
                                              "z": -2.2}))
    assert compare(fingerprint(other), fingerprint(ANSWER)).verdict is Verdict.DIFFERENT


def test_two_requests_answers_crossed_are_different():
    other = chat_answer(("b", TOP_B), ("a", TOP_A))
    assert compare(fingerprint(other), fingerprint(ANSWER)).verdict is Verdict.DIFFERENT
    assert compare(fingerprint(ANSWER), fingerprint(other)).verdict is Verdict.DIFFERENT


def test_a_token_more_or_a_choice_missing_is_different():
    longer = chat_answer(("a", TOP_A), ("b", TOP_B), ("a", TOP_A))
    assert compare(fingerprint(longer), fingerprint(ANSWER)).verdict is Verdict.DIFFERENT
    two = {"choices": ANSWER["choices"] + chat_answer(("a", TOP_A), index=1)["choices"]}
    assert compare(fingerprint(ANSWER), fingerprint(two)).verdict is Verdict.DIFFERENT


def test_a_greedy_choice_between_level_tokens_is_a_tie_and_nothing_after_it_is_compared():
    level = {"a": -0.700, "b": -0.704, "c": -2.0, "d": -2.5, "e": -3.0}
    want = chat_answer(("a", level), ("a", TOP_A))
    got = chat_answer(("b", {**level, "b": -0.699, "a": -0.703}), ("c", TOP_B))
    result = compare(fingerprint(got), fingerprint(want))
    assert result.verdict is Verdict.TIED and result.agrees
    # Not level in its own step: a wrong token, not a tie.
    far = chat_answer(("b", {**level, "b": -0.3, "a": -1.1}), ("c", TOP_B))
    assert compare(fingerprint(far), fingerprint(want)).verdict is Verdict.DIFFERENT


def test_a_top_token_swapped_at_the_edge_of_the_five_is_not_a_difference():
    edge = {**{k: v for k, v in TOP_A.items() if k != "e"}, "g": -3.004}
    got = chat_answer(("a", edge), ("b", TOP_B))
    assert compare(fingerprint(got), fingerprint(ANSWER)).verdict is Verdict.SAME


def test_completions_answers_streams_and_echo():
    def completion(tokens, logprobs, tops, index=0):
        return {"index": index, "text": "x", "logprobs": {
            "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}}

    tops = [{"token_id:5": -0.5, "token_id:6": -1.0}, {"token_id:7": -0.1, "token_id:5": -2.0}]
    answer = {"choices": [completion(["token_id:5", "token_id:7"], [-0.5, -0.1], tops)]}
    # echo: the prompt's first token has no log-prob; prompt tokens are skipped only there.
    echoed = {"choices": [completion(["token_id:1"] + ["token_id:5", "token_id:7"],
                                     [None, -0.5, -0.1], [None] + tops)]}
    assert compare(fingerprint(answer), fingerprint(echoed)).verdict is Verdict.SAME
    # A stream: the same steps over two chunks (and a usage chunk with no choices).
    chunks = [{"choices": [completion(["token_id:5"], [-0.5], tops[:1])]},
              {"choices": [completion(["token_id:7"], [-0.1], tops[1:])]},
              {"choices": [], "usage": {"completion_tokens": 2}}]
    assert fingerprint_of_stream(chunks) == fingerprint(answer)


def test_an_answer_without_log_probs_cannot_be_judged():
    with pytest.raises(NoFingerprint, match="ask_for_fingerprint"):
        fingerprint({"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": None}]})


def test_asking_for_a_fingerprint_asks_for_ids_and_the_top_five():
    chat = ask_for_fingerprint({"messages": [], "max_tokens": 3})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 5
    assert chat["return_tokens_as_token_ids"] is True and chat["max_tokens"] == 3
    assert ask_for_fingerprint({"prompt": "hi"})["logprobs"] == 5


def test_tokens_that_read_alike_are_told_apart_by_their_bytes():
    partial = {"\ufffd": -0.1, "b": -1.0}
    one = chat_answer(("\ufffd", partial))
    two = chat_answer(("\ufffd", partial))
    two["choices"][0]["logprobs"]["content"][0]["bytes"] = [0xE2]
    assert compare(fingerprint(one), fingerprint(two)).verdict is Verdict.DIFFERENT


def test_an_answer_from_decode_may_move_its_first_step_by_a_rounding_step_and_no_more():
    # Decode's own computation of the prompt's last token: one bf16 step of a logit.
    rounded = chat_answer(("a", {**TOP_A, "b": -1.2 + 0.031}), ("b", TOP_B))
    assert compare(fingerprint(rounded), fingerprint(ANSWER)).verdict is Verdict.DIFFERENT
    assert_same_answer_from_decode(rounded, ANSWER)
    # More than that on the first step, or any move past TOLERANCE on a later one, is
    # another computation.
    moved_first = chat_answer(("a", shifted(TOP_A, -2 * ROUNDING_STEP_TOLERANCE)), ("b", TOP_B))
    moved_later = chat_answer(("a", TOP_A), ("b", {**TOP_B, "d": -2.9 + 2 * TOLERANCE}))
    for wrong in (moved_first, moved_later):
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_same_answer_from_decode(wrong, ANSWER)


def test_an_answer_from_decode_whose_first_token_was_a_tie_is_compared_no_further():
    # The two likeliest tokens level within a rounding step: decode may take the other.
    level = {"a": -0.80, "b": -0.81, "c": -2.0, "d": -2.5, "e": -3.0}
    took_b = chat_answer(("b", {**level, "b": -0.79}), ("z", {"z": -0.1}))
    assert_same_answer_from_decode(took_b, chat_answer(("a", level), ("b", TOP_B)))
