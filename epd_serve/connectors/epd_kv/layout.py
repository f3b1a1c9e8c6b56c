"""Where each layer's KV blocks live in memory, and which bytes a transfer moves.

Runs in the worker process of an engine. `describe_layer` reads a KV cache tensor
(CPU, CUDA or NPU alike: only `data_ptr`, strides and sizes are used, nothing is
copied or synchronised); the rest is arithmetic on integers, unit-tested without torch.

A layer's cache is one or more *regions*; block `b` of a region starts at
`base + b * block_stride` and holds `block_len` contiguous bytes. vLLM's block-major
layouts ([blocks, heads, tokens, dim] and its permutations with blocks outermost) are
one region per layer; layouts that put the heads outside the blocks are one region per
head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec


class Region(msgspec.Struct, frozen=True, array_like=True):
    base: int
    block_stride: int
    block_len: int


class LayerLayout(msgspec.Struct, frozen=True, array_like=True):
    regions: tuple[Region, ...]

    @property
    def block_bytes(self) -> int:
        return sum(r.block_len for r in self.regions)


def describe_layer(cache, num_blocks: int) -> LayerLayout:
    """Regions of one layer's paged KV tensor whose first dimension is the (kernel)
    block. `num_blocks` counts the scheduler's blocks; where the attention kernel uses
    smaller blocks, one scheduler block is several consecutive kernel blocks."""
    if cache.dim() < 2 or cache.shape[0] % num_blocks:
        raise ValueError(
            f"KV cache of shape {tuple(cache.shape)} is not block-major with {num_blocks} "
            "blocks; the epd KV connector needs the block as the outermost dimension"
        )
    per_block = cache.shape[0] // num_blocks
    element = cache.element_size()
    stride = cache.stride(0) * element
    if cache[0].is_contiguous():
        rows = [(cache.data_ptr(), cache[0].numel() * element)]
    else:  # heads outside the token rows: each head's slice of a block is contiguous
        if not all(cache[0, h].is_contiguous() for h in range(cache.shape[1])):
            raise ValueError(f"KV cache layout with strides {cache.stride()} is not supported")
        rows = [(cache[:, h].data_ptr(), cache[0, h].numel() * element)
                for h in range(cache.shape[1])]
    if per_block > 1 and all(length == stride for _, length in rows):
        # Packed kernel blocks: a scheduler block is one run of them.
        return LayerLayout(tuple(Region(base, stride * per_block, length * per_block)
                                 for base, length in rows))
    return LayerLayout(tuple(Region(base + k * stride, stride * per_block, length)
                             for base, length in rows for k in range(per_block)))


def storage_spans(caches: Iterable) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct allocation behind the caches, to register."""
    spans: dict[int, int] = {}
    for cache in caches:
        storage = cache.untyped_storage()
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
    (stride == length); otherwise one segment per block."""
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
    return srcs, dsts, lens


def check_compatible(src: Sequence[LayerLayout], dst: Sequence[LayerLayout]) -> str | None:
    """Why the two sides cannot exchange blocks, or None when they can."""
    if len(src) != len(dst):
        return f"prefill has {len(src)} KV layers, decode {len(dst)}"
    for index, (s, d) in enumerate(zip(src, dst)):
        if [r.block_len for r in s.regions] != [r.block_len for r in d.regions]:
            return (f"layer {index}: block sizes differ (prefill "
                    f"{[r.block_len for r in s.regions]}, decode {[r.block_len for r in d.regions]})")
    return None
