"""The tests' one assertion that two answers are the same: tokens and top-5 log-probs,
compared by epd_serve.instances.answers (never the text, which a random-weight model
can repeat for different inputs). tests/e2e/test_fingerprint.py shows it fails on a
feature taken from another image, a KV block left unwritten and two answers crossed."""

from __future__ import annotations

import httpx

from epd_serve.instances.answers import Fingerprint, compare, fingerprint


def fingerprint_of(resp: httpx.Response | dict | Fingerprint) -> Fingerprint:
    if isinstance(resp, httpx.Response):
        assert resp.status_code == 200, resp.text
        resp = resp.json()
    return fingerprint(resp) if isinstance(resp, dict) else resp


def assert_same_answer(got, want, what: str = "answer") -> None:
    """`got` answers as `want` does (responses, answer JSONs or fingerprints)."""
    comparison = compare(fingerprint_of(got), fingerprint_of(want))
    assert comparison.agrees, f"{what} differs from the reference: {comparison.where}"
