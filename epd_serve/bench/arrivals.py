"""When each request of a load run is sent: offsets in seconds from the run's start.

Pure numpy; the processes AISBench offers (fixed rate, Poisson, gamma with burstiness,
linear/exponential ramp-up, all at once) plus replay of a recorded trace. A seed makes
every schedule reproducible.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Literal

import numpy as np

PROCESSES = ("fixed", "poisson", "gamma", "ramp-linear", "ramp-exp", "burst", "trace")
Process = Literal[PROCESSES]


def fixed(n: int, rate: float) -> np.ndarray:
    """One request every 1/rate seconds."""
    _check_rate(rate)
    return np.arange(n, dtype=float) / rate


def gamma(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gamma-distributed gaps with mean 1/rate. burstiness = the gamma shape: 1 is a
    Poisson process, below 1 burstier, above 1 more regular (vLLM's convention)."""
    _check_rate(rate)
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


def poisson(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Exponential gaps with mean 1/rate."""
    return gamma(n, rate, 1.0, seed)


def ramp_linear(n: int, start_rate: float, end_rate: float) -> np.ndarray:
    """Rate rising linearly from start_rate to end_rate over the run: request i goes
    when the cumulative intensity reaches i."""
    _check_rate(start_rate)
    _check_rate(end_rate)
    duration = 2.0 * n / (start_rate + end_rate)
    slope = (end_rate - start_rate) / duration
    i = np.arange(n, dtype=float)
    if abs(slope) < 1e-12:
        return i / start_rate
    # start_rate*t + slope*t^2/2 = i  ->  positive root
    return (-start_rate + np.sqrt(start_rate**2 + 2.0 * slope * i)) / slope


def ramp_exponential(n: int, start_rate: float, end_rate: float) -> np.ndarray:
    """Rate growing exponentially from start_rate to end_rate over the run."""
    _check_rate(start_rate)
    _check_rate(end_rate)
    i = np.arange(n, dtype=float)
    if math.isclose(start_rate, end_rate):
        return i / start_rate
    k = (end_rate - start_rate) / n  # from N = (end - start) / k
    return np.log1p(k * i / start_rate) / k


def burst(n: int) -> np.ndarray:
    """Everything at once (pair with a concurrency cap)."""
    return np.zeros(n)


def load_trace(path: str | Path, speedup: float = 1.0) -> np.ndarray:
    """Offsets from a recorded trace: JSONL with a "timestamp" (seconds) per line, or a
    CSV with a "timestamp" column; `speedup` > 1 replays faster."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open() as f:
            stamps = [float(row["timestamp"]) for row in csv.DictReader(f)]
    else:
        stamps = [float(json.loads(line)["timestamp"]) for line in path.read_text().splitlines()
                  if line.strip()]
    if not stamps:
        raise ValueError(f"trace {path} has no timestamps")
    arr = np.sort(np.asarray(stamps, dtype=float))
    return (arr - arr[0]) / speedup


def schedule(process: str, n: int, rate: float | None = None, *, burstiness: float = 1.0,
             end_rate: float | None = None, trace: str | None = None, speedup: float = 1.0,
             seed: int = 0) -> np.ndarray:
    """Offsets for `n` requests under a named process (the trace decides n itself)."""
    if process == "trace":
        if not trace:
            raise ValueError("the trace process needs a trace file")
        return load_trace(trace, speedup)
    if process == "burst":
        return burst(n)
    if rate is None:
        raise ValueError(f"the {process} process needs a request rate")
    if process == "fixed":
        return fixed(n, rate)
    if process == "poisson":
        return poisson(n, rate, seed)
    if process == "gamma":
        return gamma(n, rate, burstiness, seed)
    if process in ("ramp-linear", "ramp-exp"):
        if end_rate is None:
            raise ValueError(f"the {process} process needs an end rate")
        fn = ramp_linear if process == "ramp-linear" else ramp_exponential
        return fn(n, rate, end_rate)
    raise ValueError(f"unknown arrival process {process!r}; choose one of {', '.join(PROCESSES)}")


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
