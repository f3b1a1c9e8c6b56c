"""An engine's store client needs no store to be there: with none, reads miss and puts
raise StoreError at once (the engine encodes images itself); once a server answers, the
client attaches by itself and every call reaches it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epd_serve.mmstore import FeatureMeta, StoreError, StoreSpec, attach_store
from epd_serve.mmstore.service import StartedStore

from ...ports import free_port_block
from ...waiting import wait_for

META = FeatureMeta((10,), "uint8")


def test_a_client_made_without_a_store_serves_misses_then_attaches_when_one_comes():
    base = free_port_block(2, start=27200)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name="attach")
    started = time.monotonic()
    store = attach_store(spec, wait_s=0.0)
    try:
        assert not store.attached and time.monotonic() - started < 10
        asked = time.monotonic()
        assert store.get("k") is None and store.lookup("k") is None
        with pytest.raises(StoreError, match="not attached"):
            store.put("k", np.ones(10, np.uint8), META)
        assert time.monotonic() - asked < 1.0  # no call waits for an attempt
        def attached() -> bool:
            store.get("k")  # a call starts an attempt, at most every retry_s
            return store.attached

        with StartedStore(spec):
            wait_for(attached, "attached to the store that came", timeout=30)
            assert store.put("k", np.full(10, 7, np.uint8), META)
            assert (store.get("k")[0] == 7).all()
    finally:
        store.close()
