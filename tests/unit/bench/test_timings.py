"""Metrics against hand-computed cases, including the papers' 90% SLO rule."""

from __future__ import annotations

import pytest

from epd_serve.bench.timings import SLO, RequestRecord, stats, summarize


def rec(i=0, sent=0.0, tokens=(0.1, 0.2, 0.3, 0.4), end=None, out=None, inp=10, error=None,
        scheduled=None, mm=False) -> RequestRecord:
    r = RequestRecord(i, mm, sent if scheduled is None else scheduled)
    r.sent = sent
    r.token_times = list(tokens)
    r.first_token = tokens[0] if tokens else None
    r.end = end if end is not None else (tokens[-1] if tokens else sent)
    r.output_tokens = out if out is not None else len(tokens)
    r.input_tokens = inp
    r.error = error
    return r


def test_per_request_timings():
    r = rec(sent=1.0, tokens=(1.5, 1.6, 1.8, 2.1), end=2.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    # (E2EL - TTFT) / (tokens - 1) = 0.6 / 3
    assert r.tpot == pytest.approx(0.2)


def test_tpot_needs_two_tokens():
    assert rec(tokens=(0.5,)).tpot is None


def test_stats_percentiles():
    s = stats(list(range(1, 101)), scale=1.0)
    assert s["avg"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["median"] == pytest.approx(50.5)
    assert s["p75"] == pytest.approx(75.25)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert stats([])["avg"] is None


@pytest.mark.parametrize("gaps, meets", [
    ([0.04] * 10, True),                    # every gap under 50 ms
    ([0.04] * 9 + [0.5], True),             # 9 of 10 = 90%: still meets
    ([0.04] * 8 + [0.5, 0.5], False),       # 8 of 10 = 80%
    ([0.0625] * 10, True),                  # on the SLO (exact in binary) counts as under it
    ([], True),                             # a single token: only TTFT matters
])
def test_ninety_percent_gap_rule(gaps, meets):
    t = [0.5]
    for g in gaps:
        t.append(t[-1] + g)
    slo = 0.0625 if gaps and gaps[0] == 0.0625 else 0.05
    assert rec(tokens=t).meets_slo(ttft_slo=2.0, tpot_slo=slo) is meets


def test_ttft_over_slo_fails_even_with_fast_gaps():
    assert not rec(tokens=(2.5, 2.51, 2.52)).meets_slo(2.0, 0.05)
    assert rec(tokens=(1.99, 2.0, 2.01)).meets_slo(2.0, 0.05)


def test_failed_requests_never_meet_the_slo():
    assert not rec(error="HTTP 500: boom").meets_slo(10, 10)


def test_summary_hand_computed():
    # Two good requests, one slow (TTFT 3 s), one failed; 4 devices at 2 req/s.
    good1 = rec(0, sent=0.0, tokens=(0.5, 0.52, 0.54), end=0.54, out=3, inp=100)
    good2 = rec(1, sent=0.5, tokens=(1.0, 1.02, 1.04), end=1.04, out=3, inp=50)
    slow = rec(2, sent=1.0, tokens=(4.0, 4.02, 4.04), end=4.04, out=3, inp=50)
    failed = rec(3, sent=1.5, tokens=(), error="HTTP 503: no decode")
    failed.end = None
    s = summarize([good1, good2, slow, failed], SLO(ttft_ms=2000, tpot_ms=50), num_devices=4,
                  target_rate=2.0)
    duration = 4.04  # first send at 0, last answer at 4.04
    assert s["duration_s"] == pytest.approx(duration)
    assert (s["total_requests"], s["success_requests"], s["failed_requests"]) == (4, 3, 1)
    assert s["failure_reasons"] == {"HTTP 503": 1}
    assert s["request_throughput"] == pytest.approx(3 / duration)
    assert s["output_token_throughput"] == pytest.approx(9 / duration)
    assert s["input_token_throughput"] == pytest.approx(200 / duration)
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    assert s["effective_throughput"] == pytest.approx(6 / duration)
    assert s["ttft_ms"]["median"] == pytest.approx(500)
    assert s["ttft_ms"]["max"] == pytest.approx(3000)
    assert s["tpot_ms"]["avg"] == pytest.approx(20)
    assert s["itl_ms"]["avg"] == pytest.approx(20)
    assert s["e2el_ms"]["min"] == pytest.approx(540)
    assert s["concurrency"] == pytest.approx((0.54 + 0.54 + 3.04) / duration)
    assert s["per_device"]["request_rate"] == 0.5
    assert s["per_device"]["effective_throughput"] == pytest.approx(6 / duration / 4)
    # Sends at 0, 0.5, 1.0, 1.5: three gaps over 1.5 s.
    assert s["achieved_rate"] == pytest.approx(2.0)


def test_send_lag_statistics():
    a = rec(0, sent=0.0011, scheduled=0.001)
    b = rec(1, sent=0.0530, scheduled=0.050)
    s = summarize([a, b], SLO())
    assert s["send_lag_ms"]["max"] == pytest.approx(3.0)
    assert s["send_lag_ms"]["min"] == pytest.approx(0.1)
