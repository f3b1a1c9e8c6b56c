"""The simulator's invariants: every request answered in full, work conserved, one
iteration at a time per instance, latency that grows with load, routing as the proxy
does it, exact latencies for a lone request, and the load tool's own reports."""

import numpy as np
import pytest

from epd_serve.bench import arrivals, workloads
from epd_serve.bench.timings import SLO
from epd_serve.bench.report import write_report
from epd_serve.bench.runner import LoadSpec
from epd_serve.bench.workloads import ImageRef, RequestSpec
from epd_serve.planner import simulator
from epd_serve.topology import notation

from .conftest import make_profile

SLO_ = SLO(ttft_ms=2000, tpot_ms=50)
DEPLOYMENTS = ["TP1", "E-P-D", "EP-D", "(E-P)-D", "(E-D)-P", "(E-PD)", "2E-P-2D", "P-D"]


def run(deployment, profile, specs, offsets, slo=SLO_):
    plan = notation.parse(deployment)
    return simulator.simulate(simulator.instances_of(plan), profile, specs, offsets, slo,
                              rate=None, label=deployment)


@pytest.fixture(scope="module")
def mixed():
    return workloads.load_workload("visualwebinstruct", 120, 24, seed=3)


@pytest.mark.parametrize("notation", DEPLOYMENTS)
def test_no_request_is_lost_and_work_is_conserved(notation, mixed, profile):
    offsets = arrivals.poisson(len(mixed), 20.0, seed=1)  # overloaded: queues build up
    result, sim = run(notation, profile, mixed, offsets)
    records = result.records
    assert len(records) == len(mixed)
    assert all(r.ok and r.output_tokens == s.max_tokens for r, s in zip(records, mixed))
    assert all(len(r.token_times) == s.max_tokens for r, s in zip(records, mixed))
    assert all(r.first_token >= r.sent and r.end >= r.first_token for r in records)
    tokens = [profile.request_tokens(s) for s in mixed]
    stats = sim.instances.values()
    assert sum(i["images"] for i in stats) == sum(len(imgs) for _, imgs in tokens)
    assert sum(i["prefill_tokens"] for i in stats) == sum(t + sum(imgs) for t, imgs in tokens)
    # A merged instance samples the first token with the prefill; decode makes the rest.
    merged = not any("P" in i["roles"] and "D" not in i["roles"] for i in stats)
    expected = sum(s.max_tokens for s in mixed) - (len(mixed) if merged else 0)
    assert sum(i["decode_tokens"] for i in stats) == expected
    # One iteration at a time: no instance is busy longer than the run.
    assert all(i["busy_s"] <= sim.end_s + 1e-9 for i in stats)


def test_a_lone_request_costs_exactly_its_stages():
    # An image request's decode steps after its first token cost 8 ms more in all.
    profile = make_profile(llm=dict(mm_decode_once_ms=8.0))
    image = RequestSpec(0, "one two three", (ImageRef(280, 280),), 3)
    text_tokens, (visual,) = profile.request_tokens(image)
    assert (text_tokens, visual) == (13, 100)
    prompt = text_tokens + visual
    hop, t = profile.transfers.hop_ms, profile.transfers
    decode_step = profile.iteration_ms(0, 1, prompt)
    result, _ = run("E-P-D", profile, [image], np.zeros(1))
    rec = result.records[0]
    ttft = (hop + profile.encode_ms([visual]) + t.feature_ms(visual) + hop
            + profile.iteration_ms(prompt, 0) + t.kv_ms(prompt) + hop + decode_step)
    assert rec.ttft * 1e3 == pytest.approx(ttft)
    steps = profile.iteration_ms(0, 1, prompt + 1) + profile.iteration_ms(0, 1, prompt + 2)
    assert rec.tpot * 1e3 == pytest.approx((steps + 8.0) / 2)
    text = RequestSpec(1, "one two three", (), 3)
    result, _ = run("E-P-D", profile, [text], np.zeros(1))
    assert result.records[0].tpot * 1e3 == pytest.approx(
        (profile.iteration_ms(0, 1, 14) + profile.iteration_ms(0, 1, 15)) / 2)
    assert rec.stage_breakdown.stage_ms()["E"] == pytest.approx(profile.encode_ms([visual]))
    # Monolithic: encode, then prefill with the first token, on one instance.
    result, _ = run("TP1", profile, [image], np.zeros(1))
    ttft = hop + profile.encode_ms([visual]) + profile.iteration_ms(prompt, 0)
    assert result.records[0].ttft * 1e3 == pytest.approx(ttft)


def test_latency_grows_with_load(mixed, profile):
    base = arrivals.poisson(len(mixed), 1.0, seed=2)
    for notation in ("E-P-D", "TP1", "(E-P)-D"):
        means = []
        for rate in (1.0, 4.0, 16.0, 64.0):
            result, _ = run(notation, profile, mixed, base / rate)
            means.append(result.summary["e2el_ms"]["avg"])
        assert means == sorted(means), (notation, means)
        assert means[-1] > 1.5 * means[0]


def test_text_skips_the_encoders_and_images_go_to_the_least_loaded_one(profile):
    specs = [RequestSpec(i, "a b c", (ImageRef(448, 448, seed=i),) if i % 2 else (), 2)
             for i in range(8)]
    result, sim = run("2E-P-D", profile, specs, np.zeros(len(specs)))
    for rec, spec in zip(result.records, specs):
        stages = rec.stage_breakdown.stage_ms()
        assert ("E" in stages) == spec.multimodal and {"P", "D"} <= set(stages)
    assert sim.instances["e0"]["images"] == sim.instances["e1"]["images"] == 2


def test_co_location_costs_what_the_profile_says(mixed, profile):
    offsets = arrivals.poisson(len(mixed), 8.0, seed=4)
    apart, _ = run("E-P-D", profile, mixed, offsets)
    free, _ = run("(E-P)-D", profile, mixed, offsets)
    shared, _ = run("(E-P)-D", make_profile(sharing={"contention": 1.0}), mixed, offsets)
    ttft = lambda r: r.summary["ttft_ms"]["avg"]  # noqa: E731
    assert ttft(free) == pytest.approx(ttft(apart))  # no contention: as good as apart
    assert ttft(shared) > ttft(free) * 1.05
    # A directed pair: decode slowed by the encoder beside it, not the reverse.
    d_slow = make_profile(sharing={"pairs": {"D+E": 2.0}})
    slowed, _ = run("(E-D)-P", d_slow, mixed, offsets)
    plain, _ = run("(E-D)-P", profile, mixed, offsets)
    assert slowed.summary["tpot_ms"]["avg"] > plain.summary["tpot_ms"]["avg"] * 1.2


def test_a_simulated_run_writes_the_load_tools_report(tmp_path, mixed, profile):
    offsets = arrivals.poisson(len(mixed), 4.0, seed=5)
    runs = []
    for notation in ("E-P-D", "TP1"):
        result, _ = run(notation, profile, mixed, offsets)
        result.rate = 4.0
        runs.append(result)
    spec = LoadSpec(url="simulated", model="m", workload="visualwebinstruct", num_requests=120)
    write_report(runs, tmp_path, spec)
    for name in ("results.json", "summary.csv", "requests.csv", "vs_rate.png", "stages.png",
                 "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_a_deployment_that_cannot_serve_is_refused(profile):
    with pytest.raises(ValueError, match="prefill and decode"):
        simulator.Simulation([simulator.SimInstance("e0", "E", 0),
                              simulator.SimInstance("p0", "P", 1)], profile, SLO_)
    with pytest.raises(ValueError, match="one device per instance"):
        simulator.instances_of(notation.parse("TP2"))


def test_measured_hand_off_costs_are_drawn_per_request_and_seeded(mixed):
    samples = [0.0] * 10 + [500.0] * 11  # half the hand-offs stall for half a second
    spread = make_profile(transfers={"kv_samples_ms": samples})
    text = [s for s in mixed if not s.multimodal][:40]
    offsets = np.arange(len(text)) * 5.0  # far apart: no queueing
    a, _ = run("P-D", spread, text, offsets)
    b, _ = run("P-D", spread, text, offsets)
    ttfts = [r.ttft for r in a.records]
    assert ttfts == [r.ttft for r in b.records]  # the same seed, the same draws
    assert max(ttfts) - min(ttfts) > 0.4 and 0.2 < np.mean([t > 0.4 for t in ttfts]) < 0.8
    plain, _ = run("P-D", make_profile(), text, offsets)
    assert max(r.ttft for r in plain.records) - min(r.ttft for r in plain.records) < 0.05
    t = spread.transfers
    assert (t.kv_ms(10, 0.0), t.kv_ms(10, 0.99), t.kv_ms(10)) == (0.0, 500.0, t.kv_fixed_ms)


def test_a_decode_instance_pays_its_connectors_step_cost(mixed):
    text = [s for s in mixed if not s.multimodal][:5]
    offsets = np.arange(len(text)) * 5.0
    base, _ = run("P-D", make_profile(), text, offsets)
    slow, _ = run("P-D", make_profile(llm={"consumer_step_ms": 3.0}), text, offsets)
    merged, _ = run("TP1", make_profile(llm={"consumer_step_ms": 3.0}), text, offsets)
    merged_base, _ = run("TP1", make_profile(), text, offsets)
    tpot = lambda r: r.summary["tpot_ms"]["avg"]  # noqa: E731
    assert tpot(slow) == pytest.approx(tpot(base) + 3.0)
    assert tpot(merged) == pytest.approx(tpot(merged_base))  # no KV to receive


def test_a_blocking_hand_off_holds_up_the_receiving_engines_batch():
    # Two requests 0.1 s apart on P-D; each P -> D hand-off costs 300 ms.
    specs = [RequestSpec(i, "a b c d", (), 40) for i in range(2)]
    offsets = np.array([0.0, 0.1])
    delayed = make_profile(transfers={"kv_fixed_ms": 300.0})
    blocking = make_profile(transfers={"kv_fixed_ms": 300.0, "blocking": True})
    a, _ = run("P-D", delayed, specs, offsets)
    b, _ = run("P-D", blocking, specs, offsets)
    # The first request's TTFT is the same either way: the cost is paid once, before its
    # first token.
    assert b.records[0].ttft == pytest.approx(a.records[0].ttft)
    # As a delay the second hand-off does not touch the first request's decoding; as
    # engine time it stalls it for 300 ms in the middle of its stream.
    gaps = lambda rec: np.diff(rec.token_times)  # noqa: E731
    assert gaps(a.records[0]).max() < 0.05
    assert 0.3 <= gaps(b.records[0]).max() < 0.35
