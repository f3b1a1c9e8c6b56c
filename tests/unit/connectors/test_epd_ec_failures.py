"""A consumer worker that cannot load a feature it was promised stops with the reason
instead of computing the step with a stand-in (which would answer wrong, and stay in
vLLM's encoder cache for the next request of that image); a store that is briefly away
is asked again. Against a real shared-memory store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.scheduler import ECStep
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.worker import EPDECWorker, FeatureUnavailable
from epd_serve.mmstore import FeatureMeta, StoreError, open_store

from ...stores import started_shm_store
from .test_epd_ec import feature, request, scheduler

EMBEDS, HIDDEN = 4, 8


@pytest.fixture(scope="module")
def spec():
    with started_shm_store("ec-failures", 8 << 20, port_start=29100) as spec:
        yield spec


@pytest.fixture
def worker(spec):
    made = EPDECWorker(Settings(store=spec, load_timeout_s=0.5), producer=False, consumer=True)
    yield made
    made.shutdown()


def put(spec, key: str, rows: int = EMBEDS) -> torch.Tensor:
    feature = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN)
    with open_store(spec) as store:
        assert store.put(key, feature.numpy().view(np.uint8).reshape(-1),
                         FeatureMeta((rows, HIDDEN), "float32"))
    return feature


class FlakyStore:
    """The real store behind a connection that fails its first `failures` reads."""

    def __init__(self, store, failures: int):
        self.store, self.failures = store, failures

    def get(self, key):
        if self.failures:
            self.failures -= 1
            raise StoreError("the MM Store did not answer in 2000 ms")
        return self.store.get(key)

    def close(self):
        self.store.close()


def test_a_stored_feature_is_loaded_into_the_encoder_cache(spec, worker):
    feature = put(spec, "ok")
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(ECStep(loads={"ok": EMBEDS}), cache)
    assert torch.equal(cache["ok"], feature)


def test_a_feature_the_store_lost_stops_the_engine_instead_of_serving_zeros(spec, worker):
    cache: dict[str, torch.Tensor] = {}
    with pytest.raises(FeatureUnavailable, match="no longer holds"):
        worker.start_load_caches(ECStep(loads={"never-stored": EMBEDS}), cache)
    assert "never-stored" not in cache  # nothing stands in for it


def test_a_store_away_for_a_moment_is_asked_again(spec, worker):
    feature = put(spec, "flaky")
    worker.store = FlakyStore(worker.store, failures=2)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(ECStep(loads={"flaky": EMBEDS}), cache)
    assert torch.equal(cache["flaky"], feature)


def test_a_store_that_stays_away_stops_the_engine_with_the_reason(spec, worker):
    put(spec, "away")
    worker.store = FlakyStore(worker.store, failures=10**6)
    cache: dict[str, torch.Tensor] = {}
    with pytest.raises(FeatureUnavailable, match="did not answer for 0.5s"):
        worker.start_load_caches(ECStep(loads={"away": EMBEDS}), cache)
    assert "away" not in cache


def test_the_scheduler_does_not_promise_a_feature_of_the_wrong_size(spec):
    put(spec, "other-size", rows=EMBEDS - 1)  # `feature()` needs 4 embeddings
    sched = scheduler(spec)
    with_pixels = request("r1", feature("other-size", pixels=True))
    assert sched.ensure_cache_available(with_pixels, 0) is True
    assert not sched.has_cache_item("other-size")  # the engine encodes it itself
    reference_only = request("r2", feature("other-size"))
    assert sched.ensure_cache_available(reference_only, 0) is False
    # Failed for the proxy to resend (where vLLM can fail it: compat.EC_FAILS_REQUESTS).
    assert sched.take_unavailable_requests() == ({"r2"} if compat.EC_FAILS_REQUESTS else set())


def test_a_feature_of_the_wrong_size_is_not_used(spec, worker):
    put(spec, "short", rows=EMBEDS - 1)
    cache: dict[str, torch.Tensor] = {}
    with pytest.raises(FeatureUnavailable, match="needs 4 embeddings"):
        worker.start_load_caches(ECStep(loads={"short": EMBEDS}), cache)
