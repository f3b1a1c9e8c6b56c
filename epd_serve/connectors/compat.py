"""What the running vLLM offers our connectors, found by looking, never by version.

One codebase of the connectors serves every vLLM from 0.23 (the core of vllm-ascend
0.23, on Atlas nodes) to 0.32 and later. Each difference that matters is detected
here once, by an import that may fail or an attribute a base class may lack: a vLLM
whose base class declares a hook is a vLLM whose engine calls it (they come together).
Where vLLM lacks something our connectors need, this module stands in for it.

Imported only by the connector modules, which import vLLM anyway.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

# -- KV connector -------------------------------------------------------------------

try:  # vLLM 0.32+: workers report failed receives by request (`failed_recving`)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # older: by block, through get_block_ids_with_load_errors
    KVConnectorTransferResults = None

try:  # the label our external hits carry in vLLM's prefix-cache metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    P2P_CACHE_HIT_SOURCE = CacheHitSource.P2P
except ImportError:  # no per-source hit metrics
    P2P_CACHE_HIT_SOURCE = None

try:  # vLLM 0.32+ names KV cache layouts by stride order (LBHNC, LBNHC, ...)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    STRIDE_ORDER_LAYOUTS = True
except ImportError:  # older vLLM knows "NHD" and "HND" only
    KVCacheLayout = None
    STRIDE_ORDER_LAYOUTS = False

# The stride-order layouts an older vLLM can lay out, under its names (the same
# aliases vLLM 0.32 still accepts for them).
LEGACY_LAYOUT_NAMES = {"LBNHC": "NHD", "LBHNC": "HND"}


def kv_cache_layout_request(layout: str) -> str | None:
    """The name to give vLLM's `get_required_kvcache_layout` for our `kv_cache_layout`
    setting: None for "auto" (the attention backend decides)."""
    if layout == "auto":
        return None
    if STRIDE_ORDER_LAYOUTS:
        return layout
    if layout not in LEGACY_LAYOUT_NAMES:
        raise ValueError(
            f"kv_cache_layout {layout!r}: this vLLM lays KV caches out as NHD or HND only; "
            f"use one of {', '.join(LEGACY_LAYOUT_NAMES)} (or 'auto')")
    return LEGACY_LAYOUT_NAMES[layout]


def resolved_kv_cache_layout(vllm_config) -> str:
    """The KV cache layout this engine uses, by the name vLLM gives it ("" if it cannot
    say): quoted when two engines' layouts differ."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name or STRIDE_ORDER_LAYOUTS:
        return name or ""
    try:  # older vLLM: a process-wide setting, settled before the KV cache is made
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return get_kv_cache_layout() or ""
    except Exception:  # only a name in messages: never worth failing a worker for
        return ""


# -- EC connector -------------------------------------------------------------------

# Which hooks the engine drives: each came to vLLM with its caller.
EC_START_SAVE_CACHES = hasattr(ECConnectorBase, "start_save_caches")
EC_FAILS_REQUESTS = hasattr(ECConnectorBase, "take_unavailable_requests")
EC_WORKER_META = hasattr(ECConnectorBase, "build_connector_worker_meta")
EC_STATS = hasattr(ECConnectorBase, "get_ec_connector_stats")

try:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:
    class ECConnectorWorkerMetadata(abc.ABC):  # type: ignore[no-redef]
        """Stands in for vLLM's: this vLLM carries no EC worker metadata to the
        scheduler, so ours is only ever built, never shipped."""

        @abc.abstractmethod
        def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
            ...

try:
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorPromMetrics,
        ECConnectorStats,
    )
except ImportError:
    @dataclasses.dataclass
    class ECConnectorStats:  # type: ignore[no-redef]
        """Stands in for vLLM's (same shape): this vLLM has no EC stats path."""

        data: dict[str, Any] = dataclasses.field(default_factory=dict)

    class ECConnectorPromMetrics:  # type: ignore[no-redef]
        """Stands in for vLLM's (same constructor): this vLLM never builds EC metrics."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            from prometheus_client import Counter, Gauge, Histogram

            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


# What vLLM 0.32's models declare as the placeholder metadata of each modality
# (`MultiModalDataParser.embedding_fields`, role "metadata"): the processed keys that
# size an item's placeholder. Older vLLM declares none.
PLACEHOLDER_FIELDS = {
    "image": frozenset({"image_grid_thw", "image_sizes"}),
    "video": frozenset({"video_grid_thw", "video_image_sizes"}),
    "audio": frozenset({"audio_num_tokens", "audio_feature_lengths"}),
}


class TablePlaceholderResolver:
    """Stands in for vLLM 0.32's PlaceholderMetadataResolver: which processed keys of a
    modality size its placeholder, from the table above (vLLM's asks the model)."""

    def __init__(self, model_config) -> None:
        self._model_config = model_config
        self._cache: dict[str, set[str]] = {}

    def fields_for(self, modality: str) -> set[str]:
        return self._cache.setdefault(modality, set(PLACEHOLDER_FIELDS.get(modality, ())))


def collect_item_metadata(mm_features, resolver) -> dict[str, dict[str, Any]]:
    """Stands in for vLLM 0.32's collect_ec_item_metadata (same entries): one
    `ec_transfer_params` entry per feature, by mm_hash, with its placeholder metadata
    and where it occurs in the request."""
    import torch

    items: dict[str, dict[str, Any]] = {}
    for index, feature in enumerate(mm_features):
        metadata: dict[str, Any] = {}
        wanted = resolver.fields_for(feature.modality)
        if "audio_num_tokens" in wanted:
            metadata["audio_num_tokens"] = [feature.mm_position.get_num_embeds()]
        if feature.data is not None:
            for key, value in feature.data.get_data().items():
                if key not in wanted:
                    continue
                if isinstance(value, torch.Tensor):
                    metadata[key] = torch.atleast_1d(value).tolist()
                elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                    metadata[key] = value  # e.g. video timestamps, a plain list
        entry = items.setdefault(feature.identifier, {"item_indices": []})
        entry["metadata"] = metadata
        entry["item_indices"].append(index)
    return items


try:
    from vllm.distributed.ec_transfer.ec_connector.utils import (
        PlaceholderMetadataResolver,
        collect_ec_item_metadata,
    )
except ImportError:
    PlaceholderMetadataResolver = TablePlaceholderResolver
    collect_ec_item_metadata = collect_item_metadata


def accelerator_device(device_type: str) -> str:
    """Where this worker's tensors go: "cpu", or its current device of `device_type`
    with the index ("cuda:0", "npu:3"), asked of torch's module for that device
    (`torch.cuda`, `torch.npu`), not of vLLM's platform, which on some devices does
    not say."""
    if device_type == "cpu":
        return "cpu"
    import torch

    return f"{device_type}:{torch.get_device_module(device_type).current_device()}"
