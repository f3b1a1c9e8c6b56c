"""`epd-serve plan --verify`: bring the planner's top launchable candidates up for real
from a base deployment file, run the load tool on them with the requests the planner
simulated, and say whether the real runs rank them as the planner did.

Runs in the CLI process; deployments start one at a time (bringup.bring_up).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console

from epd_serve.bench.report import write_report
from epd_serve.planner.planner import Plan, recommended_engine_args, run_key


def verify(plan: Plan, base_config: str, spec, out_dir: Path, top: int, rate: float | None,
           console: Console) -> bool:
    from epd_serve.bench.runner import compare_resolved
    from epd_serve.runtime import bringup

    chosen = [ev for ev in plan.evaluations if ev.candidate.launchable][:top]
    if len(chosen) < 2:
        raise ValueError("verifying a ranking needs two launchable candidates")
    base = bringup.load(base_config)
    deps = []
    for rank, ev in enumerate(chosen, 1):
        args = {**base.config.role_engine_args}
        for stage, flags in recommended_engine_args(ev).items():
            args[stage] = {**args.get(stage, {}), **flags}
        deps.append(bringup.load(base_config, deployment=ev.candidate.notation,
                                name=f"{base.config.name}-plan{rank}", role_engine_args=args))
    real, _ = compare_resolved(deps, dataclasses.replace(spec, num_devices=plan.best.candidate.devices),
                               [rate if rate is not None else plan.rate], console=console)
    simulated = [ev.at_rate for ev in chosen]
    write_report(real + [dataclasses.replace(r, label=f"{r.label} (simulated)") for r in simulated],
                 out_dir, spec)
    planned = [ev.candidate.notation for ev in chosen]
    measured = [planned[i] for i in sorted(range(len(chosen)), key=lambda i: run_key(real[i].summary),
                                           reverse=True)]
    for ev, run in zip(chosen, real):
        sim, got = ev.at_rate.summary, run.summary
        console.print(f"{ev.candidate.notation}: SLO attainment real {got['slo_attainment']:.0%} "
                      f"/ simulated {sim['slo_attainment']:.0%}; TTFT p50 real "
                      f"{got['ttft_ms']['median']:.1f} / simulated {sim['ttft_ms']['median']:.1f} ms; "
                      f"TPOT p50 real {got['tpot_ms']['median'] or 0:.1f} / simulated "
                      f"{sim['tpot_ms']['median'] or 0:.1f} ms")
    agreed = measured == planned
    print(f"planner ranking: {' > '.join(planned)}; load tool: {' > '.join(measured)} -> "
          f"{'agrees' if agreed else 'DISAGREES'}")
    print(f"verification report: {out_dir}")
    return agreed
