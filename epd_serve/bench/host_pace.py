"""How fast this host runs a fixed piece of Python right now: a yardstick for the rounds
of a benchmark on a shared machine.

A small cloud host's speed drifts on its own, from second to second, with nothing of
ours running: on a 2-vCPU EPYC the same loop took 244, 182, 333, 215 and 160 ms five
times in 15 s, idle. A benchmark that compares deployments round by round (A B A B)
cannot tell such drift from a deployment's own cost by its latencies alone; timing the
same loop at each round's start shows the host's pace beside them.
"""

from __future__ import annotations

import statistics
import time

LOOP = 500_000  # additions a timing runs: 15-30 ms of one core on those hosts


def python_loop_ms(timings: int = 5) -> float:
    """The median of `timings` timings of the same pure-Python loop, in ms: one core's
    pace for interpreter work, which is most of what a small model's serving runs."""
    taken = []
    for _ in range(timings):
        start = time.perf_counter()
        total = 0
        for i in range(LOOP):
            total += i
        taken.append((time.perf_counter() - start) * 1e3)
    return statistics.median(taken)


def spread(times: list[float]) -> float:
    """The largest relative difference between two timings of the same thing (0.5: the
    slowest took half as long again as the fastest): of the host's paces, or of one
    deployment's rounds."""
    if len(times) < 2:
        raise ValueError("a spread needs at least two timings")
    return (max(times) - min(times)) / min(times)
