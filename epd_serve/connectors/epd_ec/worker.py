"""Worker side of the EC connector (runs in each vLLM worker process).

Producer: after the encoder runs, `save_caches` writes the feature to the MM Store with
its shape, dtype and placeholder metadata; the put is done before the step ends, so
the feature is in the store by the time the encoder's answer reaches the proxy.
Consumer: `start_load_caches` puts each feature the step carries into vLLM's encoder
cache. The scheduler side read those bytes before it promised them (loader.py), so a
load here cannot miss: nothing in a step waits on the store. Where the engine exports
spans, each load is one of its request's timeline ("features load": from the hint, or
from when the request needed it, until it is in the encoder cache).
An `ec_both` worker is both: it stores what it encodes and loads what its scheduler
side read. A feature it loaded is not stored again: the saves of a step are started
before its loads (vLLM 0.32 calls `start_save_caches` first; before, our
`bind_connector_metadata` does that work, also first), and `save_caches` comes only
for what the encoder ran on. Its saves and loads take turns over the same staging
buffers.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.codec import HostStaging, to_bytes, to_tensor
from epd_serve.connectors.epd_ec.loader import STORE_RETRY_AFTER_S
from epd_serve.connectors.epd_ec.scheduler import ECStep, Load
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.stats import EPDECWorkerMeta, LoggedCounts, Recorder
from epd_serve.connectors.spans import ConnectorSpans, wall_ns
from epd_serve.mmstore import FeatureMeta, FeatureStore, StoreError, attach_store

log = logging.getLogger("vllm.epd_serve.ec")

# Pinned buffers a consumer takes in turn for its host-to-device copies. Each grows to
# the largest feature it carried (a 110 MB video feature: 440 MB pinned at most).
CONSUMER_STAGING_SLOTS = 4
# Features seen by the scheduler and not saved yet whose metadata is kept (a few steps'
# worth: far more than a step's encoder budget holds).
PENDING_SAVES = 4096


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # model parallel not initialised (tests, single process)
        return 0


class EPDECWorker:
    def __init__(self, settings: Settings, producer: bool, consumer: bool,
                 spans: ConnectorSpans | None = None):
        from vllm.platforms import current_platform

        self.settings = settings
        self.spans = spans
        self.producer = producer
        self.consumer = consumer
        self.device = compat.accelerator_device(current_platform.device_type)
        # Only a producer talks to the store here: a consumer's scheduler side reads.
        self.store: FeatureStore | None = None
        if producer:
            self.store = attach_store(settings.store, segment_bytes=settings.segment_bytes,
                                      local_host=settings.host, wait_s=settings.open_timeout_s)
        self.recorder = Recorder()
        self._logged = None if compat.EC_WORKER_META else LoggedCounts(self.recorder, "worker")
        # Tensor-parallel ranks all hold the whole feature: one of them stores it, and
        # records a load's span.
        self.first_rank = _tp_rank() == 0
        # What the scheduler said of features to save, kept until they are saved: an
        # item may be encoded steps after its request was first seen (encoder budget).
        self._placeholders: OrderedDict[str, dict] = OrderedDict()
        self._store_as: OrderedDict[str, str] = OrderedDict()  # mm_hash -> proxy's key
        self._store_away_until = 0.0
        # Pinned buffers for the copies between the device and the store's bytes (none
        # on the CPU, where a feature is used where it lies). A producer copies one
        # feature at a time and waits for it; a consumer queues each load and goes on,
        # so it takes turns over a few buffers: one step's features rarely wait.
        self._staging = None
        if self.device != "cpu":
            self._staging = HostStaging(slots=CONSUMER_STAGING_SLOTS if consumer else 1)

    # -- producer ----------------------------------------------------------------------
    def start_save_caches(self, step: ECStep, encoder_cache: dict[str, torch.Tensor]) -> None:
        _remember(self._placeholders, step.publish)
        _remember(self._store_as, step.store_as)
        # An item still in the encoder cache from an earlier request is not encoded
        # again, so save_caches will not fire for it: make sure the store has it.
        for key in step.publish:
            if key in encoder_cache and self._lookup(self._store_as.get(key, key)) is None:
                self.save(encoder_cache, key)

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self.first_rank:
            return
        if time.monotonic() < self._store_away_until:
            # The store just failed a put: skip it for a moment rather than hold every
            # step that encodes an image for the store's round-trip deadline.
            self.recorder.count("not_saved")
            return
        data, meta = to_bytes(encoder_cache[mm_hash], self._staging)
        meta = FeatureMeta(meta.shape, meta.dtype, self._placeholders.pop(mm_hash, {}))
        key = self._store_as.pop(mm_hash, mm_hash)
        start = time.perf_counter()
        try:
            stored = self.store.put(key, data, meta)
        except StoreError as err:
            self._store_away_until = time.monotonic() + STORE_RETRY_AFTER_S
            self.recorder.count("not_saved")
            log.warning("epd-ec could not store %s: %s (consumers will encode it; no puts "
                        "for %gs)", key, err, STORE_RETRY_AFTER_S)
            return
        seconds = time.perf_counter() - start
        if stored:
            self.recorder.put(data.nbytes, seconds)
            self.recorder.count("saved")
            log.info("epd-ec saved mm_hash=%s bytes=%d put_ms=%.2f", key, data.nbytes,
                     seconds * 1e3)

    def _lookup(self, key: str) -> FeatureMeta | None:
        try:
            return self.store.lookup(key)
        except StoreError:
            return None

    # -- consumer ----------------------------------------------------------------------
    def start_load_caches(self, step: ECStep, encoder_cache: dict[str, torch.Tensor]) -> None:
        for key, load in step.loads.items():
            if key not in encoder_cache:
                encoder_cache[key] = self._load(key, load)

    def _load(self, key: str, load: Load) -> torch.Tensor:
        tensor = to_tensor(load.data, load.meta, self.device, self._staging)
        if self.spans is not None and load.trace and self.first_rank:  # one span, not one per rank
            events = [(name, wall_ns(at)) for name, at in sorted(load.marks.items(),
                                                                 key=lambda m: m[1])]
            self.spans.record("features load", load.trace, events[0][1], time.time_ns(),
                              {"epd.ec.key": key, "epd.ec.bytes": int(load.data.nbytes),
                               "epd.ec.source": load.source}, events)
        return tensor

    def step_done(self) -> None:
        """After each step: where vLLM takes no worker metadata, log the counts."""
        if self._logged is not None:
            self._logged.tick()

    def worker_meta(self) -> EPDECWorkerMeta | None:
        data = self.recorder.take()
        return EPDECWorkerMeta(data) if data is not None else None

    def shutdown(self) -> None:
        if self.spans is not None:
            self.spans.close()
        if self.store is not None:
            self.store.close()


def _remember(kept: OrderedDict, new: dict) -> None:
    """Add `new` to `kept`, dropping the oldest past PENDING_SAVES (features an ec_both
    instance loaded rather than encoded are never saved, so never taken out)."""
    kept.update(new)
    while len(kept) > PENDING_SAVES:
        kept.popitem(last=False)
