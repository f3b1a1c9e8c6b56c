"""Where a request waits for its encoder features whatever scheduler runs: the meeting
point of our two connectors inside one engine-core process.

vLLM's scheduler asks the EC connector `ensure_cache_available(request, ...)` before it
schedules a waiting request's encoder inputs, and keeps the request waiting on False
(vLLM 0.23 `vllm/v1/core/sched/scheduler.py`, "Skip request with pending mm encoding
prefetches"). vllm-ascend 0.23 replaces that scheduler process-wide
(`vllm_ascend/patch/platform/patch_balance_schedule.py`, last line:
`vllm.v1.core.sched.scheduler.Scheduler = BalanceScheduler`); on a `kv_producer`
(`_disable_preemption_on_prefill_node`) its own copy of `schedule()` runs, and that
copy's waiting loop never calls `ensure_cache_available`: the request goes straight to
`_try_schedule_encoder_inputs`, which asks only `has_cache_item`. Both waiting loops
do call the KV connector's `get_num_new_matched_tokens(request, ...)` first and skip a
request for which it answers None ("the KVConnector couldn't determine the number of
matched tokens": vLLM 0.23 scheduler.py, vllm-ascend patch_balance_schedule.py's
`schedule`). So on a prefill instance our KV connector asks the EC connector registered
here for the same vLLM configuration, and answers None while the request must wait; a
kv_both instance does so for every request it computes (all but those whose KV it
receives). vllm-ascend's check is for `kv_producer` by name, so a kv_both instance runs
vLLM's own waiting loop (unless balance scheduling is on), which asks as well.
vllm-ascend's main (for vLLM 0.27.1) drops the prefill-node copy (a prefill runs vLLM's
loop) and has its balance copy ask `ensure_cache_available` itself: there the gate
gives the same answer a second time, and still holds where neither asks.

Registered by the EC connector's scheduler side of a consumer, looked up by the KV
connector's, both made by the scheduler from one `vllm_config` object; keyed by that
object so that two engines (or tests) in one process never meet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# ensure_cache_available(request, num_computed_tokens) -> bool
Check = Callable[[Any, int], bool]

_lock = threading.Lock()
_checks: dict[int, Check] = {}  # id(vllm_config) -> the EC connector's check


def register(vllm_config, check: Check) -> None:
    with _lock:
        _checks[id(vllm_config)] = check


def unregister(vllm_config, check: Check) -> None:
    with _lock:
        if _checks.get(id(vllm_config)) == check:
            del _checks[id(vllm_config)]


def features_ready(vllm_config, request, num_computed_tokens: int) -> bool:
    """False while the request must wait for (or has failed on) its features; True when
    it has none, or no EC connector of ours serves this engine."""
    if not getattr(request, "mm_features", None):
        return True
    with _lock:
        check = _checks.get(id(vllm_config))
    return check is None or check(request, num_computed_tokens)
