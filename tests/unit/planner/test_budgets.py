"""Stage budgets: the binary search, Algorithm 1's limits, the engine flags, and the
profiler's search and fits against an engine whose costs are known."""

import pytest

from epd_serve.bench.timings import SLO
from epd_serve.bench.search import largest_passing
from epd_serve.planner import budgets, profiler

from .conftest import make_profile


@pytest.mark.parametrize("threshold", [1, 2, 37, 63, 64])
def test_integer_search_finds_the_exact_threshold_in_log_calls(threshold):
    calls = []

    def passes(n):
        calls.append(n)
        return n <= threshold

    assert largest_passing(passes, 1, 64, integer=True) == threshold
    assert len(calls) <= 2 + 6  # the two ends, then log2(64) halvings


def test_search_says_none_when_even_the_lowest_fails_and_high_when_all_pass():
    assert largest_passing(lambda n: False, 1, 10, integer=True) is None
    assert largest_passing(lambda x: True, 0.5, 8.0) == 8.0
    found = largest_passing(lambda x: x <= 3.3, 0.5, 8.0, iterations=12)
    assert 3.29 < found <= 3.3


def test_budget_is_the_largest_batch_under_the_limit():
    # 10 ms + 2 ms per item under 100 ms: 45 items (100 ms), not 46 (102 ms).
    assert budgets.search_budget(lambda n: 10 + 2 * n, 100, 512) == 45
    # An instance must make progress: one item over the limit still gets a budget of 1.
    assert budgets.search_budget(lambda n: 500 + n, 100, 512) == 1


def test_limits_follow_algorithm_1():
    slo = SLO(ttft_ms=2000, tpot_ms=50)
    for roles in ("E", "P", "EP"):
        assert budgets.latency_limit_ms(roles, slo) == 1000  # alpha = 0.5 of TTFT
    for roles in ("D", "PD", "ED", "EPD"):
        assert budgets.latency_limit_ms(roles, slo) == 50  # roles that decode: TBT


def test_role_budgets_from_a_cost_model():
    prof = make_profile(memory={"kv_capacity_tokens": 10_000})
    slo = SLO(ttft_ms=2000, tpot_ms=50)
    # E: 5 + 0.1 * 100 * n <= 1000 -> n = 99 (capped by the search range of 64)
    assert budgets.role_budget("E", slo, prof, 100, 500).images == budgets.MAX_IMAGES
    # P: 10 + 0.1 n <= 1000 -> 9900 tokens
    assert budgets.role_budget("P", slo, prof, 100, 500).tokens == 9900
    # D: 10 + 1.0 n <= 50 -> 40 sequences, but 10k KV tokens / 500 per sequence = 20
    d = budgets.role_budget("D", slo, prof, 100, 500)
    assert d.seqs == 20 and d.tokens >= 20
    # PD under TBT: 10 + 0.1 t <= 50 -> 400 tokens per iteration
    assert budgets.role_budget("PD", slo, prof, 100, 500).tokens == 400


def test_engine_flags_carry_the_budgets():
    e = budgets.engine_flags("E", budgets.Budget(images=4, tokens=0, seqs=0), 256)
    assert e == {"max_num_batched_tokens": 1024, "max_num_seqs": 4}
    d = budgets.engine_flags("D", budgets.Budget(images=0, tokens=32, seqs=32), 256)
    assert d == {"max_num_batched_tokens": 32, "max_num_seqs": 32}
    p = budgets.engine_flags("P", budgets.Budget(images=0, tokens=3000, seqs=0), 256)
    assert p == {"max_num_batched_tokens": 3000}


class KnownEngine(profiler.Prober):
    """An engine whose costs are exact: what the profiler must recover."""

    def __init__(self):
        super().__init__("http://unused", "m", repeats=1, log=lambda line: None)
        self.calls = {"prefill": 0, "decode": 0, "images": 0}

    def prefill_ms(self, tokens):  # 12 ms per request + 0.05 ms per token
        self.calls["prefill"] += 1
        return 12.0 + 0.05 * tokens

    def chat_prefill_ms(self, words, pause_s=0.5):  # a chat request costs the API server 3 ms more
        tokens = 2 * words + 10
        return 15.0 + 0.05 * tokens, tokens

    def decode_ms(self, seqs, steps=32, image_size=None, pause_s=0.0):  # 2 ms + 0.5 ms per sequence
        self.calls["decode"] += 1
        return 2.0 + 0.5 * seqs + (30.0 / (steps - 1) if image_size else 0.0)  # 30 ms once

    def images_ms(self, count, size):  # encoder 20 ms per image + a chat prefill
        self.calls["images"] += 1
        tokens = (size // 28) ** 2 + 10
        return 20.0 * count + 15.0 + 0.05 * tokens * count


def test_profiler_searches_budgets_against_the_engine_and_fits_its_costs():
    engine = KnownEngine()
    base = make_profile(template_tokens=10)
    slo = SLO(ttft_ms=410, tpot_ms=20)  # limits between probes, not on one
    prof = profiler.measure(engine, base, slo, max_tokens=4096, max_images=32, max_seqs=64)
    b = prof.measured["budgets"]
    assert b["P"]["tokens"] == 3860  # 12 + 0.05 t <= 205
    assert b["PD"]["tokens"] == 160  # 12 + 0.05 t <= 20
    assert b["D"]["seqs"] == 36  # 2 + 0.5 n <= 20
    # images: 20 n + 15 + 0.05 (256 + 10) n - (hop + iteration + prefill(266 n)) = 20 n <= 205
    assert b["E"]["images"] == 10
    assert prof.llm.per_prefill_token_ms == pytest.approx(0.05, rel=1e-6)
    assert prof.llm.per_decode_seq_ms == pytest.approx(0.5, rel=1e-6)
    assert prof.llm.fixed_ms == pytest.approx(2.0, rel=1e-6)
    assert prof.encoder.per_image_ms + prof.encoder.per_token_ms * 256 == pytest.approx(20.0, rel=1e-3)
    assert prof.llm.mm_decode_once_ms == pytest.approx(30.0, rel=1e-6)
    # The request's own overhead (a chat prompt's 15 ms beyond its tokens' prefill, over
    # 2 ms per iteration) is charged per hop.
    assert prof.transfers.hop_ms == pytest.approx(13.0, rel=1e-6)
    assert prof.measured["engine_flags"]["D"]["max_num_seqs"] == 36
    # A binary search, not a sweep: a handful of probes per stage.
    assert engine.calls["prefill"] <= 3 + 13 + 13 and engine.calls["decode"] <= 4 + 7


class KnownVideoEngine(KnownEngine):
    """KnownEngine that also takes videos: 2.5 ms of encoder work per frame, beyond the
    chat request and its prompt's prefill (its encoder charges nothing per token)."""

    def video_ms(self, frames, size):
        self.calls.setdefault("videos", 0)
        self.calls["videos"] += 1
        tokens = -(-frames // 2) * (size // 28) ** 2
        return 15.0 + 0.05 * (tokens + 10) + 2.5 * frames


def test_profiler_measures_a_videos_cost_per_frame_when_asked():
    base = make_profile(template_tokens=10)
    slo = SLO(ttft_ms=410, tpot_ms=20)
    without = profiler.measure(KnownVideoEngine(), base, slo, max_tokens=4096,
                               max_images=32, max_seqs=64)
    assert without.encoder.per_frame_ms == base.encoder.per_frame_ms  # not probed
    engine = KnownVideoEngine()
    prof = profiler.measure(engine, base, slo, max_tokens=4096, max_images=32, max_seqs=64,
                            videos=True)
    assert prof.encoder.per_token_ms == pytest.approx(0.0, abs=1e-6)
    assert prof.encoder.per_frame_ms == pytest.approx(2.5, rel=1e-6)
    assert engine.calls["videos"] == 2
    assert [n for n, _, _ in prof.measured["points_ms"]["videos"]] == [8, 32]
