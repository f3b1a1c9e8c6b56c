"""How fast a reader of vLLM's shared-memory queue wakes for a message: vLLM's spin,
against our naps (backends/cpu/idle_wait.py), on an idle host and with the cores busy.

Two processes play an engine step in a loop, as vLLM's engine core and worker do over
two MessageQueues: the "core" takes 1 ms, enqueues a step; the "worker" dequeues it,
takes 5 ms, enqueues its answer, which the core dequeues. What a step costs beyond
those 6 ms is the queues' (both directions' wake-ups); median, p90 and max over
`--steps`, for each way of waiting:
- `spin`: vLLM's own wait (sched_yield for 1 s after every read);
- `nap1`, `nap50`: our nap on the writer's notification, at most 1 / 50 ms at a time.
A nap that ends on the notification costs a wake-up; one whose notification never came
costs up to the whole nap, which `nap50` makes plain (tens of ms a step).
With `--busy N`, N processes spin on the cores meanwhile (a shared host's neighbours).

    .venv/bin/python benchmarks/shm_queue_wake.py [--steps 100] [--busy 0,2]

Ends with one line per load:
  summary: busy=<N> spin_ms=<median> nap1_ms=<median> nap50_ms=<median>
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

CORE_MS, WORKER_MS = 1.0, 5.0
WAYS = ("spin", "nap1", "nap50")


def wait_as(way: str) -> None:
    """Make this process's queue readers wait `way` (vLLM's spin is its default)."""
    if way.startswith("nap"):
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        from epd_serve.backends.cpu.idle_wait import nap_instead_of_spin

        nap_instead_of_spin(SpinCondition, int(way[3:]))


def compute(ms: float) -> None:
    """Hold the CPU for `ms`, as a step's work would (a sleep would free the core)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def worker(steps_handle, answers_to, way: str, steps: int) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    wait_as(way)
    step_queue = MessageQueue.create_from_handle(steps_handle, 0)
    answer_queue = MessageQueue(1, 1)
    answers_to.put(answer_queue.export_handle())
    step_queue.wait_until_ready()
    answer_queue.wait_until_ready()
    for _ in range(steps + 1):  # one to start with
        step_queue.dequeue()
        compute(WORKER_MS)
        answer_queue.enqueue(b"answer")


def neighbour(seconds: float) -> None:
    compute(seconds * 1e3)


def overheads(way: str, steps: int) -> list[float]:
    """Milliseconds each step took beyond its 6 ms of work."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    wait_as(way)
    ctx = mp.get_context("spawn")
    step_queue = MessageQueue(1, 1)
    handles = ctx.Queue()
    proc = ctx.Process(target=worker, args=(step_queue.export_handle(), handles, way, steps))
    proc.start()
    answer_queue = MessageQueue.create_from_handle(handles.get(timeout=120), 0)
    step_queue.wait_until_ready()
    answer_queue.wait_until_ready()
    step_queue.enqueue(b"start")
    answer_queue.dequeue()
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        compute(CORE_MS)
        step_queue.enqueue(b"step")
        answer_queue.dequeue()
        out.append((time.perf_counter() - start) * 1e3 - CORE_MS - WORKER_MS)
    proc.join(timeout=60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--busy", default="0,2", help="neighbour processes per load, "
                        "comma-separated")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for busy in (int(n) for n in args.busy.split(",")):
        medians = {}
        for way in WAYS:
            # Each way gets its own neighbours, for about as long as its steps take.
            neighbours = [ctx.Process(target=neighbour, args=(args.steps * 0.02 + 10,))
                          for _ in range(busy)]
            for proc in neighbours:
                proc.start()
            try:
                steps = sorted(overheads(way, args.steps))
            finally:
                for proc in neighbours:
                    proc.terminate()
                    proc.join()
            medians[way] = statistics.median(steps)
            print(f"busy={busy} {way:6} step overhead median {medians[way]:.2f} ms  "
                  f"p90 {steps[int(0.9 * len(steps))]:.2f}  max {steps[-1]:.1f}", flush=True)
        print(f"summary: busy={busy} " + " ".join(f"{way}_ms={medians[way]:.2f}"
                                                  for way in WAYS), flush=True)


if __name__ == "__main__":
    main()
