"""Writes a load report: JSON, CSV, PNG plots like the papers' figures, one HTML page.
Every run's row is followed by one row per modality it held (text, image, video), and
goodput is given per modality too. Runs against the epd-serve proxy also get a
per-stage breakdown (E, P, D, KV hand-off) from its x-epd-stages header: a table per
run and stages.png; and, from the requests' timelines, where the median request's time
goes (parts.png, one waterfall per run).

Runs in the bench process; matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import html
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from epd_serve.bench import waterfall  # noqa: E402
from epd_serve.bench.stages import KV_TIMINGS, STAGES  # noqa: E402
from epd_serve.bench.timings import GOODPUT_ATTAINMENT  # noqa: E402

SUMMARY_COLUMNS = [
    ("label", "deployment"), ("rate", "rate (req/s)"), ("success_requests", "ok"),
    ("failed_requests", "failed"), ("slo_attainment", "SLO attainment"),
    ("request_throughput", "req/s"), ("output_token_throughput", "out tok/s"),
    ("effective_throughput", "effective tok/s"), ("ttft_ms.median", "TTFT p50 ms"),
    ("ttft_ms.p99", "TTFT p99 ms"), ("tpot_ms.median", "TPOT p50 ms"),
    ("tpot_ms.p99", "TPOT p99 ms"), ("itl_ms.median", "ITL p50 ms"),
    ("e2el_ms.median", "E2EL p50 ms"), ("achieved_rate", "achieved rate"),
    ("send_lag_ms.p99", "send lag p99 ms"),
]
# summary.csv only (blank for runs without the proxy's header); the HTML page shows the
# full breakdown in its own section instead of widening the summary table.
STAGE_COLUMNS = [
    *((f"stage_breakdown.stages.{s}.p50_ms", f"{s} p50 ms") for s in ("E", "P", "D", "PD")),
    ("stage_breakdown.kv.transfer_ms.p50_ms", "KV transfer p50 ms"),
    ("stage_breakdown.kv.exposed_ms.p50_ms", "KV exposed p50 ms"),
]


def _get(summary: dict, dotted: str):
    value = summary
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def summary_rows(results) -> list[dict]:
    """Each run's summary, then one per modality it held, labelled `label [video]`
    (keyed as the run's own, so the same columns read it)."""
    rows = []
    for r in results:
        rows.append(r.summary)
        for modality, m in (r.summary.get("by_modality") or {}).items():
            rows.append({**m, "label": f"{r.label or 'run'} [{modality}]", "rate": r.rate})
    return rows


def modality_goodputs(results, goodputs: dict) -> dict[str, dict[str, float | None]]:
    """Per deployment with a goodput, per modality: the highest rate run at which that
    modality's requests met the SLO at least 90% of the time (None: none did)."""
    out: dict[str, dict[str, float | None]] = {}
    for label in goodputs:
        runs = [r for r in results if r.label == label and r.rate is not None]
        modalities = dict.fromkeys(m for r in runs for m in r.summary.get("by_modality") or {})
        out[label] = {m: max((r.rate for r in runs if (r.summary["by_modality"].get(m) or {})
                              .get("slo_attainment", 0.0) >= GOODPUT_ATTAINMENT), default=None)
                      for m in modalities}
    return out


def _series(results) -> dict[str, list]:
    by_label: dict[str, list] = defaultdict(list)
    for r in results:
        if r.rate is not None:
            by_label[r.label or "run"].append(r)
    return {label: sorted(runs, key=lambda r: r.rate) for label, runs in by_label.items()}


def plot_vs_rate(results, path: Path) -> None:
    """Four panels like the papers' figures: attainment, throughput, TTFT, TPOT vs the
    per-device request rate, one line per deployment."""
    panels = [
        ("slo_attainment", "SLO attainment", 100.0, "%"),
        ("per_device.output_token_throughput", "output throughput per device", 1.0, "tok/s"),
        ("ttft_ms.median", "TTFT (median)", 1.0, "ms"),
        ("tpot_ms.median", "TPOT (median)", 1.0, "ms"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (key, title, scale, unit) in zip(axes, panels):
        for label, runs in _series(results).items():
            xs = [r.summary["per_device"]["request_rate"] for r in runs]
            ys = [(_get(r.summary, key) or 0.0) * scale for r in runs]
            line, = ax.plot(xs, ys, marker="o", label=label)
            if key.startswith("per_device"):
                continue  # throughput per modality does not compare across kinds
            for style, modality in zip(("--", ":", "-."), _mixed_modalities(runs)):
                ys = [(_get(r.summary["by_modality"].get(modality) or {}, key) or 0.0) * scale
                      for r in runs]
                ax.plot(xs, ys, linestyle=style, marker=".", color=line.get_color(),
                        label=f"{label} [{modality}]")
        ax.set_title(title)
        ax.set_xlabel("request rate per device (req/s)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].axhline(90, color="grey", linestyle="--", linewidth=1)
    axes[0].set_ylim(0, 105)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mixed_modalities(runs) -> list[str]:
    """The modalities of runs that held more than one (a single kind's line would only
    repeat the run's)."""
    found = dict.fromkeys(m for r in runs for m in r.summary.get("by_modality") or {})
    return list(found) if len(found) > 1 else []


def plot_scatter(results, path: Path, slo) -> None:
    """TTFT vs TPOT of every successful request, one colour per deployment."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, runs in _series(results).items():
        pts = [(rec.ttft * 1e3, rec.tpot * 1e3) for r in runs for rec in r.records
               if rec.ok and rec.tpot is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, s=10, alpha=0.6, label=label)
    ax.axvline(slo.ttft_ms, color="grey", linestyle="--", linewidth=1)
    ax.axhline(slo.tpot_ms, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("per-request TTFT / TPOT (dashed: SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_name(r) -> str:
    return f"{r.label or 'run'} @ {r.rate if r.rate is not None else '-'}"


def _stage_series(breakdown: dict) -> dict[str, dict]:
    """Bar name -> timing stats: each stage seen, then the KV hand-off's two timings."""
    series = dict(breakdown["stages"])
    kv = breakdown.get("kv") or {}
    for key in KV_TIMINGS:
        if kv.get(key, {}).get("count"):
            series[f"KV {key.removesuffix('_ms')}"] = kv[key]
    return series


def plot_stages(results, path: Path) -> bool:
    """Grouped bars of per-stage mean and p50 ms, one group per run. Bars, not a stack:
    prefill and decode overlap in time, so the stages do not add up to the latency.
    Returns False (and writes nothing) when no run carried the proxy's header."""
    runs = [r for r in results if r.summary.get("stage_breakdown")]
    if not runs:
        return False
    per_run = [_stage_series(r.summary["stage_breakdown"]) for r in runs]
    present = {name for series in per_run for name in series}
    names = [name for name in (*STAGES, *(f"KV {k.removesuffix('_ms')}" for k in KV_TIMINGS))
             if name in present]  # pipeline order in every group
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(runs) + 4), 4.2))
    width = 0.8 / len(names)
    for ax, (key, title) in zip(axes, (("mean_ms", "per-stage mean"), ("p50_ms", "per-stage p50"))):
        for i, name in enumerate(names):
            xs = [j - 0.4 + width * (i + 0.5) for j in range(len(runs))]
            ys = [(series.get(name) or {}).get(key) or 0.0 for series in per_run]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([_run_name(r) for r in runs], rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(results, out_dir: Path, spec, goodputs: dict | None = None,
                 notes: list[str] | None = None) -> Path:
    """results.json, summary.csv, requests.csv, the plots and report.html of these runs;
    `notes` (e.g. which machine a simulation's profile describes) head the report."""
    out_dir = Path(out_dir)
    notes = notes or []
    out_dir.mkdir(parents=True, exist_ok=True)
    goodputs = goodputs or {}
    spec_dict = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("url",)}

    (out_dir / "results.json").write_text(json.dumps({
        "spec": spec_dict,
        "notes": notes,
        "goodput": goodputs,
        "goodput_by_modality": modality_goodputs(results, goodputs),
        "runs": [{"label": r.label, "rate": r.rate, "summary": r.summary,
                  "requests": [rec.to_row() for rec in r.records]} for r in results],
    }, indent=2))

    with (out_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        columns = SUMMARY_COLUMNS + STAGE_COLUMNS
        writer.writerow([title for _, title in columns])
        for row in summary_rows(results):
            writer.writerow([_get(row, key) for key, _ in columns])
    with (out_dir / "requests.csv").open("w", newline="") as f:
        rows = [{"label": r.label, "rate": r.rate, **rec.to_row()}
                for r in results for rec in r.records]
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    plot_vs_rate(results, out_dir / "vs_rate.png")
    plot_scatter(results, out_dir / "ttft_tpot.png", spec.slo)
    stages_png = out_dir / "stages.png"
    stages_png.unlink(missing_ok=True)  # a rerun into the same folder must not show stale bars
    plot_stages(results, stages_png)
    plot_timelines(results, out_dir)
    (out_dir / "report.html").write_text(_html(results, out_dir, spec_dict, goodputs, notes))
    return out_dir


def _timed(results) -> list:
    return [r for r in results if (r.summary.get("timelines") or {}).get("median_parts")]


def plot_timelines(results, out_dir: Path) -> None:
    """parts.png (each run's median parts) and one waterfall of each run's median
    request, for runs whose requests went through our proxy; stale ones removed."""
    for old in out_dir.glob("timeline_*.png"):
        old.unlink()
    (out_dir / "parts.png").unlink(missing_ok=True)
    timed = _timed(results)
    if not timed:
        return
    waterfall.plot_parts([(_run_name(r), r.summary["timelines"]["median_parts"])
                         for r in timed], out_dir / "parts.png")
    for i, r in enumerate(timed):
        waterfall.plot(r.summary["timelines"]["median_request"], out_dir / f"timeline_{i}.png")


def timeline_section(results, out_dir: Path) -> str:
    """Where the median request's time goes, from the requests' timelines."""
    timed = _timed(results)
    if not timed:
        return ""
    names = sorted({k for r in timed for k in r.summary["timelines"]["median_parts"]},
                   key=waterfall.part_order)
    head = "<th>part (ms, median)</th>" + "".join(
        f"<th>{html.escape(_run_name(r))}</th>" for r in timed)
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td>" + "".join(
            f"<td>{_fmt(r.summary['timelines']['median_parts'].get(n))}</td>" for r in timed)
        + "</tr>" for n in names)
    counts = "; ".join(
        f"{_run_name(r)}: {t['found']} of {t['requests']} timelines read, "
        f"{t['with_engine_spans']} with engine spans"
        for r in timed for t in [r.summary["timelines"]])
    waterfalls = "".join(
        f"<h3>median request of {html.escape(_run_name(r))} req/s</h3>"
        f"{_img(out_dir / f'timeline_{i}.png')}" for i, r in enumerate(timed))
    return ("<h2>Where the median request's time goes (request timelines)</h2>"
            "<p>Each hop as the proxy timed it; inside it the engine's own phases (vLLM's "
            "request span) and what the engine did not account for (HTTP, the API "
            f"server, the answer's way back). {html.escape(counts)}.</p>"
            f"<table><tr>{head}</tr>{rows}</table>{_img(out_dir / 'parts.png')}{waterfalls}")


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _instances(stage: dict) -> str:
    served = ", ".join(f"{name} {i['share']:.0%} ({i['served']})"
                       for name, i in stage["instances"].items() if i["served"])
    failed = ", ".join(f"{name} {i['failed']}" for name, i in stage["instances"].items()
                       if i["failed"])
    return served + (f"; failed: {failed}" if failed else "")


def stage_tables(results) -> str:
    """The HTML per-stage section: one table per run that carried the header."""
    head = "".join(f"<th>{t}</th>" for t in (
        "stage", "requests", "timed", "mean ms", "p50 ms", "p99 ms", "failed attempts",
        "instances (share, requests served)"))
    out = []
    for r in results:
        breakdown = r.summary.get("stage_breakdown")
        if not breakdown:
            continue
        rows = []
        for name, st in _stage_series(breakdown).items():
            cells = [name, st.get("requests", "-"), st["count"], st["mean_ms"], st["p50_ms"],
                     st["p99_ms"], st.get("failed_attempts", "-"),
                     _instances(st) if "instances" in st else "-"]
            rows.append("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in cells) + "</tr>")
        notes = [f"{breakdown['requests']} requests carried the header"]
        if breakdown.get("kv"):
            kv = breakdown["kv"]
            outcomes = ", ".join(f"{k} {v}" for k, v in kv["outcomes"].items())
            notes.append(f"KV hand-off: {outcomes}, mean {_fmt(kv['mean_bytes'])} bytes")
        if breakdown.get("images"):
            notes.append("images travelled as: " + ", ".join(
                f"{k} {v}" for k, v in breakdown["images"].items()))
        out.append(f"<h3>{html.escape(_run_name(r))} req/s</h3>"
                   f"<p>{html.escape('; '.join(notes))}.</p>"
                   f"<table><tr>{head}</tr>{''.join(rows)}</table>")
    return "".join(out)


def _modality_goodput(per_modality: dict[str, float | None]) -> str:
    """` (text 4.000, video 1.000 req/s)`: the rates each modality's requests held."""
    if not per_modality:
        return ""
    return " (" + ", ".join(f"{html.escape(m)} {_fmt(v)}" for m, v in per_modality.items()) + " req/s)"


def _html(results, out_dir: Path, spec: dict, goodputs: dict, notes: list[str]) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in SUMMARY_COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(_get(row, k)))}</td>"
                         for k, _ in SUMMARY_COLUMNS) + "</tr>"
        for row in summary_rows(results))
    breakdown = stage_tables(results)
    if breakdown:
        breakdown = ("<h2>Per stage (from the proxy's x-epd-stages header)</h2>"
                     "<p>A retried stage's time includes its failed attempts; a stage still "
                     "streaming when headers were sent is counted but not timed.</p>"
                     f"{breakdown}{_img(out_dir / 'stages.png')}")
    per_modality = modality_goodputs(results, goodputs)
    good = "".join(f"<li>{html.escape(k)}: {_fmt(v)} req/s{_modality_goodput(per_modality[k])}</li>"
                   for k, v in goodputs.items())
    failures = "".join(
        f"<li>{html.escape(r.label)} @ {r.rate}: {html.escape(json.dumps(r.summary['failure_reasons']))}</li>"
        for r in results if r.summary["failed_requests"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>epd-serve load report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style>
</head><body>
<h1>epd-serve load report</h1>
{"".join(f'<p style="background:#fff3cd;padding:6px">{html.escape(n)}</p>' for n in notes)}
<p>workload <b>{html.escape(str(spec['workload']))}</b>, arrivals <b>{html.escape(str(spec['process']))}</b>,
{spec['num_requests']} requests per rate, output {spec['output_tokens']} tokens,
SLO TTFT &lt; {spec['slo']['ttft_ms']} ms and 90% of token gaps &lt; {spec['slo']['tpot_ms']} ms.</p>
{f"<h2>Goodput (highest rate with &ge; 90% attainment)</h2><ul>{good}</ul>" if good else ""}
<h2>Summary</h2><table><tr>{head}</tr>{rows}</table>
{f"<h2>Failures</h2><ul>{failures}</ul>" if failures else ""}
<h2>Against request rate</h2>{_img(out_dir / "vs_rate.png")}
<h2>TTFT and TPOT per request</h2>{_img(out_dir / "ttft_tpot.png")}
{breakdown}
{timeline_section(results, out_dir)}
<p>Raw data: results.json, summary.csv, requests.csv.</p>
</body></html>
"""
