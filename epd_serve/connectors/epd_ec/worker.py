"""Worker side of the EC connector (runs in each vLLM worker process).

Producer: after the encoder runs, `save_caches` writes the feature to the MM Store with
its shape, dtype and placeholder metadata; the put is done before the step ends, so
the feature is in the store by the time the encoder's answer reaches the proxy.
Consumer: `start_load_caches` puts each feature the scheduler pinned into vLLM's
encoder cache, taking it from the prefetch listener when a hint brought it early.
Where the engine exports spans, each load is one of its request's timeline ("features
load": from the hint, or from when the step needed it, until it is loaded).

A pinned feature that cannot be loaded stops the engine (`FeatureUnavailable`) rather
than computing the step without it. vLLM 0.32 gives an EC connector no way to take one
request out of a step that is about to run, and whatever stood in for the feature would
stay in vLLM's encoder cache under the image's hash, where later requests for the same
image would find it: either way a wrong answer nobody is told about. A stopped engine
fails its requests with an error (the proxy retries them elsewhere) and the launcher
restarts it. The scheduler only promises a feature the store holds pinned, so this
takes a store that stopped answering for `load_timeout_s`, or one that lost a pin.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.codec import HostStaging, to_bytes, to_tensor
from epd_serve.connectors.epd_ec.prefetch import Prefetcher
from epd_serve.connectors.epd_ec.scheduler import ECStep
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.stats import EPDECWorkerMeta, LoggedCounts, Recorder
from epd_serve.connectors.spans import ConnectorSpans, wall_ns
from epd_serve.mmstore import FeatureMeta, FeatureStore, StoreError, open_store

log = logging.getLogger("vllm.epd_serve.ec")

# Pinned buffers a consumer takes in turn for its host-to-device copies. Each grows to
# the largest feature it carried (a 110 MB video feature: 440 MB pinned at most).
CONSUMER_STAGING_SLOTS = 4


class FeatureUnavailable(RuntimeError):
    """A feature the scheduler promised could not be loaded: the engine must stop."""


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
        self.store: FeatureStore = open_store(
            settings.store, segment_bytes=settings.segment_bytes if producer else 0,
            local_host=settings.host, wait_s=settings.open_timeout_s)
        self.recorder = Recorder()
        self._logged = None if compat.EC_WORKER_META else LoggedCounts(self.recorder, "worker")
        # Tensor-parallel ranks all hold the whole feature. One of them stores it and
        # listens for hints (one port per instance); the others read it when needed.
        self.first_rank = _tp_rank() == 0
        self.prefetcher = None
        if consumer and settings.prefetch_port is not None and self.first_rank:
            self.prefetcher = Prefetcher(self.store, settings.host,
                                         settings.prefetch_port, settings.prefetch_budget_bytes)
        self._placeholders: dict[str, dict] = {}
        # Pinned buffers for the copies between the device and the store's bytes (none
        # on the CPU, where a feature is used where it lies). A producer copies one
        # feature at a time and waits for it; a consumer queues each load and goes on,
        # so it takes turns over a few buffers: one step's features rarely wait.
        self._staging = None
        if self.device != "cpu":
            self._staging = HostStaging(slots=CONSUMER_STAGING_SLOTS if consumer else 1)

    # -- producer ----------------------------------------------------------------------
    def start_save_caches(self, step: ECStep, encoder_cache: dict[str, torch.Tensor]) -> None:
        self._placeholders = dict(step.publish)
        # An item still in the encoder cache from an earlier request is not encoded
        # again, so save_caches will not fire for it: make sure the store has it.
        for key in step.publish:
            if key in encoder_cache and self._lookup(key) is None:
                self.save(encoder_cache, key)

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self.first_rank:
            return
        data, meta = to_bytes(encoder_cache[mm_hash], self._staging)
        meta = FeatureMeta(meta.shape, meta.dtype, self._placeholders.get(mm_hash, {}))
        start = time.perf_counter()
        try:
            stored = self.store.put(mm_hash, data, meta)
        except StoreError as err:
            log.warning("epd-ec could not store %s: %s (consumers will encode it)", mm_hash, err)
            return
        seconds = time.perf_counter() - start
        if stored:
            self.recorder.put(data.nbytes, seconds)
            self.recorder.count("saved")
            log.info("epd-ec saved mm_hash=%s bytes=%d put_ms=%.2f", mm_hash, data.nbytes,
                     seconds * 1e3)

    def _lookup(self, key: str) -> FeatureMeta | None:
        try:
            return self.store.lookup(key)
        except StoreError:
            return None

    # -- consumer ----------------------------------------------------------------------
    def start_load_caches(self, step: ECStep, encoder_cache: dict[str, torch.Tensor]) -> None:
        for key, num_embeds in step.loads.items():
            if key not in encoder_cache:
                encoder_cache[key] = self._load(key, num_embeds, step.traces.get(key))

    def _load(self, key: str, num_embeds: int,
              trace: dict[str, str] | None = None) -> torch.Tensor:
        needed_at = time.monotonic()
        start = time.perf_counter()
        found, source, overlap = None, "on_demand", None
        item = self.prefetcher.claim(key) if self.prefetcher else None
        if item is not None:
            item.done.wait(self.settings.prefetch_wait_s)
            found = item.result
            if found is not None:
                busy = item.ready_at - item.hinted_at
                exposed = max(0.0, item.ready_at - needed_at)
                source = "prefetch_late" if exposed > 0 else "prefetched"
                overlap = 1.0 - exposed / busy if busy > 0 else 1.0
        if found is None:
            source = "on_demand"
            found = self._read_store(key)
        seconds = time.perf_counter() - start
        if found is None:
            self._give_up(key, "the MM Store no longer holds it, although it was pinned")
        data, meta = found
        if not meta.shape or meta.shape[0] != num_embeds:  # another feature under this key
            self._give_up(key, f"the stored feature has shape {meta.shape}, the request "
                               f"needs {num_embeds} embeddings")
        self.recorder.count("loaded")
        self.recorder.count(source)
        self.recorder.get(data.nbytes, seconds, overlap)
        timing = ""
        if overlap is not None:  # transfer: hint -> local; scheduling: hint -> needed
            timing = (f" transfer_ms={(item.ready_at - item.hinted_at) * 1e3:.2f}"
                      f" sched_ms={(needed_at - item.hinted_at) * 1e3:.2f} overlap={overlap:.4f}")
        log.info("epd-ec loaded mm_hash=%s bytes=%d source=%s wait_ms=%.2f%s", key,
                 data.nbytes, source, seconds * 1e3, timing)
        tensor = to_tensor(data, meta, self.device, self._staging)
        if self.spans is not None and trace and self.first_rank:  # one span, not one per rank
            marks = [("needed", needed_at)]
            if overlap is not None:  # a prefetch: hinted, then in memory here
                marks += [("hinted", item.hinted_at), ("in memory", item.ready_at)]
            events = [(name, wall_ns(at)) for name, at in sorted(marks, key=lambda m: m[1])]
            self.spans.record("features load", trace, events[0][1], time.time_ns(),
                              {"epd.ec.key": key, "epd.ec.bytes": int(data.nbytes),
                               "epd.ec.source": source}, events)
        return tensor

    def _read_store(self, key: str) -> tuple | None:
        """The feature from the store (None: the store says it lacks it). A store that
        does not answer is asked again, backing off, for `load_timeout_s`."""
        deadline = time.monotonic() + self.settings.load_timeout_s
        delay = 0.05
        while True:
            try:
                return self.store.get(key)
            except StoreError as err:
                if time.monotonic() + delay > deadline:
                    self._give_up(key, f"the MM Store did not answer for "
                                       f"{self.settings.load_timeout_s:g}s: {err}")
                log.warning("epd-ec MM Store unreachable while loading %s: %s; asking again",
                            key, err)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _give_up(self, key: str, why: str) -> NoReturn:
        message = (f"epd-ec could not load pinned feature {key}: {why}. Stopping this engine "
                   "rather than computing requests without it (its requests fail with an "
                   "error; the launcher restarts it)")
        log.error(message)
        raise FeatureUnavailable(message)

    def step_done(self) -> None:
        """After each step: where vLLM takes no worker metadata, log the counts."""
        if self._logged is not None:
            self._logged.tick()

    def worker_meta(self) -> EPDECWorkerMeta | None:
        data = self.recorder.take()
        return EPDECWorkerMeta(data) if data is not None else None

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.spans is not None:
            self.spans.close()
        self.store.close()
