"""Load runs, rate sweeps, goodput search and deployment comparison.

Runs in the `epd-serve bench` process: builds the requests, drives the load generator
(client.py) with live progress, and turns records into summaries (metrics.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from epd_serve.bench import arrivals, client, workloads

from epd_serve.bench import waterfall
from epd_serve.bench.timings import GOODPUT_ATTAINMENT, SLO, RequestRecord, summarize
from epd_serve.bench.search import largest_passing


@dataclasses.dataclass
class LoadSpec:
    """Everything that defines one load run except the rate."""

    url: str  # base URL of an OpenAI-compatible server
    model: str
    workload: str = "sharegpt4o"
    num_requests: int = 100
    output_tokens: int | None = 64
    process: str = "poisson"
    burstiness: float = 1.0
    end_rate: float | None = None
    trace: str | None = None
    speedup: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0
    slo: SLO = dataclasses.field(default_factory=SLO)
    num_devices: int = 1
    # Sent with every request: the deployment's API key, and its admin key where the
    # proxy shows which stages served a request to the operator only (the per-stage
    # report reads them). Never printed nor written into a report.
    headers: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)


@dataclasses.dataclass
class RunResult:
    label: str  # deployment name
    rate: float | None
    summary: dict
    records: list[RequestRecord]


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


class Bodies:
    """Request bodies built once per (workload, model) and reused across rates."""

    def __init__(self, spec: LoadSpec, console: Console):
        self.specs = workloads.load_workload(spec.workload, spec.num_requests, spec.output_tokens,
                                             spec.seed)
        with _progress(console) as progress:
            task = progress.add_task("building requests", total=len(self.specs))
            self.bodies = list(workloads.build_bodies(
                self.specs, spec.model, spec.ignore_eos, lambda: progress.advance(task)))
        self.modalities = [s.modality for s in self.specs]


def run_once(spec: LoadSpec, rate: float | None, bodies: Bodies, label: str = "",
             console: Console | None = None) -> RunResult:
    console = console or Console(stderr=True)
    offsets = arrivals.schedule(spec.process, len(bodies.bodies), rate,
                                burstiness=spec.burstiness, end_rate=spec.end_rate,
                                trace=spec.trace, speedup=spec.speedup, seed=spec.seed)
    n = min(len(offsets), len(bodies.bodies))
    url = spec.url.rstrip("/") + "/v1/chat/completions"
    with _progress(console) as progress:
        what = f"{label} " if label else ""
        task = progress.add_task(f"{what}rate {rate if rate is not None else spec.process}",
                                 total=n)
        records = client.run(client.run_schedule(
            url, bodies.bodies[:n], offsets[:n], bodies.modalities[:n],
            spec.max_concurrency, spec.timeout_s,
            on_done=lambda rec: progress.advance(task), headers=spec.headers))
    summary = summarize(records, spec.slo, spec.num_devices, rate)
    summary.update({"label": label, "rate": rate, "process": spec.process,
                    "workload": spec.workload})
    # Through our proxy: where the time of the run's requests went, from their timelines.
    summary["timelines"] = waterfall.collect(spec.url, [r for r in records if r.ok],
                                             headers=spec.headers)
    console.print(_one_line(label, rate, summary))
    for line in modality_lines(summary):
        console.print(line)
    return RunResult(label, rate, summary, records)


def _one_line(label: str, rate: float | None, s: dict) -> str:
    ttft, tpot = s["ttft_ms"]["median"], s["tpot_ms"]["median"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return (f"{label or 'run'} @ {rate} req/s: {s['success_requests']}/{s['total_requests']} ok, "
            f"TTFT p50 {fmt(ttft)} ms, TPOT p50 {fmt(tpot)} ms, "
            f"SLO attainment {s['slo_attainment']:.0%}, "
            f"{s['output_token_throughput']:.1f} out tok/s{_tail(s)}"
            f"{_stage_line(s.get('stage_breakdown'))}")


def modality_lines(s: dict) -> list[str]:
    """One line per modality of the run: `  video: 9/10 ok, TTFT p50 812.0 ms, ...`."""
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return [f"  {modality}: {m['success_requests']}/{m['total_requests']} ok, "
            f"TTFT p50 {fmt(m['ttft_ms']['median'])} ms, TPOT p50 {fmt(m['tpot_ms']['median'])} ms, "
            f"ITL p50 {fmt(m['itl_ms']['median'])} ms, E2EL p50 {fmt(m['e2el_ms']['median'])} ms, "
            f"SLO attainment {m['slo_attainment']:.0%}"
            for modality, m in (s.get("by_modality") or {}).items()]


def _tail(s: dict) -> str:
    """`; slowest request 1.4x the median E2EL (text 1.2x, multimodal 1.3x)`."""
    tail = s.get("slowest_over_median") or {}
    if tail.get("all") is None:
        return ""
    kinds = ", ".join(f"{kind} {tail[kind]:.2f}x" for kind in ("text", "multimodal")
                      if tail.get(kind) is not None)
    return f"; slowest request {tail['all']:.2f}x the median E2EL ({kinds})"


def _stage_line(breakdown: dict | None) -> str:
    """`; stage p50 E 12.3, P 40.1 ms` for runs through the proxy, else nothing."""
    if not breakdown:
        return ""
    timed = [f"{name} {st['p50_ms']:.1f}" for name, st in breakdown["stages"].items()
             if st["p50_ms"] is not None]
    return f"; stage p50 {', '.join(timed)} ms" if timed else ""


def sweep(spec: LoadSpec, rates: list[float], label: str = "",
          console: Console | None = None, bodies: Bodies | None = None) -> list[RunResult]:
    console = console or Console(stderr=True)
    bodies = bodies or Bodies(spec, console)
    return [run_once(spec, rate, bodies, label, console) for rate in rates]


def find_goodput(spec: LoadSpec, low: float, high: float, iterations: int = 5,
                 label: str = "", console: Console | None = None,
                 bodies: Bodies | None = None) -> tuple[float | None, list[RunResult]]:
    """Binary search for the highest rate whose SLO attainment is >= 90%.
    Returns (goodput or None when even `low` misses, every run made)."""
    console = console or Console(stderr=True)
    bodies = bodies or Bodies(spec, console)
    runs = []

    def passes(rate: float) -> bool:
        result = run_once(spec, rate, bodies, label, console)
        runs.append(result)
        return result.summary["slo_attainment"] >= GOODPUT_ATTAINMENT

    return largest_passing(passes, low, high, iterations=iterations), runs


def deployment_headers(dep) -> dict[str, str]:
    """What the deployment's own tools send its proxy: its first API key and the admin
    key, each from the environment variable its file names (where set)."""
    from epd_serve.proxy.tenancy import ADMIN_KEY_HEADER, own_key

    proxy = dep.config.proxy
    headers = {}
    api_key = own_key(proxy.api_key_env)
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    admin_key = os.environ.get(proxy.admin_key_env) if proxy.admin_key_env else None
    if admin_key:
        headers[ADMIN_KEY_HEADER] = admin_key
    return headers


def compare_deployments(config_paths: list[str], spec: LoadSpec, rates: list[float],
                        out_dir: Path, goodput: tuple[float, float] | None = None,
                        console: Console | None = None) -> Path:
    """Bring each deployment up with the launcher, run the same workload, tear it down;
    write one report for all of them."""
    from epd_serve.bench.report import write_report
    from epd_serve.runtime import bringup

    results, goodputs = compare_resolved([bringup.load(p) for p in config_paths], spec, rates,
                                         goodput, console)
    return write_report(results, out_dir, spec, goodputs)


def compare_resolved(deps: list, spec: LoadSpec, rates: list[float],
                     goodput: tuple[float, float] | None = None,
                     console: Console | None = None) -> tuple[list[RunResult], dict]:
    """compare_deployments on loaded deployments: (every run, goodput per deployment)."""
    from epd_serve.runtime import bringup
    console = console or Console(stderr=True)
    results: list[RunResult] = []
    goodputs: dict[str, float | None] = {}
    for dep in deps:
        label = f"{dep.config.name} ({dep.plan.to_notation()})"
        run_spec = dataclasses.replace(
            spec, url=dep.proxy_url, model=dep.launches[0].served_model_name,
            num_devices=dep.plan.num_devices, headers=deployment_headers(dep))
        console.rule(label)
        launcher = bringup.bring_up(dep)
        try:
            bodies = Bodies(run_spec, console)
            results += sweep(run_spec, rates, label, console, bodies)
            if goodput:
                value, runs = find_goodput(run_spec, goodput[0], goodput[1], label=label,
                                           console=console, bodies=bodies)
                goodputs[label] = value
        finally:
            launcher.stop()
    return results, goodputs


def quick_report(dep, requests: int, out_dir: Path) -> tuple[Path, int]:
    """The demo's short load: two rates against a running deployment, full report.
    Returns the report's folder and how many requests failed."""
    from epd_serve.bench.report import write_report

    spec = LoadSpec(url=dep.proxy_url, model=dep.launches[0].served_model_name,
                    workload="tiny-mm", num_requests=max(2, requests // 2), output_tokens=16,
                    process="poisson", num_devices=dep.plan.num_devices,
                    slo=SLO(ttft_ms=2000, tpot_ms=200), headers=deployment_headers(dep))
    label = f"{dep.config.name} ({dep.plan.to_notation()})"
    results = sweep(spec, [0.25, 0.5], label)  # what two CPU cores serve without queueing
    failed = sum(r.summary["total_requests"] - r.summary["success_requests"] for r in results)
    return write_report(results, out_dir, spec), failed
