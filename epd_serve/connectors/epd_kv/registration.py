"""Which memory of a worker's KV caches the transfer engine registers.

Runs in an engine worker process, from `worker.py register_kv_caches`. Pure arithmetic
on `data_ptr`, strides and storages (CPU, CUDA or NPU alike, nothing is copied or
synchronised), unit-tested with fakes.

- CPU and CUDA: each allocation behind the caches, whole, from its own base
  (`layout.storage_spans`): vLLM 0.32 gives every layer a view into one buffer.
- Ascend (`device.type == "npu"`): as vllm-ascend 0.23.0.post1 registers them. Its
  model runner allocates each layer's k and v apart, with 2 MiB extra, and slices each
  to a 2 MiB-aligned start whenever a KV transfer config is given ("prefill
  disaggregation need the addr of cache tensor be aligned with 2M",
  vllm_ascend/worker/model_runner_v1.py:4100-4130 and `_allocate_int8_cache_tensor`,
  :4004-4025): the allocation's own base is *not* aligned, the tensors are. Its
  Mooncake connectors register each tensor's own range, merged per underlying storage
  (`collect_storage_merged_register_regions`,
  vllm_ascend/distributed/kv_transfer/utils/utils.py:363-425, ranges of one storage
  closer than 4 KiB become one), assert that a registered start is 2 MiB-aligned
  (kv_p2p/mooncake_connector.py:2296, kv_p2p/mooncake_layerwise_connector.py:1241),
  and refuse more than 256 regions, HCCL's limit per process
  (`validate_register_region_count`, utils.py:428-445). Mooncake's Ascend transport
  registers each region with ADXL (`TransferExecutorBase` in Mooncake's
  ascend_direct_transport), which moves device memory over HCCS: a region that does
  not start on a 2 MiB boundary fails there, or at the first write, with no word of
  why. So a KV tensor whose range cannot start on one, even rounded down within its
  own allocation (as vllm-ascend's store connector does, kv_pool/ascend_store/
  pool_worker.py:632-649), is refused here, at start-up, by name.
"""

from __future__ import annotations

from collections.abc import Mapping

from epd_serve.connectors.epd_kv.layout import layer_tensors, storage_spans

HCCS_ALIGNMENT = 2 << 20  # ADXL/HCCS registrations start on 2 MiB boundaries
MAX_ASCEND_REGIONS = 256  # HCCL's registered regions per process
MERGE_GAP_BYTES = 4096  # ranges of one storage this close become one (as vllm-ascend)


class RegistrationError(ValueError):
    """KV memory the transfer engine cannot register: a start-up error."""


def tensor_range(tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor's elements occupy (strided or not)."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size()


def kv_regions(kv_caches: Mapping, device_type: str,
               limit: int = MAX_ASCEND_REGIONS) -> list[tuple[int, int]]:
    """(address, bytes) to register for the caches (layer name -> tensor or (k, v)) of
    a worker on `device_type`; at most `limit` regions on Ascend."""
    if device_type != "npu":
        return storage_spans(kv_caches.values())
    return ascend_regions(kv_caches, limit)


def ascend_regions(kv_caches: Mapping, limit: int = MAX_ASCEND_REGIONS) -> list[tuple[int, int]]:
    """Each tensor's own range, merged per storage, every region starting on a 2 MiB
    boundary; raises `RegistrationError` when that cannot be, or when more than `limit`
    regions would be registered."""
    # storage base -> (its end, [start, end) of the tensors in it)
    by_storage: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for name, cache in kv_caches.items():
        tensors = layer_tensors(cache)
        for index, tensor in enumerate(tensors):
            start, end = tensor_range(tensor)
            if start == end:
                continue
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            aligned = start - start % HCCS_ALIGNMENT
            if aligned < base:
                part = "kv"[index] if index < 2 else str(index)
                label = name if len(tensors) == 1 else f"{name} ({part})"
                raise RegistrationError(
                    f"KV cache tensor {label} starts at {start:#x}, not on a 2 MiB boundary, "
                    f"and its allocation (from {base:#x}) has none below it: Mooncake's Ascend "
                    "transport registers KV memory with ADXL, which moves it over HCCS and "
                    "needs each registered region 2 MiB-aligned. vllm-ascend aligns its KV "
                    "cache only when the engine is started with a KV transfer config "
                    "(--kv-transfer-config); was it started without one, or by another "
                    "model runner?")
            storage_end, ranges = by_storage.setdefault(base, (base + storage.nbytes(), []))
            ranges.append((aligned, min(end, storage_end)))
    regions = [(start, end - start) for _, ranges in by_storage.values()
               for start, end in merge_ranges(ranges)]
    if len(regions) > limit:
        raise RegistrationError(
            f"the KV cache would be registered as {len(regions)} memory regions, more than "
            f"{limit}: HCCL registers at most {MAX_ASCEND_REGIONS} per process "
            f"({MAX_ASCEND_REGIONS - limit} of them this worker needs for itself). Every k and "
            "v tensor is its own allocation: fewer layers per worker (pipeline parallelism) "
            "or a model runner that allocates them together is needed")
    return sorted(regions)


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges of one storage, sorted, with those overlapping, adjacent or
    closer than MERGE_GAP_BYTES made one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + MERGE_GAP_BYTES:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
