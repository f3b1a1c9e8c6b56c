"""A store client that needs no store to be there: what an engine holds.

Used by the EC connector in every E, P and D engine. An engine must start, and keep
serving, while the MM Store is down (not started yet, restarting, crashed): without
the store a feature is simply not found, and the instance encodes its images itself
(counted as `encoded_locally`). So the client is attached in the background: until a
store answers, reads miss and puts raise StoreError (the worker then stops putting for
a while); every `retry_s` at most, a thread of its own tries to open the real client
(shm or Mooncake, mmstore.open_store), and from then on every call goes to it. No
caller ever waits for an attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from epd_serve.mmstore.base import FeatureMeta, FeatureStore, StoreError

log = logging.getLogger("epd_serve.mmstore")

RETRY_S = 2.0


class AttachingStore(FeatureStore):
    name = "attaching"

    def __init__(self, opener: Callable[[], FeatureStore], what: str, retry_s: float = RETRY_S):
        self._open = opener
        self._what = what  # the store, for messages: "shm MM Store at 127.0.0.1:8990"
        self._retry_s = retry_s
        self._store: FeatureStore | None = None
        self._attempt: threading.Thread | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._try_now()  # most often the store is there: attached before the first call

    @property
    def attached(self) -> bool:
        return self._store is not None

    def _try_now(self) -> None:
        try:
            store = self._open()
        except (StoreError, OSError) as err:
            log.warning("%s is not there (%s): features are encoded here until it is; "
                        "trying again every %g s", self._what, err, self._retry_s)
            return
        with self._lock:
            if self._closed:
                store.close()
                return
            self._store = store
        log.info("%s attached", self._what)

    def _client(self) -> FeatureStore | None:
        """The real client, or None (then an attempt starts, if none runs and the last
        is `retry_s` ago)."""
        store = self._store
        if store is not None:
            return store
        with self._lock:
            now = time.monotonic()
            running = self._attempt is not None and self._attempt.is_alive()
            if not (running or self._closed) and now >= self._next_try:
                self._next_try = now + self._retry_s
                self._attempt = threading.Thread(target=self._try_now, daemon=True,
                                                 name="mmstore-attach")
                self._attempt.start()
        return None

    def _missing(self) -> StoreError:
        return StoreError(f"{self._what} is not attached (not there yet, or restarting)")

    # -- FeatureStore ----------------------------------------------------------------
    def put(self, key: str, data: memoryview | bytes | np.ndarray, meta: FeatureMeta) -> bool:
        store = self._client()
        if store is None:
            raise self._missing()
        return store.put(key, data, meta)

    def get(self, key: str) -> tuple[np.ndarray, FeatureMeta] | None:
        store = self._client()
        return None if store is None else store.get(key)

    def lookup(self, key: str) -> FeatureMeta | None:
        store = self._client()
        return None if store is None else store.lookup(key)

    def pin(self, key: str) -> FeatureMeta | None:
        store = self._client()
        return None if store is None else store.pin(key)

    def unpin(self, key: str) -> None:
        store = self._client()
        if store is not None:
            store.unpin(key)

    def delete(self, key: str) -> bool:
        store = self._client()
        return False if store is None else store.delete(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()
