"""Arrival processes: the statistics of the generated gaps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from epd_serve.bench import arrivals

N = 20000


def gaps(offsets):
    return np.diff(offsets)


def test_fixed_rate_is_exactly_periodic():
    off = arrivals.fixed(5, 4.0)
    assert off.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_gaps_are_exponential():
    g = gaps(arrivals.poisson(N, 5.0, seed=1))
    assert g.mean() == pytest.approx(0.2, rel=0.03)
    # Exponential: coefficient of variation 1, P(gap > mean) = e^-1.
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)
    assert (g > 0.2).mean() == pytest.approx(np.exp(-1), abs=0.015)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_mean_and_sets_the_variation(burstiness):
    g = gaps(arrivals.gamma(N, 10.0, burstiness, seed=2))
    assert g.mean() == pytest.approx(0.1, rel=0.04)
    # Gamma with shape k: CV = 1/sqrt(k).
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)


def test_seeds_make_schedules_reproducible():
    assert np.array_equal(arrivals.poisson(100, 3.0, seed=7), arrivals.poisson(100, 3.0, seed=7))
    assert not np.array_equal(arrivals.poisson(100, 3.0, seed=7), arrivals.poisson(100, 3.0, seed=8))


def test_linear_ramp_rates_rise_from_start_to_end():
    off = arrivals.ramp_linear(N, 2.0, 10.0)
    assert off[0] == 0 and np.all(np.diff(off) > 0)
    g = gaps(off)
    assert 1 / g[:50].mean() == pytest.approx(2.0, rel=0.05)
    assert 1 / g[-50:].mean() == pytest.approx(10.0, rel=0.05)
    assert off[-1] == pytest.approx(2 * N / 12.0, rel=0.01)  # N / mean rate


def test_exponential_ramp_rates_rise_geometrically():
    off = arrivals.ramp_exponential(N, 1.0, 16.0)
    g = gaps(off)
    assert 1 / g[:20].mean() == pytest.approx(1.0, rel=0.05)
    assert 1 / g[-20:].mean() == pytest.approx(16.0, rel=0.05)
    # Halfway through the duration the rate is the geometric mean (4).
    t_half = off[-1] / 2
    i = np.searchsorted(off, t_half)
    assert 1 / g[i - 10:i + 10].mean() == pytest.approx(4.0, rel=0.08)


def test_burst_sends_everything_at_once():
    assert arrivals.burst(5).tolist() == [0.0] * 5


def test_trace_replay_from_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps({"timestamp": t}) for t in (100.0, 101.5, 100.5)))
    assert arrivals.load_trace(jsonl).tolist() == [0.0, 0.5, 1.5]
    csv = tmp_path / "t.csv"
    csv.write_text("timestamp,other\n10,a\n12,b\n")
    assert arrivals.schedule("trace", 0, trace=str(csv), speedup=2.0).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(process="poisson", n=3, rate=0), "rate must be > 0"),
    (dict(process="poisson", n=3), "needs a request rate"),
    (dict(process="ramp-linear", n=3, rate=1), "needs an end rate"),
    (dict(process="trace", n=3), "needs a trace file"),
    (dict(process="zipf", n=3, rate=1), "unknown arrival process"),
])
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arrivals.schedule(**kwargs)
