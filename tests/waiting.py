"""Waiting in tests on state that can be observed, with a deadline, instead of a fixed
sleep: on a busy machine a sleep is either too short (flaky) or wasted time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str = "condition", *, timeout: float = 10.0,
             interval: float = 0.01) -> T:
    """Call `condition` until it returns something truthy, and return that. Fails the
    test (AssertionError naming `what`) if it has not by `timeout` seconds; it is always
    asked once more at the deadline, so a slow scheduler cannot make it give up early.
    The deadline only bounds a failing test: nothing is asserted about how long a
    passing one took."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not so after {timeout:g}s")
        time.sleep(interval)
