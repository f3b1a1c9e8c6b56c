"""Who used the CPU while a request's hop computed: each process's CPU time inside each
engine phase of a request's timeline (P's prefill, D's wait for the KV, ...).

On a host whose cores the instances share, a hop can take longer in a disaggregated
deployment than the same work in one instance because other processes run inside it
(decode's frontend and engine loop inside prefill's forward, the proxy, the store).
`CpuSampler` reads every watched process's time on a CPU (the kernel's per-thread
`schedstat`, in ns) every few milliseconds; `cpu_within` gives each group's share of
one window of those samples; `phase_windows` the windows of one timeline
(proxy/timeline.py's JSON, as waterfall.py reads it). numpy for the sums and the
interpolation; `/proc` read directly (psutil's CPU times count in 10 ms ticks, longer
than the phases measured).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping

import numpy as np

from epd_serve.bench.waterfall import ENGINE_SPAN, spans_by_parent

SAMPLE_EVERY_S = 0.002


def runtime_ns(pid: int) -> int:
    """Time the process's threads have spent on a CPU so far, in ns (0 once it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended between the listing and the read
    return total


class CpuSampler:
    """Samples, in a thread of its own, each group's CPU time (its processes' together)
    against the wall clock (time.time_ns, the clock of the timelines' spans)."""

    def __init__(self, groups: Mapping[str, Iterable[int]], every_s: float = SAMPLE_EVERY_S):
        self.names = list(groups)
        self._pids = [list(pids) for pids in groups.values()]
        self.every_s = every_s
        self._rows: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time_ns()
            self._rows.append([now] + [sum(runtime_ns(pid) for pid in pids)
                                       for pids in self._pids])
            self._stop.wait(self.every_s)

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Wall times (ns, shape n) and each group's cumulative CPU time (ns, n x groups)."""
        rows = np.array(self._rows, dtype=np.int64).reshape(-1, 1 + len(self.names))
        return rows[:, 0], rows[:, 1:]


def cpu_within(times: np.ndarray, cumulative: np.ndarray, start_ns: int,
               end_ns: int) -> np.ndarray:
    """Each group's CPU time between `start_ns` and `end_ns`, in ms, interpolated
    linearly between the samples around each end."""
    if len(times) < 2 or end_ns <= start_ns:
        return np.zeros(cumulative.shape[1])
    t = times.astype(np.float64)
    at = [np.interp([start_ns, end_ns], t, cumulative[:, g].astype(np.float64))
          for g in range(cumulative.shape[1])]
    return np.array([(b - a) / 1e6 for a, b in at])


def phase_windows(timeline: dict) -> list[tuple[str, int, int]]:
    """The engine phases of one request's successful hops, as ("P prefill", start_ns,
    end_ns) in the order the timeline has them; phases of no length are left out."""
    spans = timeline["spans"]
    by_parent = spans_by_parent(spans)
    out = []
    for hop in spans:
        if hop["source"] != "proxy" or hop["name"] == "request" \
                or hop.get("attrs", {}).get("failed"):
            continue
        stage = hop["name"].removesuffix(" hop")
        for engine in by_parent.get(hop.get("span_id") or "-", []):
            if engine["name"] != ENGINE_SPAN:
                continue
            for phase in by_parent.get(engine.get("span_id") or "-", []):
                if phase["end_ns"] > phase["start_ns"]:
                    out.append((f"{stage} {phase['name']}", phase["start_ns"], phase["end_ns"]))
    return out
