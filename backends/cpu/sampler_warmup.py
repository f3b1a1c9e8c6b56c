"""A vLLM worker compiles its sampler's logprob-rank kernel when it starts, not in the
middle of the first request that asks for logprobs.

vLLM's sampler ranks the chosen token of a request that asks for logprobs with
`batched_count_greater_than`, a torch.compile'd function that inductor compiles (C++)
at its first call. On a fresh 2-core host that took 5-20 s inside an engine step: the
first logprobs request after start-up stalled prefill and decode together, past the
proxy's deadlines, and was answered 504 with both instances marked hung (seen on a
fresh machine: tests/e2e/test_fingerprint.py's first request). The warm-up requests
cannot take it on instead: the same stall would fail them for the same reason.

So a sampling worker calls the function at start, twice, at two vocabulary widths
(batch dimension unbacked, as vLLM's own calls mark it): dynamo then holds that
dimension dynamic too, and the model's first real call compiles a graph of its own in
0.15-1.7 s (measured), not 5-20 s: inductor's headers and kernels are built by then
and kept on disk for the host's next workers. Start-up pays the first compile
instead: 5-27 s on a cold host (27 s with P and D compiling at once on 2 cores),
well under a second warm.

`vllm_plugin` is a vLLM general plugin (entry point `vllm.general_plugins`): it acts in
worker processes where the HAL set `ENV` (the CPU platform does, except on encoder-only
instances, which never sample). A compile that fails fails the worker's start, with the
reason: it would otherwise fail the first logprobs request, inside the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time

ENV = "EPD_COMPILE_SAMPLER_AT_START"  # "1": compile in this instance's workers

WORKER_PROCESS_PREFIX = "VllmWorker"  # vLLM's multiproc executor names its workers so

log = logging.getLogger("vllm.epd_serve.sampler_warmup")


def compile_logprob_ranks(count_greater_than) -> None:
    """Call `count_greater_than` (vLLM's batched_count_greater_than) as the sampler
    does, at two widths, checking its answers; raises what the compile raises."""
    import torch
    from torch._dynamo.decorators import mark_unbacked

    for width in (8, 9):
        x = torch.arange(2 * width, dtype=torch.float32).reshape(2, width)
        values = x[:, 3:4].clone()
        mark_unbacked(x, 0)
        mark_unbacked(values, 0)
        got = count_greater_than(x, values)
        if got.tolist() != [width - 3, width - 3]:
            raise RuntimeError(f"the compiled logprob-rank kernel counted {got.tolist()} "
                               f"where {[width - 3] * 2} was due")


def vllm_plugin() -> None:
    """vLLM general plugin: compile the sampler's logprob-rank kernel in a worker."""
    if os.environ.get(ENV) != "1":
        return
    process = multiprocessing.current_process().name
    if not process.startswith(WORKER_PROCESS_PREFIX):
        return
    try:
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    except ImportError:
        log.warning("epd-serve: this vLLM has no batched_count_greater_than; its sampler "
                    "compiles what it compiles at first use (%s not applied)", ENV)
        return
    start = time.monotonic()
    try:
        compile_logprob_ranks(batched_count_greater_than)
    except Exception as err:
        raise RuntimeError(f"epd-serve: compiling vLLM's logprob-rank kernel at start "
                           f"failed ({type(err).__name__}: {err}); a request asking for "
                           "logprobs would fail the same way inside the engine") from err
    log.info("epd-serve compiled the sampler's logprob-rank kernel in %s (pid %d) in "
             "%.1f s", process, os.getpid(), time.monotonic() - start)
