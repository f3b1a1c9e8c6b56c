"""The MM Store, measured like paper 004's Table 3 (E -> P feature transfer).

(a) put / get of encoder features per backend, shapes [100..16206, 3584] fp16 (the
    paper's), against a plain memcpy of the same bytes where they lie (shm: a copy of
    the entry's bytes out of the arena, with no lookup and no check: what a get cannot
    avoid), and against a memcpy of as many bytes of the consumer's private memory. The
    store's own processes run as a deployment runs them; a separate consumer process
    does the gets (the first read of each feature) and the copies. The two baselines
    differ where the machine backs private memory with huge pages and shared memory
    with 4 KiB pages (/sys/kernel/mm/transparent_hugepage/shmem_enabled `never`):
    there a copy out of /dev/shm costs up to 1.5x one out of private memory.
(b) E -> P hand-off per image size: from the producer holding the encoder output to the
    consumer process holding it. Ours: put, then the prefetch hint, then the consumer's
    feature loader (the connector's own class) pulls it. vLLM's connectors: driven by
    benchmarks/ec_peers.py with their real classes.
(c) Prefetch overlap on a real E-P-D deployment of the tiny model (features 256 wide):
    images of each size through the proxy; prefill's worker logs, per feature, the
    transfer (hint -> feature local) and the scheduling latency (hint -> vLLM asks for
    it); overlap = share of the transfer done before it was needed. The same scheduling
    latency against (a)'s get time gives the overlap for the paper's 3584-wide features.

Ends with one line:
  summary: shm_get_vs_memcpy=<ratio> shm_get_vs_private_memcpy=<ratio>
           handoff_rank=<n>/<m> prefetch_overlap_min=<pct>
(--store-only: `<backend>_get_vs_memcpy` for each, and shm's private-memory ratio.)

    scripts/in-netns.sh .venv/bin/python benchmarks/mmstore_bench.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from epd_serve.runtime import bringup  # noqa: E402
from epd_serve.mmstore import FeatureMeta, StoreSpec, open_store  # noqa: E402
from epd_serve.mmstore.service import StartedStore  # noqa: E402
from epd_serve.instances.payloads import chat_body, image_data_url, make_image  # noqa: E402
from epd_serve.proxy.tenancy import image_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WIDTH = 3584
# Table 3's rows: image size -> feature rows of a 3584-wide fp16 feature.
ROWS = {"280x280": 100, "560x560": 400, "640x960": 529, "720x1280": 1196,
        "1080x1920": 2691, "4096x3112": 16206}
LOADED_RE = re.compile(r"epd-ec loaded mm_hash=(\S+) bytes=(\d+) source=(\w+) wait_ms=[\d.]+"
                       r"(?: transfer_ms=([\d.]+) sched_ms=([\d.]+) overlap=([\d.]+))?")


# -- the consumer process ---------------------------------------------------------------
def _consumer(spec_json: str, conn) -> None:
    """Serves ('get', key), ('memcpy', nbytes) and ('prefetch', key) commands; answers
    seconds (or, for prefetch, the monotonic time the feature was local)."""
    from epd_serve.connectors.epd_ec.loader import FeatureLoader

    spec = StoreSpec.from_json(spec_json)
    store = open_store(spec)
    loader = None
    # Written before each timed read: the bytes read come from memory, not from a CPU
    # cache, for the get and for the memcpy alike (between E's put and P's get much
    # else runs; a memcpy of bytes just generated would be flattered by the cache).
    scratch = np.zeros(64 << 20, np.uint8)
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "get":
            scratch += 1
            start = time.perf_counter()
            found = store.get(arg)
            elapsed = time.perf_counter() - start
            # Freed before the next read, as the memcpy's copy is: both then reuse
            # memory the allocator has already mapped, rather than one of them paying
            # fresh page faults every time.
            conn.send(elapsed if found is not None else None)
            del found
        elif cmd == "copy_in_store":
            place = _bytes_in_arena(store, arg)
            scratch += 1
            start = time.perf_counter()
            copy = place.copy()
            conn.send(time.perf_counter() - start)
            del copy, place
        elif cmd == "memcpy":
            src = np.random.default_rng(0).integers(0, 255, arg, dtype=np.uint8)
            scratch += 1
            start = time.perf_counter()
            copy = src.copy()
            conn.send(time.perf_counter() - start)
            del copy, src
        elif cmd == "listen":
            loader = FeatureLoader(store, budget_bytes=1 << 30, listen=("127.0.0.1", arg))
            conn.send(True)
        elif cmd == "claim":
            while not loader.has_copy(arg):
                time.sleep(0.0002)
            item = loader.want(arg)  # as a request takes it, and gives it back
            loader.hold(item)
            loader.release(item)
            conn.send(item.ready_at)
    if loader is not None:
        loader.close()
    store.close()


def _bytes_in_arena(store, key: str) -> np.ndarray:
    """The shm entry's feature bytes where they lie in the arena (a view): the store's
    own layout, read here without its checks, for the copy a get cannot avoid."""
    from epd_serve.mmstore import shm_layout as layout

    arena = store._current_arena()
    _slot, row = arena.directory.find(key)
    begin = row[layout.OFFSET] + layout.meta_span(row[layout.META_LEN])
    return arena.bytes[begin:begin + row[layout.NBYTES]]


def forget(store, key: str) -> None:
    """Free a measured feature. Mooncake's delete waits out the read's lease (5 s), so
    there the pool is sized for every feature of the run instead."""
    if store.name == "shm":
        store.delete(key)


def put_get(spec: StoreSpec, rows: list[int], repeats: int, segment_bytes: int):
    """(a): per shape, medians of put, first get in another process, memcpy there."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(spec.to_json(), theirs))
    child.start()
    results = []
    try:
        with open_store(spec, segment_bytes=segment_bytes) as store:
            for n in rows:
                nbytes = n * WIDTH * 2
                data = np.random.default_rng(n).integers(0, 255, nbytes, dtype=np.uint8)
                meta = FeatureMeta((n, WIDTH), "float16")
                puts, gets, copies, in_store = [], [], [], []
                for r in range(repeats + 1):  # the first is a warm-up, as for vLLM's
                    key = f"ab-{spec.backend}-{n}-{r}-{time.time_ns()}"
                    start = time.perf_counter()
                    assert store.put(key, data, meta), f"put of {key} refused"
                    puts.append(time.perf_counter() - start)
                    mine.send(("get", key))
                    got = mine.recv()
                    assert got is not None, f"{key} not found"
                    gets.append(got)
                    mine.send(("memcpy", nbytes))
                    copies.append(mine.recv())
                    if spec.backend == "shm":
                        mine.send(("copy_in_store", key))
                        in_store.append(mine.recv())
                    forget(store, key)
                    if r == 0:
                        puts, gets, copies, in_store = [], [], [], []
                # Elsewhere the bytes lie in another process (Mooncake's pool): the
                # private memcpy is the baseline.
                copy = statistics.median(in_store) if in_store else statistics.median(copies)
                results.append({"rows": n, "bytes": nbytes, "put": statistics.median(puts),
                                "get": statistics.median(gets), "memcpy": copy,
                                "private_memcpy": statistics.median(copies)})
    finally:
        mine.send(("stop", None))
        child.join(timeout=30)
    return results


def handoff_ours(spec: StoreSpec, rows: list[int], repeats: int, segment_bytes: int,
                 port: int) -> dict[int, list[float]]:
    """(b) for our store: put + hint, until the consumer's prefetch listener holds it."""
    import zmq

    import msgspec

    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(spec.to_json(), theirs))
    child.start()
    zctx = zmq.Context()
    hint = zctx.socket(zmq.PUSH)
    hint.setsockopt(zmq.LINGER, 0)
    out: dict[int, list[float]] = {}
    try:
        mine.send(("listen", port))
        mine.recv()
        hint.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.2)
        with open_store(spec, segment_bytes=segment_bytes) as store:
            for n in rows:
                data = np.random.default_rng(n).integers(0, 255, n * WIDTH * 2, dtype=np.uint8)
                meta = FeatureMeta((n, WIDTH), "float16")
                out[n] = []
                for r in range(repeats + 1):  # the first is a warm-up
                    key = f"ho-{spec.backend}-{n}-{r}-{time.time_ns()}"
                    start = time.monotonic()  # the producer has the encoder output
                    store.put(key, data, meta)
                    hint.send(msgspec.msgpack.encode([key]))
                    mine.send(("claim", key))
                    ready = mine.recv()
                    assert ready is not None, f"prefetch of {key} failed"
                    if r:
                        out[n].append(ready - start)
                    forget(store, key)
    finally:
        mine.send(("stop", None))
        child.join(timeout=30)
        hint.close()
        zctx.term()
    return out


# -- (c) on a real deployment ---------------------------------------------------------------
def image_size(label: str) -> tuple[int, int]:
    w, h = label.split("x")
    return int(w), int(h)


def overlap_on_deployment(sizes: list[str], repeats: int, work: Path) -> dict[str, list[dict]]:
    shutil.rmtree(work / "e-p-d", ignore_errors=True)  # logs of an earlier run
    # The processor's default caps an image at ~1280 tokens; Qwen2.5-VL-7B's allows
    # 16206 (4096x3112), as in Table 3.
    engine_args = {"limit_mm_per_prompt": '{"image":1,"video":0}',
                   "mm_processor_kwargs": '{"max_pixels": 12845056}'}
    dep = bringup.load(REPO / "configs/cpu/e-p-d.yaml", work_dir=str(work / "e-p-d"),
                      engine_args=engine_args,
                      max_model_len=20480, proxy_port=18300, base_port=18310,
                      kv_base_port=18330,
                      mm_store={"port": 18340, "metrics_port": 18341,
                                "prefetch_base_port": 18342})
    launcher = bringup.bring_up(dep)
    p = next(l.name for l in dep.launches if l.instance.roles == "P")
    model = dep.launches[0].served_model_name
    rows: dict[str, list[dict]] = {}
    try:
        with httpx.Client(base_url=dep.proxy_url, timeout=900) as client:
            for label in sizes:
                rows[label] = []
                for r in range(repeats):
                    url = image_data_url(make_image(*image_size(label), seed=9000 + r))
                    resp = client.post("/v1/chat/completions",
                                       json=chat_body(model, "Describe it.", [url], max_tokens=2))
                    resp.raise_for_status()
                    key = image_key(model, url)
                    time.sleep(0.2)
                    log = (dep.work_dir / "logs" / f"{p}.log").read_text(errors="replace")
                    for found in LOADED_RE.finditer(log):
                        if found.group(1) == key and found.group(4):
                            rows[label].append({
                                "bytes": int(found.group(2)), "source": found.group(3),
                                "transfer_ms": float(found.group(4)),
                                "sched_ms": float(found.group(5)),
                                "overlap": float(found.group(6))})
                print(f"  (c) {label}: {rows[label]}", file=sys.stderr)
    finally:
        launcher.stop()
    return rows


# -- report -------------------------------------------------------------------------------------
def plot(store_rows: dict, handoffs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    labels = list(ROWS)
    x = np.arange(len(labels))
    width = 0.8 / (len(store_rows) + 1)
    memcpy = [r["memcpy"] * 1e3 for r in next(iter(store_rows.values()))]
    axes[0].bar(x, memcpy, width, label="memcpy", color="grey")
    for i, (backend, results) in enumerate(store_rows.items(), start=1):
        axes[0].bar(x + i * width, [r["get"] * 1e3 for r in results], width, label=f"{backend} get")
    axes[0].set_title("(a) get of a [rows, 3584] fp16 feature vs memcpy (ms, log)")
    width = 0.8 / len(handoffs)
    for i, (name, per_rows) in enumerate(handoffs.items()):
        axes[1].bar(x + i * width, [statistics.median(per_rows[n]) * 1e3 for n in ROWS.values()],
                    width, label=name)
    axes[1].set_title("(b) E -> P hand-off (ms, log)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xticks(x + 0.4 - width / 2, labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("MM Store on 2 CPU cores (Table 3's feature sizes)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backends", default="shm,mooncake")
    parser.add_argument("--skip-deployment", action="store_true", help="skip (c)")
    parser.add_argument("--store-only", action="store_true",
                        help="(a) only: put and get against memcpy (the get path's checks)")
    parser.add_argument("--out", default=str(REPO / "results" / "mmstore"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    rows = list(ROWS.values())
    # Every feature of both phases fits: Mooncake keeps them (see `forget`).
    capacity = 2 * args.repeats * sum(rows) * WIDTH * 2 + (256 << 20)
    backends = args.backends.split(",")

    store_rows: dict[str, list[dict]] = {}
    handoffs: dict[str, dict[int, list[float]]] = {}
    for i, backend in enumerate(backends):
        spec = StoreSpec(backend=backend, port=18400 + 10 * i, metrics_port=18401 + 10 * i,
                         capacity_bytes=capacity, name="bench")
        segment = capacity if backend == "mooncake" else 0
        console.print(f"[bold]{backend}[/]: starting the store")
        service = StartedStore(spec, out / "logs", timeout_s=60)
        try:
            store_rows[backend] = put_get(spec, rows, args.repeats, segment)
            if not args.store_only:
                handoffs[f"ours ({backend})"] = handoff_ours(spec, rows, args.repeats,
                                                             segment, port=18405 + 10 * i)
        finally:
            service.close()

    table = Table(title="(a) MM Store put / get of [rows, 3584] fp16 features, ms "
                        "(medians; get in another process, first read)")
    for col in ("backend", "feature", "MiB", "memcpy (in store)", "memcpy (private)", "put",
                "get", "get / memcpy", "get / private", "get GB/s"):
        table.add_column(col, justify="right")
    for backend, results in store_rows.items():
        for r in results:
            table.add_row(backend, f"[{r['rows']}, {WIDTH}]", f"{r['bytes'] / 2**20:.1f}",
                          f"{r['memcpy'] * 1e3:.3f}", f"{r['private_memcpy'] * 1e3:.3f}",
                          f"{r['put'] * 1e3:.3f}", f"{r['get'] * 1e3:.3f}",
                          f"{r['get'] / r['memcpy']:.2f}",
                          f"{r['get'] / r['private_memcpy']:.2f}",
                          f"{r['bytes'] / r['get'] / 1e9:.2f}")
    console.print(table)
    shm = store_rows.get("shm", [])
    ratio = max((r["get"] / r["memcpy"] for r in shm), default=float("nan"))
    private = max((r["get"] / r["private_memcpy"] for r in shm), default=float("nan"))
    if args.store_only:
        worst = {backend: max(r["get"] / r["memcpy"] for r in results)
                 for backend, results in store_rows.items()}
        print("summary: " + " ".join(f"{b}_get_vs_memcpy={w:.2f}" for b, w in worst.items())
              + (f" shm_get_vs_private_memcpy={private:.2f}" if shm else ""))
        return 0

    from ec_peers import PEERS, handoff_seconds

    for name, status in PEERS.items():
        if status.startswith("runs"):
            console.print(f"[bold]vLLM {name}[/]: hand-offs")
            measured = handoff_seconds(name, [(n, WIDTH) for n in rows], args.repeats,
                                       out / "peers")
            handoffs[f"vLLM {name}"] = {shape[0]: secs for shape, secs in measured.items()}
    table = Table(title="(b) E -> P hand-off, producer has the feature -> consumer holds it, "
                        "ms (medians)")
    table.add_column("image")
    table.add_column("feature")
    for name in handoffs:
        table.add_column(name, justify="right")
    worst_rank = 1
    ours = f"ours ({backends[0]})"
    for label, n in ROWS.items():
        medians = {name: statistics.median(v[n]) for name, v in handoffs.items()}
        rank = 1 + sum(1 for name, m in medians.items()
                       if not name.startswith("ours") and m < medians[ours])
        worst_rank = max(worst_rank, rank)
        table.add_row(label, f"[{n}, {WIDTH}]", *(f"{m * 1e3:.2f}" for m in medians.values()))
    console.print(table)
    for name, status in PEERS.items():
        if not status.startswith("runs"):
            console.print(f"  vLLM {name}: not measured: {status}")
    compared = 1 + sum(1 for name in handoffs if not name.startswith("ours"))

    overlap_min = float("nan")
    overlaps = {}
    if not args.skip_deployment:
        overlaps = overlap_on_deployment(list(ROWS), max(1, args.repeats // 2), out)
        shm_get = {r["rows"]: r["get"] for r in store_rows.get("shm", [])}
        table = Table(title="(c) Prefetch overlap on E-P-D (tiny model, 256-wide features); "
                            "right: the same scheduling latency against a 3584-wide shm get")
        for col in ("image", "feature MiB", "transfer ms", "scheduling ms", "overlap",
                    "3584-wide get ms", "overlap at 3584"):
            table.add_column(col, justify="right")
        seen = []
        for label, samples in overlaps.items():
            if not samples:
                table.add_row(label, "-", "-", "-", "no prefetched load logged", "-", "-")
                seen.append(0.0)
                continue
            transfer = statistics.median(s["transfer_ms"] for s in samples)
            sched = statistics.median(s["sched_ms"] for s in samples)
            overlap = min(s["overlap"] for s in samples)
            seen.append(overlap)
            wide = shm_get.get(ROWS[label])
            wide_overlap = min(1.0, sched / (wide * 1e3)) if wide else float("nan")
            table.add_row(label, f"{samples[0]['bytes'] / 2**20:.2f}", f"{transfer:.2f}",
                          f"{sched:.1f}", f"{overlap:.2%}",
                          f"{wide * 1e3:.2f}" if wide else "-", f"{wide_overlap:.2%}")
        console.print(table)
        overlap_min = min(seen) if seen else float("nan")

    plot(store_rows, handoffs, out / "mmstore.png")
    console.print(f"plot: {out / 'mmstore.png'}")
    (out / "mmstore_bench.json").write_text(json.dumps({
        "store": store_rows,
        "handoff_s": {k: {str(n): v for n, v in d.items()} for k, d in handoffs.items()},
        "peers": PEERS, "overlap": overlaps}, indent=2))
    print(f"summary: shm_get_vs_memcpy={ratio:.2f} shm_get_vs_private_memcpy={private:.2f} "
          f"handoff_rank={worst_rank}/{compared} prefetch_overlap_min={overlap_min:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
