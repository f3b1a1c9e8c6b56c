"""The P -> D KV hand-off, measured like paper 004's Table 4.

Builds a 28-layer tiny Qwen2-VL (as deep as Qwen2-VL-7B, 256 wide), brings up 1P1D on
the CPU backend with our connector and sends the same prompt lengths through the proxy
in each transfer mode (`whole`, `layer`, `group`), then brings up 1P1D with vLLM's
MooncakeConnector and sends the same prompts; and times the raw transfer engine
writing the same number of bytes in one piece. Per mode and length, medians of
`--repeats` requests (after one warm-up), each prompt unique so no cache answers:

- KV latency: time the link spent on the request's KV (ours: union of the writes'
  submit-to-completion intervals; vLLM's: decode's pull, request to completion);
- exposed: KV transfer time not hidden behind the prefill forward pass (ours: the
  last write's completion after the pass ended; vLLM's: all of it, see hand-off);
- hand-off: from the end of prefill's forward pass until decode's engine knows the KV
  is there (wall clocks of two processes on one host);
- prefill: the prefill request's time as the proxy saw it;
- overlap = 1 - exposed / KV latency; bandwidth = KV bytes / KV latency.

Ends with one line:
  summary: group_overlap_min=<pct> bandwidth_vs_raw=<pct> exposed_vs_vllm=<ratio>
(lowest group overlap over the lengths; lowest group bandwidth as % of the raw engine's
for the same bytes; our group hand-off divided by vLLM's at 2048 tokens).

    scripts/in-netns.sh .venv/bin/python benchmarks/kv_transfer_bench.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from epd_serve.runtime import bringup
from epd_serve.models.tinymodel import Shape, build_tiny_model, is_model_dir

REPO = Path(__file__).resolve().parents[1]
MODES = ("whole", "layer", "group")
TIMING_RE = re.compile(r"epd-kv-timing role=(\w+) request=(\S+) (.*)")
STAGE_RE = re.compile(r"(\w+)=(\w+):([\d.]+)ms")


def model_dir(layers: int) -> Path:
    path = REPO / ".epd" / "models" / f"tiny-qwen2-vl-{layers}l"
    if not is_model_dir(path):
        build_tiny_model("qwen2_vl", path, shape=Shape(layers=layers))
    return path


# -- the raw transfer engine --------------------------------------------------------
def _peer(size: int, ready, stop) -> None:
    from epd_serve.connectors.epd_kv.transfer import Link

    link = Link("127.0.0.1")
    buffer = np.zeros(size, dtype=np.uint8)
    link.register([(buffer.ctypes.data, size)])
    ready.put((link.session_id, buffer.ctypes.data))
    stop.wait()


def raw_bandwidth(sizes: list[int], repeats: int = 7) -> dict[int, float]:
    """Bytes per second of one-segment writes of each size, loopback, best conditions."""
    from epd_serve.connectors.epd_kv.transfer import Link

    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    peer = context.Process(target=_peer, args=(max(sizes), ready, stop), daemon=True)
    peer.start()
    try:
        session, remote = ready.get(timeout=60)
        link = Link("127.0.0.1")
        source = np.ones(max(sizes), dtype=np.uint8)
        link.register([(source.ctypes.data, source.nbytes)])
        result = {}
        for size in sizes:
            times = []
            for i in range(repeats + 2):
                start = time.perf_counter()
                link.write(session, [source.ctypes.data], [remote], [size])
                if i >= 2:  # the first writes pay the handshake
                    times.append(time.perf_counter() - start)
            result[size] = size / statistics.median(times)
        return result
    finally:
        stop.set()
        peer.join(timeout=10)


# -- requests through a deployment ----------------------------------------------------
def prompt(length: int, seed: int) -> list[int]:
    """Token ids inside the tiny model's vocabulary; a new seed, a new prompt."""
    return np.random.default_rng(seed).integers(10, 1300, size=length).tolist()


def send(client: httpx.Client, dep, length: int, seed: int, mode: str | None) -> dict:
    body = {"model": dep.launches[0].served_model_name, "prompt": prompt(length, seed),
            "max_tokens": 2, "ignore_eos": True}
    if mode:
        body["kv_transfer_params"] = {"epd_mode": mode}
    resp = client.post(dep.proxy_url + "/v1/completions", json=body)
    resp.raise_for_status()
    stages = {stage: float(ms) for stage, _, ms in STAGE_RE.findall(resp.headers["x-epd-stages"])}
    report = (resp.json().get("kv_transfer_params") or {}).get("epd_kv") or {}
    return {"request_id": resp.headers["x-request-id"], "prefill_ms": stages.get("P"),
            "usage": resp.json()["usage"], **report}


def run_ours(args, console: Console) -> dict:
    rows: dict[tuple[str, int], list[dict]] = {}
    dep = bringup.load(REPO / "configs/cpu/p-d.yaml", **common_overrides(args, "epd"))
    launcher = bringup.bring_up(dep)
    try:
        with httpx.Client(timeout=600) as client:
            seed = 1000
            for length in args.lengths:
                for mode in MODES:
                    runs = []
                    for rep in range(args.repeats + 1):
                        seed += 1
                        result = send(client, dep, length, seed, mode)
                        if result.get("outcome") != "done":
                            console.print(f"[red]{mode} {length}: transfer {result}")
                        if rep:  # the first of each kind warms it up
                            runs.append(result)
                    rows[(mode, length)] = runs
                    console.print(f"epd {mode:>5} {length:>5} tokens: "
                                  + describe(summarise_ours(runs)))
    finally:
        launcher.stop()
    return rows


def run_vllm(args, console: Console) -> dict:
    rows: dict[int, list[dict]] = {}
    dep = bringup.load(REPO / "configs/cpu/p-d.yaml", **common_overrides(args, "mooncake"))
    launcher = bringup.bring_up(dep)
    sent: dict[int, list[dict]] = {}
    try:
        with httpx.Client(timeout=600) as client:
            seed = 5000
            for length in args.lengths:
                sent[length] = []
                for rep in range(args.repeats + 1):
                    seed += 1
                    result = send(client, dep, length, seed, None)
                    if rep:
                        sent[length].append(result)
        time.sleep(1.0)  # the last log lines
        timings = read_timings(dep)
    finally:
        launcher.stop()
    for length, results in sent.items():
        rows[length] = []
        for result in results:
            rid = result["request_id"]
            prefill = next((t for k, t in timings["prefill"].items() if rid in k), None)
            decode = next((t for k, t in timings["decode"].items() if rid in k), None)
            if prefill is None or decode is None or not decode["ok"]:
                console.print(f"[red]vLLM {length}: no complete timing for {rid}")
                continue
            rows[length].append({**result,
                                 "transfer_ms": (decode["ready"] - decode["recv_start"]) * 1e3,
                                 "handoff_ms": (decode["ready"] - prefill["forward_end"]) * 1e3})
        console.print(f"vLLM mooncake {length:>5} tokens: {len(rows[length])} timed")
    return rows


def common_overrides(args, connector: str) -> dict:
    return {"model": str(model_dir(args.layers)), "tiny_model": None, "kv_connector": connector,
            "kv_connector_config": {} if connector != "epd" else {"mode": "group"},
            "max_model_len": max(args.lengths) + 64,
            "engine_args": {"limit_mm_per_prompt": '{"image":1,"video":0}',
                            "max_num_batched_tokens": max(args.lengths) + 64},
            "work_dir": str(REPO / ".epd" / f"kv-bench-{connector}")}


def read_timings(dep) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {"prefill": {}, "decode": {}}
    for launch in dep.launches:
        text = (dep.work_dir / "logs" / f"{launch.name}.log").read_text(errors="replace")
        for role, request, rest in TIMING_RE.findall(text):
            fields = dict(item.split("=") for item in rest.split())
            out[role][request] = {k: float(v) for k, v in fields.items()}
    return out


# -- summaries --------------------------------------------------------------------------
def summarise_ours(runs: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {
        "kv_ms": med("transfer_ms"), "exposed_ms": med("exposed_ms"),
        "handoff_ms": med("handoff_ms"), "prefill_ms": med("prefill_ms"),
        "overlap": statistics.median(1 - r["exposed_ms"] / r["transfer_ms"] for r in runs),
        "gbps": statistics.median(r["bytes"] / r["transfer_ms"] / 1e6 for r in runs),
        "bytes": runs[0]["bytes"], "groups": med("groups"),
    }


def summarise_vllm(runs: list[dict], nbytes: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {
        "kv_ms": med("transfer_ms"), "exposed_ms": med("handoff_ms"),
        "handoff_ms": med("handoff_ms"), "prefill_ms": med("prefill_ms"),
        "overlap": statistics.median(max(0.0, 1 - r["handoff_ms"] / r["transfer_ms"])
                                     for r in runs),
        "gbps": statistics.median(nbytes / r["transfer_ms"] / 1e6 for r in runs),
        "bytes": nbytes, "groups": 1,
    }


def describe(row: dict) -> str:
    return (f"KV {row['kv_ms']:.2f} ms, exposed {row['exposed_ms']:.2f} ms, hand-off "
            f"{row['handoff_ms']:.2f} ms, prefill {row['prefill_ms']:.0f} ms, overlap "
            f"{row['overlap'] * 100:.2f}%, {row['gbps']:.2f} GB/s")


def plot(table: dict, raw: dict, lengths: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [*MODES, "vllm"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(methods)
    x = np.arange(len(lengths))
    for i, method in enumerate(methods):
        rows = [table[(method, n)] for n in lengths]
        label = f"epd {method}" if method != "vllm" else "vLLM MooncakeConnector"
        axes[0].bar(x + i * width, [r["handoff_ms"] for r in rows], width, label=label)
        axes[1].bar(x + i * width, [r["overlap"] * 100 for r in rows], width, label=label)
        axes[2].bar(x + i * width, [r["gbps"] for r in rows], width, label=label)
    axes[2].plot(x + 0.4 - width / 2, [raw[table[("group", n)]["bytes"]] / 1e9 for n in lengths],
                 "k_", markersize=40, label="raw transfer engine")
    titles = ("hand-off after prefill (ms, log)", "overlap with prefill (%)",
              "bandwidth (GB/s)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xticks(x + 0.4 - width / 2, [f"{n} tok" for n in lengths])
    axes[0].set_yscale("log")
    fig.legend(*axes[2].get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8)
    fig.suptitle("P -> D KV hand-off, 28-layer tiny Qwen2-VL, 1P1D on 2 CPU cores")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--out", default="results/kv_transfer")
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    console = Console()

    ours = run_ours(args, console)
    vllm = run_vllm(args, console)
    table = {(mode, n): summarise_ours(ours[(mode, n)]) for mode in MODES for n in args.lengths}
    for n in args.lengths:
        if not vllm[n]:
            console.print(f"[red]no timed vLLM request at {n} tokens")
            return 1
        table[("vllm", n)] = summarise_vllm(vllm[n], table[("group", n)]["bytes"])
    raw = raw_bandwidth(sorted({table[("group", n)]["bytes"] for n in args.lengths}))

    view = Table(title="P -> D KV hand-off (paper 004, Table 4), medians of "
                       f"{args.repeats} requests, {args.layers} layers")
    for column in ("input", "method", "KV latency ms", "exposed ms", "hand-off ms",
                   "prefill ms", "overlap", "bandwidth GB/s", "raw engine GB/s", "writes"):
        view.add_column(column, justify="right")
    for n in args.lengths:
        for method in (*MODES, "vllm"):
            row = table[(method, n)]
            view.add_row(str(n), method if method != "vllm" else "vLLM mooncake",
                         f"{row['kv_ms']:.2f}", f"{row['exposed_ms']:.2f}",
                         f"{row['handoff_ms']:.2f}", f"{row['prefill_ms']:.0f}",
                         f"{row['overlap'] * 100:.2f}%", f"{row['gbps']:.2f}",
                         f"{raw[row['bytes']] / 1e9:.2f}", f"{row['groups']:.0f}")
    console.print(view)
    plot(table, raw, args.lengths, out / "kv_transfer.png")
    (out / "results.json").write_text(json.dumps({
        "table": {f"{m}/{n}": row for (m, n), row in table.items()},
        "raw_bytes_per_s": {str(k): v for k, v in raw.items()},
        "requests": {"epd": {f"{m}/{n}": runs for (m, n), runs in ours.items()},
                     "vllm": {str(n): runs for n, runs in vllm.items()}}}, indent=2))
    console.print(f"table, plot and raw requests in {out}")

    overlap_min = min(table[("group", n)]["overlap"] for n in args.lengths)
    bandwidth = min(table[("group", n)]["gbps"] * 1e9 / raw[table[("group", n)]["bytes"]]
                    for n in args.lengths)
    ref = 2048 if 2048 in args.lengths else args.lengths[len(args.lengths) // 2]
    ratio = table[("group", ref)]["handoff_ms"] / table[("vllm", ref)]["handoff_ms"]
    print(f"summary: group_overlap_min={overlap_min * 100:.2f}% "
          f"bandwidth_vs_raw={bandwidth * 100:.1f}% exposed_vs_vllm={ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
