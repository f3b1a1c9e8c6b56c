"""The feature loader of a consumer (prefill, or decode recomputing; an ec_both instance
is one): features read from the MM Store into this instance's own memory before the
scheduler promises them to vLLM.

Runs beside the EC connector's scheduler side, in the engine-core process. Two ways a
read starts: a prefetch hint (the proxy sends the hashes of a request's features to the
listener the moment the encoder is done, before the request itself: msgpack list of
keys on a ZeroMQ PULL socket), or the scheduler asking for a feature a waiting request
needs. The listener reads what it is hinted, a reader thread what requests ask for
(copies are bound by memory bandwidth: more threads would not make them faster). The
scheduler only says "cached" for a feature whose private copy is here, so a store that
lost the feature, restarted, or stopped answering shows up before vLLM's decision and
becomes local encoding, never a step that cannot run. A copy lasts as long as a request
holds it; a prefetched copy no request has taken yet stays within a byte budget and for
`UNCLAIMED_TTL_S`. A video's features stored in chunks (protocols/feature_chunks.py) are
read chunk by chunk and joined in order; one chunk missing is the whole missing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from epd_serve.mmstore import FeatureMeta, FeatureStore, StoreError
from epd_serve.protocols.feature_chunks import part_keys

log = logging.getLogger("vllm.epd_serve.ec")

UNCLAIMED_TTL_S = 120.0
# After the store failed a read (not a miss: an error), reads fail at once for this
# long instead of each waiting for the store's own timeout while it is away.
STORE_RETRY_AFTER_S = 2.0


class ChunksDisagree(ValueError):
    """A feature's chunks cannot be joined (their shapes or dtypes differ)."""


@dataclass
class Feature:
    """One feature read (or being read) into this process."""

    key: str
    asked_at: float  # when the read was asked for (by a hint or by a request)
    hinted: bool  # asked for by a prefetch hint first
    needed_at: float | None = None  # when a request first waited for it
    done: threading.Event = field(default_factory=threading.Event)
    ready_at: float = 0.0
    result: tuple[np.ndarray, FeatureMeta] | None = None
    error: str | None = None  # why the read failed (None with no result: a miss)
    holders: int = 0  # requests that hold this copy

    @property
    def nbytes(self) -> int:
        return self.result[0].nbytes if self.result is not None else 0

    @property
    def source(self) -> str:
        """How the read met the request: hinted and here before it was needed, hinted
        but late, or read only when a request asked."""
        if not self.hinted:
            return "on_demand"
        if self.needed_at is None or self.ready_at <= self.needed_at:
            return "prefetched"
        return "prefetch_late"

    @property
    def overlap(self) -> float | None:
        """The share of a hinted read done before a request needed it."""
        if not self.hinted or self.needed_at is None:
            return None
        busy = self.ready_at - self.asked_at
        exposed = max(0.0, self.ready_at - self.needed_at)
        return 1.0 - exposed / busy if busy > 0 else 1.0


class FeatureLoader:
    def __init__(self, store: FeatureStore, budget_bytes: int,
                 listen: tuple[str, int] | None = None):
        self.store = store
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._features: OrderedDict[str, Feature] = OrderedDict()  # oldest first
        self._todo: queue.SimpleQueue[Feature | None] = queue.SimpleQueue()
        self._store_away_until = 0.0
        self._reader = threading.Thread(target=self._read_loop, name="epd-ec-loader",
                                        daemon=True)
        self._reader.start()
        self._stop = threading.Event()
        self._ctx = self._sock = self._listener = None
        if listen is not None:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PULL)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(f"tcp://{listen[0]}:{listen[1]}")
            self._listener = threading.Thread(target=self._listen, name="epd-ec-hints",
                                              daemon=True)
            self._listener.start()

    # -- asking for features -------------------------------------------------------------
    def hint(self, keys: list[str]) -> None:
        """Read `keys` now, in the calling thread (the listener's: a hand-over to the
        reader thread would cost a wake-up on the path the hint exists to shorten)."""
        now = time.monotonic()
        with self._lock:
            self._forget_unheld(now)
            new = [item for key in keys if (item := self._ask(key, now, hinted=True))]
        for item in new:
            self._read_one(item)

    def want(self, key: str) -> Feature:
        """The read of `key` for a request that waits for it, started if need be. A
        failed read is handed out once, then forgotten, so the next request asks the
        store again."""
        now = time.monotonic()
        with self._lock:
            self._forget_unheld(now)
            item = self._ask(key, now, hinted=False) or self._features[key]
            if item.needed_at is None:
                item.needed_at = now
            if item.done.is_set() and item.result is None:
                self._drop(key)
            return item

    def read_now(self, key: str, wait_s: float) -> Feature | None:
        """The copy of `key`, its read started now if none is under way, waiting at most
        `wait_s` for it; None if it is not here by then (the read goes on) or the store
        has no such feature."""
        item = self.want(key)
        if not item.done.wait(wait_s):
            return None  # still reading: the copy stays for a request that comes later
        if item.result is None:
            with self._lock:
                if self._features.get(key) is item:
                    self._drop(key)  # forgotten: the next request asks the store again
            return None
        return item

    def _ask(self, key: str, now: float, hinted: bool) -> Feature | None:
        """A new read of `key` (None if one is here or under way already); a request's
        read goes to the reader thread, a hint's the caller does."""
        if key in self._features:
            return None
        item = self._features[key] = Feature(key, now, hinted)
        if not hinted:
            self._todo.put(item)
        return item

    def hold(self, item: Feature) -> None:
        with self._lock:
            item.holders += 1

    def release(self, item: Feature, keep: bool = False) -> None:
        """A request is done with the copy. The last one's going drops it: the engine's
        encoder cache keeps what it wants to reuse, a second copy here would only double
        the memory. `keep`: a hold taken for one scheduling pass that no request took
        over: the copy goes back to the unheld ones (budget, TTL) for the next pass."""
        with self._lock:
            item.holders -= 1
            if item.holders == 0 and not keep and self._features.get(item.key) is item:
                self._drop(item.key)

    def copy_here(self, key: str, needed: bool = False) -> Feature | None:
        """The finished read of `key` with the feature in hand, if there is one; starts
        no read and never waits. `needed`: a request needs it now (for its timings)."""
        with self._lock:
            item = self._features.get(key)
            if item is None or not item.done.is_set() or item.result is None:
                return None
            if needed and item.needed_at is None:
                item.needed_at = time.monotonic()
            return item

    def has_copy(self, key: str) -> bool:
        """Whether a read of `key` is done here with the feature in hand."""
        return self.copy_here(key) is not None

    # -- reading ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while (item := self._todo.get()) is not None:
            self._read_one(item)

    def _read_one(self, item: Feature) -> None:
        try:
            self._read(item)
        except Exception as err:  # noqa: BLE001 - a bug here must not stop the loader
            log.exception("epd-ec reading %s failed", item.key)
            item.error = f"{type(err).__name__}: {err}"
        finally:
            item.ready_at = time.monotonic()
            with self._lock:
                item.done.set()
                self._trim()

    def _read(self, item: Feature) -> None:
        if time.monotonic() < self._store_away_until:
            item.error = "the MM Store failed a read moments ago"
            return
        try:
            parts = part_keys(item.key)
            item.result = self.store.get(item.key) if parts is None else self._joined(parts)
        except ChunksDisagree as err:  # the store answered: one video's data is bad
            item.error = str(err)
            log.warning("epd-ec %s", err)
        except StoreError as err:
            self._store_away_until = time.monotonic() + STORE_RETRY_AFTER_S
            item.error = str(err)
            log.warning("epd-ec reading %s from the MM Store failed: %s", item.key, err)

    def _joined(self, parts: list[str]) -> tuple[np.ndarray, FeatureMeta] | None:
        """A feature stored in chunks (a video's frames encoded in parts), joined in
        order; a miss if any chunk is (the request then encodes the whole here)."""
        read = []
        for key in parts:
            found = self.store.get(key)
            if found is None:
                log.info("epd-ec %s is not in the MM Store: its whole is encoded here", key)
                return None
            read.append(found)
        first = read[0][1]
        rows = 0
        for _, meta in read:
            if meta.dtype != first.dtype or tuple(meta.shape[1:]) != tuple(first.shape[1:]):
                raise ChunksDisagree(f"the chunks of {parts[0]} disagree: {meta.shape} "
                                     f"{meta.dtype} after {first.shape} {first.dtype}")
            rows += meta.shape[0]
        data = np.concatenate([data for data, _ in read])
        return data, FeatureMeta((rows, *first.shape[1:]), first.dtype)

    # -- the hint listener ---------------------------------------------------------------
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

    # -- what stays here -------------------------------------------------------------------
    def _forget_unheld(self, now: float) -> None:
        for key, item in list(self._features.items()):
            if (item.done.is_set() and item.holders == 0
                    and now - item.asked_at >= UNCLAIMED_TTL_S):
                self._drop(key)

    def _trim(self) -> None:
        """Drop copies nobody holds, oldest first, while the unheld bytes exceed the
        budget (held copies are not counted: their requests need them)."""
        unheld = [(k, i) for k, i in self._features.items()
                  if i.done.is_set() and i.holders == 0]
        excess = sum(i.nbytes for _, i in unheld) - self.budget_bytes
        for key, item in unheld:  # oldest first
            if excess <= 0:
                break
            excess -= item.nbytes
            self._drop(key)

    def _drop(self, key: str) -> None:
        self._features.pop(key, None)

    def close(self) -> None:
        self._stop.set()
        self._todo.put(None)
        if self._listener is not None:
            self._listener.join(timeout=1)
            self._sock.close()
            self._ctx.term()
        self._reader.join(timeout=1)
