"""The tests' one assertion that two answers are the same: tokens and top-5 log-probs,
compared by epd_serve.instances.answers (never the text, which a random-weight model
can repeat for different inputs). tests/e2e/test_fingerprint.py shows it fails on a
feature taken from another image, a KV block left unwritten and two answers crossed."""

from __future__ import annotations

import httpx

from epd_serve.instances.answers import (
    ROUNDING_STEP_TOLERANCE,
    Fingerprint,
    Verdict,
    compare,
    fingerprint,
)


def fingerprint_of(resp: httpx.Response | dict | Fingerprint) -> Fingerprint:
    if isinstance(resp, httpx.Response):
        assert resp.status_code == 200, resp.text
        resp = resp.json()
    return fingerprint(resp) if isinstance(resp, dict) else resp


def assert_same_answer(got, want, what: str = "answer") -> None:
    """`got` answers as `want` does (responses, answer JSONs or fingerprints)."""
    comparison = compare(fingerprint_of(got), fingerprint_of(want))
    assert comparison.agrees, f"{what} differs from the reference: {comparison.where}"


def assert_same_answer_from_decode(got, want, what: str = "answer") -> None:
    """`got`, answered by a decode instance handed the prompt's KV, answers as `want`
    (one instance alone) does: every step after the first exactly as assert_same_answer
    (decode puts back the K/V prefill computed for the prompt's last token,
    epd_kv/prompt_tail.py, so later steps read the cache one instance holds), the first,
    decode's own computation of that token in its own batch shape, within one bf16
    rounding step of a logit (ROUNDING_STEP_TOLERANCE: on a long prompt it moves by
    that much, past TOLERANCE)."""
    got, want = fingerprint_of(got), fingerprint_of(want)
    first = compare(tuple(steps[:1] for steps in got), tuple(steps[:1] for steps in want),
                    tolerance=ROUNDING_STEP_TOLERANCE)
    assert first.agrees, f"{what} differs from the reference: {first.where}"
    if first.verdict is Verdict.TIED:
        return  # two tokens level at the first step: nothing after it can be compared
    later = compare(tuple(steps[1:] for steps in got), tuple(steps[1:] for steps in want))
    assert later.agrees, f"{what} differs from the reference after its first token: " \
                         f"{later.where}"
