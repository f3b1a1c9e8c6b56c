"""Paper 003's Table 6 (dynamic role switching) in the simulator, per shipped profile.

The workload shifts under a deployment planned for its first phase: 100 requests, one
4K (4032x3024) image each, Poisson arrivals at 3 req/s; the first 10 ask 50 output
tokens, the other 90 ask 500. The deployment is the paper's 5E1P2D with the encoders
and decoders switchable (5E~1P2D~); the simulator runs it with the roles fixed and with
the proxy's role controller on (proxy/role_policy.py's rule, planner/switching.py), and
prints the simulated means beside the paper's, the off/on ratios, and the switches.
The CPU profile runs a 3-instance E~-P~-D~ at a rate that machine holds, scaled down.
A second scenario shifts text-only questions to image-heavy ones (two 4K images each).

    .venv/bin/python benchmarks/role_shift_sim.py [--profile NAME ...] [--overhead-s 0.5]

The last lines, one per profile, are what a real run is checked against:
    predicted: profile=<name> tpot_ratio=<off/on> e2el_ratio=<off/on> switches=<n>
A real benchmark gets the CPU prediction of its own scenario from `cpu_prediction`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from epd_serve.planner import profile as profiles
from epd_serve.planner.role_shift import (TABLE6, TEXT_TO_IMAGE, Phase, ShiftScenario,
                                          predict_ratios, simulate_role_shift)
from epd_serve.planner.switching import RoleControl

# Table 6: mean E2E latency, TTFT, TPOT (s) with switching ("on") and without ("off").
PAPER = {"on": {"e2el": 28.01, "ttft": 1.42, "tpot": 0.05},
         "off": {"e2el": 61.10, "ttft": 1.33, "tpot": 0.12},
         "start": "5E1P2D", "end": "2E1P5D"}
METRICS = (("e2el", "E2E latency"), ("ttft", "TTFT"), ("tpot", "TPOT"))
CPU_PROFILE = "cpu-tiny-qwen2-vl"
CPU_NOTATION = "E~-P~-D~"
# The CPU run, scaled to what the 2-core host holds and to a short run: 40 requests at
# 2 req/s, the first 4 asking 50 tokens, the rest 500; one 640x480 image each. Its one
# encoder can only be given up when idle (the rule's low_load), and 4K images keep it
# busy often enough that whether it switches at all depends on the arrival draw.
CPU_IMAGE = (640, 480)
CPU_TABLE6 = ShiftScenario("table6-cpu", 40, 2.0, 4, Phase(50, resolution=CPU_IMAGE),
                           Phase(500, resolution=CPU_IMAGE))
CPU_TEXT_TO_IMAGE = ShiftScenario("text->image-cpu", 40, 2.0, 12,
                                  Phase(100, images=0, text_words=64.0),
                                  Phase(100, images=2, resolution=CPU_IMAGE))


@dataclasses.dataclass(frozen=True)
class Case:
    """One profile's runs: its deployment and scenarios."""

    profile: str
    notation: str  # the Table 6 deployment
    table6: ShiftScenario
    text_notation: str  # the text -> image deployment: planned for text
    text_to_image: ShiftScenario


CASES = {
    "atlas-800i-a2-openpangu-7b-vl": Case("atlas-800i-a2-openpangu-7b-vl", "5E~1P2D~", TABLE6,
                                          "2E~1P5D~", TEXT_TO_IMAGE),
    "h800-qwen3-vl-8b": Case("h800-qwen3-vl-8b", "5E~1P2D~", TABLE6, "2E~1P5D~", TEXT_TO_IMAGE),
    CPU_PROFILE: Case(CPU_PROFILE, CPU_NOTATION, CPU_TABLE6, CPU_NOTATION, CPU_TEXT_TO_IMAGE),
}


def cpu_prediction(rate: float, requests: int, output_before: int, output_after: int,
                   shift_at: int, image: bool | str = True, notation: str = CPU_NOTATION,
                   resolution: tuple[int, int] = CPU_IMAGE, overhead_s: float = 0.0) -> dict:
    """The CPU profile's prediction for a real run's own shift scenario: {"tpot",
    "e2el", "ttft": off/on ratios of the means (above 1: switching helps), "switches",
    "final_layout", "result": everything}. `image`: True (every request one image),
    False (text only) or "text->image" (text before the shift, an image each after), of
    `resolution`. Import it with benchmarks/ on sys.path (`from role_shift_sim import
    cpu_prediction`), or call epd_serve.planner.role_shift.predict_ratios directly."""
    modality = image if isinstance(image, str) else ("image" if image else "text")
    return predict_ratios(profiles.load(CPU_PROFILE), notation, rate, requests, output_before,
                          output_after, shift_at, modality=modality, resolution=resolution,
                          control=RoleControl(overhead_s=overhead_s))


def describe(scenario: ShiftScenario, profile) -> str:
    def phase(p: Phase) -> str:
        if not p.images:
            return f"text-only, {p.output_tokens} tokens out"
        tokens = profile.image_tokens(*p.resolution)
        return (f"{p.images}x {p.resolution[0]}x{p.resolution[1]} image ({tokens} visual "
                f"tokens each), {p.output_tokens} tokens out")

    return (f"{scenario.requests} requests at {scenario.rate:g} req/s (Poisson); "
            f"requests 0-{scenario.shift_at - 1}: {phase(scenario.before)}; "
            f"from {scenario.shift_at}: {phase(scenario.after)}")


def print_table6(result: dict, with_paper: bool) -> None:
    """The simulated means beside the paper's Table 6, with the off/on ratios."""
    on, off = result["on"]["phases"]["all"], result["off"]["phases"]["all"]
    print(f"  {'mean (s)':<12} {'paper on':>9} {'paper off':>10} {'ratio':>6}   "
          f"{'sim on':>9} {'sim off':>9} {'ratio':>6}")
    for key, label in METRICS:
        sim_on, sim_off = on[f"{key}_s"]["mean"], off[f"{key}_s"]["mean"]
        paper = (f"{PAPER['on'][key]:>9.2f} {PAPER['off'][key]:>10.2f} "
                 f"{PAPER['off'][key] / PAPER['on'][key]:>5.1f}x") if with_paper else " " * 28
        print(f"  {label:<12} {paper}   {sim_on:>9.3f} {sim_off:>9.3f} "
              f"{result['ratios'][key]:>5.2f}x")
    plain = result["plain"]["phases"]["all"]
    print(f"  plain {result['notation'].replace('~', '')} (no ~: encoders run no LM): means "
          + ", ".join(f"{label} {plain[f'{key}_s']['mean']:.3f}" for key, label in METRICS))
    paper_layout = f"paper {PAPER['start']} -> {PAPER['end']}; " if with_paper else ""
    print(f"  layout: {paper_layout}sim {result['on']['start_layout']} -> "
          f"{result['on']['final_layout']} (switching on)")


def print_phases(result: dict) -> None:
    """Per phase and run: p50/p90/mean of TTFT, TPOT, E2EL, and SLO attainment."""
    slo = result["slo"]
    print(f"  per phase (s; SLO TTFT <= {slo['ttft_ms'] / 1e3:g} s, TPOT <= "
          f"{slo['tpot_ms'] / 1e3:g} s):")
    for run in ("off", "on"):
        for phase, m in result[run]["phases"].items():
            cells = "  ".join(
                f"{key} {m[f'{key}_s']['p50']:.3f}/{m[f'{key}_s']['p90']:.3f}/"
                f"{m[f'{key}_s']['mean']:.3f}" for key in ("ttft", "tpot", "e2el"))
            print(f"    {run:<3} {phase:<6} n={m['requests']:<3} {cells}  "
                  f"SLO {m['slo_attainment']:.0%}")
    print("    (each: p50/p90/mean)")


def print_switches(switches: list[dict]) -> None:
    print(f"  switches: {len(switches)}")
    for s in switches:
        drain = s["drained_s"] - s["decided_s"] if s["drained_s"] is not None else float("nan")
        print(f"    t={s['decided_s']:7.2f} s  {s['instance']:<4} {s['source']} -> "
              f"{s['target']}  serving at {s['serving_s']:7.2f} s (drain {drain:.2f} s): "
              f"{s['reason']}")


def run_case(case: Case, control: RoleControl, seed: int, seeds: int,
             max_pixels: int | None = None) -> dict:
    profile = profiles.load(case.profile)
    if max_pixels:  # as a deployment's mm_processor_kwargs would cap every image
        image = profile.image.model_copy(update={"max_pixels": max_pixels})
        profile = profile.model_copy(update={"image": image})
    out = {}
    for key, notation, scenario in (("table6", case.notation, case.table6),
                                    ("text_to_image", case.text_notation, case.text_to_image)):
        print(f"\n== {case.profile}: {notation}, {scenario.name}")
        print(f"  {describe(scenario, profile)}")
        result = simulate_role_shift(profile, notation, scenario, control=control, seed=seed)
        print_table6(result, with_paper=key == "table6")
        print_phases(result)
        print_switches(result["on"]["switches"])
        out[key] = result
    print_seeds(profile, case, control, seeds)
    return out


def print_seeds(profile, case: Case, control: RoleControl, seeds: int) -> None:
    """How much the Table 6 prediction moves with the arrival and image draws."""
    runs = [simulate_role_shift(profile, case.notation, case.table6, control=control, seed=s)
            for s in range(seeds)]
    cells = ", ".join(f"{r['ratios']['tpot']:.2f}/{r['ratios']['e2el']:.2f}/"
                      f"{len(r['on']['switches'])}" for r in runs)
    print(f"\n  {case.table6.name} over seeds 0-{seeds - 1} (tpot ratio/e2el ratio/switches): "
          f"{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", choices=sorted(CASES),
                        help="profiles to run (default: all shipped)")
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--overhead-s", type=float, default=0.0,
                        help="a switch's time from the end of its drain to serving")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=5,
                        help="also run Table 6 over this many seeds, for its spread")
    parser.add_argument("--max-pixels", type=int, help="cap each image at this many pixels "
                        "before it becomes visual tokens (default: each profile's own cap)")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args(argv)
    control = RoleControl(interval_s=args.interval_s, overhead_s=args.overhead_s)
    results = {name: run_case(CASES[name], control, args.seed, args.seeds, args.max_pixels)
               for name in args.profile or list(CASES)}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print()
    for name, result in results.items():
        t6 = result["table6"]
        print(f"predicted: profile={name} tpot_ratio={t6['ratios']['tpot']:.2f} "
              f"e2el_ratio={t6['ratios']['e2el']:.2f} switches={len(t6['on']['switches'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
