"""Chaos soak: mixed text+image load on a real deployment while its processes fail.

First the reference: every request of a fixed pool (text prompts, and images that come
back, so the MM Store's reuse is exercised) is answered greedily by one monolithic
instance of the same model (configs/cpu/tp1.yaml). Then the deployment under test is
brought up and loaded at a fixed rate for `--minutes`, while every 30-60 s (random,
seeded) one fault strikes, each kind once in a random order before any comes again:
  kill -9 of E, P or D (the whole process group), or of the MM Store server;
  SIGSTOP of an instance for 20 s, then SIGCONT;
  the store filled past its capacity with other features;
  the store server restarted (SIGTERM; the launcher starts it again).
Each request records its status, latency and whether the answer equals the reference.
The launcher supervises the deployment as `epd-serve up` does; every restart it made
that no fault explains is an engine crash. Ends with a plot of latency over time with
the faults marked, and one line:

  summary: served=<pct> wrong=<n> hung=<n> engine_crashes=<n> p99_ms=<x>

(`hung`: requests that took over 30 s; `served`: answered 200.)

    scripts/in-netns.sh .venv/bin/python benchmarks/chaos_soak.py configs/cpu/e-p-d.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.progress import Progress

from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.mmstore import FeatureMeta, open_store
from epd_serve.runtime import bringup

REPO = Path(__file__).resolve().parents[1]
HUNG_S = 30.0
STOP_FOR_S = 20.0
FAULTS = ("kill E", "kill P", "kill D", "kill store", "stop instance", "fill store",
          "restart store")


@dataclass
class Outcome:
    index: int  # which request of the pool
    sent_at: float  # seconds since the load began
    status: int | str
    latency_s: float
    right: bool | None  # None: no answer to judge


@dataclass
class Fault:
    at: float  # seconds since the load began
    kind: str
    target: str
    detail: str = ""


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    kills: dict[str, int] = field(default_factory=dict)  # child -> times we killed it


# -- the request pool and its reference answers -------------------------------------------
def request_pool(model: str, size: int, max_tokens: int) -> list[dict]:
    """`size` requests, half text, half one image; images repeat (a quarter of the pool
    is distinct images), as hot images do."""
    images = [image_data_url(make_image(336, 336, seed=7000 + i)) for i in range(size // 4 + 1)]
    pool = []
    for i in range(size):
        urls = [images[(i // 2) % len(images)]] if i % 2 else []
        body = chat_body(model, f"Chaos request {i}: say something.", urls,
                         max_tokens=max_tokens)
        body["temperature"] = 0.0  # greedy: one right answer per request
        pool.append(body)
    return pool


def answer_of(resp: httpx.Response) -> str:
    return resp.json()["choices"][0]["message"]["content"]


def reference_answers(pool: list[dict], work: Path) -> list[str]:
    """Each request answered by one monolithic instance of the same model."""
    dep = bringup.load(REPO / "configs" / "cpu" / "tp1.yaml", work_dir=str(work / "tp1"))
    launcher = bringup.bring_up(dep)
    try:
        with httpx.Client(timeout=300) as client:
            answers = []
            for body in pool:
                resp = client.post(dep.proxy_url + "/v1/chat/completions",
                                   json={**body, "model": dep.launches[0].served_model_name})
                resp.raise_for_status()
                answers.append(answer_of(resp))
            return answers
    finally:
        launcher.stop()


# -- faults ---------------------------------------------------------------------------------
def role_children(launcher) -> dict[str, list[str]]:
    """Child names by what a fault can strike: each stage's instances, the store server."""
    roles: dict[str, list[str]] = {"E": [], "P": [], "D": [], "store": [], "instance": []}
    for launch in launcher.dep.launches:
        for role in launch.instance.roles:  # "E", "P", "D", or several: "PD"
            roles[role].append(launch.name)
        roles["instance"].append(launch.name)
    roles["store"] = [c.name for c in launcher.children
                      if c.name.startswith(("mmstore", "mooncake"))][:1]
    return roles


def signal_group(launcher, name: str, sig: int) -> int:
    child = next(c for c in launcher.children if c.name == name)
    pid = child.process.pid
    os.killpg(pid, sig)  # children start in their own session: the group is the instance
    return pid


def fill_store(dep) -> str:
    """Put other features into the store until it has taken 1.5 times its capacity."""
    spec = dep.mm_store
    chunk = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    stored = 0
    with open_store(spec) as store:
        while stored < 1.5 * spec.capacity_bytes:
            key = secrets.token_hex(32)
            if store.put(key, chunk, FeatureMeta((chunk.size // 512, 256), "float16")):
                stored += chunk.nbytes
    return f"{stored >> 20} MiB of other features"


def strike(launcher, soak: Soak, kind: str, rng: random.Random, at: float) -> None:
    roles = role_children(launcher)
    target, detail = "", ""
    if kind.startswith("kill "):
        role = kind.split()[1]
        if not roles[role]:
            kind, role = "kill P", "P"
        target = rng.choice(roles[role])
        detail = f"pid {signal_group(launcher, target, signal.SIGKILL)}"
        soak.kills[target] = soak.kills.get(target, 0) + 1
    elif kind == "stop instance":
        target = rng.choice(roles["instance"])
        pid = signal_group(launcher, target, signal.SIGSTOP)
        threading.Timer(STOP_FOR_S, lambda: os.killpg(pid, signal.SIGCONT)).start()
        detail = f"pid {pid} for {STOP_FOR_S:g}s"
    elif kind == "fill store":
        target = "store"
        detail = fill_store(launcher.dep)
    elif kind == "restart store":
        target = roles["store"][0]
        detail = f"pid {signal_group(launcher, target, signal.SIGTERM)}"
        soak.kills[target] = soak.kills.get(target, 0) + 1
    soak.faults.append(Fault(at, kind, target, detail))
    print(f"[{at:6.1f}s] fault: {kind} {target} {detail}", file=sys.stderr, flush=True)


async def inject_faults(launcher, soak: Soak, until: float, start: float, seed: int) -> None:
    rng = random.Random(seed)
    kinds = [k for k in FAULTS if launcher.dep.mm_store is not None or "store" not in k]
    deck: list[str] = []
    while True:
        await asyncio.sleep(rng.uniform(30, 60))
        now = time.monotonic()
        if now >= until - 15:  # leave the last requests time to see the fault out
            return
        if not deck:  # every kind once, in a random order, before any comes again
            deck = rng.sample(kinds, len(kinds))
        await asyncio.to_thread(strike, launcher, soak, deck.pop(), rng, now - start)


# -- load -----------------------------------------------------------------------------------
async def load(dep, pool: list[dict], answers: list[str], rate: float, seconds: float,
               soak: Soak, launcher, seed: int) -> None:
    model = dep.launches[0].served_model_name
    start = time.monotonic()
    until = start + seconds
    total = int(seconds * rate)
    rng = random.Random(seed)
    faults = asyncio.create_task(inject_faults(launcher, soak, until, start, seed))

    async def one(client: httpx.AsyncClient, index: int) -> None:
        sent = time.monotonic()
        status: int | str
        right = None
        try:
            resp = await client.post(dep.proxy_url + "/v1/chat/completions",
                                     json={**pool[index], "model": model})
            status = resp.status_code
            if status == 200:
                right = answer_of(resp) == answers[index]
        except httpx.HTTPError as err:
            status = type(err).__name__
        soak.outcomes.append(Outcome(index, sent - start, status, time.monotonic() - sent, right))
        progress.advance(task)

    with Progress() as progress:
        task = progress.add_task(f"{total} requests at {rate:g}/s with faults", total=total)
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=None)) as client:
            running = []
            for n in range(total):
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
                running.append(asyncio.create_task(one(client, rng.randrange(len(pool)))))
            await asyncio.gather(*running)
    faults.cancel()


def supervise(launcher, stop: threading.Event) -> None:
    """What `epd-serve up` does after start-up: restart what exits."""
    while not stop.wait(2.0):
        launcher.supervise_once()


# -- report ---------------------------------------------------------------------------------
def summarize(soak: Soak, launcher) -> dict:
    n = len(soak.outcomes)
    served = sum(1 for o in soak.outcomes if o.status == 200)
    wrong = sum(1 for o in soak.outcomes if o.right is False)
    hung = sum(1 for o in soak.outcomes if o.latency_s > HUNG_S)
    restarts = {c.name: c.restarts for c in launcher.children}
    crashes = {name: count - soak.kills.get(name, 0) for name, count in restarts.items()
               if count > soak.kills.get(name, 0)}
    latencies = sorted(o.latency_s for o in soak.outcomes if o.status == 200)
    return {"requests": n, "served_pct": 100.0 * served / max(n, 1), "wrong": wrong,
            "hung": hung, "engine_crashes": sum(crashes.values()), "crashed": crashes,
            "restarts": restarts, "kills": soak.kills,
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)) if latencies else float("nan"),
            "statuses": {str(s): sum(1 for o in soak.outcomes if str(o.status) == str(s))
                         for s in {str(o.status) for o in soak.outcomes}}}


def plot(soak: Soak, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for label, pick, color in (("right", lambda o: o.right is True, "tab:green"),
                               ("wrong", lambda o: o.right is False, "tab:red"),
                               ("not served", lambda o: o.status != 200, "black")):
        chosen = [o for o in soak.outcomes if pick(o)]
        ax.scatter([o.sent_at for o in chosen], [o.latency_s for o in chosen], s=8,
                   color=color, label=f"{label} ({len(chosen)})")
    for fault in soak.faults:
        ax.axvline(fault.at, color="tab:orange", alpha=0.6, lw=1)
        ax.text(fault.at, ax.get_ylim()[1] * 0.98, f" {fault.kind} {fault.target}",
                rotation=90, va="top", fontsize=7, color="tab:orange")
    ax.axhline(HUNG_S, color="gray", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the soak (request sent)")
    ax.set_ylabel("latency, s")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the deployment under test, e.g. configs/cpu/e-p-d.yaml")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--pool", type=int, default=32, help="distinct requests")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--out", default=str(REPO / "results" / "chaos"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    dep = bringup.load(args.config, work_dir=str(out / "work"))
    pool = request_pool(dep.launches[0].served_model_name, args.pool, args.max_tokens)
    print(f"reference answers of {len(pool)} requests from one monolithic instance ...",
          file=sys.stderr)
    answers = reference_answers(pool, out)

    launcher = bringup.bring_up(dep)
    stop = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(launcher, stop), daemon=True)
    supervisor.start()
    soak = Soak()
    try:
        asyncio.run(load(dep, pool, answers, args.rate, args.minutes * 60, soak, launcher,
                         args.seed))
    finally:
        stop.set()
        supervisor.join(timeout=10)
        summary = summarize(soak, launcher)
        launcher.stop()
    name = Path(args.config).stem
    (out / f"{name}.json").write_text(json.dumps(
        {"summary": summary, "faults": [asdict(f) for f in soak.faults],
         "outcomes": [asdict(o) for o in soak.outcomes]}, indent=1))
    plot(soak, out / f"{name}.png", f"chaos soak: {dep.plan.to_notation()}, "
         f"{args.rate:g} req/s, {args.minutes:g} min")
    print(f"faults: {len(soak.faults)}: " + ", ".join(f"{f.kind} {f.target}" for f in soak.faults))
    print(f"statuses: {summary['statuses']}; restarts: {summary['restarts']}; "
          f"kills: {summary['kills']}; unexplained exits: {summary['crashed']}")
    print(f"plot: {out / (name + '.png')}")
    print(f"summary: served={summary['served_pct']:.2f} wrong={summary['wrong']} "
          f"hung={summary['hung']} engine_crashes={summary['engine_crashes']} "
          f"p99_ms={summary['p99_ms']:.0f}")


if __name__ == "__main__":
    main()
