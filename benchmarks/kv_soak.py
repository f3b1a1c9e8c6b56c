"""Soak the P -> D KV hand-off: many requests at a steady rate through E-P-D.

Brings up configs/cpu/e-p-d.yaml (our KV connector unless --kv-connector says
otherwise), sends `--requests` requests at a fixed rate, alternating text and 448x448
image requests, and prints what each KV transfer took: for our connector the time the
link spent on it and the hand-off after prefill (decode's own report), for vLLM's
MooncakeConnector decode's pull (from its timing log). The line to read:

  soak: requests=N ok=N transfers=N max_transfer_ms=X over_1s=N max_handoff_ms=X
        handoff_over_1s=N failed_transfers=N

    scripts/in-netns.sh .venv/bin/python benchmarks/kv_soak.py [--requests 500 --rate 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.progress import Progress

from epd_serve.runtime import bringup
from epd_serve.instances.payloads import chat_body, image_data_url, make_image

REPO = Path(__file__).resolve().parents[1]
TIMING_RE = re.compile(r"epd-kv-timing role=decode request=(\S+) recv_start=([\d.]+) "
                       r"ready=([\d.]+) ok=(\d)")


async def soak(dep, requests: int, rate: float, max_tokens: int) -> list[dict]:
    model = dep.launches[0].served_model_name
    images = [image_data_url(make_image(448, 448, seed=9000 + i)) for i in range(requests // 2 + 1)]
    results: list[dict] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = chat_body(model, f"Request {i}: describe it.",
                         [images[i // 2]] if i % 2 else [], max_tokens=max_tokens)
        start = time.perf_counter()
        try:
            resp = await client.post(dep.proxy_url + "/v1/chat/completions", json=body)
            ok = resp.status_code == 200
            kv = (resp.json().get("kv_transfer_params") or {}).get("epd_kv") if ok else None
            results.append({"i": i, "ok": ok, "status": resp.status_code, "kv": kv,
                            "request_id": resp.headers.get("x-request-id"),
                            "latency_s": time.perf_counter() - start})
        except httpx.HTTPError as err:
            results.append({"i": i, "ok": False, "status": type(err).__name__, "kv": None,
                            "latency_s": time.perf_counter() - start})
        progress.advance(task)

    with Progress() as progress:
        task = progress.add_task(f"{requests} requests at {rate}/s", total=requests)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
            tasks, begin = [], time.perf_counter()
            for i in range(requests):
                await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
                tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.gather(*tasks)
    return sorted(results, key=lambda r: r["i"])


def vllm_transfer_times(dep, results: list[dict]) -> None:
    """vLLM's connector reports nothing in the answer: read decode's timing log."""
    text = "".join((dep.work_dir / "logs" / f"{l.name}.log").read_text(errors="replace")
                   for l in dep.launches if l.instance.roles == "D")
    pulls = {rid: (float(ready) - float(start), ok == "1")
             for rid, start, ready, ok in TIMING_RE.findall(text)}
    for result in results:
        match = next((v for k, v in pulls.items() if result.get("request_id") and result["request_id"] in k), None)
        if match:
            result["kv"] = {"transfer_ms": match[0] * 1e3, "handoff_ms": match[0] * 1e3,
                            "outcome": "done" if match[1] else "failed"}


def summarise(name: str, results: list[dict], out: Path) -> bool:
    """Print the run's numbers; True when every request succeeded."""
    kv = [r["kv"] for r in results if r["kv"]]
    transfer = [k["transfer_ms"] for k in kv if "transfer_ms" in k]
    handoff = [k["handoff_ms"] for k in kv if "handoff_ms" in k]
    latency = [r["latency_s"] for r in results if r["ok"]]
    print(f"{name}: latency p50 {statistics.median(latency) * 1e3:.0f} ms, "
          f"max {max(latency) * 1e3:.0f} ms; transfer p50 {statistics.median(transfer):.2f} ms, "
          f"hand-off after prefill p50 {statistics.median(handoff):.2f} ms; details in {out}")
    # The transfer: the KV in flight, first write to last landing. The hand-off adds
    # the wait for decode to reserve its blocks (its own parsing of the request).
    print(f"soak: requests={len(results)} ok={len(latency)} transfers={len(kv)} "
          f"max_transfer_ms={max(transfer, default=0):.1f} "
          f"over_1s={sum(1 for t in transfer if t > 1000)} "
          f"max_handoff_ms={max(handoff, default=0):.1f} "
          f"handoff_over_1s={sum(1 for t in handoff if t > 1000)} "
          f"failed_transfers={sum(1 for k in kv if k.get('outcome') != 'done')}")
    return len(latency) == len(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-connector", default="epd", choices=["epd", "mooncake"])
    parser.add_argument("--out", default="results/kv_soak")
    parser.add_argument("--summarise", metavar="JSON",
                        help="print the numbers of a saved run instead of running one")
    args = parser.parse_args()
    out = REPO / args.out
    if args.summarise:
        return 0 if summarise(Path(args.summarise).stem, json.loads(Path(args.summarise).read_text()),
                              out) else 1

    dep = bringup.load(REPO / "configs/cpu/e-p-d.yaml", kv_connector=args.kv_connector,
                      work_dir=str(REPO / ".epd" / f"kv-soak-{args.kv_connector}"))
    launcher = bringup.bring_up(dep)
    try:
        results = asyncio.run(soak(dep, args.requests, args.rate, args.max_tokens))
        time.sleep(1.0)
        if args.kv_connector == "mooncake":
            vllm_transfer_times(dep, results)
    finally:
        launcher.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.kv_connector}.json").write_text(json.dumps(results, indent=1))
    return 0 if summarise(args.kv_connector, results, out) else 1


if __name__ == "__main__":
    sys.exit(main())
