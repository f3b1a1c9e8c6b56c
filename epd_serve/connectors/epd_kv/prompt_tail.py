"""Decode keeps the K/V prefill computed for a received prompt's last token.

vLLM computes at least one token of every prompt itself, so after a whole prompt's KV
has been received, decode runs the last prompt token again (to sample the first output
token) and writes its K/V over the one prefill sent. That token is then computed as a
one-token query over the cached prompt, while one instance computes it inside the
prompt's own forward pass; with bf16 kernels of different shapes the two K/V differ in
their last bits, and on long prompts every later token's log-probs drift from what one
instance answers (~0.03 at step 1 on a ~2000-token prompt). Putting prefill's K/V back
after that step leaves decode's cache exactly what one instance would hold.

The step is the first one that schedules a received request with all but its last
prompt token computed (the scheduler side names its last block, `KeepPlan`); the
worker saves that block in every layer before the forward pass and writes it back after
it. Only the last token's slot changes in between, so restoring the whole block
restores that slot and nothing else. Only receives the worker saw succeed are kept: a
block a failed receive never wrote is the engine's to recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from epd_serve.connectors.epd_kv.layout import layer_tensors


class KeepPlan(NamedTuple):
    """A received request scheduled to compute its last prompt token in this step."""

    request_id: str
    block_id: int  # the scheduler block holding that token


def keep_plans(scheduled_new_reqs, received: set[str], block_size: int) -> list[KeepPlan]:
    """Scheduler side: the received requests this step computes only the last prompt
    token of (vLLM schedules a received request as new, with every prompt token but
    the last one computed)."""
    plans = []
    for new in scheduled_new_reqs:
        prompt_len = len(new.prompt_token_ids or ())
        if new.req_id not in received or prompt_len == 0:
            continue
        if new.num_computed_tokens != prompt_len - 1:
            continue  # a failed or partial receive: the engine computes more itself
        block_ids = new.block_ids[0]  # the (only) KV cache group's blocks
        plans.append(KeepPlan(new.req_id, block_ids[(prompt_len - 1) // block_size]))
    return plans


class PromptTailKeeper:
    """Worker side: saves the planned blocks before the forward pass and writes them
    back after it, in every layer."""

    def __init__(self, caches: Sequence, blocks_per_block: int = 1):
        # Every layer's tensor, or both of its (k, v) pair: block-major.
        self._tensors = [tensor for cache in caches for tensor in layer_tensors(cache)]
        self._per_block = blocks_per_block  # kernel blocks per scheduler block
        self._landed: set[str] = set()  # receives that succeeded, not yet kept
        self._saved: list[tuple[int, list]] = []

    def landed(self, request_ids: set[str]) -> None:
        self._landed |= request_ids

    def forget(self, request_ids: set[str]) -> None:
        self._landed -= request_ids

    def save(self, plans: Sequence[KeepPlan]) -> None:
        for plan in plans:
            if plan.request_id not in self._landed:
                continue
            self._landed.discard(plan.request_id)
            rows = self._rows(plan.block_id)
            self._saved.append((plan.block_id, [tensor[rows].clone() for tensor in self._tensors]))

    def restore(self) -> None:
        saved, self._saved = self._saved, []
        for block_id, copies in saved:
            rows = self._rows(block_id)
            for tensor, copy in zip(self._tensors, copies):
                tensor[rows].copy_(copy)

    def _rows(self, block_id: int) -> slice:
        return slice(block_id * self._per_block, (block_id + 1) * self._per_block)
