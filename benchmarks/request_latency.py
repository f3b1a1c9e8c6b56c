"""The latency of single requests through a disaggregated deployment against one
monolithic instance, alternated in one run so that both see the same machine.

Brings up each deployment in turn, A B A B ... (default E-P-D and TP1, two rounds
each), sends text and image requests one at a time after a few unmeasured ones, and
prints per round and kind the median end-to-end latency and the median time of each
stage as the proxy reports it (x-epd-stages). Then where the time goes, per hop, from
each measured request's timeline (the proxy's hop spans with the engines' own spans
under them, proxy/timeline.py): a table of medians per part and deployment, and the
same as a plot (results/request_latency/parts.png). Before the hops, "proxy before
hops": the proxy's own work up to its first hop (parsing, checks). A hop's parts:

    outside engine   HTTP both ways, the API server's work before the engine sees the
                     request and after its last token (detokenizing, the response)
    preprocess       vLLM's frontend: parse, chat template, tokenize, media processing,
                     up to the engine core taking the request
    queue            the scheduler's wait
    prefill, decode  the forward passes (to the first token, after it)
    features load    (P, D) a stored feature read from the MM Store into the engine
    KV receive       (D) the KV hand-off, reservation to landed

Each round also times a fixed pure-Python loop while its deployment idles, just after
it came up and again after its last request (epd_serve/bench/host_pace.py): the host's
own pace that round, printed beside its medians, so that a round slow because the
machine was slow shows as such. Ends with one line:

    summary: text_ratio=<x> image_ratio=<x> spread=<pct> host_spread=<pct>

ratio: the first deployment's median over the second's, per kind, all rounds pooled;
spread: the largest relative difference between two rounds of the same deployment and
kind (how far this machine lets one run wander from the next); host_spread: the same
between the rounds' host paces (how far the machine itself wandered meanwhile).

    scripts/in-netns.sh .venv/bin/python benchmarks/request_latency.py \
        [--configs configs/cpu/e-p-d.yaml configs/cpu/tp1.yaml] [--rounds 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

from epd_serve.bench import host_pace, waterfall
from epd_serve.bench.runner import deployment_headers
from epd_serve.deployment import schema
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime import bringup

STAGE_RE = re.compile(r"(\w+)=(\w+):([\d.]+)ms")
KINDS = ("text", "image")
UNMEASURED = 3  # requests per kind before the measured ones: first-use costs out


def measure(path: str, overrides: dict, requests: int, max_tokens: int, seed: int
            ) -> tuple[str, dict[str, dict[str, list[float]]], dict[str, list[dict]], float]:
    """Bring up one deployment, time `requests` requests of each kind one at a time,
    stop it. Returns its notation, per kind the samples of each stage in ms, per kind
    the measured requests' timelines, and the host's pace meanwhile (ms of the loop)."""
    dep = bringup.load(path, **overrides)
    start = time.monotonic()
    launcher = bringup.bring_up(dep)  # as `epd-serve up`: healthy, then one warm-up of each kind
    print(f"{dep.config.name} ({dep.plan.to_notation()}): up after "
          f"{time.monotonic() - start:.0f}s", file=sys.stderr)
    model = dep.launches[0].served_model_name
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    traced: dict[str, list[str]] = defaultdict(list)
    timelines: dict[str, list[dict]] = defaultdict(list)
    paces = [host_pace.python_loop_ms()]  # the deployment up and idle
    try:
        with httpx.Client(base_url=dep.proxy_url, timeout=300,
                          headers=deployment_headers(dep)) as client:
            for i in range(2 * (UNMEASURED + requests)):
                kind = KINDS[i % 2]
                # A new image every time: an image seen before would skip its encoder.
                images = [image_data_url(make_image(448, 448, seed=seed + i))] \
                    if kind == "image" else []
                body = chat_body(model, "Describe what you see in detail.", images,
                                 max_tokens=max_tokens)
                t = time.perf_counter()
                resp = client.post("/v1/chat/completions", json=body)
                ms = (time.perf_counter() - t) * 1e3
                resp.raise_for_status()
                if i < 2 * UNMEASURED:
                    continue
                rows[kind]["total"].append(ms)
                for stage, _inst, stage_ms in STAGE_RE.findall(
                        resp.headers.get("x-epd-stages", "")):
                    rows[kind][stage].append(float(stage_ms))
                traced[kind].append(resp.headers.get("x-epd-trace-id", ""))
            time.sleep(waterfall.SPANS_SETTLE_S)  # the engines' last spans
            paces.append(host_pace.python_loop_ms())
            for kind, ids in traced.items():
                for trace_id in ids:
                    found = client.get(f"/v1/traces/{trace_id}") if trace_id else None
                    if found is not None and found.status_code == 200:
                        timelines[kind].append(found.json())
    finally:
        launcher.stop()
    if not any(timelines.values()):
        print(f"{dep.config.name}: no timeline readable (stage_headers: operator needs "
              "the admin key in EPD_ADMIN_KEY): no breakdown", file=sys.stderr)
    return dep.plan.to_notation(), rows, timelines, statistics.mean(paces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs=2, metavar=("A", "B"),
                        default=["configs/cpu/e-p-d.yaml", "configs/cpu/tp1.yaml"],
                        help="the deployment measured and the one it is compared with")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (at least 2)")
    parser.add_argument("--requests", type=int, default=10, help="measured, per kind and round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("results/request_latency"),
                        help="folder of the breakdown's plot")
    parser.add_argument("--kv-connector", choices=["epd", "mooncake"],
                        help="override A's KV connector (P -> D hand-off)")
    parser.add_argument("--mm-store", choices=["shm", "mooncake", "file"],
                        help="override A's MM Store backend (E -> P hand-off)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2, or there is no spread to report")

    overrides: dict = {}
    if args.kv_connector:
        overrides["kv_connector"] = args.kv_connector
    if args.mm_store:
        store = schema.load(args.configs[0])[0].mm_store.model_dump()
        overrides["mm_store"] = {**store, "backend": args.mm_store}

    # medians[deployment][kind] -> one median per round
    medians: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    # timelines[deployment][kind]: every round's measured requests
    timelines: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    names = []
    # Two deployments of the same notation (a change measured before/after: the same
    # deployment with one setting changed) are told apart by their files' names.
    notations = [schema.load(path)[0].deployment for path in args.configs]
    labelled = notations[0] == notations[1]
    paces: list[float] = []  # the host's, one per deployment and round
    for rnd in range(args.rounds):
        for which, path in enumerate(args.configs):
            name, rows, traces, pace = measure(path, overrides if which == 0 else {},
                                               args.requests, args.max_tokens,
                                               seed=1000 * (rnd + 1) + 100 * which)
            if labelled:
                name = schema.load(path)[0].name
            if name not in names:
                names.append(name)
            paces.append(pace)
            for kind in KINDS:
                timelines[name][kind] += traces[kind]
            for kind in KINDS:
                stages = rows[kind]
                medians[name][kind].append(statistics.median(stages["total"]))
                samples[name][kind] += stages["total"]
                parts = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in stages.items())
                print(f"round {rnd + 1} {name:6s} {kind:5s} ({args.max_tokens} output tokens, "
                      f"{len(stages['total'])} requests), medians in ms: {parts}; "
                      f"host pace {pace:.0f} ms", flush=True)

    a, b = names
    ratios = {kind: statistics.median(samples[a][kind]) / statistics.median(samples[b][kind])
              for kind in KINDS}
    spread = max(host_pace.spread(v) for per_kind in medians.values() for v in per_kind.values())
    for name in names:
        print(f"{name:6s} " + "  ".join(
            f"{kind} median {statistics.median(samples[name][kind]):.0f} ms "
            f"(rounds: {', '.join(f'{m:.0f}' for m in medians[name][kind])})" for kind in KINDS))
    print_breakdown(names, timelines, args.out)
    print(f"host pace by round (ms of the same loop): {', '.join(f'{p:.0f}' for p in paces)}")
    print(f"summary: text_ratio={ratios['text']:.2f} image_ratio={ratios['image']:.2f} "
          f"spread={spread:.0%} host_spread={host_pace.spread(paces):.0%}")


def print_breakdown(names: list[str], timelines: dict, out: Path) -> None:
    """Per kind, the median of each part of a request (ms) in each deployment, and the
    same as a plot."""
    medians = {(name, kind): waterfall.median_parts(timelines[name][kind])
               for name in names for kind in KINDS if timelines[name][kind]}
    if not medians:
        return
    for kind in KINDS:
        columns = [(name, medians[name, kind]) for name in names if (name, kind) in medians]
        print(f"where a {kind} request's time goes (ms, median of each part over "
              f"{', '.join(f'{len(timelines[n][kind])} {n}' for n, _ in columns)} requests):")
        print("\n".join(waterfall.parts_table(columns)))
    out.mkdir(parents=True, exist_ok=True)
    path = waterfall.plot_parts([(f"{name} {kind}", parts)
                                 for (name, kind), parts in medians.items()], out / "parts.png")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
