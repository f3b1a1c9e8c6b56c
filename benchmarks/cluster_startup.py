"""Start-up of E-P-D on one host against E-P-D on three Ray nodes (a local Ray cluster
on this machine), alternating, and the first requests of each.

For each round: bring up configs/cpu/e-p-d.yaml (child processes, no Ray), then
configs/cpu/ray-e-p-d.yaml (three raylets, one actor per process); time until every
process is healthy, until warmed up, then one text and one image request; stop.

    scripts/in-netns.sh .venv/bin/python benchmarks/cluster_startup.py [--rounds 2]

Last line:
  summary: ray_vs_host_healthy=<ratio> host_healthy_s=<s> ray_healthy_s=<s>
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from epd_serve.runtime import bringup
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime.progress import warm_up

CONFIGS = {"one host": "configs/cpu/e-p-d.yaml", "three Ray nodes": "configs/cpu/ray-e-p-d.yaml"}


def one_run(path: str, seed: int) -> dict[str, float]:
    dep = bringup.load(path)
    bringup.ensure_model(dep)
    launcher = bringup.launcher_for(dep)
    start = time.monotonic()
    try:
        launcher.start()  # Ray: the local cluster, placement groups and actors
        launcher.wait_healthy()
        healthy = time.monotonic() - start
        warm_up(dep, operator_token=launcher.internal_token)
        warmed = time.monotonic() - start
        model = dep.launches[0].served_model_name
        times = {}
        with httpx.Client(base_url=dep.proxy_url, timeout=300) as client:
            for kind, images in (("text", []), ("image", [image_data_url(make_image(448, 448, seed))])):
                t = time.perf_counter()
                resp = client.post("/v1/chat/completions",
                                   json=chat_body(model, "Describe.", images, max_tokens=16))
                resp.raise_for_status()
                times[kind] = (time.perf_counter() - t) * 1e3
    finally:
        launcher.stop()
    return {"healthy_s": healthy, "warmed_s": warmed, "text_ms": times["text"],
            "image_ms": times["image"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds):
        for name, path in CONFIGS.items():
            print(f"round {round_ + 1}/{args.rounds}: {name} ({path}) ...", flush=True)
            run = one_run(path, seed=900 + round_)
            results[name].append(run)
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()), flush=True)
    print("\nmedian over rounds")
    print(f"{'deployment':<16} {'healthy s':>10} {'warmed s':>10} {'text ms':>9} {'image ms':>9}")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:<16} {med['healthy_s']:>10.1f} {med['warmed_s']:>10.1f} "
              f"{med['text_ms']:>9.0f} {med['image_ms']:>9.0f}")
    one, ray = ([statistics.median(r["healthy_s"] for r in results[n]) for n in CONFIGS])
    print(f"\nsummary: ray_vs_host_healthy={ray / one:.2f}x host_healthy_s={one:.1f} "
          f"ray_healthy_s={ray:.1f}")


if __name__ == "__main__":
    main()
