"""How fast can the load generator keep its schedule?

Starts an instant OpenAI-shaped server in its own process, then sends fixed-rate runs of
rising rate (one-token streaming answers) and prints, per rate, the achieved rate and
the send lag (actual minus planned send time). The result is the highest rate whose
p99 send lag stays under 1 ms. Goal: 2000 req/s.

    .venv/bin/python benchmarks/loadgen_bench.py [--seconds 3] [--rates 250,500,...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import time

import httpx
from aiohttp import web

from epd_serve.bench.client import run, run_schedule
from epd_serve.bench.timings import SLO, summarize
from epd_serve.bench.arrivals import fixed

LAG_LIMIT_MS = 1.0


CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
         b'"delta":{"content":"a"}}]}\n\n'
         b'data: {"id":"x","object":"chat.completion.chunk","choices":[],'
         b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
         b"data: [DONE]\n\n")


def instant_server(port: int) -> None:
    """An OpenAI-shaped server that answers every request at once with one token.
    aiohttp.web rather than epd_serve.testing.fake_server (FastAPI): on a two-core machine the
    server shares the cores with the generator, so it must cost as little as possible."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(CHUNK)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument("--rates", default="250,500,1000,1500,2000,2500,3000,4000")
    args = parser.parse_args()

    port = free_port()
    server = multiprocessing.Process(target=instant_server, args=(port,), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": 1, "stream": True}).encode()
        best = None
        print(f"{'target':>8} {'achieved':>9} {'ok':>6} {'lag p50':>8} {'lag p99':>8} {'lag max':>8}")
        for rate in (float(r) for r in args.rates.split(",")):
            n = int(rate * args.seconds)
            records = run(run_schedule(url + "/v1/chat/completions", [body] * n,
                                       fixed(n, rate), [False] * n, timeout_s=60))
            s = summarize(records, SLO(), target_rate=rate)
            lag = s["send_lag_ms"]
            print(f"{rate:8.0f} {s['achieved_rate']:9.1f} {s['success_requests']:6d} "
                  f"{lag['median']:8.3f} {lag['p99']:8.3f} {lag['max']:8.2f}", flush=True)
            if lag["p99"] < LAG_LIMIT_MS and s["failed_requests"] == 0:
                best = rate
        print(f"highest rate with p99 send lag < {LAG_LIMIT_MS} ms: "
              f"{best if best is not None else 'none'} req/s (goal 2000)")
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
