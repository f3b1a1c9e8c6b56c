"""What `epd-serve plan` shows and writes: the per-candidate table, plan.png, plan.json
and, for the candidates' simulated runs, the load tool's own report (so the simulated
runs read like `bench compare`). Runs in the CLI process; matplotlib with Agg."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

from epd_serve.planner.planner import Plan, recommended_engine_args  # noqa: E402


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def goodput_text(ev) -> str:
    if ev.goodput is None:
        return "< lowest"
    return f"{'>=' if ev.goodput_capped else ''}{ev.goodput:.2f}"


def table(plan: Plan) -> Table:
    t = Table(title=f"candidates at {plan.rate:.2f} req/s, SLO TTFT {plan.slo.ttft_ms:.0f} ms / "
                    f"TPOT {plan.slo.tpot_ms:.0f} ms (simulated)")
    for col in ("rank", "deployment", "form", "devices", "goodput req/s", "SLO attainment",
                "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms", "note"):
        t.add_column(col, justify="left" if col in ("deployment", "form", "note") else "right")
    for rank, ev in enumerate(plan.evaluations, 1):
        s = ev.at_rate.summary
        t.add_row(str(rank), ev.candidate.notation, ev.candidate.form, str(ev.candidate.devices),
                  goodput_text(ev), f"{s['slo_attainment']:.1%}", _ms(s["ttft_ms"]["median"]),
                  _ms(s["ttft_ms"]["p90"]), _ms(s["tpot_ms"]["median"]), _ms(s["tpot_ms"]["p90"]),
                  "" if ev.candidate.launchable else "simulated only")
    return t


def recommendation(plan: Plan) -> str:
    launchable = [ev for ev in plan.evaluations if ev.candidate.launchable]
    best = launchable[0] if launchable else plan.best
    s = best.at_rate.summary
    lines = [f"recommended: {best.candidate.notation} ({best.candidate.form}, "
             f"{best.candidate.devices} devices): goodput {goodput_text(best)} req/s, "
             f"{s['slo_attainment']:.1%} of requests within the SLO at {plan.rate:.2f} req/s"]
    if best is not plan.best:
        lines.append(f"(the top candidate {plan.best.candidate.notation} cannot run on our "
                     "engines; see the table)")
    flags = recommended_engine_args(best)
    lines.append("role_engine_args: " + json.dumps(flags, sort_keys=True))
    return "\n".join(lines)


def plot(plan: Plan, path: Path) -> Path:
    """Goodput per candidate, and TTFT/TPOT p50 against the SLO at the trace's rate."""
    evs = plan.evaluations
    names = [ev.candidate.notation for ev in evs]
    colors = ["tab:green" if i == 0 else "tab:blue" if ev.candidate.launchable else "tab:gray"
              for i, ev in enumerate(evs)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [
        ("goodput (req/s, 90% within SLO)", [ev.goodput or 0.0 for ev in evs], None),
        ("TTFT p50 (ms) at the trace's rate",
         [ev.at_rate.summary["ttft_ms"]["median"] or 0.0 for ev in evs], plan.slo.ttft_ms),
        ("TPOT p50 (ms) at the trace's rate",
         [ev.at_rate.summary["tpot_ms"]["median"] or 0.0 for ev in evs], plan.slo.tpot_ms),
    ]
    for ax, (title, values, slo_line) in zip(axes, panels):
        ax.barh(range(len(evs)), values, color=colors)
        ax.set_yticks(range(len(evs)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        if slo_line is not None:
            ax.axvline(slo_line, color="red", linestyle="--", linewidth=1, label="SLO")
            ax.legend(fontsize=8)
    fig.suptitle(f"epd-serve plan: {plan.best.candidate.devices} devices, "
                 f"{plan.rate:.2f} req/s (green: best; grey: simulated only)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(plan: Plan, out_dir: Path, load_spec, notes: list[str] | None = None) -> Path:
    """plan.json, plan.png and the simulated runs' load report under out_dir; `notes`
    (which machine the profile describes) in both."""
    from epd_serve.bench.report import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.json").write_text(json.dumps({
        "notes": notes or [],
        "rate": plan.rate, "slo": dataclasses.asdict(plan.slo),
        "stage_work": dataclasses.asdict(plan.work),
        "candidates": [{
            "rank": rank, "notation": ev.candidate.notation, "form": ev.candidate.form,
            "devices": ev.candidate.devices, "counts": ev.candidate.counts,
            "launchable": ev.candidate.launchable, "goodput": ev.goodput,
            "goodput_capped": ev.goodput_capped,
            "role_engine_args": recommended_engine_args(ev), "instances": ev.instances,
            "summary": {k: v for k, v in ev.at_rate.summary.items() if k != "instances"},
        } for rank, ev in enumerate(plan.evaluations, 1)],
    }, indent=2, default=str))
    plot(plan, out_dir / "plan.png")
    write_report([ev.at_rate for ev in plan.evaluations], out_dir / "simulated", load_spec,
                 notes=notes)
    return out_dir
