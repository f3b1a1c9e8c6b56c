"""Paper 003's Table 6 experiment scaled to the CPU backend: a workload that shifts
while the deployment serves, with the role controller off and on, on the same three
switchable instances (E~-P~-D~), in the order off, on, off, on.

Two scenarios: the output length shifts (the first tenth of the requests 40 tokens,
the rest ten times longer, one image each: Table 6's 50 -> 500), and the mix shifts
from text-only with long answers (decode-heavy) to two images each with short ones
(encoder-heavy). Each run sends the same requests at the same fixed rate; before each the
roles are put back as they started. Per run and phase (before / after the shift): TTFT,
TPOT and E2EL p50/p90 and SLO attainment; every switch with its time from decision to
serving; requests lost (no 200) and answers that differ from one instance alone
(greedy: a full engine given no hand-off parameters is a monolithic one; compared by
tokens and top-5 log-probs, epd_serve.instances.answers). Then the
planner's simulator's prediction for the CPU profile, and one summary line.

Run it in a loopback-only network namespace (Mooncake listens everywhere):
    scripts/in-netns.sh .venv/bin/python benchmarks/role_shift.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from epd_serve.instances.answers import (
    ask_for_fingerprint,
    compare,
    fingerprint,
    fingerprint_of_stream,
)
from epd_serve.instances.payloads import chat_body, image_data_url, make_image

REPO = Path(__file__).resolve().parents[1]
ADMIN_KEY = "role-shift-bench"
CONTROL = {"enabled": False, "interval_s": 0.25, "high_load": 3.0, "ratio": 3.0,
           "low_load": 0.5, "sustain_s": 1.0, "min_dwell_s": 3.0}
START_ROLES = {"e0": "E", "p0": "P", "d0": "D"}
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2  # the CPU profile's


def requests_for(scenario: str, n: int, model: str) -> tuple[list[dict], int]:
    """The run's bodies (greedy, streamed, asking for their fingerprints) and the index
    of the shift."""
    shift = n // 10 if scenario == "output" else (2 * n) // 5
    bodies = []
    for i in range(n):
        if scenario == "output":
            images, tokens, side = 1, 40 if i < shift else 400, 224
        else:
            images, tokens, side = (0, 200, 0) if i < shift else (2, 8, 448)
        urls = [image_data_url(make_image(side, side, seed=7000 + 10 * i + k))
                for k in range(images)]
        body = chat_body(model, f"Say something about request {i}.", urls, max_tokens=tokens,
                         stream=True)
        bodies.append(ask_for_fingerprint({**body, "temperature": 0}))
    return bodies, shift


async def one(session: aiohttp.ClientSession, url: str, body: dict, delay: float) -> dict:
    """Send `body` after `delay`; its timings, its fingerprint and what the proxy said."""
    await asyncio.sleep(delay)
    start = time.perf_counter()
    times, events = [], []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}"}
            stages = resp.headers.get("x-epd-stages", "")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[5:]))
                choices = events[-1].get("choices") or []  # the usage chunk: none
                if choices and choices[0].get("delta", {}).get("content"):
                    times.append(time.perf_counter() - start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return {"ok": False, "error": type(err).__name__}
    end = time.perf_counter() - start
    tpot = (end - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"ok": bool(times), "ttft": times[0] if times else None, "tpot": tpot, "e2el": end,
            "fingerprint": fingerprint_of_stream(events), "stages": stages}


async def send_all(url: str, bodies: list[dict], rate: float) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one(session, url, b, i / rate)
                                      for i, b in enumerate(bodies)))


def admin(method: str, url: str, body: dict) -> dict:
    resp = httpx.request(method, url, json=body, timeout=900,
                         headers={"authorization": f"Bearer {ADMIN_KEY}"})
    resp.raise_for_status()
    return resp.json()


def put_back_roles(proxy: str) -> None:
    """Every instance back in the role it started in (E last: P and D never empty)."""
    now = {n: v["roles"] for n, v in httpx.get(proxy + "/roles", timeout=30).json()
           ["instances"].items()}
    for name in sorted(now, key=lambda n: START_ROLES[n] == "E"):
        if now[name] != START_ROLES[name]:
            admin("POST", f"{proxy}/instances/{name}/role", {"role": START_ROLES[name],
                                                             "wait_s": 600})


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def phase_line(label: str, results: list[dict]) -> str:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    e2el = [r["e2el"] for r in ok]
    slo = sum(1 for r in ok if r["ttft"] <= SLO_TTFT_S
              and (r["tpot"] is None or r["tpot"] <= SLO_TPOT_S)) / max(1, len(results))
    return (f"  {label:<14} n={len(results):<3} TTFT p50/p90 {p(ttft, 50)*1e3:7.0f}/"
            f"{p(ttft, 90)*1e3:7.0f} ms  TPOT {p(tpot, 50)*1e3:6.1f}/{p(tpot, 90)*1e3:6.1f} ms"
            f"  E2EL {p(e2el, 50):6.2f}/{p(e2el, 90):6.2f} s  SLO {slo:5.0%}")


def run_once(proxy: str, bodies, shift, expected, rate, switching: bool) -> dict:
    put_back_roles(proxy)
    before = len(httpx.get(proxy + "/roles", timeout=30).json()["switches"])
    admin("POST", proxy + "/roles/controller", {"enabled": switching})
    results = asyncio.run(send_all(proxy + "/v1/chat/completions", bodies, rate))
    admin("POST", proxy + "/roles/controller", {"enabled": False})
    switches = [s for s in httpx.get(proxy + "/roles", timeout=30).json()["switches"][before:]
                if s["reason"] != "manual"]
    lost = sum(1 for r in results if not r["ok"])
    wrong = sum(1 for r, want in zip(results, expected)
                if r["ok"] and not compare(r["fingerprint"], want).agrees)
    return {"results": results, "shift": shift, "switches": switches, "lost": lost,
            "wrong": wrong}


def report(name: str, run: dict) -> None:
    res, shift = run["results"], run["shift"]
    print(f"{name}: lost {run['lost']}, wrong {run['wrong']}, switches {len(run['switches'])}")
    print(phase_line("before shift", res[:shift]))
    print(phase_line("after shift", res[shift:]))
    print(phase_line("all", res))
    for s in run["switches"]:
        print(f"    switch {s['instance']} {s['source']}->{s['target']} serving after "
              f"{s['serving_after_ms']:.0f} ms: {s['reason']}")


def means(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for run in runs for r in run["results"]
                          if r["ok"] and r[key] is not None]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--scenarios", default="output,mix")
    args = ap.parse_args()
    from epd_serve.models.tinymodel import build_tiny_model
    from epd_serve.runtime import bringup

    os.environ["EPD_ADMIN_KEY"] = ADMIN_KEY
    work = Path(tempfile.mkdtemp(prefix="role-shift-"))
    model = build_tiny_model("qwen2_vl", work / "tiny-qwen2-vl")
    dep = bringup.load(REPO / "configs/cpu/e-p-d.yaml", model=str(model), tiny_model=None,
                       deployment="E~-P~-D~", work_dir=str(work / "dep"),
                       proxy={"role_control": CONTROL})
    print(f"bringing up {dep.plan.to_notation()} (three full engines) ...", flush=True)
    launcher = bringup.bring_up(dep)
    try:
        return measure(dep, args)
    finally:
        launcher.stop()


def measure(dep, args) -> int:
    proxy = dep.proxy_url
    p0 = next(l.url for l in dep.launches if l.name == "p0")
    model = dep.launches[0].served_model_name
    all_on, all_off, switch_ms, lost, wrong = [], [], [], 0, 0
    for scenario in args.scenarios.split(","):
        bodies, shift = requests_for(scenario, args.requests, model)
        plain = [{**{k: v for k, v in b.items() if k != "stream_options"}, "stream": False}
                 for b in bodies]
        with httpx.Client(timeout=900) as client, ThreadPoolExecutor(4) as pool:
            # One instance alone, the reference.
            expected = list(pool.map(lambda b: fingerprint(client.post(
                p0 + "/v1/chat/completions", json=b).json()), plain))
        print(f"\n== scenario {scenario}: {args.requests} requests at {args.rate} req/s, "
              f"shift at request {shift}", flush=True)
        for switching in (False, True, False, True):
            run = run_once(proxy, bodies, shift, expected, args.rate, switching)
            report(f"switching {'on ' if switching else 'off'}", run)
            (all_on if switching else all_off).append(run)
            switch_ms += [s["serving_after_ms"] for s in run["switches"]
                          if s["serving_after_ms"] is not None]
            lost, wrong = lost + run["lost"], wrong + run["wrong"]
    predicted = simulated()
    tpot_ratio = means(all_off, "tpot") / means(all_on, "tpot")
    e2el_ratio = means(all_off, "e2el") / means(all_on, "e2el")
    print(f"\nsimulator, CPU profile, output-length shift: {predicted}")
    print(f"measured: tpot_ratio={tpot_ratio:.2f} e2el_ratio={e2el_ratio:.2f}")
    median = float(np.median(switch_ms)) if switch_ms else float("nan")
    print(f"summary: tpot_ratio={tpot_ratio:.2f} e2el_ratio={e2el_ratio:.2f} "
          f"switch_ms_p50={median:.0f} lost={lost} wrong={wrong}")
    return 0 if lost == wrong == 0 else 1


def simulated() -> str:
    """What the planner's simulator predicts for this machine's profile."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from role_shift_sim import cpu_prediction

    pred = cpu_prediction(rate=2.0, requests=40, output_before=40, output_after=400,
                          shift_at=4, image=True, notation="E~-P~-D~", resolution=(224, 224))
    return (f"tpot_ratio={pred['tpot']:.2f} e2el_ratio={pred['e2el']:.2f} "
            f"switches={pred['switches']} final layout {pred['final_layout']}")


if __name__ == "__main__":
    sys.exit(main())
