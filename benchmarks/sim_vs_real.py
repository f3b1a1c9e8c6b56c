"""The simulator against the real thing on the CPU backend: the same requests at the
same times, sent by the load tool to a running deployment and fed to the simulator
with a measured profile (with --profile-first, a quick profile of this machine
measured first on the same deployment files). Prints TTFT/TPOT per deployment, rate and run, the
prediction error of each run and of all runs at a rate pooled, how far two real runs
of the same setting are apart, and a summary line.

    scripts/in-netns.sh .venv/bin/python benchmarks/sim_vs_real.py \
        --profile cpu-tiny-qwen2-vl --configs configs/cpu/tp1.yaml configs/cpu/e-p-d.yaml \
        --rates 0.5,1.0 --num-requests 60 --repeats 2 [--profile-first]

A profile from another machine predicts that machine: the run says so (and so does its
report and summary line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from rich.console import Console

from epd_serve.runtime import bringup
from epd_serve.bench import arrivals, runner
from epd_serve.bench.timings import SLO, summarize
from epd_serve.bench.report import write_report
from epd_serve.planner import deployment_profile, profile as profiles, profiler, simulator
METRICS = (("ttft_ms", "median"), ("ttft_ms", "avg"), ("tpot_ms", "median"), ("tpot_ms", "avg"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny-qwen2-vl")
    ap.add_argument("--configs", nargs="+", default=["configs/cpu/tp1.yaml", "configs/cpu/e-p-d.yaml"])
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2, help="real runs per rate, each its own seed")
    ap.add_argument("--workload", default="tiny-mm")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--out", default="results/sim_vs_real")
    ap.add_argument("--profile-first", action="store_true",
                    help="first measure a quick profile of this machine (epd-serve profile "
                         "--quick) on the monolithic and the split file of --configs, and use it")
    args = ap.parse_args()
    console = Console(stderr=True)
    slo = SLO(ttft_ms=2000, tpot_ms=200)
    prof = profiles.load(args.profile)
    if args.profile_first:
        prof, _ = deployment_profile.quick(prof, slo, *_quick_configs(args.configs),
                                           console=console)
    other_machine, machine_line = profiles.machine_note(prof)
    console.print(machine_line, style="bold yellow" if other_machine else None)
    rates = [float(r) for r in args.rates.split(",")]
    rows, real_runs, sim_runs = [], [], []
    for path in args.configs:
        dep = bringup.load(path)
        label = dep.plan.to_notation()
        launcher = bringup.bring_up(dep)
        try:
            for i, rate in enumerate(rates):
                real_records, sim_records = [], []
                for rep in range(args.repeats):
                    # A fresh seed per run: the MM Store must not already hold the images.
                    spec = runner.LoadSpec(
                        url=dep.proxy_url, model=dep.launches[0].served_model_name,
                        workload=args.workload, num_requests=args.num_requests,
                        output_tokens=args.output_tokens, slo=slo, seed=100 + 10 * i + rep,
                        num_devices=dep.plan.num_devices)
                    bodies = runner.Bodies(spec, console)
                    real = runner.run_once(spec, rate, bodies, f"{label} real", console)
                    offsets = arrivals.schedule(spec.process, len(bodies.specs), rate, seed=spec.seed)
                    sim, _ = simulator.simulate(simulator.instances_of(dep.plan), prof, bodies.specs,
                                                offsets, slo, rate, dep.plan.num_devices,
                                                f"{label} simulated")
                    real_runs.append(real)
                    sim_runs.append(sim)
                    rows.append(_row(label, rate, str(rep + 1), real.summary, sim.summary))
                    real_records += real.records
                    sim_records += sim.records
                # All runs at this rate pooled: the number the goal is judged on.
                rows.append(_row(label, rate, "all", summarize(real_records, slo),
                                 summarize(sim_records, slo)))
        finally:
            launcher.stop()
    out = Path(args.out)
    write_report(real_runs + sim_runs, out, dataclasses.replace(spec, url=""),
                 notes=[machine_line])
    (out / "errors.json").write_text(json.dumps(rows, indent=2))
    print(f"{'deployment':10s} {'rate':>5s} {'run':>4s} " + " ".join(
        f"{m}.{s} real/sim/err".rjust(34) for m, s in METRICS))
    for row in rows:
        cells = []
        for metric, stat in METRICS:
            c = row[f"{metric}.{stat}"]
            err = "-" if c["error"] is None else f"{c['error']:+.0%}"
            cells.append(f"{c['real'] or 0:9.1f} {c['simulated'] or 0:9.1f} {err:>6s}".rjust(34))
        print(f"{row['deployment']:10s} {row['rate']:5.2f} {row['run']:>4s} " + " ".join(cells))
    pooled = [r for r in rows if r["run"] == "all"]
    worst = max(abs(r[f"{m}.median"]["error"]) for r in pooled for m in ("ttft_ms", "tpot_ms"))
    # How far two real runs of the same deployment and rate are apart: the floor under
    # any prediction's error on this machine.
    spread = 0.0
    for r in pooled:
        runs = [x for x in rows if x["deployment"] == r["deployment"] and x["rate"] == r["rate"]
                and x["run"] != "all"]
        for m in ("ttft_ms", "tpot_ms"):
            values = [x[f"{m}.median"]["real"] for x in runs]
            if len(values) > 1:
                spread = max(spread, (max(values) - min(values)) / float(np.mean(values)))
    print(f"report: {out}")
    print(machine_line)
    print(f"summary: worst_pooled_median_error={worst:.3f} real_run_to_run_spread={spread:.3f} "
          f"runs={len(rows) - len(pooled)} profile={prof.name} "
          f"profile_machine={'other' if other_machine else 'this'}")


def _quick_configs(paths: list[str]) -> tuple[str, str | None]:
    """The file among `paths` whose engine costs a quick profile measures (one with a
    monolithic instance) and the one whose hand-offs it measures (a split one)."""
    plans = {path: bringup.load(path).plan for path in paths}
    engine = next((p for p, plan in plans.items() if profiler.has_monolithic(plan)), None)
    if engine is None:
        raise SystemExit("--profile-first needs a file with a monolithic instance in --configs "
                         "(e.g. configs/cpu/tp1.yaml)")
    split = next((p for p, plan in plans.items() if profiler.splits_prefill_decode(plan)), None)
    return engine, split


def _row(label: str, rate: float, run: str, real: dict, sim: dict) -> dict:
    row = {"deployment": label, "rate": rate, "run": run}
    for metric, stat in METRICS:
        r, s = real[metric][stat], sim[metric][stat]
        row[f"{metric}.{stat}"] = {"real": r, "simulated": s, "error": (s - r) / r if r else None}
    return row


if __name__ == "__main__":
    main()
