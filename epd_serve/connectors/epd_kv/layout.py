"""Where each layer's KV blocks live in memory, and which bytes a transfer moves.

Runs in the worker process of an engine. `describe_layer` reads a layer's KV cache
(CPU, CUDA or NPU alike: only `data_ptr`, strides and sizes are used, nothing is
copied or synchronised); the rest is arithmetic on integers, unit-tested without torch.

A layer's cache is one tensor whose first dimension is the block (vLLM 0.32 gives each
layer a `[blocks, heads, tokens, k+v]` view into one buffer shared by every layer, in
whatever physical order the resolved KV cache layout puts those dimensions), or a
`(k_cache, v_cache)` pair of such tensors (vllm-ascend). Each tensor is one or more
*regions*: block `b` of a region starts at `base + b * block_stride` and holds
`block_len` contiguous bytes. A block that is dense in memory, in any order of its
dimensions (LBHNC, LBNHC, BLHNC, ...), is one region; a layout that puts the heads
outside the blocks (LHBNC) is one region per head.

Raw bytes can only be copied between two engines that order a block's bytes the same
way, so every tensor's *form* (a block's shape, the memory order of its dimensions, its
element size) travels with the reservation and both sides refuse a mismatch by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec


class Region(msgspec.Struct, frozen=True, array_like=True):
    base: int
    block_stride: int
    block_len: int


class BlockForm(msgspec.Struct, frozen=True, array_like=True):
    """How one tensor of a layer stores a block: the block's logical shape, its
    dimensions from outermost to innermost in memory, and the element size."""

    shape: tuple[int, ...]
    order: tuple[int, ...]
    itemsize: int

    def __str__(self) -> str:
        shape = "x".join(str(size) for size in self.shape)
        return f"{shape} stored in dimension order {self.order}, {self.itemsize} B elements"


class LayerLayout(msgspec.Struct, frozen=True, array_like=True):
    regions: tuple[Region, ...]
    forms: tuple[BlockForm, ...] = ()  # one per tensor: (k and v) or (k+v)

    @property
    def block_bytes(self) -> int:
        return sum(r.block_len for r in self.regions)


def memory_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The dimensions of a tensor from the largest stride to the smallest; dimensions of
    size 1 take no memory and are left out (their strides mean nothing)."""
    dims = [d for d, size in enumerate(shape) if size > 1]
    return tuple(sorted(dims, key=lambda d: (-strides[d], d)))


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the elements fill one contiguous run of memory, in some order of the
    dimensions (each stride is the product of the sizes of the dimensions inside it)."""
    expected = 1
    for dim in reversed(memory_order(shape, strides)):
        if strides[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def layer_tensors(cache) -> tuple:
    """The tensors of one layer's cache: itself, or the (k, v) pair."""
    return tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)


def describe_layer(cache, num_blocks: int) -> LayerLayout:
    """Regions and forms of one layer's paged KV cache (a tensor or a (k, v) pair)
    whose first dimension is the (kernel) block. `num_blocks` counts the scheduler's
    blocks; where the attention kernel uses smaller blocks, one scheduler block is
    several consecutive kernel blocks."""
    regions: list[Region] = []
    forms: list[BlockForm] = []
    for tensor in layer_tensors(cache):
        tensor_regions, form = _describe_tensor(tensor, num_blocks)
        regions += tensor_regions
        forms.append(form)
    return LayerLayout(tuple(regions), tuple(forms))


def _describe_tensor(cache, num_blocks: int) -> tuple[list[Region], BlockForm]:
    if cache.dim() < 2 or cache.shape[0] % num_blocks:
        raise ValueError(
            f"KV cache of shape {tuple(cache.shape)} is not block-major with {num_blocks} "
            "blocks; the epd KV connector needs the block as the outermost dimension"
        )
    per_block = cache.shape[0] // num_blocks
    element = cache.element_size()
    stride = cache.stride(0) * element
    block_shape, block_strides = tuple(cache.shape[1:]), tuple(cache.stride()[1:])
    form = BlockForm(block_shape, memory_order(block_shape, block_strides), element)
    if is_dense(block_shape, block_strides):
        rows = [(cache.data_ptr(), cache[0].numel() * element)]
    elif is_dense(block_shape[1:], block_strides[1:]):
        # Heads outside the blocks: each head's slice of a block is one run.
        rows = [(cache[:, h].data_ptr(), cache[0, h].numel() * element)
                for h in range(cache.shape[1])]
    else:
        raise ValueError(f"KV cache of shape {tuple(cache.shape)} with strides "
                         f"{cache.stride()}: a block is neither dense in memory nor dense "
                         "per head, so the epd KV connector cannot move it")
    if per_block > 1 and all(length == stride for _, length in rows):
        # Packed kernel blocks: a scheduler block is one run of them.
        return [Region(base, stride * per_block, length * per_block)
                for base, length in rows], form
    return [Region(base + k * stride, stride * per_block, length)
            for base, length in rows for k in range(per_block)], form


def storage_spans(caches: Iterable) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct allocation behind the caches, to register."""
    spans: dict[int, int] = {}
    for cache in caches:
        for tensor in layer_tensors(cache):
            storage = tensor.untyped_storage()
            spans[storage.data_ptr()] = storage.nbytes()
    return sorted(spans.items())


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair source and destination block ids and merge runs that are consecutive on
    both sides into (src_first, dst_first, count): one transfer segment per run."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def segments(src: Sequence[LayerLayout], dst: Sequence[LayerLayout], layers: Iterable[int],
             runs: Sequence[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    """Source addresses, destination addresses and lengths that move `runs` of blocks
    for each of `layers`. A run is one segment where the blocks are packed
    (stride == length); otherwise one segment per block. Segments that continue one
    another on both sides are then one (`merge_contiguous`)."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for layer in layers:
        for s_reg, d_reg in zip(src[layer].regions, dst[layer].regions, strict=True):
            packed = (s_reg.block_stride == s_reg.block_len
                      and d_reg.block_stride == d_reg.block_len)
            for s_first, d_first, count in runs:
                if packed:
                    srcs.append(s_reg.base + s_first * s_reg.block_stride)
                    dsts.append(d_reg.base + d_first * d_reg.block_stride)
                    lens.append(count * s_reg.block_len)
                    continue
                for i in range(count):
                    srcs.append(s_reg.base + (s_first + i) * s_reg.block_stride)
                    dsts.append(d_reg.base + (d_first + i) * d_reg.block_stride)
                    lens.append(s_reg.block_len)
    return merge_contiguous(srcs, dsts, lens)


def merge_contiguous(srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int],
                     ) -> tuple[list[int], list[int], list[int]]:
    """The same bytes in fewer segments: where one segment starts where another ends on
    the source AND on the destination, the two become one (a block-outermost layout's
    layers of one block, the whole of a layer's region, ...). Each segment costs the
    transfer engine one submit and, on Mooncake's Ascend transport, one ADXL call
    (transfer.py). Ordered by source address."""
    out_srcs: list[int] = []
    out_dsts: list[int] = []
    out_lens: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: srcs[i]):
        if out_lens and srcs[i] == out_srcs[-1] + out_lens[-1] \
                and dsts[i] == out_dsts[-1] + out_lens[-1]:
            out_lens[-1] += lens[i]
            continue
        out_srcs.append(srcs[i])
        out_dsts.append(dsts[i])
        out_lens.append(lens[i])
    return out_srcs, out_dsts, out_lens


def check_compatible(src: Sequence[LayerLayout], dst: Sequence[LayerLayout],
                     src_name: str = "", dst_name: str = "") -> str | None:
    """Why prefill (`src`) and decode (`dst`) cannot exchange blocks, or None when they
    can. The names are the KV cache layouts the engines report (e.g. LBNHC), quoted in
    the refusal."""
    if len(src) != len(dst):
        return f"prefill has {len(src)} KV layers, decode {len(dst)}"
    for index, (s, d) in enumerate(zip(src, dst)):
        if s.forms != d.forms:
            return (f"KV cache layouts differ (layer {index}): prefill {src_name or 'its'} "
                    f"layout [{'; '.join(map(str, s.forms))}], decode {dst_name or 'its'} "
                    f"layout [{'; '.join(map(str, d.forms))}]; the same bytes would mean "
                    "other tokens and heads: run both with one KV cache layout")
        if [r.block_len for r in s.regions] != [r.block_len for r in d.regions]:
            return (f"layer {index}: block sizes differ (prefill "
                    f"{[r.block_len for r in s.regions]}, decode {[r.block_len for r in d.regions]})")
    return None
