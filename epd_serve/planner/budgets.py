"""Stage budgets (paper 001, Algorithm 1): how much one iteration of an instance may
hold so that it stays under its latency limit, and the engine flags that enforce it.

An instance that decodes must keep every iteration under the TBT (TPOT) SLO; one that
only encodes or prefills may take alpha x the TTFT SLO per iteration, since a request
needs an encode and a prefill iteration before its first token. The search runs on any
latency function: a running engine measured probe by probe (profiler.py) or a
profile's cost model (the planner and the simulator). Pure Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from epd_serve.bench.timings import SLO
from epd_serve.bench.search import largest_passing

DECODING_ROLES = frozenset({"D", "PD", "ED", "EPD"})
MAX_TOKENS = 16384  # search ranges: far above what one iteration of a 7-8B model holds
MAX_IMAGES = 64
MAX_SEQS = 512


def latency_limit_ms(roles: str, slo: SLO, alpha: float = 0.5) -> float:
    """What one iteration of an instance with these roles may take."""
    return slo.tpot_ms if roles in DECODING_ROLES else alpha * slo.ttft_ms


def search_budget(latency_ms: Callable[[int], float], limit_ms: float, high: int) -> int:
    """The largest batch size in [1, high] whose latency stays under the limit; 1 when
    even one item is over it (an instance must make progress: the SLO is missed, not
    the request)."""
    found = largest_passing(lambda n: latency_ms(int(n)) <= limit_ms, 1, high, integer=True)
    return int(found) if found is not None else 1


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one iteration of an instance may hold."""

    images: int  # image budget (tau_e)
    tokens: int  # token budget (tau_t): prefill tokens plus one per decoding sequence
    seqs: int  # decoding sequences


def role_budget(roles: str, slo: SLO, profile, image_tokens: int, context_tokens: int,
                item_frames: int = 0) -> Budget:
    """Algorithm 1, line 1-5, on a profile's cost model. `image_tokens`: a typical
    encoder item's visual tokens (an image, or a video or a chunk of one, of
    `item_frames` frames); `context_tokens`: a typical decoding sequence's context."""
    limit = latency_limit_ms(roles, slo, profile.alpha)
    images = tokens = seqs = 0
    if "E" in roles:
        images = search_budget(lambda n: profile.encode_ms([image_tokens] * n, n * item_frames),
                               limit, MAX_IMAGES)
    if "P" in roles:
        tokens = search_budget(lambda n: profile.iteration_ms(n, 0), limit, MAX_TOKENS)
    if "D" in roles:
        seqs = search_budget(lambda n: profile.iteration_ms(0, n, n * context_tokens), limit,
                             MAX_SEQS)
        seqs = min(seqs, max(1, profile.memory.kv_capacity_tokens // max(1, context_tokens)))
        tokens = max(tokens, seqs)
    return Budget(images, tokens, seqs)


def engine_flags(roles: str, budget: Budget, image_tokens: int) -> dict[str, int]:
    """vLLM's batching flags for a budget. vLLM has no separate image budget: its
    encoder budget is max_num_batched_tokens (in visual tokens), so an encoder-only
    instance gets its image budget in tokens, and an instance running several stages
    the larger of its two budgets."""
    tokens = budget.tokens
    if "E" in roles:
        tokens = max(tokens, budget.images * image_tokens)
    flags = {"max_num_batched_tokens": max(tokens, image_tokens if "E" in roles else 1)}
    if "D" in roles:
        flags["max_num_seqs"] = budget.seqs
    elif roles == "E":
        flags["max_num_seqs"] = budget.images
    return flags
