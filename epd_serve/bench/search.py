"""The one search every part of the planner needs: the largest value that still passes
a monotone test (the largest batch under a latency limit, the highest request rate
that meets the SLO). Pure Python."""

from __future__ import annotations

from collections.abc import Callable


def largest_passing(passes: Callable[[float], bool], low: float, high: float, *,
                    integer: bool = False, iterations: int = 8) -> float | None:
    """The largest x in [low, high] with passes(x), assuming passes is true up to some
    point and false after it. None when even `low` fails.

    Integers are searched exactly (about log2(high - low) calls); real numbers get
    `iterations` halvings after the two end points.
    """
    if not passes(low):
        return None
    if passes(high):
        return high
    good, bad = low, high
    if integer:
        good, bad = int(good), int(bad)
        while bad - good > 1:
            mid = (good + bad) // 2
            if passes(mid):
                good = mid
            else:
                bad = mid
        return good
    for _ in range(iterations):
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    return good
