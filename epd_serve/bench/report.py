"""Writes a load report: JSON, CSV, PNG plots like the papers' figures, one HTML page.

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
            ax.plot(xs, ys, marker="o", label=label)
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


def write_report(results, out_dir: Path, spec, goodputs: dict | None = None) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    goodputs = goodputs or {}
    spec_dict = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("url",)}

    (out_dir / "results.json").write_text(json.dumps({
        "spec": spec_dict,
        "goodput": goodputs,
        "runs": [{"label": r.label, "rate": r.rate, "summary": r.summary,
                  "requests": [rec.to_row() for rec in r.records]} for r in results],
    }, indent=2))

    with (out_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([title for _, title in SUMMARY_COLUMNS])
        for r in results:
            writer.writerow([_get(r.summary, key) for key, _ in SUMMARY_COLUMNS])
    with (out_dir / "requests.csv").open("w", newline="") as f:
        rows = [{"label": r.label, "rate": r.rate, **rec.to_row()}
                for r in results for rec in r.records]
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    plot_vs_rate(results, out_dir / "vs_rate.png")
    plot_scatter(results, out_dir / "ttft_tpot.png", spec.slo)
    (out_dir / "report.html").write_text(_html(results, out_dir, spec_dict, goodputs))
    return out_dir


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _html(results, out_dir: Path, spec: dict, goodputs: dict) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in SUMMARY_COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(_get(r.summary, k)))}</td>"
                         for k, _ in SUMMARY_COLUMNS) + "</tr>"
        for r in results)
    good = "".join(f"<li>{html.escape(k)}: {_fmt(v)} req/s</li>" for k, v in goodputs.items())
    failures = "".join(
        f"<li>{html.escape(r.label)} @ {r.rate}: {html.escape(json.dumps(r.summary['failure_reasons']))}</li>"
        for r in results if r.summary["failed_requests"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>epd-serve load report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style>
</head><body>
<h1>epd-serve load report</h1>
<p>workload <b>{html.escape(str(spec['workload']))}</b>, arrivals <b>{html.escape(str(spec['process']))}</b>,
{spec['num_requests']} requests per rate, output {spec['output_tokens']} tokens,
SLO TTFT &lt; {spec['slo']['ttft_ms']} ms and 90% of token gaps &lt; {spec['slo']['tpot_ms']} ms.</p>
{f"<h2>Goodput (highest rate with &ge; 90% attainment)</h2><ul>{good}</ul>" if good else ""}
<h2>Summary</h2><table><tr>{head}</tr>{rows}</table>
{f"<h2>Failures</h2><ul>{failures}</ul>" if failures else ""}
<h2>Against request rate</h2>{_img(out_dir / "vs_rate.png")}
<h2>TTFT and TPOT per request</h2>{_img(out_dir / "ttft_tpot.png")}
<p>Raw data: results.json, summary.csv, requests.csv.</p>
</body></html>
"""
