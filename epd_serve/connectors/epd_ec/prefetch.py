"""The prefetch listener of a consumer worker (prefill, or decode recomputing).

The proxy sends the hashes of a request's features here the moment the encoder is
done, before it sends the request itself (msgpack list of keys on a ZeroMQ PULL
socket). The listener thread pulls those features from the MM Store into this process
while the request is parsed and scheduled (one after another: copies are bound by
memory bandwidth, and handing them to another thread costs a wake-up), so the load that
vLLM asks for later usually finds the feature already here. Hints are only hints: a feature nobody claims ages out, and
one that was never hinted is read at load time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from epd_serve.mmstore import FeatureMeta, FeatureStore, StoreError

log = logging.getLogger("vllm.epd_serve.prefetch")

UNCLAIMED_TTL_S = 120.0


@dataclass
class Prefetch:
    hinted_at: float
    done: threading.Event = field(default_factory=threading.Event)
    ready_at: float = 0.0
    result: tuple[np.ndarray, FeatureMeta] | None = None


class Prefetcher:
    def __init__(self, store: FeatureStore, host: str, port: int, budget_bytes: int):
        self.store = store
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Prefetch] = OrderedDict()  # oldest hint first
        self._held_bytes = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="epd-ec-hints", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        decoder = msgspec.msgpack.Decoder(list[str])
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            try:
                keys = decoder.decode(self._sock.recv())
            except msgspec.DecodeError as err:
                log.warning("epd-ec prefetch: bad hint dropped: %s", err)
                continue
            self.hint(keys)

    def hint(self, keys: list[str]) -> None:
        """Pull `keys` now, in the calling thread (the listener's)."""
        now = time.monotonic()
        todo = []
        with self._lock:
            self._forget_unclaimed(now)
            for key in keys:
                if key not in self._items:
                    todo.append((key, self._items.setdefault(key, Prefetch(now))))
        for key, item in todo:
            self._fetch(key, item)

    def _fetch(self, key: str, item: Prefetch) -> None:
        try:
            item.result = self.store.get(key)
        except StoreError as err:
            log.warning("epd-ec prefetch of %s failed: %s", key, err)
        item.ready_at = time.monotonic()
        with self._lock:
            # Bytes count against the budget only while the prefetch waits to be claimed.
            if item.result is not None and self._items.get(key) is item:
                self._held_bytes += item.result[0].nbytes
            item.done.set()
            self._trim()

    def claim(self, key: str) -> Prefetch | None:
        """Hand over the prefetch of `key` (the caller waits on `done` if it is still
        under way); None if it was never hinted or has aged out."""
        with self._lock:
            return self._drop(key) if key in self._items else None

    def _forget_unclaimed(self, now: float) -> None:
        while self._items:
            key, item = next(iter(self._items.items()))
            if now - item.hinted_at < UNCLAIMED_TTL_S or not item.done.is_set():
                break
            self._drop(key)

    def _trim(self) -> None:
        for key in [k for k, i in self._items.items() if i.done.is_set()]:
            if self._held_bytes <= self.budget_bytes:
                break
            self._drop(key)

    def _drop(self, key: str) -> Prefetch:
        item = self._items.pop(key)
        if item.done.is_set() and item.result is not None:
            self._held_bytes -= item.result[0].nbytes
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._sock.close()
        self._ctx.term()
