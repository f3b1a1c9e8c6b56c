"""What role switching buys when the workload shifts: one load run, simulated with the
roles fixed and with the proxy's role controller on (switching.py).

The scenario is paper 003's Table 6 experiment, generalised: the requests change what
they ask at a given index (there, output 50 -> 500 tokens at request 10; here also
text-only -> image-heavy), and each run is reported per phase (before, after the shift)
and overall, with the load tool's own aggregates (bench.timings.summarize), so the
numbers read like a real run's and can be set beside one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from epd_serve.bench import arrivals
from epd_serve.bench.timings import SLO, summarize
from epd_serve.bench.workloads import RequestSpec, SyntheticWorkload
from epd_serve.planner import simulator
from epd_serve.planner.profile import Profile
from epd_serve.planner.switching import RoleControl
from epd_serve.topology import notation as deployment_notation

FOUR_K = (4032, 3024)  # paper 003's "4K" image


@dataclasses.dataclass(frozen=True)
class Phase:
    """What every request of one phase asks."""

    output_tokens: int
    images: int = 1  # per request; 0: text only
    resolution: tuple[int, int] = FOUR_K
    text_words: float = 16.0  # mean words of the question

    def requests(self, n: int, seed: int) -> list[RequestSpec]:
        mix = SyntheticWorkload("shift-phase", self.text_words, 1.0 if self.images else 0.0,
                                self.resolution, images_per_request=(self.images, self.images),
                                output_tokens=self.output_tokens)
        return mix.requests(n, seed)


@dataclasses.dataclass(frozen=True)
class ShiftScenario:
    """A load run whose requests change at `shift_at`: `before` until then, `after`
    from then on; Poisson arrivals at `rate`."""

    name: str
    requests: int
    rate: float
    shift_at: int
    before: Phase
    after: Phase

    def specs(self, seed: int = 0) -> list[RequestSpec]:
        first = self.before.requests(self.shift_at, seed)
        rest = self.after.requests(self.requests - self.shift_at, seed + 1)
        return [dataclasses.replace(spec, index=i) for i, spec in enumerate(first + rest)]

    def offsets(self, seed: int = 0):
        return arrivals.poisson(self.requests, self.rate, seed)


# Paper 003 §4.4, Table 6: 100 requests, one 4K image each, 3 req/s; the first 10 ask
# 50 output tokens, the other 90 ask 500.
TABLE6 = ShiftScenario("table6", 100, 3.0, 10, Phase(50), Phase(500))
# The other way round for the encoder: text-only questions, then two 4K images each.
TEXT_TO_IMAGE = ShiftScenario("text->image", 100, 3.0, 30,
                              Phase(100, images=0, text_words=64.0), Phase(100, images=2))


def phase_metrics(records, slo: SLO) -> dict:
    """TTFT, TPOT and E2EL (s: p50, p90, mean) and SLO attainment of some requests."""
    summary = summarize(records, slo)
    out: dict = {"requests": len(records), "slo_attainment": summary["slo_attainment"]}
    for name in ("ttft", "tpot", "e2el"):
        ms = summary[f"{name}_ms"]
        out[f"{name}_s"] = {"p50": _s(ms["median"]), "p90": _s(ms["p90"]), "mean": _s(ms["avg"])}
    return out


def layout(roles: list[str]) -> str:
    """Instances per stage, as counted notation writes it: ["E", "E", "P", "D"] -> 2E1P1D."""
    counts = Counter(roles)
    return "".join(f"{counts[r]}{r}" for r in sorted(counts, key=_pipeline_order))


def run_once(profile: Profile, notation: str, scenario: ShiftScenario, slo: SLO,
             control: RoleControl | None, seed: int = 0) -> dict:
    """One simulated run of the scenario: per-phase metrics, switches, final layout."""
    plan = deployment_notation.parse(notation)
    specs = scenario.specs(seed)
    result, sim = simulator.simulate(simulator.instances_of(plan), profile, specs,
                                     scenario.offsets(seed), slo, scenario.rate,
                                     label=notation, seed=seed, role_control=control)
    records = result.records
    return {
        "phases": {"before": phase_metrics(records[:scenario.shift_at], slo),
                   "after": phase_metrics(records[scenario.shift_at:], slo),
                   "all": phase_metrics(records, slo)},
        "switches": [s.to_dict() for s in sim.switches],
        "start_layout": layout([i["roles"] for i in sim.instances.values()]),
        "final_layout": layout([i["final_roles"] for i in sim.instances.values()]),
        "finished": sum(1 for r in records if r.ok),
        "end_s": sim.end_s,
    }


def simulate_role_shift(profile: Profile, notation: str, scenario: ShiftScenario = TABLE6,
                        slo: SLO | None = None, control: RoleControl | None = None,
                        seed: int = 0) -> dict:
    """The scenario with switching off and on, and the off/on ratios of the means of
    TTFT, TPOT and E2EL over all requests (above 1: switching helps). `slo` defaults to
    the profile's measured one, else SLO(); `control` to RoleControl().

    Also "plain": the same layout with no instance switchable. A switchable encoder is a
    full engine whose encode hops prefill too, so "plain" shows what being ready to
    switch costs when no switch is made (paper 003's w/o-switch system has plain
    encoders)."""
    slo = slo or _profile_slo(profile)
    control = control or RoleControl()
    off = run_once(profile, notation, scenario, slo, None, seed)
    on = run_once(profile, notation, scenario, slo, control, seed)
    plain = run_once(profile, notation.replace("~", ""), scenario, slo, None, seed)
    ratios = {}
    for name in ("ttft", "tpot", "e2el"):
        a, b = off["phases"]["all"][f"{name}_s"]["mean"], on["phases"]["all"][f"{name}_s"]["mean"]
        ratios[name] = a / b if a is not None and b else None
    return {"profile": profile.name, "notation": notation, "scenario": scenario.name,
            "slo": dataclasses.asdict(slo), "control": dataclasses.asdict(control),
            "off": off, "on": on, "plain": plain, "ratios": ratios}


MODALITIES = ("image", "text", "text->image")


def predict_ratios(profile: Profile, notation: str, rate: float, requests: int,
                   output_before: int, output_after: int, shift_at: int,
                   modality: str = "image", images_per_request: int = 1,
                   resolution: tuple[int, int] = FOUR_K, control: RoleControl | None = None,
                   slo: SLO | None = None) -> dict:
    """What the simulator predicts for one shift, for a real run of the same scenario
    to be set beside: the off/on ratios of mean TPOT, E2EL and TTFT, the number of
    switches and the layout switching ends in. `modality`: every request carries
    images ("image"), none does ("text"), or none before the shift and all after
    ("text->image")."""
    if modality not in MODALITIES:
        raise ValueError(f"modality {modality!r}: one of {', '.join(MODALITIES)}")
    before_images = images_per_request if modality == "image" else 0
    after_images = 0 if modality == "text" else images_per_request
    scenario = ShiftScenario(f"{modality} {output_before}->{output_after} tokens", requests,
                             rate, shift_at, Phase(output_before, before_images, resolution),
                             Phase(output_after, after_images, resolution))
    result = simulate_role_shift(profile, notation, scenario, slo, control)
    return {**result["ratios"], "switches": len(result["on"]["switches"]),
            "final_layout": result["on"]["final_layout"], "result": result}


def _profile_slo(profile: Profile) -> SLO:
    measured = (profile.measured or {}).get("slo")
    return SLO(**measured) if measured else SLO()


def _pipeline_order(roles: str) -> tuple[int, ...]:
    return tuple("EPD".find(r) for r in roles)


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3
