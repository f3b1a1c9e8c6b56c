"""The planner (Algorithm 2): stage work, the device split, candidates our notation can
run, and small cases whose best answer is known."""

import json

import numpy as np
import pytest

from epd_serve.bench import arrivals, workloads
from epd_serve.bench.timings import SLO
from epd_serve.bench.workloads import ImageRef, RequestSpec
from epd_serve.planner import planner, simulator
from epd_serve.topology import notation

from .conftest import make_profile

SLO_ = SLO(ttft_ms=2000, tpot_ms=50)


@pytest.mark.parametrize("n,times,expected", [
    (3, [1, 1, 1], [1, 1, 1]),
    (8, [2, 1, 1], [4, 2, 2]),
    (8, [10, 0.01, 0.01], [6, 1, 1]),  # at least one device per stage
    (5, [0, 0, 0], None),  # no work anywhere: shared out evenly
    (2, [1, 1, 1], None),  # too few devices for three stages
])
def test_partition(n, times, expected):
    split = planner.partition(n, times)
    if expected is None and n >= len(times):
        assert sum(split) == n and min(split) >= 1
    else:
        assert split == expected


def test_partition_always_uses_every_device():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 4))
        n = int(rng.integers(k, 17))
        split = planner.partition(n, rng.random(k).tolist())
        assert sum(split) == n and min(split) >= 1


def test_stage_work_sums_the_trace(profile):
    specs = [RequestSpec(0, "a b", (ImageRef(280, 280),), 10), RequestSpec(1, "c", (), 5)]
    work = planner.stage_work(profile, specs, SLO_)
    assert work.work == {"E": 100.0, "P": 12 + 100 + 11, "D": 15.0}
    for stage in "EPD":
        assert work.seconds[stage] == pytest.approx(work.work[stage] / work.throughput[stage])


def test_candidates_are_what_our_notation_runs(profile):
    specs = workloads.load_workload("sharegpt4o", 50, 64)
    work = planner.stage_work(profile, specs, SLO_)
    cands = planner.candidates(8, work)
    assert {c.form for c in cands} == set(planner.FORMS)
    for cand in cands:
        assert cand.devices == 8
        assert len({i.device for i in cand.instances}) == 8
        if cand.launchable:
            plan = notation.parse(cand.notation)
            assert plan.num_devices == 8
            assert sorted(i.roles for i in plan.instances) == sorted(i.roles for i in cand.instances)
        else:
            assert cand.form == "ED-P"
    everything = planner.candidates(4, work, all_splits=True)
    assert len([c for c in everything if c.form == "E-P-D"]) == 3  # (2,1,1) (1,2,1) (1,1,2)
    assert len([c for c in everything if c.form == "EP-D"]) == 3


def _trace(n=80, rate=6.0, images=True):
    specs = [RequestSpec(i, "describe this", (ImageRef(448, 448, seed=i),) if images else (), 16)
             for i in range(n)]
    return specs, arrivals.poisson(n, rate, seed=0)


def test_free_co_location_beats_serial_merging_and_costly_co_location_loses():
    # With no contention, E and P side by side on k devices do 2k devices' work; an EP
    # instance on the same k devices does one stage after the other. With heavy
    # contention the co-located pair is slower than the merged one.
    specs, offsets = _trace()
    for contention, winner, loser in ((0.0, "(E-P)-D", "EP-D"), (3.0, "EP-D", "(E-P)-D")):
        prof = make_profile(encoder={"per_token_ms": 0.5}, sharing={"contention": contention})
        result = planner.plan(prof, specs, offsets, SLO_, devices=3)
        ranked = [ev.candidate.form for ev in result.evaluations]
        assert ranked.index(winner) < ranked.index(loser), (contention, ranked)


def test_one_device_without_contention_prefers_the_split_encoder():
    # (E-PD) on one device is TP1 with the encoder in its own process: with no
    # contention it never does worse, and with image work it does better.
    specs, offsets = _trace(rate=12.0)
    prof = make_profile(encoder={"per_token_ms": 0.3})
    result = planner.plan(prof, specs, offsets, SLO_, devices=1)
    assert [ev.candidate.form for ev in result.evaluations][0] == "(E-PD)"


def test_goodput_is_the_highest_rate_meeting_the_slo(profile):
    specs, offsets = _trace(rate=2.0)
    cand = planner.build("E-P-D", (1, 1, 1))
    ev = planner.evaluate(cand, profile, specs, offsets, SLO_)
    assert ev.goodput is not None and not ev.goodput_capped
    rate = planner.trace_rate(offsets)

    def attainment(r):
        run_specs, run_offsets = planner._replay(specs, offsets, rate, r)
        run, _ = simulator.simulate(list(cand.instances), profile, run_specs, run_offsets, SLO_, r)
        return run.summary["slo_attainment"]
    assert attainment(ev.goodput) >= 0.9
    assert attainment(ev.goodput * 1.1) < 0.9


def test_plan_command_prints_a_recommendation_and_writes_the_evidence(tmp_path, capsys):
    from epd_serve.cli.main import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 0.1, "prompt_words": 10,
                                           "images": [[802, 652]] if i % 3 else [],
                                           "output_tokens": 64}) for i in range(60)))
    out = tmp_path / "plan"
    code = main(["plan", "--profile", "atlas-800i-a2-openpangu-7b-vl", "--trace", str(trace),
                 "--slo-ttft", "2000", "--slo-tpot", "50", "--devices", "8", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "role_engine_args" in text
    for form in planner.FORMS:
        assert f" {form} " in text  # one row per form
    data = json.loads((out / "plan.json").read_text())
    assert len(data["candidates"]) == len(planner.FORMS)
    goodputs = [c["goodput"] or 0 for c in data["candidates"]]
    assert goodputs == sorted(goodputs, reverse=True)
    assert data["candidates"][0]["summary"]["total_requests"] == 60
    assert (out / "plan.png").stat().st_size > 10_000
    assert (out / "simulated" / "report.html").is_file()


def test_simulate_command_and_bad_input(tmp_path, capsys):
    from epd_serve.cli.main import main

    assert main(["simulate", "--profile", "h800-qwen3-vl-8b", "--deployment", "(E-P)-D",
                 "--workload", "visualwebinstruct", "--num-requests", "30", "--rates", "1,4",
                 "--out", str(tmp_path)]) == 0
    assert "report:" in capsys.readouterr().out
    # A header, then per rate the run's row and its text and image rows.
    assert (tmp_path / "summary.csv").read_text().count("\n") == 1 + 2 * 3
    assert main(["plan", "--profile", "no-such-profile", "--rate", "1", "--devices", "2"]) == 2
    assert "no profile 'no-such-profile'" in capsys.readouterr().err
    assert main(["plan", "--profile", "h800-qwen3-vl-8b", "--devices", "2",
                 "--out", str(tmp_path)]) == 2
    assert "--rate" in capsys.readouterr().err
    assert main(["simulate", "--profile", "h800-qwen3-vl-8b", "--deployment", "E-E",
                 "--rates", "1", "--out", str(tmp_path)]) == 2


def test_a_request_trace_is_a_workload_the_load_tool_replays(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0.0, "prompt_words": 3, "images": [[640, 480]], '
                     '"output_tokens": 7}\n{"timestamp": 0.5, "text": "just text"}\n')
    stamps = tmp_path / "stamps.jsonl"
    stamps.write_text('{"timestamp": 0.0}\n{"timestamp": 1.0}\n')
    assert workloads.is_request_trace(trace) and not workloads.is_request_trace(stamps)
    specs = workloads.load_workload(str(trace), 2, None)
    assert [(len(s.text.split()), s.multimodal, s.max_tokens) for s in specs] == [
        (3, True, 7), (2, False, 64)]
    assert (specs[0].images[0].width, specs[0].images[0].height) == (640, 480)
    assert list(arrivals.load_trace(trace)) == [0.0, 0.5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "images": [[1]]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a trace row"):
        workloads.load_workload(str(bad), 1, None)


def test_a_trace_replayed_faster_lasts_as_long_as_recorded():
    specs, offsets = _trace(n=50, rate=5.0)
    rate = planner.trace_rate(offsets)
    same_specs, same = planner._replay(specs, offsets, rate, rate)
    assert same_specs == specs and np.allclose(same, offsets)
    fast_specs, fast = planner._replay(specs, offsets, rate, 4 * rate)
    assert len(fast_specs) == len(fast) == 200
    assert sorted({s.index for s in fast_specs}) == list(range(200))
    assert np.all(np.diff(fast) > 0)
    assert fast[-1] == pytest.approx(offsets[-1], rel=0.05)
    capped_specs, _ = planner._replay(specs, offsets, rate, 100 * rate)
    assert len(capped_specs) == planner.MAX_REPEATS * 50
