"""Who uses the CPU while each hop of a request computes, on a host the instances share.

Brings up one deployment, sends a few unmeasured requests, then text and image
requests one at a time, while every process of the deployment has its CPU time
sampled every 2 ms (epd_serve/bench/cpu_share.py). Reads each request's timeline and
prints, per kind and engine phase (E prefill, P prefill, D queue: decode waiting for
the KV, D decode, PD prefill...), its median length and the CPU each process used
inside it (ms, mean over the requests): the instance computing, and everyone else
running beside it. Also as a plot (results/hop_cpu/hop_cpu.png). Where request_latency.py
shows a hop slower than the same work in one instance, this shows what ran inside it.

    scripts/in-netns.sh .venv/bin/python benchmarks/hop_cpu.py \
        [--config configs/cpu/e-p-d.yaml] [--requests 12] [--out results/hop_cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import matplotlib
import numpy as np
import psutil

from epd_serve.bench import waterfall
from epd_serve.bench.cpu_share import CpuSampler, cpu_within, phase_windows
from epd_serve.bench.runner import deployment_headers
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime import bringup

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = ("text", "image")
UNMEASURED = 3  # requests per kind before the measured ones
PAUSE_S = 0.3  # between requests: each arrives at an idle deployment
ENGINE_PROCESSES = {"VLLM::EngineCore": "engine core", "VLLM::Worker": "worker"}
OUR_SERVICES = ("proxy", "mmstore")  # one group each, whatever they run
SHOWN_MS = 1.0  # a process using less inside a phase is left out of the table


def process_groups(launcher) -> dict[str, list[int]]:
    """The deployment's processes by what they are: each instance's API server, engine
    core and worker (`p0 worker`), the proxy, the store; an instance's other children
    (resource trackers) count with its API server."""
    groups: dict[str, list[int]] = defaultdict(list)
    for child in launcher.children:
        if child.process is None:
            continue
        leader = psutil.Process(child.process.pid)
        for proc in [leader, *leader.children(recursive=True)]:
            role = _role(proc)
            name = child.name if role == "api" and child.name in OUR_SERVICES \
                else f"{child.name} {role}"
            groups[name].append(proc.pid)
    return dict(groups)


def _role(proc: psutil.Process) -> str:
    try:
        name = proc.name()
    except psutil.Error:
        return "api"
    # The kernel keeps 15 characters of a process's name: VLLM::EngineCor.
    return next((role for prefix, role in ENGINE_PROCESSES.items()
                 if name.startswith(prefix[:15])), "api")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/cpu/e-p-d.yaml")
    parser.add_argument("--requests", type=int, default=12, help="measured, per kind")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("results/hop_cpu"))
    args = parser.parse_args()

    dep = bringup.load(args.config)
    launcher = bringup.bring_up(dep)
    model = dep.launches[0].served_model_name
    cores = os.cpu_count() or 1
    try:
        groups = process_groups(launcher)
        with httpx.Client(base_url=dep.proxy_url, timeout=300,
                          headers=deployment_headers(dep)) as client:
            def send(kind: str, seed: int) -> str:
                # A new image every time: one seen before would skip its encoder.
                images = [image_data_url(make_image(448, 448, seed=seed))] \
                    if kind == "image" else []
                resp = client.post("/v1/chat/completions", json=chat_body(
                    model, "Describe what you see in detail.", images,
                    max_tokens=args.max_tokens))
                resp.raise_for_status()
                return resp.headers.get("x-epd-trace-id", "")

            for i in range(UNMEASURED):
                for kind in KINDS:
                    send(kind, 90_000 + i)
            traced: dict[str, list[str]] = defaultdict(list)
            with CpuSampler(groups) as sampler:
                for i in range(args.requests):
                    for kind in KINDS:
                        traced[kind].append(send(kind, 100_000 + i))
                        time.sleep(PAUSE_S)
            time.sleep(waterfall.SPANS_SETTLE_S)  # the engines' last spans
            timelines = {kind: [found.json() for found in
                                (client.get(f"/v1/traces/{t}") for t in ids if t)
                                if found.status_code == 200]
                         for kind, ids in traced.items()}
    finally:
        launcher.stop()
    if not any(timelines.values()):
        sys.exit("no timeline readable (stage_headers: operator needs the admin key in "
                 "EPD_ADMIN_KEY)")

    times, cumulative = sampler.samples()
    names = sampler.names
    print(f"{dep.config.name} ({dep.plan.to_notation()}), {cores} CPUs, CPU sampled every "
          f"{sampler.every_s * 1e3:.0f} ms ({len(times)} samples)")
    results = []  # (kind, phase, median wall ms, mean CPU ms per group)
    for kind in KINDS:
        walls: dict[str, list[float]] = defaultdict(list)
        used: dict[str, list[np.ndarray]] = defaultdict(list)
        for timeline in timelines[kind]:
            for phase, start, end in phase_windows(timeline):
                walls[phase].append((end - start) / 1e6)
                used[phase].append(cpu_within(times, cumulative, start, end))
        print(f"{kind} requests ({len(timelines[kind])}): CPU ms used inside each phase, "
              f"mean per request")
        for phase in walls:
            wall = statistics.median(walls[phase])
            cpu = np.mean(used[phase], axis=0)
            results.append((kind, phase, wall, cpu))
            shown = sorted(((ms, name) for ms, name in zip(cpu, names) if ms >= SHOWN_MS),
                           reverse=True)
            print(f"  {phase:12s} {wall:7.1f} ms long, {cores * wall:6.0f} CPU-ms there: "
                  + ", ".join(f"{name} {ms:.1f}" for ms, name in shown)
                  + f"; idle {max(0.0, cores * wall - cpu.sum()):.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"plot: {plot(results, names, cores, args.out / 'hop_cpu.png')}")


def plot(results: list, names: list[str], cores: int, path: Path) -> Path:
    """One bar per kind and phase: each process's CPU inside it, stacked, beside the
    CPU time the host had there (its length times the cores)."""
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(results) + 2))
    labels = [f"{kind}: {phase}" for kind, phase, _, _ in results][::-1]
    rows = results[::-1]
    left = np.zeros(len(rows))
    colors = plt.get_cmap("tab20")
    for g, name in enumerate(names):
        widths = np.array([cpu[g] for _, _, _, cpu in rows])
        if widths.max(initial=0) < SHOWN_MS:
            continue
        ax.barh(labels, widths, left=left, color=colors(g % 20), label=name)
        left += widths
    ax.scatter([cores * wall for _, _, wall, _ in rows], labels, marker="|", s=300,
               color="black", label=f"phase length x {cores} CPUs")
    ax.set_xlabel("CPU ms inside the phase (mean over the requests)")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
