"""The E -> P feature path of our EC connector with CUDA tensors (a GPU machine).

What the connector does on a CUDA deployment, minus vLLM: the encoder's output is on
the GPU; `to_bytes` copies it to the host through the producer's pinned staging buffer
(`HostStaging`, one slot, as the EC worker keeps it) and the producer puts it in the
shared-memory MM Store; a consumer process gets it and `to_tensor` queues its copy to
the GPU through the consumer's own pinned staging (four slots, as the EC worker's), then
waits for it as the model's kernels would. Per Table 3 shape ([rows, 3584] fp16),
medians of `--repeats`, against torch's own device-to-host and host-to-device copies of
the same tensor from pageable memory; the consumer checks it got the same values. Needs
torch with CUDA, numpy, msgspec, pyzmq, xxhash, prometheus_client (no vLLM);
benchmarks/gpu_check.py runs it as its feature part.

    PYTHONPATH=. python benchmarks/mmstore_cuda.py
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import time

import torch

from epd_serve.connectors.epd_ec.codec import HostStaging, to_bytes, to_tensor
from epd_serve.mmstore import StoreSpec, open_store
from epd_serve.mmstore.service import StartedStore

ROWS = {"280x280": 100, "560x560": 400, "640x960": 529, "720x1280": 1196,
        "1080x1920": 2691, "4096x3112": 16206}
WIDTH = 3584
PRODUCER_SLOTS, CONSUMER_SLOTS = 1, 4  # as epd_ec/worker.py's HostStaging (needs vLLM)
COLUMNS = ("torch D2H", "to_bytes", "put", "get", "to_tensor", "torch H2D", "E->P total")


@dataclasses.dataclass
class Row:
    label: str
    nbytes: int
    medians: dict[str, float]  # seconds, by column
    intact: bool  # the consumer got the same values every time


def _consumer(spec_json: str, conn) -> None:
    store = open_store(StoreSpec.from_json(spec_json))
    torch.zeros(1, device="cuda")  # CUDA context up before anything is timed
    staging = HostStaging(slots=CONSUMER_SLOTS)
    while (msg := conn.recv()) is not None:
        key, checksum = msg
        start = time.perf_counter()
        found = store.get(key)
        got = time.perf_counter()
        tensor = to_tensor(found[0], found[1], "cuda:0", staging)  # queued, as the worker
        torch.cuda.synchronize()  # ... until the kernels that use it would run
        done = time.perf_counter()
        same = abs(float(tensor.float().sum()) - checksum) < 1e-3 * max(1.0, abs(checksum))
        conn.send((got - start, done - got, time.monotonic(), same))
    store.close()


def measure(labels: list[str], repeats: int, port: int) -> list[Row]:
    """One row per image size of `ROWS`, medians of `repeats` after a warm-up."""
    spec = StoreSpec(backend="shm", port=port, metrics_port=port + 1,
                     capacity_bytes=1 << 30, name="cuda-check")
    store_service = StartedStore(spec)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(spec.to_json(), theirs))
    child.start()
    staging = HostStaging(slots=PRODUCER_SLOTS)
    rows = []
    try:
        with open_store(spec) as store:
            for label in labels:
                count = ROWS[label]
                cols: dict[str, list[float]] = {c: [] for c in COLUMNS}
                intact = True
                for r in range(repeats + 1):  # the first is a warm-up
                    x = torch.randn(count, WIDTH, dtype=torch.float16, device="cuda")
                    checksum = float(x.float().sum())
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    host = x.to("cpu")
                    d2h = time.perf_counter() - t
                    t = time.perf_counter()
                    host.to("cuda")
                    torch.cuda.synchronize()
                    h2d = time.perf_counter() - t
                    key = f"{label}-{r}"
                    start = time.monotonic()
                    t = time.perf_counter()
                    data, meta = to_bytes(x, staging)
                    encoded = time.perf_counter() - t
                    t = time.perf_counter()
                    assert store.put(key, data, meta)
                    put = time.perf_counter() - t
                    mine.send((key, checksum))
                    get, upload, done, same = mine.recv()
                    intact &= same
                    store.delete(key)
                    if r:
                        for c, v in zip(COLUMNS, (d2h, encoded, put, get, upload, h2d,
                                                  done - start)):
                            cols[c].append(v)
                rows.append(Row(label, count * WIDTH * 2,
                                {c: statistics.median(v) for c, v in cols.items()}, intact))
    finally:
        mine.send(None)
        child.join(timeout=60)
        store_service.close()
    return rows


def print_table(rows: list[Row]) -> None:
    header = ("image", "MiB", *COLUMNS)
    print("milliseconds; to_bytes and to_tensor through pinned staging")
    print(" | ".join(f"{h:>10}" for h in header))
    for row in rows:
        print(" | ".join([f"{row.label:>10}", f"{row.nbytes / 2**20:>10.1f}",
                          *(f"{row.medians[c] * 1e3:>10.3f}" for c in COLUMNS)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--port", type=int, default=18700)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = measure(list(ROWS), args.repeats, args.port)
    print_table(rows)
    ok = all(row.intact for row in rows)
    print(f"values intact on the consumer's GPU: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
