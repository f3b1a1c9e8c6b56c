"""CPU per hop of the proxy's hop client (proxy/hop_client.py) against aiohttp's client.

Starts one fake instance (`epd_serve.testing.fake_server --forget-requests`, which
answers at once) and sends it the same chat completion (max_tokens 4) from this
process with each client in turn, `--concurrency` at a time, A B A B: requests per
second and this process's CPU time per request (time.process_time), which is what each
hop costs the proxy's one process. The fake shares the cores, so read the CPU column,
not the rate, and ratios inside one run.

Ends with one line:
  summary: hop_client_cpu_ms=<ms> aiohttp_cpu_ms=<ms> cpu_ratio=<hop client / aiohttp>

    .venv/bin/python benchmarks/hop_client_bench.py [--requests 4000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import uvloop

from epd_serve.proxy.hop_client import HopClient, Origin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import Children, free_port, wait_healthy  # noqa: E402

PATH = "/v1/chat/completions"
BODY = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hello there"}],
                   "max_tokens": 4}).encode()
HEADERS = {"content-type": "application/json", "X-Request-Id": "0" * 32}


async def measure(kind: str, url: str, requests: int, concurrency: int) -> tuple[float, float]:
    """(requests per second, CPU ms per request) of one client."""
    if kind == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        auto_decompress=False)

        async def one() -> bytes:
            async with session.post(url + PATH, data=BODY, headers=HEADERS) as resp:
                return await resp.read()
    else:
        hops, origin = HopClient(), Origin(url)

        async def one() -> bytes:
            resp = await hops.post(origin, PATH, BODY, HEADERS)
            body = await resp.read()
            resp.release()
            return body

    for _ in range(concurrency):  # connections opened before the clock starts
        await one()
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if kind == "aiohttp":
        await session.close()
    else:
        hops.close()
    return requests / wall, cpu * 1e3 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    children = Children(Path(tempfile.mkdtemp(prefix="hop-client-bench-")))
    cpu: dict[str, list[float]] = {"hop_client": [], "aiohttp": []}
    try:
        fake = children.start("fake", [sys.executable, "-m", "epd_serve.testing.fake_server",
                                       "--forget-requests", "--port", str(port)])
        wait_healthy(url, fake, children, "fake")
        for round_ in range(args.rounds):
            for kind in cpu:
                rate, ms = uvloop.run(measure(kind, url, args.requests, args.concurrency))
                cpu[kind].append(ms)
                print(f"round {round_ + 1} {kind:10s} {rate:7.0f} req/s  "
                      f"{ms:.3f} ms CPU per request", flush=True)
    finally:
        children.stop_all()
    ours, theirs = statistics.median(cpu["hop_client"]), statistics.median(cpu["aiohttp"])
    print(f"summary: hop_client_cpu_ms={ours:.3f} aiohttp_cpu_ms={theirs:.3f} "
          f"cpu_ratio={ours / theirs:.2f}")


if __name__ == "__main__":
    main()
