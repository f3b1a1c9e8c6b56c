"""Feature-transfer telemetry of the EC connector, on each instance's `/metrics`.

Workers count what they save and load and return it as worker metadata (vLLM's V1
model runner returns no worker stats for EC connectors); the scheduler side merges
that with its own counts and hands the lot to vLLM, whose API server turns it into:
- `epd_ec_features_total{event}`: saved, not_saved (the store failed the put, or had
  just failed one), loaded, prefetched (ready before needed),
  prefetch_late (the load waited for it), on_demand (no hint, read at load time),
  encoded_locally (a consumer recomputed a missing feature), unavailable
  (missing and no image to recompute from: the request failed for the proxy to retry)
- `epd_ec_bytes_total{direction}`, `epd_ec_store_seconds{op}` (put and get latency)
- `epd_ec_prefetch_overlap` (share of a prefetch hidden before the feature was needed)
A vLLM without a path for these (before 0.32: no EC worker metadata, no EC stats) gets
them as a log line every `LOG_INTERVAL_S` instead (`LoggedCounts`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from vllm.v1.metrics.utils import create_metric_per_engine

from epd_serve.connectors.compat import (
    ECConnectorPromMetrics,
    ECConnectorStats,
    ECConnectorWorkerMetadata,
)

EVENTS = ("saved", "not_saved", "loaded", "prefetched", "prefetch_late", "on_demand",
          "encoded_locally", "unavailable", "internal_error")
SERIES = ("put_bytes", "put_s", "get_bytes", "get_s", "overlap")
LOG_INTERVAL_S = 10.0

log = logging.getLogger("vllm.epd_serve.ec")


def empty() -> dict[str, Any]:
    return {"events": dict.fromkeys(EVENTS, 0), **{key: [] for key in SERIES}}


def merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for event, count in other.get("events", {}).items():
        into["events"][event] = into["events"].get(event, 0) + count
    for key in SERIES:
        into[key].extend(other.get(key, []))


class Recorder:
    """Thread-safe counts kept by one side of the connector until they are shipped."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = empty()

    def count(self, event: str, n: int = 1) -> None:
        with self._lock:
            self._data["events"][event] += n

    def put(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._data["put_bytes"].append(nbytes)
            self._data["put_s"].append(seconds)

    def get(self, nbytes: int, seconds: float, overlap: float | None) -> None:
        with self._lock:
            self._data["get_bytes"].append(nbytes)
            self._data["get_s"].append(seconds)
            if overlap is not None:
                self._data["overlap"].append(overlap)

    def absorb(self, data: dict[str, Any]) -> None:
        with self._lock:
            merge(self._data, data)

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            data, self._data = self._data, empty()
        busy = any(data["events"].values()) or any(data[key] for key in SERIES)
        return data if busy else None


class LoggedCounts:
    """A recorder's counts logged every `interval_s` (when there are any), for a vLLM
    that has no path to carry them to its metrics: failures still show, and the
    recorder does not grow for ever."""

    def __init__(self, recorder: Recorder, side: str, interval_s: float = LOG_INTERVAL_S):
        self.recorder = recorder
        self.side = side
        self.interval_s = interval_s
        self._last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        data = self.recorder.take()
        if data is not None:
            summary = ", ".join(f"{k}={v}" for k, v in EPDECStats(data=data).reduce().items())
            log.info("epd-ec %s counts (this vLLM has no EC metrics path): %s", self.side,
                     summary)


@dataclasses.dataclass
class EPDECWorkerMeta(ECConnectorWorkerMetadata):
    data: dict[str, Any]

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        merge(self.data, other.data)
        return self


@dataclasses.dataclass
class EPDECStats(ECConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = empty()

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not (any(self.data["events"].values()) or any(self.data[k] for k in SERIES))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data["events"].items() if v}
        gets = self.data["get_s"]
        if gets:
            out["avg get ms"] = round(sum(gets) / len(gets) * 1e3, 3)
        if self.data["overlap"]:
            out["min prefetch overlap"] = round(min(self.data["overlap"]), 4)
        return out


class EPDECPromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self._events = self._counter_cls(
            name="epd_ec_features_total", labelnames=[*labelnames, "event"],
            documentation="Encoder features handled by the epd EC connector, by event.")
        self._bytes = self._counter_cls(
            name="epd_ec_bytes_total", labelnames=[*labelnames, "direction"],
            documentation="Feature bytes written to (put) and read from (get) the MM Store.")
        self._seconds = self._histogram_cls(
            name="epd_ec_store_seconds", labelnames=[*labelnames, "op"],
            buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5],
            documentation="Latency of one MM Store put or get.")
        self._overlap = per_engine(self._histogram_cls(
            name="epd_ec_prefetch_overlap", labelnames=labelnames,
            buckets=[0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0],
            documentation="Share of a prefetch done before the feature was needed."))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        for event, count in data.get("events", {}).items():
            if count:
                self._events.labels(*labels, event).inc(count)
        for op in ("put", "get"):
            for nbytes, seconds in zip(data.get(f"{op}_bytes", []), data.get(f"{op}_s", [])):
                self._bytes.labels(*labels, op).inc(nbytes)
                self._seconds.labels(*labels, op).observe(seconds)
        for overlap in data.get("overlap", []):
            self._overlap[engine_idx].observe(overlap)
