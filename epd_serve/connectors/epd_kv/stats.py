"""Transfer telemetry: vLLM's stats container and Prometheus metrics for our connector.

Worker processes record into `EPDKVStats`; vLLM ships the records to the API server,
where `EPDKVPromMetrics.observe` turns them into metrics on the instance's `/metrics`:
- `epd_kv_transfers_total{side}`, `epd_kv_failures_total{side}`, `epd_kv_bytes_total`
- `epd_kv_transfer_seconds` (link busy time), `epd_kv_exposed_seconds` (not hidden
  behind the prefill forward pass), `epd_kv_groups` (writes per transfer)
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_KEYS = ("sent_bytes", "busy_s", "exposed_s", "groups", "send_failures",
         "received", "receive_failures", "internal_errors", "fenced", "fence_expired",
         "stale_writes_refused", "refused_silent_peer")


@dataclasses.dataclass
class EPDKVStats(KVConnectorStats):
    def __post_init__(self):
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    def __getstate__(self) -> dict[str, Any]:  # the lock does not travel
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}

    def record_send(self, nbytes: int, busy_s: float, exposed_s: float, groups: int) -> None:
        with self._lock:
            for key, value in (("sent_bytes", nbytes), ("busy_s", busy_s),
                               ("exposed_s", exposed_s), ("groups", groups)):
                self.data[key].append(value)

    def record(self, key: str) -> None:
        with self._lock:
            self.data[key].append(1)

    def clone_and_reset(self) -> "EPDKVStats":
        with self._lock:
            snapshot = {key: list(values) for key, values in self.data.items()}
            self.reset()
        return EPDKVStats(data=snapshot)

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        sent = len(self.data["sent_bytes"])
        busy = sum(self.data["busy_s"])
        return {
            "transfers sent": sent,
            "MB sent": round(sum(self.data["sent_bytes"]) / 2**20, 3),
            "avg exposed ms": round(sum(self.data["exposed_s"]) / sent * 1e3, 3) if sent else 0,
            "MB/s on the link": round(sum(self.data["sent_bytes"]) / 2**20 / busy, 1) if busy else 0,
            "send failures": len(self.data["send_failures"]),
            "transfers received": len(self.data["received"]),
            "receive failures (recomputed)": len(self.data["receive_failures"]),
            "internal errors": len(self.data.get("internal_errors", [])),
            "transfers held for a silent prefill": len(self.data.get("fenced", [])),
        }


class EPDKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        sides = [*labelnames, "side"]

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self._transfers = self._counter_cls(
            name="epd_kv_transfers_total", labelnames=sides,
            documentation="KV transfers finished by the epd connector (side=send|receive).")
        self._failures = self._counter_cls(
            name="epd_kv_failures_total", labelnames=sides,
            documentation="KV transfers that failed; on the receive side each one was "
                          "recomputed by the decode instance.")
        self._bytes = per_engine(self._counter_cls(
            name="epd_kv_bytes_total", labelnames=labelnames,
            documentation="KV bytes written to decode instances."))
        self._busy = per_engine(self._histogram_cls(
            name="epd_kv_transfer_seconds", labelnames=labelnames,
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5],
            documentation="Time the link spent on one request's KV."))
        self._exposed = per_engine(self._histogram_cls(
            name="epd_kv_exposed_seconds", labelnames=labelnames,
            buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1],
            documentation="Part of one request's KV transfer not hidden behind the "
                          "prefill forward pass."))
        self._internal = self._counter_cls(
            name="epd_kv_internal_errors_total", labelnames=labelnames,
            documentation="Exceptions of the epd connector's own code (a bug of ours), "
                          "each of which cost the request or step it happened in, never "
                          "the engine; the log names the request.")
        self._fence = self._counter_cls(
            name="epd_kv_fence_total", labelnames=[*labelnames, "event"],
            documentation="Late-writer fencing: transfers whose blocks decode held because "
                          "their prefill fell silent, not known gone (event=held); held "
                          "past fence_max_s and given back anyway (event=expired); writes "
                          "prefill refused for a reservation that old (event=refused); "
                          "reservations decode did not send to a prefill silent with "
                          "transfers still held (event=not_reserved: computed on decode).")
        self._groups = per_engine(self._histogram_cls(
            name="epd_kv_groups", labelnames=labelnames, buckets=[1, 2, 4, 8, 16, 32, 64, 128],
            documentation="Writes (layer groups x prefill chunks) per request."))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        for nbytes, busy, exposed, groups in zip(data.get("sent_bytes", []), data.get("busy_s", []),
                                                 data.get("exposed_s", []), data.get("groups", [])):
            self._transfers.labels(*labels, "send").inc()
            self._bytes[engine_idx].inc(nbytes)
            self._busy[engine_idx].observe(busy)
            self._exposed[engine_idx].observe(exposed)
            self._groups[engine_idx].observe(groups)
        for _ in data.get("received", []):
            self._transfers.labels(*labels, "receive").inc()
        for _ in data.get("send_failures", []):
            self._failures.labels(*labels, "send").inc()
        for _ in data.get("receive_failures", []):
            self._failures.labels(*labels, "receive").inc()
        for _ in data.get("internal_errors", []):
            self._internal.labels(*labels).inc()
        for key, event in (("fenced", "held"), ("fence_expired", "expired"),
                           ("stale_writes_refused", "refused"),
                           ("refused_silent_peer", "not_reserved")):
            for _ in data.get(key, []):
                self._fence.labels(*labels, event).inc()
