"""Cross-check the load tool's timings against the server's own metrics.

Brings up a deployment (default: the monolithic CPU TP1, so the server's histograms
cover the whole request), runs one load through our generator, and compares, over the
same requests, our mean TTFT / TPOT / ITL / E2EL with the means of vLLM's Prometheus
histograms (sum / count deltas). Prints both and the relative difference.

    scripts/in-netns.sh .venv/bin/python benchmarks/crosscheck_vllm_metrics.py
"""

from __future__ import annotations

import argparse

import httpx
import numpy as np

from epd_serve.runtime import bringup
from epd_serve.bench.timings import SLO
from epd_serve.bench.runner import Bodies, LoadSpec, run_once
from epd_serve.instances.counters import parse_prometheus

PAIRS = [  # (our number, vLLM histogram)
    ("TTFT", "vllm:time_to_first_token_seconds"),
    ("TPOT", "vllm:request_time_per_output_token_seconds"),
    ("ITL", "vllm:inter_token_latency_seconds"),
    ("E2EL", "vllm:e2e_request_latency_seconds"),
]


def histogram_means(url: str) -> dict[str, tuple[float, float]]:
    values = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    return {name: (values.get(name + "_sum", 0.0), values.get(name + "_count", 0.0))
            for _, name in PAIRS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/cpu/tp1.yaml")
    parser.add_argument("--workload", default="tiny-mm")
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--direct", action="store_true",
                        help="load the engine itself instead of the proxy in front of it")
    args = parser.parse_args()

    dep = bringup.load(args.config)
    cfg = dep.config
    engine = dep.launches[-1]  # the instance that produces the tokens
    launcher = bringup.bring_up(dep)
    try:
        spec = LoadSpec(url=engine.url if args.direct else dep.proxy_url, model=engine.served_model_name,
                        workload=args.workload, num_requests=args.num_requests,
                        output_tokens=args.output_tokens, process="poisson", slo=SLO())
        from rich.console import Console

        bodies = Bodies(spec, Console(stderr=True))
        before = histogram_means(engine.url)
        result = run_once(spec, args.rate, bodies, cfg.name)
        import time

        time.sleep(1.0)  # let the engine publish its last counters
        after = histogram_means(engine.url)
    finally:
        launcher.stop()

    ok = [r for r in result.records if r.ok]
    ours = {
        "TTFT": np.mean([r.ttft for r in ok]),
        "TPOT": np.mean([r.tpot for r in ok if r.tpot is not None]),
        "ITL": np.mean([g for r in ok for g in r.itls[1:]]),  # [0] is the role chunk gap
        "E2EL": np.mean([r.e2el for r in ok]),
    }
    target = "engine directly" if args.direct else "through the proxy"
    print(f"{cfg.name} ({target}), workload {args.workload}: {len(ok)}/{len(result.records)} "
          f"requests ok, rate {args.rate} req/s")
    print(f"{'metric':6} {'ours ms':>9} {'vLLM ms':>9} {'diff':>7}  (vLLM samples)")
    for ours_name, hist in PAIRS:
        total = after[hist][0] - before[hist][0]
        count = after[hist][1] - before[hist][1]
        server = total / count if count else float("nan")
        diff = (ours[ours_name] - server) / server
        print(f"{ours_name:6} {ours[ours_name] * 1e3:9.2f} {server * 1e3:9.2f} {diff:+7.1%}  ({count:.0f})")


if __name__ == "__main__":
    main()
