"""Whatever befalls the MM Store, a consumer never stops its engine and never computes
with a stand-in: a feature is promised only once its bytes are in the instance, so a
store that loses it later costs nothing, and one that lost it, or does not answer,
turns into local encoding (or a failed request when there is no image to encode) before
vLLM decides. Against a real shared-memory store."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.worker import EPDECWorker
from epd_serve.mmstore import FeatureMeta, StoreError, StoreSpec, open_store
from epd_serve.mmstore.service import StartedStore

from ...ports import free_port_block
from ...waiting import wait_for
from .test_epd_ec import decided, feature, request, scheduler, step, store_feature

EMBEDS, HIDDEN = 4, 8


@pytest.fixture
def worker(store_spec):
    made = EPDECWorker(Settings(store=store_spec), producer=False, consumer=True)
    yield made
    made.shutdown()


def put(store_spec, key: str, rows: int = EMBEDS) -> torch.Tensor:
    feature = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN)
    with open_store(store_spec) as store:
        assert store.put(key, feature.numpy().view(np.uint8).reshape(-1),
                         FeatureMeta((rows, HIDDEN), "float32"))
    return feature


class StalledStore:
    """The real store behind a connection whose reads fail (`fails`) or hang until
    released (a store server gone, or one that stopped answering)."""

    def __init__(self, store, fails: bool = False):
        self.store, self.fails = store, fails
        self.released = threading.Event()

    def get(self, key):
        if self.fails:
            raise StoreError("the MM Store did not answer in 2000 ms")
        self.released.wait(10)
        return self.store.get(key)

    def close(self):
        self.released.set()
        self.store.close()


def test_a_consumer_worker_loads_what_the_step_carries_without_the_store(store_spec, worker):
    feature_ = put(store_spec, "ok")
    sched = scheduler(store_spec)
    req = request("r0", feature("ok"))
    assert decided(sched, req)
    sched.update_state_after_alloc(req, 0)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(sched.build_connector_meta(step()), cache)
    assert torch.equal(cache["ok"], feature_)
    assert worker.store is None  # nothing in a step can wait on the store
    sched.shutdown()


def test_a_feature_the_store_loses_after_the_promise_is_still_loaded(store_spec, worker):
    # A request queued past the store's lease (Mooncake: 5 s), or a hot image evicted
    # under pressure: the entry is gone by the time the step runs.
    feature_ = put(store_spec, "lapsed")
    sched = scheduler(store_spec)
    req = request("r1", feature("lapsed"))
    assert decided(sched, req)
    with open_store(store_spec) as store:
        assert store.delete("lapsed")
    sched.update_state_after_alloc(req, 0)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(sched.build_connector_meta(step()), cache)
    assert torch.equal(cache["lapsed"], feature_)
    sched.shutdown()


def test_a_store_that_fails_reads_turns_into_local_encoding(store_spec):
    put(store_spec, "unreadable")
    sched = scheduler(store_spec)
    sched.loader.store = StalledStore(sched.loader.store, fails=True)
    with_pixels = request("r2", feature("unreadable", pixels=True))
    assert decided(sched, with_pixels) is True
    assert not sched.has_cache_item("unreadable")  # the engine encodes it itself
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    reference_only = request("r3", feature("unreadable"))
    assert decided(sched, reference_only) is False
    assert sched.take_unavailable_requests() == ({"r3"} if compat.EC_FAILS_REQUESTS else set())
    sched.shutdown()


def test_a_store_that_stops_answering_keeps_a_request_waiting_no_longer_than_the_load_timeout(
        store_spec):
    put(store_spec, "hanging")
    sched = scheduler(store_spec, load_timeout_s=0.3)
    stalled = sched.loader.store = StalledStore(sched.loader.store)
    req = request("r4", feature("hanging", pixels=True))
    assert sched.ensure_cache_available(req, 0) is False  # waits for the read...
    assert decided(sched, req) is True  # ...until the timeout: then encodes it here
    assert not sched.has_cache_item("hanging")
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    stalled.released.set()
    sched.shutdown()


def test_the_scheduler_does_not_promise_a_feature_of_the_wrong_size(store_spec):
    put(store_spec, "other-size", rows=EMBEDS - 1)  # `feature()` needs 4 embeddings
    sched = scheduler(store_spec)
    with_pixels = request("r5", feature("other-size", pixels=True))
    assert decided(sched, with_pixels) is True
    assert not sched.has_cache_item("other-size")  # the engine encodes it itself
    reference_only = request("r6", feature("other-size"))
    assert decided(sched, reference_only) is False
    # Failed for the proxy to resend (where vLLM can fail it: compat.EC_FAILS_REQUESTS).
    assert sched.take_unavailable_requests() == ({"r6"} if compat.EC_FAILS_REQUESTS else set())
    sched.shutdown()


class DeadStore:
    """A store whose server is gone: every put waits out its deadline, then fails."""

    def __init__(self):
        self.puts = 0

    def put(self, key, data, meta):
        self.puts += 1
        raise StoreError("the MM Store did not answer in 2000 ms")

    def close(self):
        pass


def test_an_encoder_whose_store_failed_a_put_skips_puts_for_a_moment(store_spec):
    encoder = EPDECWorker(Settings(store=store_spec), producer=True, consumer=False)
    encoder.store.close()
    encoder.store = dead = DeadStore()
    cache = {key: torch.zeros(EMBEDS, HIDDEN) for key in ("a", "b", "c")}
    for key in cache:  # three images encoded in a row while the store is down
        encoder.save(cache, key)
    # One put waited for the store; the others did not hold their steps.
    assert dead.puts == 1
    assert encoder.recorder.take()["events"]["not_saved"] == 3
    encoder.shutdown()


def test_an_engine_starts_without_the_store_encodes_meanwhile_and_attaches_when_it_comes():
    """The store is down when the engine starts (restarting, crashed): the connector is
    made at once (no 30 s wait ending in an exception that stops the engine), features
    are encoded here meanwhile, and once the store answers they are loaded from it."""
    base = free_port_block(2, start=27300)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name="ec-late-store")
    started = time.monotonic()
    sched = scheduler(spec, open_timeout_s=0.5)
    try:
        assert time.monotonic() - started < 10
        assert decided(sched, request("early", feature("img", pixels=True))) is True
        assert sched.recorder.take()["events"]["encoded_locally"] == 1
        with StartedStore(spec):
            store_feature(spec, "img")
            wait_for(lambda: sched.store.get("img") is not None, "the store attached",
                     timeout=30)
            assert decided(sched, request("late", feature("img"))) is True
            assert sched.recorder.take()["events"]["loaded"] == 1
    finally:
        sched.shutdown()
