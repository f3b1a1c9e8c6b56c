"""What an encoder that may switch role costs against an encoder-only one, and what a
switch by restart would cost instead.

One deployment, E-E~-PD on the CPU backend: e0 is encoder-only (`--mm-encoder-only`,
no language model, no KV cache), e1 is a switchable E~ (a full engine with kv_both and
ec_both, so it can become P or D by routing alone). Measured on the same host in one
run:
- an encoder hop (the request the proxy sends an encoder: one image, one token) on
  each, on fresh images, interleaved: the full engine also runs the language model's
  prefill of the image's tokens and samples one token;
- each instance's resident memory (its whole process tree);
- a restart of each (SIGKILL, the launcher starts it again, until /health answers):
  what switching by restarting an instance with another role would cost at least,
  against a `~` switch, which is a drain and a table change (benchmarks/role_shift.py).

Run it in a loopback-only network namespace (Mooncake listens everywhere):
    scripts/in-netns.sh .venv/bin/python benchmarks/encoder_kind.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from epd_serve.instances.payloads import image_data_url, make_image

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def encoder_hop(client: httpx.Client, url: str, model: str, seed: int, size: int) -> float:
    """One encoder hop's latency (ms), as the proxy sends it: the image alone, one token."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url",
         "image_url": {"url": image_data_url(make_image(size, size, seed=seed))}}]}]}
    start = time.perf_counter()
    resp = client.post(url + "/v1/chat/completions", json=body)
    resp.raise_for_status()
    return (time.perf_counter() - start) * 1e3


def tree_rss_gib(launcher, name: str) -> float:
    child = next(c for c in launcher.children if c.name == name)
    leader = psutil.Process(child.process.pid)
    return sum(p.memory_info().rss for p in [leader, *leader.children(recursive=True)]) / GIB


def restart_s(launcher, url: str, name: str) -> float:
    """SIGKILL the instance's processes; seconds until the launcher's new one answers."""
    child = next(c for c in launcher.children if c.name == name)
    leader = psutil.Process(child.process.pid)
    procs = [leader, *leader.children(recursive=True)]
    start = time.monotonic()
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    while True:
        launcher.supervise_once()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        print(f"  {name} restarting: {time.monotonic() - start:.0f} s", end="\r", flush=True)
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=16, help="encoder hops per instance")
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    args = ap.parse_args()
    from epd_serve.models.tinymodel import build_tiny_model
    from epd_serve.runtime import bringup

    work = Path(tempfile.mkdtemp(prefix="encoder-kind-"))
    model = build_tiny_model("qwen2_vl", work / "tiny-qwen2-vl")
    dep = bringup.load(REPO / "configs/cpu/e-p-d.yaml", model=str(model), tiny_model=None,
                       deployment="E-E~-PD", work_dir=str(work / "dep"))
    launcher = bringup.bring_up(dep)
    try:
        urls = {l.name: l.url for l in dep.launches}
        served = dep.launches[0].served_model_name
        kinds = {"e0": "encoder-only", "e1": "full (E~)"}
        hops: dict[str, list[float]] = {name: [] for name in kinds}
        with httpx.Client(timeout=300) as client:
            for name in kinds:  # warm-up: the first request pays one-off costs
                encoder_hop(client, urls[name], served, 1, args.size)
            for i in range(args.images):
                for name in (kinds if i % 2 == 0 else list(kinds)[::-1]):
                    seed = 1000 + 2 * i + (name == "e1")  # fresh images: nothing stored
                    hops[name].append(encoder_hop(client, urls[name], served, seed, args.size))
        rss = {name: tree_rss_gib(launcher, name) for name in kinds}
        restarts = {}
        for name in kinds:
            restarts[name] = restart_s(launcher, urls[name], name)
            print(f"  {name} back after {restarts[name]:.1f} s" + " " * 20)
    finally:
        launcher.stop()
    print(f"\n{args.images} encoder hops of {args.size}x{args.size} images each, CPU backend")
    print(f"{'instance':<20} {'hop p50 ms':>10} {'hop p90 ms':>10} {'RSS GiB':>8} {'restart s':>9}")
    for name, kind in kinds.items():
        ordered = sorted(hops[name])
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(f"{name} {kind:<17} {statistics.median(hops[name]):10.1f} {p90:10.1f} "
              f"{rss[name]:8.2f} {restarts[name]:9.1f}")
    ratio = statistics.median(hops["e1"]) / statistics.median(hops["e0"])
    print(f"summary: e_hop_ms_encoder_only={statistics.median(hops['e0']):.1f} "
          f"e_hop_ms_full={statistics.median(hops['e1']):.1f} full_over_encoder_only={ratio:.2f} "
          f"rss_gib_encoder_only={rss['e0']:.2f} rss_gib_full={rss['e1']:.2f} "
          f"restart_s_encoder_only={restarts['e0']:.1f} restart_s_full={restarts['e1']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
