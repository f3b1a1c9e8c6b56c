"""Scheduler side of the EC connector (runs in the vLLM engine-core process).

Producer (encoder): notes each new request's placeholder metadata (the image grid) so
the worker stores it beside the feature, and returns it in `ec_transfer_params`, which
is what the proxy builds prefill's and decode's image references from.

Consumer (prefill; decode when it must recompute): before a request is scheduled, each
feature it still needs is pinned in the MM Store, so it cannot be evicted before the
worker has loaded it. A feature the store lacks is encoded locally when the request
carries the image; when it carries only a reference the request is failed at once
(vLLM fails it with a retryable error) and the proxy sends it again with the image.
Never the "encoder cache miss" crash: a feature is only promised when it is pinned.

vLLM before 0.32 calls less of this (compat.py): no `request_finished` (pins are given
back when the request shows up in `finished_req_ids`, which is correct on every vLLM;
and no `ec_transfer_params`), no way to fail a request (one that carries only a
reference to a missing feature waits until its client aborts it), no EC metrics (the
counts are logged instead).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from epd_serve.connectors import compat
from epd_serve.connectors.compat import PlaceholderMetadataResolver, collect_ec_item_metadata
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.stats import LoggedCounts, Recorder
from epd_serve.mmstore import FeatureStore, StoreError, open_store

log = logging.getLogger("vllm.epd_serve.ec")


@dataclass
class ECStep(ECConnectorMetadata):
    """What the worker does this step."""

    loads: dict[str, int] = field(default_factory=dict)  # mm_hash -> embeddings to load
    publish: dict[str, dict] = field(default_factory=dict)  # mm_hash -> placeholder metadata
    # mm_hash -> the trace context of the request a load is for, where vLLM traces: the
    # worker makes the load a span of that request's timeline.
    traces: dict[str, dict[str, str]] = field(default_factory=dict)


class EPDECScheduler:
    def __init__(self, vllm_config, settings: Settings, producer: bool, consumer: bool):
        self.producer = producer
        self.consumer = consumer
        self.resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self.store: FeatureStore = open_store(settings.store, local_host=settings.host,
                                              wait_s=settings.open_timeout_s)
        self.recorder = Recorder()
        self._logged = None if compat.EC_STATS else LoggedCounts(self.recorder, "scheduler")
        self._pins: dict[str, dict[str, bool]] = {}  # request id -> key -> pinned here
        self._pinned: Counter[str] = Counter()  # key -> requests holding a pin
        self._unavailable: set[str] = set()  # failed, until vLLM finishes them
        self._to_fail: set[str] = set()  # failed, not yet handed to vLLM
        self._loads: dict[str, int] = {}
        self._traces: dict[str, dict[str, str]] = {}
        self._publish: dict[str, dict] = {}

    # -- before scheduling ---------------------------------------------------------
    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        """Called on every scheduling pass (before vLLM 0.32: only while the request
        has no computed token). Features are looked at again when more of the prompt
        must be computed than before: a decode instance that expected the prompt's KV
        first needs none, then all of them once that KV failed to arrive."""
        req_id = request.request_id
        if req_id in self._unavailable:
            return False
        if self.producer and req_id not in self._pins:
            items = collect_ec_item_metadata(request.mm_features, self.resolver)
            self._publish.update({key: item["metadata"] for key, item in items.items()})
        decided = self._pins.setdefault(req_id, {})  # key -> pinned (True) or encoded here
        if not self.consumer:
            return True
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # its tokens are computed already (prefix cache, received KV)
            key = feature.identifier
            if key in decided:
                continue
            if self._pin(key, request.get_num_encoder_embeds(index)):
                decided[key] = True
            elif self._carries_media(feature):
                log.info("epd-ec %s not in the MM Store: encoding it here (request %s)",
                         key, req_id)
                self.recorder.count("encoded_locally")
                decided[key] = False
            else:
                self.recorder.count("unavailable")
                self._release(req_id)
                self._unavailable.add(req_id)
                if compat.EC_FAILS_REQUESTS:
                    log.warning("epd-ec %s not in the MM Store and request %s carries no "
                                "image: failing it for the proxy to resend with the image",
                                key, req_id)
                    self._to_fail.add(req_id)
                else:
                    log.error("epd-ec %s not in the MM Store and request %s carries no "
                              "image; this vLLM cannot fail a request from its EC "
                              "connector, so it waits until its client aborts it (send "
                              "this engine images, not references)", key, req_id)
                return False
        return True

    def _release(self, req_id: str) -> None:
        for key, pinned in self._pins.pop(req_id, {}).items():
            if pinned:
                self._unpin(key)

    def _pin(self, key: str, num_embeds: int) -> bool:
        """Hold `key` in the store for a request that needs `num_embeds` embeddings of it;
        False when the store lacks it, or holds something else under that key (a
        feature of another size would stop the worker that loads it)."""
        if self._pinned[key] == 0:
            try:
                meta = self.store.pin(key)
            except StoreError as err:
                log.warning("epd-ec MM Store unreachable: %s", err)
                return False
            if meta is None:
                return False
            if not meta.shape or meta.shape[0] != num_embeds:
                log.warning("epd-ec %s in the MM Store has shape %s, the request needs %d "
                            "embeddings: not using it", key, meta.shape, num_embeds)
                self._store_unpin(key)
                return False
        self._pinned[key] += 1
        return True

    def _unpin(self, key: str) -> None:
        self._pinned[key] -= 1
        if self._pinned[key] <= 0:
            del self._pinned[key]
            self._store_unpin(key)

    def _store_unpin(self, key: str) -> None:
        try:
            self.store.unpin(key)
        except StoreError:
            pass  # the store's pins lapse by themselves

    def _carries_media(self, feature) -> bool:
        """True when the request holds what the encoder needs (pixels), not only the
        placeholder metadata of a reference."""
        if feature.data is None:
            return False
        return bool(set(feature.data) - self.resolver.fields_for(feature.modality))

    # -- scheduling ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self.consumer and identifier in self._pinned

    def update_state_after_alloc(self, request, index: int) -> None:
        key = request.mm_features[index].identifier
        if self.has_cache_item(key):
            self._loads[key] = request.get_num_encoder_embeds(index)
            if getattr(request, "trace_headers", None):
                self._traces[key] = dict(request.trace_headers)

    def build_connector_meta(self, scheduler_output) -> ECStep:
        # Requests finished since the last step give their pins back here, as well as
        # in request_finished: vLLM before 0.32 never calls that for EC connectors.
        for req_id in scheduler_output.finished_req_ids:
            self._finished(req_id)
        if self._logged is not None:
            self._logged.tick()
        step = ECStep(loads=self._loads, publish=self._publish, traces=self._traces)
        self._loads, self._publish, self._traces = {}, {}, {}
        return step

    def take_unavailable_requests(self) -> set[str]:
        failed, self._to_fail = self._to_fail, set()
        return failed

    # -- after -------------------------------------------------------------------------
    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.ec_connector_worker_meta
        if meta is not None:
            self.recorder.absorb(meta.data)

    def request_finished(self, request) -> tuple[bool, dict | None]:
        self._finished(request.request_id)
        if not self.producer:
            return False, None
        return False, collect_ec_item_metadata(request.mm_features, self.resolver) or None

    def _finished(self, req_id: str) -> None:
        self._unavailable.discard(req_id)
        self._release(req_id)

    def shutdown(self) -> None:
        self.store.close()
