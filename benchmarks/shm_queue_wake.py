"""How fast a reader of vLLM's shared-memory queue wakes for a message: vLLM's spin,
against the CPU plugin's naps (backends/cpu/idle_wait.py), with and without its fix for
dropped notifications, on an idle host and beside busy neighbours.

A writer process sends messages in pairs, the second 0.3 ms after the first, as vLLM
0.32's engine core sends a step (the model run, then the sampling), and rests 10 ms
between pairs; the reader process takes the first, then waits for the second. The gap
between the two reads is what the reader paid to wake for the second: about 0.3 ms when
it woke at once. Median, p90 and max over `--pairs`, for each way of waiting:
- `spin`: vLLM's own wait (sched_yield for 1 s after every read);
- `nap1`, `nap50`: the plugin's: readers nap on the writer's notification, at most 1 /
  50 ms at a time, and writers drop none;
- `nap1-drops`, `nap50-drops`: the same naps with vLLM's own notify, which drops a
  notification sent within about a millisecond of the previous one: the reader then
  naps to the end (up to the next pair's notification, 10 ms later, with 50 ms naps).
With `--busy N`, N processes spin on the cores meanwhile (a shared host's neighbours).

    .venv/bin/python benchmarks/shm_queue_wake.py [--pairs 60] [--busy 0,2]

Ends with one line per load:
  summary: busy=<N> spin_ms=<median gap> nap1_ms=<...> nap50_ms=<...> ...
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

SECOND_AFTER_MS, REST_MS = 0.3, 10.0
WAYS = ("spin", "nap1", "nap50", "nap1-drops", "nap50-drops")


def wait_as(way: str) -> None:
    """Make this process's queues wait `way` (vLLM's spin is its default)."""
    if way.startswith("nap"):
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        from epd_serve.backends.cpu.idle_wait import nap_instead_of_spin, notify_without_drops

        nap, _, drops = way[3:].partition("-")
        nap_instead_of_spin(SpinCondition, int(nap))
        if not drops:
            notify_without_drops(SpinCondition)


def compute(ms: float) -> None:
    """Hold the CPU for `ms` (a sleep would free the core)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def reader(handle, way: str, pairs: int, results) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    wait_as(way)
    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    gaps = []
    for _ in range(pairs):
        queue.dequeue()
        first = time.perf_counter()
        queue.dequeue()
        gaps.append((time.perf_counter() - first) * 1e3)
    results.send(gaps)


def writer(way: str, pairs: int, results) -> None:
    """Sends the pairs to a reader of its own (each way in fresh processes: a patch
    stays for the life of the process that made it)."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    wait_as(way)
    ctx = mp.get_context("spawn")
    queue = MessageQueue(1, 1)
    proc = ctx.Process(target=reader, args=(queue.export_handle(), way, pairs, results))
    proc.start()
    queue.wait_until_ready()
    time.sleep(0.5)  # the reader's subscription reaches the writer
    for _ in range(pairs):
        queue.enqueue(b"run the model")
        compute(SECOND_AFTER_MS)
        queue.enqueue(b"sample")
        time.sleep(REST_MS / 1e3)
    proc.join(timeout=60)


def gaps_ms(way: str, pairs: int) -> list[float]:
    """Milliseconds from taking each pair's first message to taking its second."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=writer, args=(way, pairs, theirs))
    proc.start()
    gaps = ours.recv()
    proc.join(timeout=60)
    return gaps


def neighbour(seconds: float) -> None:
    compute(seconds * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--busy", default="0,2", help="neighbour processes per load, "
                        "comma-separated")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for busy in (int(n) for n in args.busy.split(",")):
        medians = {}
        for way in WAYS:
            # Each way gets its own neighbours, for about as long as its pairs take.
            neighbours = [ctx.Process(target=neighbour, args=(args.pairs * 0.02 + 10,))
                          for _ in range(busy)]
            for proc in neighbours:
                proc.start()
            try:
                gaps = sorted(gaps_ms(way, args.pairs))
            finally:
                for proc in neighbours:
                    proc.terminate()
                    proc.join()
            medians[way] = statistics.median(gaps)
            print(f"busy={busy} {way:11} first -> second read: median {medians[way]:.2f} ms"
                  f"  p90 {gaps[int(0.9 * len(gaps))]:.2f}  max {gaps[-1]:.1f}", flush=True)
        print(f"summary: busy={busy} " + " ".join(f"{way}_ms={medians[way]:.2f}"
                                                  for way in WAYS), flush=True)


if __name__ == "__main__":
    main()
