"""The E -> P feature path of our EC connector with CUDA tensors (a GPU machine).

What the connector does on a CUDA deployment, minus vLLM: the encoder's output is on
the GPU; `to_bytes` copies it to the host (through a pinned staging buffer) and the
producer puts it in the shared-memory
MM Store; a consumer process gets it and `to_tensor` copies it to its GPU. Per Table 3
shape ([rows, 3584] fp16), medians of `--repeats`, against torch's own device-to-host
and host-to-device copies of the same tensor; the consumer checks it got the same
values. Needs torch with CUDA, numpy, msgspec, pyzmq, xxhash, prometheus_client (no
vLLM).

    PYTHONPATH=. python benchmarks/mmstore_cuda.py
"""

from __future__ import annotations

import argparse
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


def _consumer(spec_json: str, conn) -> None:
    store = open_store(StoreSpec.from_json(spec_json))
    torch.zeros(1, device="cuda")  # CUDA context up before anything is timed
    while (msg := conn.recv()) is not None:
        key, checksum = msg
        start = time.perf_counter()
        found = store.get(key)
        got = time.perf_counter()
        tensor = to_tensor(found[0], found[1], "cuda:0")
        torch.cuda.synchronize()
        done = time.perf_counter()
        same = abs(float(tensor.float().sum()) - checksum) < 1e-3 * max(1.0, abs(checksum))
        conn.send((got - start, done - got, time.monotonic(), same))
    store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--port", type=int, default=18700)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    spec = StoreSpec(backend="shm", port=args.port, metrics_port=args.port + 1,
                     capacity_bytes=1 << 30, name="cuda-check")
    store_service = StartedStore(spec)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(spec.to_json(), theirs))
    child.start()
    ok = True
    staging = HostStaging()  # the producer worker keeps one
    header = ("image", "MiB", "torch D2H", "to_bytes", "put", "get", "to_tensor",
              "torch H2D", "E->P total")
    print(" | ".join(f"{h:>10}" for h in header))
    try:
        with open_store(spec) as store:
            for label, rows in ROWS.items():
                cols: dict[str, list[float]] = {h: [] for h in header[2:]}
                for r in range(args.repeats + 1):  # the first is a warm-up
                    x = torch.randn(rows, WIDTH, dtype=torch.float16, device="cuda")
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
                    ok &= same
                    store.delete(key)
                    if r:
                        for h, v in zip(header[2:], (d2h, encoded, put, get, upload, h2d,
                                                     done - start)):
                            cols[h].append(v)
                mib = rows * WIDTH * 2 / 2**20
                print(" | ".join([f"{label:>10}", f"{mib:>10.1f}",
                                  *(f"{statistics.median(v) * 1e3:>10.3f}"
                                    for v in cols.values())]))
    finally:
        mine.send(None)
        child.join(timeout=60)
        store_service.close()
    print(f"values intact on the consumer's GPU: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
