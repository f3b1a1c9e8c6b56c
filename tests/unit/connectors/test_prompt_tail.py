"""Decode puts back the K/V prefill computed for a received prompt's last token after
the step that computes that token again (prompt_tail.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epd_serve.connectors.epd_kv.prompt_tail import KeepPlan, PromptTailKeeper, keep_plans

BLOCK = 4


def new_request(req_id: str, prompt_len: int, computed: int, blocks: list[int]):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=computed, block_ids=(blocks,))


def test_only_a_received_request_computing_its_last_prompt_token_is_kept():
    scheduled = [
        new_request("received", 10, 9, [7, 8, 9]),  # token 9 lies in block 2 (id 9)
        new_request("local", 10, 9, [1, 2, 3]),  # a prefix hit of its own: not ours
        new_request("failed load", 10, 4, [4, 5, 6]),  # recomputes from token 4
        new_request("full block", 8, 7, [11, 12]),  # token 7: last slot of block 1
    ]
    plans = keep_plans(scheduled, {"received", "failed load", "full block"}, BLOCK)
    assert plans == [KeepPlan("received", 9), KeepPlan("full block", 12)]


def layers(count: int, pair: bool, kernel_blocks: int = 1) -> list:
    """Block-major caches: 6 scheduler blocks of BLOCK tokens, 2 heads of 3 values."""
    def tensor():
        return torch.randn(6 * kernel_blocks, 2, BLOCK // kernel_blocks, 3)
    return [(tensor(), tensor()) if pair else tensor() for _ in range(count)]


def flat(caches) -> list[torch.Tensor]:
    return [t for layer in caches for t in (layer if isinstance(layer, tuple) else (layer,))]


def unchanged_since(caches, snapshot: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(flat(caches), snapshot))


def forward_writes_slot(caches, block: int, slot: int, kernel_blocks: int = 1) -> None:
    """What decode's forward pass does to the last prompt token's slot: its own K/V."""
    per = BLOCK // kernel_blocks
    for tensor in flat(caches):
        tensor[block * kernel_blocks + slot // per, :, slot % per] += 0.01


def test_prefills_kv_goes_back_after_the_step_in_every_layer_and_form():
    for pair, kernel_blocks in ((False, 1), (True, 1), (False, 2)):
        caches = layers(3, pair, kernel_blocks)
        before = [t.clone() for t in flat(caches)]
        keeper = PromptTailKeeper(caches, kernel_blocks)
        keeper.landed({"r"})
        keeper.save([KeepPlan("r", 2)])
        forward_writes_slot(caches, block=2, slot=3, kernel_blocks=kernel_blocks)
        assert not unchanged_since(caches, before)
        keeper.restore()
        assert unchanged_since(caches, before)


def test_a_receive_not_seen_to_succeed_keeps_what_decode_computed():
    caches = layers(2, pair=False)
    keeper = PromptTailKeeper(caches)
    keeper.landed({"aborted"})
    keeper.forget({"aborted"})
    keeper.save([KeepPlan("aborted", 1), KeepPlan("never landed", 3)])
    forward_writes_slot(caches, block=1, slot=0)
    after_forward = [t.clone() for t in flat(caches)]
    keeper.restore()
    assert unchanged_since(caches, after_forward)


def test_a_request_is_kept_once():
    caches = layers(1, pair=False)
    keeper = PromptTailKeeper(caches)
    keeper.landed({"r"})
    keeper.save([KeepPlan("r", 0)])
    keeper.restore()
    keeper.save([KeepPlan("r", 0)])  # scheduled again later (resumed): decode's own now
    forward_writes_slot(caches, block=0, slot=1)
    after_forward = [t.clone() for t in flat(caches)]
    keeper.restore()
    assert unchanged_since(caches, after_forward)
