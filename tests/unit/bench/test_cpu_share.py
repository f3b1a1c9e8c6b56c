"""The CPU each process used inside a request's phases: the windows read from a
timeline, the share of a window from cumulative samples, and the sampler on real
processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from epd_serve.bench.cpu_share import CpuSampler, cpu_within, phase_windows, runtime_ns

MS = 1_000_000  # ns


def span(name, source, start, end, span_id="", parent="", **attrs):
    return {"name": name, "source": source, "start_ns": start * MS, "end_ns": end * MS,
            "span_id": span_id, "parent_id": parent, "attrs": attrs, "events": []}


def test_phase_windows_are_each_successful_hops_engine_phases():
    timeline = {"spans": [
        span("request", "proxy", 0, 100),
        span("P hop", "proxy", 1, 40, span_id="h1", instance="p0", failed=True),
        span("P hop", "proxy", 41, 60, span_id="h2", instance="p1"),
        span("llm_request", "p1", 42, 59, span_id="e2", parent="h2"),
        span("preprocess", "p1", 42, 45, parent="e2"),
        span("queue", "p1", 45, 45, parent="e2"),  # no length: left out
        span("prefill", "p1", 45, 59, parent="e2"),
        span("kv receive", "d0", 50, 70, parent="h3"),  # a connector's span, not a phase
        span("D hop", "proxy", 44, 100, span_id="h3", instance="d0"),
        span("llm_request", "d0", 45, 99, span_id="e3", parent="h3"),
        span("queue", "d0", 47, 70, parent="e3"),
        span("decode", "d0", 71, 99, parent="e3"),
        # the failed hop's engine phases are not the request's
        span("llm_request", "p0", 2, 39, span_id="e1", parent="h1"),
        span("prefill", "p0", 3, 39, parent="e1"),
    ]}
    assert phase_windows(timeline) == [
        ("P preprocess", 42 * MS, 45 * MS), ("P prefill", 45 * MS, 59 * MS),
        ("D queue", 47 * MS, 70 * MS), ("D decode", 71 * MS, 99 * MS)]


def test_cpu_within_interpolates_between_the_samples_around_each_end():
    times = np.array([0, 10, 20, 30]) * MS
    # group 0 runs flat out from 10 ms on; group 1 used 4 ms between 0 and 10, then nothing
    cumulative = np.array([[0, 0], [0, 4], [10, 4], [20, 4]]) * MS
    assert cpu_within(times, cumulative, 15 * MS, 25 * MS) == pytest.approx([10.0, 0.0])
    assert cpu_within(times, cumulative, 5 * MS, 15 * MS) == pytest.approx([5.0, 2.0])
    assert cpu_within(times, cumulative, 0, 30 * MS) == pytest.approx([20.0, 4.0])
    # an empty window, or too few samples to say, uses nothing
    assert cpu_within(times, cumulative, 20 * MS, 20 * MS) == pytest.approx([0.0, 0.0])
    assert cpu_within(times[:1], cumulative[:1], 0, 30 * MS) == pytest.approx([0.0, 0.0])


def busy(cpu_seconds: float) -> None:
    """Compute until this thread has used `cpu_seconds` of CPU (however busy the host)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


# A process that computes for 0.1 s of CPU, then rests 0.2 s, printing the wall clock
# (ns) where it starts computing, stops, and ends its rest.
COMPUTE_THEN_REST = """
import sys, time
print(time.time_ns(), flush=True)
end = time.thread_time() + 0.1
while time.thread_time() < end:
    pass
print(time.time_ns(), flush=True)
time.sleep(0.2)
print(time.time_ns(), flush=True)
"""


def test_runtime_counts_this_process_computing():
    before = runtime_ns(os.getpid())
    busy(0.1)
    assert runtime_ns(os.getpid()) - before >= 100 * MS
    assert runtime_ns(2**22 + 12345) == 0  # no such process


def test_the_sampler_sees_another_process_compute_then_rest():
    child = subprocess.Popen([sys.executable, "-c", COMPUTE_THEN_REST], stdout=subprocess.PIPE,
                             text=True)
    try:
        with CpuSampler({"child": [child.pid]}, every_s=0.002) as sampler:
            start, stop, end = (int(child.stdout.readline()) for _ in range(3))
            time.sleep(0.01)  # a sample after the rest's end
    finally:
        child.wait(timeout=30)
    times, cumulative = sampler.samples()
    assert cumulative.shape == (len(times), 1) and len(times) > 20
    computing = cpu_within(times, cumulative, start, stop)[0]
    resting = cpu_within(times, cumulative, stop, end)[0]
    # Each end is interpolated between the samples around it: 2 ms apart, more on a
    # busy host.
    assert computing > 70 and resting < 20, (computing, resting)
