"""KV caches laid out exactly as the engines lay them out, moved by the real transfer
engine: vLLM 0.32 gives each layer a [blocks, heads, tokens, k+v] view into one buffer
shared by every layer, in the physical order of the resolved layout (built here by
vLLM's own `create_kv_cache_views`); vllm-ascend gives each layer a (k_cache, v_cache)
pair of [blocks, tokens, heads, head_dim] tensors. Head counts are Qwen2.5-VL-7B's 4 KV
heads per rank at tensor parallel 1 and 2 at 2 (head_dim 128, bf16, 16-token blocks).

The transfers run through Mooncake's engine on loopback (run inside a netns:
`scripts/in-netns.sh`, which `scripts/test.sh` uses): plan the segments, write them,
then compare every token of every head of every layer on both sides."""

from __future__ import annotations

import pytest
import torch

# The caches are built by vLLM 0.32's allocator; older vLLM (0.23) has none of it.
pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.32's KV cache layouts")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from epd_serve.connectors.epd_kv.layout import (
    block_runs,
    check_compatible,
    describe_layer,
    segments,
    storage_spans,
)
from epd_serve.connectors.epd_kv.transfer import Link

HEAD_DIM, BLOCK_SIZE, LAYERS, BLOCKS = 128, 16, 4, 12
QWEN25_VL_7B_KV_HEADS = {1: 4, 2: 2}  # per rank, by tensor-parallel size
# Prefill's blocks of one request, in token order, and where decode put them.
PREFILL_BLOCKS = [3, 4, 5, 9, 1]
DECODE_BLOCKS = [7, 8, 2, 3, 10]
PROMPT_TOKENS = 4 * BLOCK_SIZE + 5  # the last block is partial


def vllm_caches(layout: KVCacheLayout, heads: int, kernel_block_size: int | None = None,
                ) -> list[torch.Tensor]:
    """One engine's per-layer caches as vLLM 0.32 allocates them for `layout`."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    tensor = KVCacheTensor(size=LAYERS * BLOCKS * spec.page_size_bytes,
                           layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor,
                                 kernel_block_size=kernel_block_size)


def ascend_caches(heads: int, one_buffer: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """vllm-ascend's (k_cache, v_cache) per layer: two allocations, or halves of one."""
    shape = (BLOCKS, BLOCK_SIZE, heads, HEAD_DIM)
    caches = []
    for _ in range(LAYERS):
        if one_buffer:
            k, v = torch.zeros(2, *shape, dtype=torch.bfloat16).unbind(0)
        else:
            k, v = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        caches.append((k, v))
    return caches


def token_rows(cache, block: int, slot: int) -> list[torch.Tensor]:
    """Every head's KV of the token in `slot` of `block`, in logical order."""
    if isinstance(cache, tuple):  # [blocks, tokens, heads, dim] each
        return [part[block, slot] for part in cache]
    return [cache[block, :, slot]]  # [blocks, heads, tokens, k+v]


def fill(caches) -> None:
    generator = torch.Generator().manual_seed(0)
    for cache in caches:
        for tensor in cache if isinstance(cache, tuple) else (cache,):
            tensor.copy_(torch.randn(tensor.shape, generator=generator))


def assert_same_tokens(prefill, decode) -> None:
    """Token by token: decode's blocks hold prefill's KV for every prompt token, and no
    other block of decode was touched."""
    for layer, (p_cache, d_cache) in enumerate(zip(prefill, decode)):
        for token in range(PROMPT_TOKENS):
            index, slot = divmod(token, BLOCK_SIZE)
            p_rows = token_rows(p_cache, PREFILL_BLOCKS[index], slot)
            d_rows = token_rows(d_cache, DECODE_BLOCKS[index], slot)
            for p_row, d_row in zip(p_rows, d_rows):
                assert torch.equal(p_row, d_row), f"layer {layer}, token {token}"
        for block in set(range(BLOCKS)) - set(DECODE_BLOCKS):
            for tensor in d_cache if isinstance(d_cache, tuple) else (d_cache,):
                assert not tensor[block].any(), f"layer {layer}: block {block} was written"


def transfer(link: Link, prefill, decode) -> None:
    """What the sender does for one request: describe both sides, refuse a mismatch,
    plan the segments of every layer, write them."""
    src = [describe_layer(cache, BLOCKS) for cache in prefill]
    dst = [describe_layer(cache, BLOCKS) for cache in decode]
    assert check_compatible(src, dst) is None
    link.register(storage_spans(prefill) + storage_spans(decode))
    srcs, dsts, lens = segments(src, dst, range(LAYERS), block_runs(PREFILL_BLOCKS, DECODE_BLOCKS))
    link.write(link.session_id, srcs, dsts, lens)


@pytest.fixture
def link():
    # One engine per test: memory registered by an earlier test is freed by now.
    return Link("127.0.0.1", "tcp")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC,
                                    KVCacheLayout.BLHNC, KVCacheLayout.LHBNC])
def test_vllm_layouts_move_token_by_token_through_the_transfer_engine(link, layout, tp):
    heads = QWEN25_VL_7B_KV_HEADS[tp]
    prefill, decode = vllm_caches(layout, heads), vllm_caches(layout, heads)
    fill(prefill)
    transfer(link, prefill, decode)
    assert_same_tokens(prefill, decode)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("one_buffer", [False, True])
def test_ascend_k_v_pairs_move_token_by_token_through_the_transfer_engine(link, tp, one_buffer):
    heads = QWEN25_VL_7B_KV_HEADS[tp]
    prefill, decode = ascend_caches(heads, one_buffer), ascend_caches(heads, one_buffer)
    fill(prefill)
    transfer(link, prefill, decode)
    assert_same_tokens(prefill, decode)


def test_how_each_layout_is_cut_into_regions():
    block_bytes = 4 * BLOCK_SIZE * 2 * HEAD_DIM * 2
    # Tokens outside heads (FlashAttention's and FlashInfer's default on an H800): a
    # block is not contiguous in [heads, tokens, k+v] order, but dense: one region.
    (lbnhc,) = describe_layer(vllm_caches(KVCacheLayout.LBNHC, 4)[0], BLOCKS).regions
    assert (lbnhc.block_stride, lbnhc.block_len) == (block_bytes, block_bytes)
    # Block-outermost: a block holds every layer's page, so blocks stride past them.
    (blhnc,) = describe_layer(vllm_caches(KVCacheLayout.BLHNC, 4)[0], BLOCKS).regions
    assert (blhnc.block_stride, blhnc.block_len) == (LAYERS * block_bytes, block_bytes)
    # Heads outside blocks: one region per head.
    lhbnc = describe_layer(vllm_caches(KVCacheLayout.LHBNC, 4)[0], BLOCKS).regions
    assert [r.block_len for r in lhbnc] == [block_bytes // 4] * 4
    # k and v: their regions one after the other.
    (k, v) = describe_layer(ascend_caches(2, one_buffer=False)[0], BLOCKS).regions
    assert k.block_len == v.block_len == BLOCK_SIZE * 2 * HEAD_DIM * 2
    # 16-token blocks for the scheduler made of two 8-token kernel blocks: one region.
    (split,) = describe_layer(vllm_caches(KVCacheLayout.LBNHC, 4, kernel_block_size=8)[0],
                              BLOCKS).regions
    assert (split.block_stride, split.block_len) == (block_bytes, block_bytes)


def test_engines_with_different_layouts_are_refused_by_name():
    lbnhc = [describe_layer(c, BLOCKS) for c in vllm_caches(KVCacheLayout.LBNHC, 4)]
    lbhnc = [describe_layer(c, BLOCKS) for c in vllm_caches(KVCacheLayout.LBHNC, 4)]
    # Same sizes everywhere: only the order of a block's bytes differs.
    assert [r.block_len for r in lbnhc[0].regions] == [r.block_len for r in lbhnc[0].regions]
    why = check_compatible(lbnhc, lbhnc, "LBNHC", "LBHNC")
    assert why and "prefill LBNHC layout" in why and "decode LBHNC layout" in why
    # Where one head per rank leaves nothing to order, the two are the same bytes.
    one_head = [[describe_layer(c, BLOCKS) for c in vllm_caches(layout, 1)]
                for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)]
    assert check_compatible(*one_head) is None
    # A (k, v) pair and vLLM's k+v view of the same sizes are not the same bytes either.
    pairs = [describe_layer(c, BLOCKS) for c in ascend_caches(4, one_buffer=True)]
    assert "layouts differ" in check_compatible(pairs, lbnhc)


def test_a_block_that_is_neither_dense_nor_dense_per_head_is_refused():
    # Every other token of a bigger buffer: no run of memory holds a block.
    sparse = torch.zeros(BLOCKS, 4, 2 * BLOCK_SIZE, 8)[:, :, ::2]
    with pytest.raises(ValueError, match="neither dense in memory nor dense per head"):
        describe_layer(sparse, BLOCKS)
