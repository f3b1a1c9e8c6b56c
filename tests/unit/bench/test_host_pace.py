"""The host's pace, the yardstick request_latency.py prints beside each round."""

from __future__ import annotations

import statistics
import threading

import pytest

from epd_serve.bench import host_pace


def test_the_pace_is_slower_while_another_thread_takes_the_interpreter_half_the_time():
    """The loop's pace follows how much of a core it gets: a thread spinning beside it
    (sharing the interpreter, as a busy neighbour shares a core) makes it slower. Timed
    alone and shared in turn, three times, so a host whose own pace drifts meanwhile
    moves both sides of each pair alike."""
    ratios = []
    for _ in range(3):
        alone = host_pace.python_loop_ms()
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                sum(range(1000))

        neighbour = threading.Thread(target=spin)
        neighbour.start()
        try:
            shared = host_pace.python_loop_ms()
        finally:
            stop.set()
            neighbour.join()
        assert alone > 0
        ratios.append(shared / alone)
    assert statistics.median(ratios) > 1.25


def test_spread_is_the_slowest_against_the_fastest():
    assert host_pace.spread([100.0, 150.0, 120.0]) == pytest.approx(0.5)
    assert host_pace.spread([80.0, 80.0]) == 0.0
    with pytest.raises(ValueError):
        host_pace.spread([80.0])
