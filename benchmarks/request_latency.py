"""Start-up time of a deployment and the latency of single requests through it.

Brings up a deployment file (default configs/cpu/e-p-d.yaml), then sends text and
image requests one at a time and prints, per kind, the median end-to-end latency and
the median time of each stage as the proxy reports it (x-epd-stages).

    scripts/in-netns.sh .venv/bin/python benchmarks/request_latency.py [--config ...]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import httpx

from epd_serve.deployment import config

from epd_serve.runtime import deploy
from epd_serve.engines.payloads import chat_body, image_data_url, make_image

STAGE_RE = re.compile(r"(\w+)=(\w+):([\d.]+)ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/cpu/e-p-d.yaml")
    parser.add_argument("--requests", type=int, default=10, help="per kind")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-connector", choices=["epd", "mooncake"],
                        help="override the deployment's KV connector (P -> D hand-off)")
    parser.add_argument("--mm-store", choices=["shm", "mooncake", "file"],
                        help="override the deployment's MM Store backend (E -> P hand-off)")
    args = parser.parse_args()

    overrides = {}
    if args.kv_connector:
        overrides["kv_connector"] = args.kv_connector
    if args.mm_store:
        store = config.load(args.config)[0].mm_store.model_dump()
        overrides["mm_store"] = {**store, "backend": args.mm_store}
    dep = deploy.load(args.config, **overrides)
    cfg = dep.config
    start = time.monotonic()
    launcher = deploy.bring_up(dep)  # as `epd-serve up`: healthy, then one warm-up of each kind
    ready = time.monotonic() - start
    model = dep.launches[0].served_model_name
    try:
        rows = defaultdict(lambda: defaultdict(list))
        with httpx.Client(base_url=dep.proxy_url, timeout=300) as client:
            first = time.perf_counter()
            client.post("/v1/chat/completions", json=chat_body(model, "first", max_tokens=2))
            first_ms = (time.perf_counter() - first) * 1e3
            for i in range(args.requests * 2):
                kind = "image 448x448" if i % 2 else "text"
                images = [image_data_url(make_image(448, 448, seed=500 + i))] if i % 2 else []
                body = chat_body(model, "Describe what you see in detail.", images,
                                 max_tokens=args.max_tokens)
                t = time.perf_counter()
                resp = client.post("/v1/chat/completions", json=body)
                rows[kind]["total"].append((time.perf_counter() - t) * 1e3)
                resp.raise_for_status()
                for stage, _inst, ms in STAGE_RE.findall(resp.headers.get("x-epd-stages", "")):
                    rows[kind][stage].append(float(ms))
    finally:
        launcher.stop()
    store = dep.mm_store.backend if dep.mm_store else "file" if cfg.mm_store.backend == "file" else "-"
    print(f"{cfg.name} ({dep.plan.to_notation()}, KV {dep.launches[0].kv_protocol}, "
          f"MM Store {store}): healthy and "
          f"warmed up after {ready:.1f}s; "
          f"first request after that {first_ms:.0f} ms")
    for kind, stages in rows.items():
        parts = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in stages.items())
        print(f"  {kind} ({args.max_tokens} output tokens), medians in ms of "
              f"{len(stages['total'])}: {parts}")


if __name__ == "__main__":
    main()
