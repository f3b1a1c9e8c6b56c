"""Scheduler side of the EC connector (runs in the vLLM engine-core process).

Producer (encoder): notes each new request's placeholder metadata (the image grid) so
the worker stores it beside the feature, and returns it in `ec_transfer_params`, which
is what the proxy builds prefill's and decode's image references from.

Consumer (prefill; decode when it must recompute): a feature is promised to vLLM
("cached": vLLM will not run the encoder for it) only once its bytes are in this
process (loader.py). Until its read is done the request waits, as vLLM makes requests
wait for a transfer; the bytes then travel to the workers with the step. So whatever
befalls the store (a lost entry, a restart, no answer) happens before the promise and
turns into local encoding when the request carries the image, or, when it carries only
a reference, into a failed request (vLLM fails it with a retryable error) that the
proxy sends again with the image. The copy is held until the request ends; no store
lease or pin can lapse under a request that waits in the queue.

Not every scheduler asks `ensure_cache_available`: vllm-ascend's own copy of
`schedule()` (a prefill instance, or balance scheduling) asks only `has_cache_item`.
On a prefill instance our KV connector asks for it instead (feature_gate.py), so the
request waits exactly as above. Where nothing asks (balance scheduling on an instance
with no KV connector of ours), `has_cache_item` claims a copy that is here already for
the scheduling pass, and `update_state_after_alloc` hands it to the request; a feature
not here by then is encoded locally (counted, logged), as no request can wait there.

A video the proxy split into chunks (protocols/feature_chunks.py) is stored and read
under the keys the proxy names for it in the request's `vllm_xargs` (an encoder: each
chunk's own; prefill: its chunks', joined in order), rather than under vLLM's hash of
it, which on vLLM 0.32 hashes in the engine's media kwargs, so no two roles would agree
on it and the proxy could never look it up.

Both (`ec_both`: an instance the proxy switches between encoder, prefill and decode by
routing alone): a producer and a consumer at once, each part as above, for every
request. A request it encodes for others (the proxy's E hop: the image, one output
token) is first looked for in the MM Store like any other: missing, it is encoded here
(counted as `encoded_locally`), stored by the worker and published in its
`ec_transfer_params`; stored already (another encoder had it), it is loaded, not
encoded again, and published all the same. A request it prefills takes its features
from the store as a consumer does. vLLM runs the whole model on it (it is a consumer:
vLLM's encoder-only mode is for a producer that is not), and saves what it encodes
through `save_caches` as on a producer.

vLLM before 0.32 calls less of this (compat.py): no `request_finished` (holds are given
back when the request shows up in `finished_req_ids`, which is correct on every vLLM;
and no `ec_transfer_params`), no way to fail a request (one that carries only a
reference to a missing feature waits until its client aborts it), no EC metrics (the
counts are logged instead).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from epd_serve.connectors import compat, feature_gate
from epd_serve.connectors.compat import PlaceholderMetadataResolver, collect_ec_item_metadata
from epd_serve.connectors.epd_ec.form import FeatureForm
from epd_serve.connectors.epd_ec.loader import Feature, FeatureLoader
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.stats import LoggedCounts, Recorder
from epd_serve.mmstore import FeatureMeta, FeatureStore, attach_store
from epd_serve.protocols.encoder import EncoderParams
from epd_serve.protocols.feature_chunks import VIDEO_KEYS_ARG, part_keys
from epd_serve.protocols.params import ParamsError, from_dict, to_dict

log = logging.getLogger("vllm.epd_serve.ec")


def published(items: dict) -> dict | None:
    """A request's `ec_transfer_params`, written through protocols/encoder.py's struct
    (what the proxy reads them as); None where the request has no feature."""
    if not items:
        return None
    try:
        return to_dict(from_dict(EncoderParams, items, "ec_transfer_params"))
    except ParamsError as err:
        # vLLM's entries changed shape: sent as they are, for the proxy to refuse the
        # request naming the field (failing here would take the engine down).
        log.error("epd-ec: the features' ec_transfer_params do not match their struct: %s", err)
        return items


@dataclass
class Load:
    """A feature the worker puts into vLLM's encoder cache: its bytes (read by the
    scheduler side), and when it was asked for, needed and here, for its span."""

    data: np.ndarray
    meta: FeatureMeta
    source: str  # prefetched, prefetch_late or on_demand
    marks: dict[str, float]  # event -> time.monotonic()
    trace: dict[str, str] | None = None  # the request's trace context, where vLLM traces


@dataclass
class ECStep(ECConnectorMetadata):
    """What the worker does this step."""

    loads: dict[str, Load] = field(default_factory=dict)  # mm_hash -> feature to load
    publish: dict[str, dict] = field(default_factory=dict)  # mm_hash -> placeholder metadata
    # mm_hash -> the key to store it under, where the proxy named one (a video's chunk)
    store_as: dict[str, str] = field(default_factory=dict)


class EPDECScheduler:
    def __init__(self, vllm_config, settings: Settings, producer: bool, consumer: bool):
        self.producer = producer
        self.consumer = consumer
        self._vllm_config = vllm_config
        self.settings = settings
        self.resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self.form = FeatureForm.of(vllm_config.model_config)
        self.recorder = Recorder()
        self._logged = None if compat.EC_STATS else LoggedCounts(self.recorder, "scheduler")
        self.store: FeatureStore | None = None
        self.loader: FeatureLoader | None = None
        if consumer:
            self.store = attach_store(settings.store, local_host=settings.host,
                                      wait_s=settings.open_timeout_s)
            listen = None
            if settings.prefetch_port is not None:
                listen = (settings.host, settings.prefetch_port)
            self.loader = FeatureLoader(self.store, settings.prefetch_budget_bytes, listen)
            feature_gate.register(vllm_config, self.ensure_cache_available)
        # request id -> key -> the copy it holds (None: encoded here)
        self._decided: dict[str, dict[str, Feature | None]] = {}
        self._held: dict[str, Feature] = {}  # key -> a copy some request holds
        # vLLM's hash of a feature -> the store key it was read under, where they differ
        # (a video stored in chunks: protocols/feature_chunks.py)
        self._aliases: dict[str, str] = {}
        # Copies has_cache_item promised this scheduling pass (where nothing asks
        # ensure_cache_available), until a request takes them over or the pass ends.
        self._claims: dict[str, Feature] = {}
        self._asked_first = False  # something calls ensure_cache_available before scheduling
        self._unavailable: set[str] = set()  # failed, until vLLM finishes them
        self._to_fail: set[str] = set()  # failed, not yet handed to vLLM
        self._loads: dict[str, Load] = {}
        self._publish: dict[str, dict] = {}
        self._store_as: dict[str, str] = {}

    # -- before scheduling ---------------------------------------------------------
    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        """Called on every scheduling pass (before vLLM 0.32: only while the request
        waits). False: the request waits (a read is under way) or has failed. Features
        are looked at again when more of the prompt must be computed than before: a
        decode instance that expected the prompt's KV first needs none, then all of them
        once that KV failed to arrive."""
        req_id = request.request_id
        self._asked_first = True
        if req_id in self._unavailable:
            return False
        if self.producer and req_id not in self._decided:
            items = collect_ec_item_metadata(request.mm_features, self.resolver)
            self._publish.update({key: item["metadata"] for key, item in items.items()})
            for index, feature in enumerate(request.mm_features):
                key = self._store_key(request, index)
                # A chunk it encodes for others is stored under the chunk's key; a whole
                # video it prefills is not stored (nothing reads a joined key whole).
                if key != feature.identifier and part_keys(key) is None:
                    self._store_as[feature.identifier] = key
        decided = self._decided.setdefault(req_id, {})
        if not self.consumer:
            return True
        waiting = False
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # its tokens are computed already (prefix cache, received KV)
            key = self._store_key(request, index)
            if key in decided:
                continue
            item = self.loader.want(key)
            if not item.done.is_set():
                if time.monotonic() - item.needed_at < self.settings.load_timeout_s:
                    waiting = True
                    continue
                why = (f"took over {self.settings.load_timeout_s:g}s to read from the MM "
                       "Store")
            else:
                why = self._unusable(item, request.get_num_encoder_embeds(index))
            if why is None:
                self._hold(decided, key, item)
            elif self._carries_media(feature):
                log.info("epd-ec %s %s: encoding it here (request %s)", key, why, req_id)
                self.recorder.count("encoded_locally")
                decided[key] = None
            else:
                self._fail(req_id, key, why)
                return False
        return not waiting

    def _store_key(self, request, index: int) -> str:
        """The MM Store key of feature `index` of `request`: vLLM's hash of it, except
        for a video whose chunks the proxy named (protocols/feature_chunks.py)."""
        feature = request.mm_features[index]
        if feature.modality != "video":
            return feature.identifier
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
        named = extra.get(VIDEO_KEYS_ARG)
        position = sum(1 for f in request.mm_features[:index] if f.modality == "video")
        if not isinstance(named, list) or position >= len(named) \
                or not isinstance(named[position], str) or not named[position]:
            return feature.identifier
        key = named[position]
        if key != feature.identifier:
            self._aliases[feature.identifier] = key
        return key

    def _unusable(self, item: Feature, num_embeds: int) -> str | None:
        """Why a finished read cannot stand for the feature (None: it can)."""
        if item.result is None:
            if item.error:
                return f"could not be read from the MM Store ({item.error})"
            return "not in the MM Store"
        data, meta = item.result
        # Another image's feature, or a torn or foreign entry, would stop the model (or
        # the worker turning its bytes into a tensor) that is fed it.
        return self.form.mismatch(meta, int(data.nbytes), num_embeds)

    def _hold(self, decided: dict, key: str, item: Feature) -> None:
        if key not in self._held:  # a new copy: count its read once
            self._count_load(key, item)
        self.loader.hold(item)
        self._held[key] = item
        decided[key] = item

    def _count_load(self, key: str, item: Feature) -> None:
        self.recorder.count("loaded")
        self.recorder.count(item.source)
        self.recorder.get(item.nbytes, item.ready_at - item.asked_at, item.overlap)
        waited = max(0.0, item.ready_at - (item.needed_at or item.ready_at))
        timing = ""
        if item.overlap is not None:  # read: hint -> here; scheduling: hint -> needed
            timing = (f" transfer_ms={(item.ready_at - item.asked_at) * 1e3:.2f}"
                      f" sched_ms={(item.needed_at - item.asked_at) * 1e3:.2f}"
                      f" overlap={item.overlap:.4f}")
        log.info("epd-ec loaded mm_hash=%s bytes=%d source=%s wait_ms=%.2f%s", key,
                 item.nbytes, item.source, waited * 1e3, timing)

    def _fail(self, req_id: str, key: str, why: str) -> None:
        self.recorder.count("unavailable")
        self._release(req_id)
        self._unavailable.add(req_id)
        if compat.EC_FAILS_REQUESTS:
            log.warning("epd-ec %s %s and request %s carries no image: failing it for "
                        "the proxy to resend with the image", key, why, req_id)
            self._to_fail.add(req_id)
        else:
            log.error("epd-ec %s %s and request %s carries no image; this vLLM cannot "
                      "fail a request from its EC connector, so it waits until its client "
                      "aborts it (send this engine images, not references)", key, why, req_id)

    def _release(self, req_id: str) -> None:
        for key, item in self._decided.pop(req_id, {}).items():
            if item is None:
                continue
            self.loader.release(item)
            if item.holders == 0 and self._held.get(key) is item:
                del self._held[key]
        if self._aliases:  # only those of copies still held are looked up again
            self._aliases = {a: k for a, k in self._aliases.items() if k in self._held}

    def _carries_media(self, feature) -> bool:
        """True when the request holds what the encoder needs (pixels), not only the
        placeholder metadata of a reference."""
        if feature.data is None:
            return False
        return bool(set(feature.data) - self.resolver.fields_for(feature.modality))

    # -- scheduling ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if not self.consumer:
            return False
        identifier = self._aliases.get(identifier, identifier)
        if identifier in self._held or identifier in self._claims:
            return True
        if self._asked_first:
            return False  # decided before scheduling: not held means encoded here
        item = self.loader.copy_here(identifier, needed=True)
        if item is None:
            # Not read here yet: the proxy's hint lost the race with the request (or
            # went to another prefill). Nothing made this request wait for it (this
            # scheduler asks nothing before it schedules), so read it now, waiting a
            # bound far shorter than the encode it saves.
            item = self.loader.read_now(identifier, self.settings.claim_wait_s)
        if item is None:
            return False
        self.loader.hold(item)
        self._claims[identifier] = item
        return True

    def update_state_after_alloc(self, request, index: int) -> None:
        if not self.consumer:
            return
        key = self._store_key(request, index)
        decided = self._decided.setdefault(request.request_id, {})
        if key not in decided and not self._asked_first:
            self._decide_when_scheduled(request, index, decided)
        item = self._held.get(key)
        if item is None:
            return
        data, meta = item.result
        marks = {"needed": item.needed_at or item.ready_at}
        if item.hinted:  # a prefetch: hinted, then in memory here
            marks |= {"hinted": item.asked_at, "in memory": item.ready_at}
        trace = getattr(request, "trace_headers", None)
        # Into vLLM's encoder cache under vLLM's own hash of the feature.
        self._loads[request.mm_features[index].identifier] = Load(
            data, meta, item.source, marks, dict(trace) if trace else None)

    def _decide_when_scheduled(self, request, index: int, decided: dict) -> None:
        """What became of a feature under a scheduler that never asked first: loaded
        if has_cache_item promised a copy, else vLLM runs the encoder for it."""
        key = self._store_key(request, index)
        item = self._claims.get(key) or self._held.get(key)
        if item is None:
            log.info("epd-ec %s was not in this instance when request %s was scheduled "
                     "(its scheduler does not wait for features): encoding it here", key,
                     request.request_id)
            self.recorder.count("encoded_locally")
            decided[key] = None
            return
        why = self._unusable(item, request.get_num_encoder_embeds(index))
        if why is None:
            self._hold(decided, key, item)
            return
        # vLLM has already counted it as loaded: the step cannot run for this request.
        log.error("epd-ec %s %s: the encoder and this instance disagree on the image's "
                  "size (are they started with the same model and processor settings?); "
                  "request %s cannot be served here", key, why, request.request_id)
        decided[key] = None

    def build_connector_meta(self, scheduler_output) -> ECStep:
        # Requests finished since the last step give their holds back here, as well as
        # in request_finished: vLLM before 0.32 never calls that for EC connectors.
        for req_id in scheduler_output.finished_req_ids:
            self._finished(req_id)
        for item in self._claims.values():  # the pass is over: requests hold theirs
            self.loader.release(item, keep=True)
        self._claims.clear()
        if self._logged is not None:
            self._logged.tick()
        step = ECStep(loads=self._loads, publish=self._publish, store_as=self._store_as)
        self._loads, self._publish, self._store_as = {}, {}, {}
        return step

    def fail_request(self, request, why: str) -> None:
        """A request the calls above could not decide on (a bug of ours): it fails
        alone, as one whose feature is missing does (the proxy sends it again)."""
        self._fail(request.request_id, "?", why)

    def abandon_step(self, why: str) -> ECStep:
        """The step's plan where building it failed (a bug of ours): what was ready to
        load, publish and store still goes, so no request finds a promised feature
        missing from the encoder cache."""
        log.error("epd-ec: the step's plan was built from what was pending: %s", why)
        step = ECStep(loads=self._loads, publish=self._publish, store_as=self._store_as)
        self._loads, self._publish, self._store_as = {}, {}, {}
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
        return False, published(collect_ec_item_metadata(request.mm_features, self.resolver))

    def _finished(self, req_id: str) -> None:
        self._unavailable.discard(req_id)
        self._release(req_id)

    def shutdown(self) -> None:
        if self.loader is not None:
            feature_gate.unregister(self._vllm_config, self.ensure_cache_available)
            self.loader.close()
        if self.store is not None:
            self.store.close()
