"""Chaos soak: mixed text+image load on a real deployment while its processes fail.

First the reference: every request of a fixed pool (text prompts, and images that come
back, so the MM Store's reuse is exercised) is answered greedily by one monolithic
instance of the same model (configs/cpu/tp1.yaml). Then the deployment under test is
brought up as an operator brings it up (`epd-serve up`, in a process of its own, so
that the supervisor itself can fail) and loaded at a fixed rate for `--minutes`, while
every 25-45 s (random, seeded) one fault strikes, each kind once in a random order
before any comes again (the catalogue: benchmarks/chaos_faults.py).
Each request records its status, latency and whether its answer is the reference's:
the same tokens and top-5 log-probs (epd_serve.instances.answers), never the text alone.
So that this judge is seen to see a wrong answer, canaries go in among the load, each
made wrong on purpose (epd_serve.testing.corruption; the deployment runs with
`fault_injection: true`): an image whose stored feature is another image's, a prompt
whose KV reaches decode with one block unwritten, and an answer judged against another
request's reference. A canary whose corruption could not take effect (a fault struck
it: the feature was evicted and encoded again, the transfer failed and decode
recomputed) is void, not counted. Every restart the supervisor made that no fault
explains is an engine crash. Ends with a plot of latency over time with the faults
marked, and one line:

  summary: faults=<n> detect=<pct> served=<pct> wrong=<n> hung=<n> engine_crashes=<n> p99_ms=<x>

(`faults`: injected, listed by kind above it, with the kinds never injected; `detect`:
the share of the canaries that took effect which the judge called wrong, goal 100;
`hung`: requests that took over 30 s; `served`: answered 200; canaries count only in
`detect`.)

    scripts/in-netns.sh .venv/bin/python benchmarks/chaos_soak.py configs/cpu/e-p-d.yaml
    scripts/in-netns.sh .venv/bin/python benchmarks/chaos_soak.py configs/cpu/e-p-d.yaml \
        --notation "E~-P~-D~" --role-control     # roles that move, the controller on
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml
from rich.progress import Progress

from epd_serve.instances.answers import (
    ROUNDING_STEP_TOLERANCE,
    TOLERANCE,
    Comparison,
    Fingerprint,
    ask_for_fingerprint,
    compare,
    fingerprint,
)
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.mmstore import StoreError
from epd_serve.proxy.tenancy import image_key
from epd_serve.runtime import bringup
from epd_serve.testing.corruption import SKIP_KV_BLOCK, plant_foreign_feature, remove_feature

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_faults import LONG_STOP_S, Fault, Targets, UpProcess, strike  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HUNG_S = 30.0
CANARIES = ("foreign feature", "lost KV block", "crossed answers")
CANARY_EVERY_S = 10.0
IMAGE_SIDE = 336
# 16384 tokens: eight long prompts. Blocks still go round within seconds at the soak's
# rate; with 128 (two long prompts) the blocks decode holds for a stopped prefill (its
# fence) left nothing for new requests, and the proxy rightly saw decode as hung.
DECODE_BLOCKS = 512
# Long prompts: one monolithic instance's own answer to a ~2000-token prompt moves with
# the batch it is computed in (measured: alone and among 7 others, 0.030-0.032 in a
# step's log-probs, on TP1 as on E-P-D; short prompts never move).
LONG_PROMPT_TOLERANCE = ROUNDING_STEP_TOLERANCE


def judge(got: Fingerprint, want: Fingerprint, long_prompt: bool) -> Comparison:
    """Whether `got` is the reference answer `want`: the same tokens and top-5 log-probs,
    within TOLERANCE (0.01), or on a long prompt within LONG_PROMPT_TOLERANCE."""
    return compare(got, want, LONG_PROMPT_TOLERANCE if long_prompt else TOLERANCE)


@dataclass
class Outcome:
    index: int  # which request of the pool
    sent_at: float  # seconds since the load began
    status: int | str
    latency_s: float
    right: bool | None  # None: no answer to judge
    verdict: str = ""  # same, tied (both right) or different


@dataclass
class CanaryRequest:
    """One request made wrong on purpose, and the body that gets the right answer."""

    kind: str
    body: dict  # what the reference instance is sent
    donor: dict | None = None  # foreign feature: the image whose feature is planted
    victim_url: str = ""
    want: Fingerprint = ()  # the right answer, from the reference instance


@dataclass
class Canary:
    kind: str
    at: float  # seconds since the load began
    applied: bool  # the corruption took effect: the answer is wrong
    flagged: bool | None  # the judge called it wrong; None: no answer to judge
    detail: str = ""


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    struck: dict[str, int] = field(default_factory=dict)  # child -> faults that struck it
    canaries: list[Canary] = field(default_factory=list)
    last_served: tuple[int, Fingerprint] | None = None  # a pool answer, for crossing


# -- the request pool, the canaries and their reference answers ---------------------------
def request_pool(model: str, size: int, max_tokens: int) -> list[dict]:
    """`size` requests, half text, half one image; images repeat (a quarter of the pool
    is distinct images), as hot images do; every fourth a long text prompt (about
    LONG_PROMPT_TOKENS: many KV blocks). Greedy, each asking for its fingerprint."""
    images = [image_data_url(make_image(IMAGE_SIDE, IMAGE_SIDE, seed=7000 + i))
              for i in range(size // 4 + 1)]
    pool = []
    for i in range(size):
        urls = [images[(i // 2) % len(images)]] if i % 2 else []
        text = f"Chaos request {i}: say something."
        if is_long(i):
            text = f"Chaos request {i}: " + f"a long story about wave {i} and the sea " * 80
        body = chat_body(model, text, urls, max_tokens=max_tokens)
        pool.append(ask_for_fingerprint({**body, "temperature": 0.0}))
    return pool


def is_long(index: int) -> bool:
    return index % 4 == 0


def image_urls(pool: list[dict]) -> list[str]:
    """The distinct images the pool sends."""
    return list(dict.fromkeys(part["image_url"]["url"] for body in pool
                              for part in body["messages"][0]["content"]
                              if isinstance(part, dict) and part.get("type") == "image_url"))


def canary_pool(model: str, count: int, max_tokens: int) -> list[CanaryRequest]:
    """`count` canaries, the kinds in turn. Each has images and a prompt of its own: a
    corruption never reaches a request of the pool, nor another canary."""
    def greedy(text: str, urls: list[str] = ()) -> dict:
        body = chat_body(model, text, urls, max_tokens=max_tokens)
        return ask_for_fingerprint({**body, "temperature": 0.0})

    canaries = []
    for i in range(count):
        kind = CANARIES[i % len(CANARIES)]
        if kind == "foreign feature":
            donor, victim = (image_data_url(make_image(IMAGE_SIDE, IMAGE_SIDE,
                                                       seed=90000 + 2 * i + k)) for k in (0, 1))
            canaries.append(CanaryRequest(kind, greedy(f"Canary {i}: what is in it?", [victim]),
                                          donor=greedy(f"Canary {i}: donor.", [donor]),
                                          victim_url=victim))
        elif kind == "lost KV block":
            # As long as the pool's long prompts (judged as loosely), so that the judge is
            # seen to see one lost block among ~45; its own from the first token on, so
            # the block decode keeps unwritten holds nothing another prompt shares.
            canaries.append(CanaryRequest(kind, greedy(f"Canary {i}: " + "count the stars " * 200)))
        else:
            canaries.append(CanaryRequest(kind, {}))  # judged on a pool answer
    return canaries


def reference_answers(bodies: list[dict], work: Path, engine: dict) -> list[Fingerprint]:
    """Each request answered by one monolithic instance of the same model (with the
    soak's `engine` settings, SOAK_ENGINE: its KV blocks the same size)."""
    dep = bringup.load(REPO / "configs" / "cpu" / "tp1.yaml", work_dir=str(work / "tp1"),
                       **engine)
    launcher = bringup.bring_up(dep)
    try:
        with httpx.Client(timeout=300) as client:
            answers = []
            for body in bodies:
                resp = client.post(dep.proxy_url + "/v1/chat/completions",
                                   json={**body, "model": dep.launches[0].served_model_name})
                resp.raise_for_status()
                answers.append(fingerprint(resp.json()))
            return answers
    finally:
        launcher.stop()


# -- faults ---------------------------------------------------------------------------------
async def inject_faults(up: UpProcess, soak: Soak, until: float, start: float,
                        seed: int, send_long, live_keys: list[str]) -> None:
    rng = random.Random(seed)
    targets = Targets.of(up.dep)
    kinds = targets.kinds()
    deck: list[str] = []
    while True:
        await asyncio.sleep(rng.uniform(25, 45))
        now = time.monotonic()
        if now >= until - 15:  # leave the last requests time to see the fault out
            return
        if not deck:  # every kind once, in a random order, before any comes again
            deck = rng.sample(kinds, len(kinds))
        kind = deck.pop()
        try:
            target, detail = await asyncio.to_thread(strike, up, targets, kind, rng,
                                                     send_long=send_long, live_keys=live_keys)
        except Exception as err:  # noqa: BLE001 - reported; the soak goes on
            target, detail = "?", f"could not strike: {type(err).__name__}: {err}"
        soak.struck[target] = soak.struck.get(target, 0) + 1
        soak.faults.append(Fault(now - start, kind, target, detail))
        print(f"[{now - start:6.1f}s] fault: {kind} {target} {detail}", file=sys.stderr,
              flush=True)


# -- canaries -------------------------------------------------------------------------------
async def post(client: httpx.AsyncClient, dep, body: dict) -> httpx.Response:
    return await client.post(dep.proxy_url + "/v1/chat/completions",
                             json={**body, "model": dep.launches[0].served_model_name})


async def foreign_feature(client, dep, canary: CanaryRequest) -> tuple[httpx.Response | None, str]:
    """The donor sent (its feature stored), planted under the victim's key, the victim
    sent; the answer and whether the corruption took effect ("" if so, else why not)."""
    donor = await post(client, dep, canary.donor)
    if donor.status_code != 200:
        return None, f"the donor got {donor.status_code}"
    model = dep.launches[0].served_model_name
    try:
        key = await asyncio.to_thread(plant_foreign_feature, dep.mm_store, model,
                                      canary.victim_url, canary.donor["messages"][0]["content"][0]
                                      ["image_url"]["url"])
    except (LookupError, RuntimeError, StoreError) as err:
        return None, f"not planted: {err}"
    try:
        resp = await post(client, dep, canary.body)
    finally:
        await asyncio.to_thread(remove_feature, dep.mm_store, key)
    stages = resp.headers.get("x-epd-stages", "")
    # Prefill (or decode standing in for it) took "its" feature from the store by
    # reference, or the plant did not hold (evicted: encoded again; the store gone:
    # recomputed from the pixels).
    took = stages.startswith("E=store") and "IMG=ref" in stages.split(";")
    return resp, "" if took else f"the planted feature was not used ({stages})"


async def lost_kv_block(client, dep, canary: CanaryRequest) -> tuple[httpx.Response | None, str]:
    resp = await post(client, dep, {**canary.body, "kv_transfer_params": SKIP_KV_BLOCK})
    stages = resp.headers.get("x-epd-stages", "")
    took = "KV=done" in stages and "FALLBACK" not in stages
    return resp, "" if took else f"the KV did not come by the transfer ({stages})"


async def one_canary(client, dep, soak: Soak, canary: CanaryRequest,
                     pool_answers: list[Fingerprint], at: float) -> None:
    """Send one canary (or, for crossed answers, take the last served pool answer) and
    judge it against the reference of what it was meant to answer."""
    if canary.kind == "crossed answers":
        if soak.last_served is None:
            soak.canaries.append(Canary(canary.kind, at, False, None, "nothing served yet"))
            return
        index, got = soak.last_served
        other = (index + 1) % len(pool_answers)  # another request's right answer
        flagged = not judge(got, pool_answers[other], is_long(index) or is_long(other)).agrees
        soak.canaries.append(Canary(canary.kind, at, True, flagged, f"{index} as {other}"))
        return
    send = foreign_feature if canary.kind == "foreign feature" else lost_kv_block
    try:
        resp, void = await send(client, dep, canary)
    except httpx.HTTPError as err:
        resp, void = None, type(err).__name__
    if resp is None or resp.status_code != 200:
        why = void or f"answered {resp.status_code}"
        soak.canaries.append(Canary(canary.kind, at, False, None, why))
        return
    flagged = not judge(fingerprint(resp.json()), canary.want,
                        long_prompt=canary.kind == "lost KV block").agrees
    soak.canaries.append(Canary(canary.kind, at, not void, flagged, void))


async def send_canaries(client, dep, soak: Soak, canaries: list[CanaryRequest],
                        pool_answers: list[Fingerprint], start: float, until: float) -> None:
    for canary in canaries:
        await asyncio.sleep(CANARY_EVERY_S)
        if time.monotonic() >= until:
            return
        await one_canary(client, dep, soak, canary, pool_answers, time.monotonic() - start)


# -- load -----------------------------------------------------------------------------------
async def load(dep, pool: list[dict], pool_answers: list[Fingerprint],
               canaries: list[CanaryRequest], rate: float, seconds: float, soak: Soak,
               up: UpProcess, seed: int) -> None:
    start = time.monotonic()
    until = start + seconds
    total = int(seconds * rate)
    rng = random.Random(seed)

    def judged(index: int, sent: float, resp: httpx.Response | None, error: str = "") -> None:
        right, verdict = None, ""
        if resp is not None and resp.status_code == 200:
            got = fingerprint(resp.json())
            judgement = judge(got, pool_answers[index], is_long(index))
            right, verdict = judgement.agrees, judgement.verdict.value
            soak.last_served = (index, got)
        status = resp.status_code if resp is not None else error
        soak.outcomes.append(Outcome(index, sent - start, status, time.monotonic() - sent,
                                     right, verdict))

    def send_long(kv_transfer_params: dict) -> None:
        """(A fault's thread.) One long prompt of the pool with these parameters."""
        index = rng.choice([i for i in range(len(pool)) if is_long(i)])
        sent = time.monotonic()
        body = {**pool[index], "model": dep.launches[0].served_model_name,
                "kv_transfer_params": kv_transfer_params}
        try:
            resp = httpx.post(dep.proxy_url + "/v1/chat/completions", json=body, timeout=180)
            judged(index, sent, resp)
        except httpx.HTTPError as err:
            judged(index, sent, None, type(err).__name__)

    live_keys = [image_key(dep.launches[0].served_model_name, url) for url in image_urls(pool)]
    faults = asyncio.create_task(inject_faults(up, soak, until, start, seed, send_long,
                                               live_keys))

    async def one(client: httpx.AsyncClient, index: int) -> None:
        sent = time.monotonic()
        try:
            judged(index, sent, await post(client, dep, pool[index]))
        except httpx.HTTPError as err:
            judged(index, sent, None, type(err).__name__)
        progress.advance(task)

    with Progress() as progress:
        task = progress.add_task(f"{total} requests at {rate:g}/s with faults", total=total)
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=None)) as client:
            canaried = asyncio.create_task(send_canaries(client, dep, soak, canaries,
                                                         pool_answers, start, until))
            running = []
            for n in range(total):
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
                running.append(asyncio.create_task(one(client, rng.randrange(len(pool)))))
            await asyncio.gather(*running)
            canaried.cancel()
    faults.cancel()


# -- report ---------------------------------------------------------------------------------
def summarize(soak: Soak, restarts: dict[str, int], kinds: list[str]) -> dict:
    n = len(soak.outcomes)
    served = sum(1 for o in soak.outcomes if o.status == 200)
    wrong = sum(1 for o in soak.outcomes if o.right is False)
    hung = sum(1 for o in soak.outcomes if o.latency_s > HUNG_S)
    # A fault that struck a process explains one restart of it (a kill; a stop the
    # supervisor found hung); any other restart is a crash.
    crashes = {name: count - soak.struck.get(name, 0) for name, count in restarts.items()
               if count > soak.struck.get(name, 0)}
    latencies = sorted(o.latency_s for o in soak.outcomes if o.status == 200)
    applied = [c for c in soak.canaries if c.applied]
    by_kind = {kind: {"sent": sum(1 for c in soak.canaries if c.kind == kind),
                      "applied": sum(1 for c in applied if c.kind == kind),
                      "flagged": sum(1 for c in applied if c.kind == kind and c.flagged)}
               for kind in CANARIES}
    faults = {kind: sum(1 for f in soak.faults if f.kind == kind)
              for kind in dict.fromkeys(f.kind for f in soak.faults)}
    return {"requests": n, "served_pct": 100.0 * served / max(n, 1), "wrong": wrong,
            "tied": sum(1 for o in soak.outcomes if o.verdict == "tied"),
            "faults": len(soak.faults), "faults_by_kind": faults,
            "detect_pct": 100.0 * sum(1 for c in applied if c.flagged) / len(applied)
            if applied else float("nan"), "canaries": by_kind,
            "hung": hung, "engine_crashes": sum(crashes.values()), "crashed": crashes,
            "restarts": restarts, "struck": soak.struck,
            "kinds_not_injected": [k for k in kinds if k not in faults],
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


def soak_engine(config: str | Path) -> dict:
    """The engine settings of the soak (and of its reference): KV blocks of 32 tokens and
    decode's KV cache held to DECODE_BLOCKS of them, so that blocks are given to the next
    request within seconds (a late write into a reused block meets another request's KV),
    with prompts up to 2048 tokens. The file's own engine flags are kept."""
    file = yaml.safe_load(Path(config).read_text())
    engine_args = {**file.get("engine_args", {}), "block_size": 32}
    role_args = file.get("role_engine_args", {})
    role_args = {**role_args, "D": {**role_args.get("D", {}),
                                    "num_gpu_blocks_override": DECODE_BLOCKS}}
    return {"max_model_len": 2048, "engine_args": engine_args, "role_engine_args": role_args}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the deployment under test, e.g. configs/cpu/e-p-d.yaml")
    parser.add_argument("--notation", help="another deployment notation for its instances, "
                        "e.g. E~-P~-D~ (roles that move)")
    parser.add_argument("--role-control", action="store_true",
                        help="turn the role controller on (switchable instances)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--pool", type=int, default=32, help="distinct requests")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--out", default=str(REPO / "results" / "chaos"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Fault injection: the canaries' lost KV block, the prefill that stops itself (no
    # shipped file turns it on).
    overrides = {"work_dir": str(out / "work"), "fault_injection": True,
                 "supervision": {"hung_restart_s": LONG_STOP_S + 45}, **soak_engine(args.config)}
    if args.notation:
        overrides["deployment"] = args.notation
    if args.role_control:
        overrides["proxy"] = {"role_control": True}
    dep = bringup.load(args.config, **overrides)
    model = dep.launches[0].served_model_name
    pool = request_pool(model, args.pool, args.max_tokens)
    canaries = canary_pool(model, int(args.minutes * 60 / CANARY_EVERY_S), args.max_tokens)
    sent = [c for c in canaries if c.body]
    print(f"reference answers of {len(pool)} requests and {len(sent)} canaries from one "
          "monolithic instance ...", file=sys.stderr)
    answers = reference_answers(pool + [c.body for c in sent], out,
                                soak_engine(REPO / "configs" / "cpu" / "tp1.yaml"))
    pool_answers = answers[:len(pool)]
    for canary, want in zip(sent, answers[len(pool):]):
        canary.want = want

    bringup.ensure_model(dep)
    up = UpProcess(dep, out / "deployment.yaml", out / "up.log")
    print(f"epd-serve up {dep.plan.to_notation()} (its log: {out / 'up.log'}) ...",
          file=sys.stderr)
    up.start()
    soak = Soak()
    try:
        asyncio.run(load(dep, pool, pool_answers, canaries, args.rate, args.minutes * 60, soak,
                         up, args.seed))
        restarts = up.restarts()
    finally:
        up.stop()
    summary = summarize(soak, restarts, Targets.of(dep).kinds())
    report(soak, summary, dep, args, out)


def report(soak: Soak, summary: dict, dep, args, out: Path) -> None:
    name = Path(args.config).stem + (f"-{args.notation}" if args.notation else "")
    (out / f"{name}.json").write_text(json.dumps(
        {"summary": summary, "faults": [asdict(f) for f in soak.faults],
         "canaries": [asdict(c) for c in soak.canaries],
         "outcomes": [asdict(o) for o in soak.outcomes]}, indent=1))
    plot(soak, out / f"{name}.png", f"chaos soak: {dep.plan.to_notation()}, "
         f"{args.rate:g} req/s, {args.minutes:g} min")
    print(f"faults: {len(soak.faults)}: " + ", ".join(f"{f.kind} {f.target}" for f in soak.faults))
    print("faults by kind: " + ", ".join(f"{k} {n}" for k, n in summary["faults_by_kind"].items())
          + f"; never injected: {', '.join(summary['kinds_not_injected']) or 'none'}")
    print("canaries (sent / took effect / called wrong): " + ", ".join(
        f"{kind} {c['sent']}/{c['applied']}/{c['flagged']}"
        for kind, c in summary["canaries"].items()))
    for canary in soak.canaries:
        if not canary.applied or not canary.flagged:
            print(f"  canary {canary.kind} at {canary.at:.0f}s: "
                  f"{'MISSED' if canary.applied else 'void'} {canary.detail}")
    print(f"statuses: {summary['statuses']}; answers tied (both right): {summary['tied']}; "
          f"restarts: {summary['restarts']}; struck by faults: {summary['struck']}; "
          f"unexplained exits: {summary['crashed']}")
    print(f"plot: {out / (name + '.png')}")
    print(f"summary: faults={summary['faults']} detect={summary['detect_pct']:.1f} "
          f"served={summary['served_pct']:.2f} wrong={summary['wrong']} "
          f"hung={summary['hung']} engine_crashes={summary['engine_crashes']} "
          f"p99_ms={summary['p99_ms']:.0f}")


if __name__ == "__main__":
    main()
