"""The epd KV connector's pure parts: layer groups, group size, block layout, segments,
settings."""

from __future__ import annotations

import pytest

from epd_serve.connectors.epd_kv.grouping import (
    ComputeModel,
    LinkEstimator,
    LinkModel,
    fitted_groups,
    plan_groups,
)
from epd_serve.connectors.epd_kv.layout import (
    LayerLayout,
    Region,
    block_runs,
    check_compatible,
    describe_layer,
    segments,
)
from epd_serve.connectors.epd_kv.settings import Settings


@pytest.mark.parametrize("mode, size, groups", [
    ("whole", 3, [(0, 5)]),
    ("layer", 3, [(i, i) for i in range(6)]),
    ("group", 2, [(0, 1), (2, 3), (4, 4), (5, 5)]),
    ("group", 3, [(0, 2), (3, 4), (5, 5)]),
    ("group", 9, [(0, 4), (5, 5)]),
    ("group", 1, [(i, i) for i in range(6)]),
])
def test_groups_cover_every_layer_once_in_order_with_the_last_alone(mode, size, groups):
    assert plan_groups(6, mode, size) == groups
    covered = [layer for first, last in groups for layer in range(first, last + 1)]
    assert covered == list(range(6))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="choose one of whole, layer, group"):
        plan_groups(4, "chunk")


LINK = LinkModel(overhead_s=100e-6, bytes_per_s=2e9)  # what tcp on loopback measures


def sizes(groups):
    return [last - first + 1 for first, last in groups]


@pytest.mark.parametrize("compute_s, expected", [
    (10e-3, [18, 9, 1]),  # 1 MiB per layer is 0.52 ms on the wire
    (2e-3, [13, 7, 4, 2, 1, 1]),  # less compute to hide behind: smaller writes near the end
])
def test_fitted_groups_shrink_towards_the_end_and_the_link_drains_in_time(compute_s, expected):
    groups = fitted_groups(28, 1 << 20, LINK, layer_compute_s=compute_s)
    assert groups[-1] == (27, 27)
    assert [layer for f, l in groups for layer in range(f, l + 1)] == list(range(28))
    assert sizes(groups) == expected
    # From each group on, the writes before the last one fit in half the compute left.
    for index, (_, last) in enumerate(groups[:-1]):
        writes = sum(LINK.transfer_s((l - f + 1) << 20) for f, l in groups[index:-1])
        assert writes <= 0.5 * (27 - last) * compute_s or sizes(groups[index:index + 1]) == [1]


def test_fitted_groups_fall_back_to_one_layer_per_write():
    # Compute not measured yet: assumed no faster than the wire.
    assert sizes(fitted_groups(6, 1 << 20, LINK, layer_compute_s=None)) == [1] * 6
    # Compute faster than the wire: nothing can hide, so nothing waits either.
    assert sizes(fitted_groups(6, 1 << 20, LINK, layer_compute_s=1e-5)) == [1] * 6
    # Nothing to send (decode had the prompt cached): one write.
    assert sizes(fitted_groups(6, 0, LINK, layer_compute_s=1e-3)) == [5, 1]
    assert fitted_groups(0, 1, LINK, None) == []


def test_compute_model_learns_per_token_layer_time():
    model = ComputeModel(smoothing=0.5)
    assert model.layer_s(1000) is None
    model.observe(0.010, 1000)
    model.observe(0.020, 1000)
    assert model.layer_s(2000) == pytest.approx(0.030)


def test_link_estimator_learns_the_cost_writes_really_have():
    loaded = LinkModel(overhead_s=2e-3, bytes_per_s=0.5e9)  # a busy host
    estimator = LinkEstimator(LINK, window=16)
    for i in range(7):
        estimator.observe((i + 1) << 20, loaded.transfer_s((i + 1) << 20))
    assert estimator.model == LINK  # too few writes to trust yet
    for i in range(16):
        estimator.observe((i % 8 + 1) << 20, loaded.transfer_s((i % 8 + 1) << 20))
    assert estimator.model.overhead_s == pytest.approx(2e-3)
    assert estimator.model.bytes_per_s == pytest.approx(0.5e9)
    # Same-size writes cannot separate overhead from bandwidth: keep the overhead.
    same = LinkEstimator(loaded, min_samples=2)
    for _ in range(4):
        same.observe(1 << 20, 2e-3 + (1 << 20) / 0.25e9)
    assert same.model.overhead_s == 2e-3
    assert same.model.bytes_per_s == pytest.approx(0.25e9)


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    assert block_runs([2, 3, 4, 9, 10], [7, 8, 9, 11, 13]) == [(2, 7, 3), (9, 11, 1), (10, 13, 1)]
    assert block_runs([], []) == []


def test_segments_are_one_per_run_when_blocks_are_packed():
    packed = [LayerLayout((Region(1000 * (i + 1), 64, 64),)) for i in range(2)]
    srcs, dsts, lens = segments(packed, packed, [0, 1], [(2, 5, 3)])
    assert srcs == [1000 + 128, 2000 + 128] and dsts == [1000 + 320, 2000 + 320]
    assert lens == [192, 192]


def test_segments_are_one_per_block_when_blocks_have_gaps():
    src = [LayerLayout((Region(0, 100, 64), Region(10_000, 100, 64)))]
    dst = [LayerLayout((Region(50_000, 80, 64), Region(60_000, 80, 64)))]
    srcs, dsts, lens = segments(src, dst, [0], [(1, 2, 2)])
    assert srcs == [100, 200, 10_100, 10_200]
    assert dsts == [50_160, 50_240, 60_160, 60_240]
    assert lens == [64] * 4


def test_describe_layer_reads_block_major_and_head_major_tensors():
    torch = pytest.importorskip("torch")
    blocks = torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16)  # [blocks, heads, tokens, dim]
    (region,) = describe_layer(blocks, 8).regions
    assert region == Region(blocks.data_ptr(), 2 * 16 * 32 * 2, 2 * 16 * 32 * 2)
    # Heads outside the blocks: one region per head, blocks strided by the full row.
    heads = torch.zeros(2, 8, 16, 32, dtype=torch.bfloat16).permute(1, 0, 2, 3)
    layout = describe_layer(heads, 8)
    assert [r.block_len for r in layout.regions] == [16 * 32 * 2] * 2
    assert layout.regions[1].base - layout.regions[0].base == 8 * 16 * 32 * 2
    # A scheduler block made of two kernel blocks.
    (pair,) = describe_layer(blocks, 4).regions
    assert (pair.block_stride, pair.block_len) == (2 * region.block_stride, 2 * region.block_len)
    with pytest.raises(ValueError, match="not block-major"):
        describe_layer(torch.zeros(3, 5), 8)


def test_layouts_must_agree_on_layers_and_block_sizes():
    a = [LayerLayout((Region(0, 64, 64),))] * 2
    assert check_compatible(a, a) is None
    assert "prefill has 2 KV layers, decode 1" in check_compatible(a, a[:1])
    assert "block sizes differ" in check_compatible(a, [LayerLayout((Region(0, 64, 32),))] * 2)


def test_settings_refuse_unknown_keys_and_bad_values():
    assert Settings.from_extra_config({"mode": "layer", "group_size": 4}).group_size == 4
    with pytest.raises(ValueError, match="unknown epd KV connector setting"):
        Settings.from_extra_config({"grup_size": 4})
    with pytest.raises(ValueError, match="group_size must be 'auto' or a positive integer"):
        Settings.from_extra_config({"group_size": 0})
    # RoCE GIDs are a table of 256 entries: a wrong one fails at load, not in the engine.
    assert Settings.from_extra_config({"gid_index": 3}).gid_index == 3
    with pytest.raises(ValueError, match="gid_index must be 0-255"):
        Settings.from_extra_config({"gid_index": 300})
    with pytest.raises(ValueError, match="role must be one of"):
        Settings.from_extra_config({"role": "producer"})
    assert Settings.from_extra_config({"idle_step_wait_ms": 0}).idle_step_wait_ms == 0
    with pytest.raises(ValueError, match="idle_step_wait_ms must be 0-100"):
        Settings.from_extra_config({"idle_step_wait_ms": -1})
    # Timeouts are sized to the expected transfer time, with a floor.
    settings = Settings(transfer_timeout_floor_s=1.0, transfer_timeout_slack=20)
    assert settings.transfer_timeout_s(0.001) == 1.0
    assert settings.transfer_timeout_s(0.5) == 10.0
