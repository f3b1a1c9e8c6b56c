"""backends/cpu/sampler_warmup.py: which processes compile vLLM's logprob-rank kernel
at start, that a wrong kernel or a failed compile stops the start, and nothing else."""

from __future__ import annotations

import sys
import types

import pytest

from epd_serve.backends.cpu import sampler_warmup
from epd_serve.backends.cpu.sampler_warmup import ENV, compile_logprob_ranks, vllm_plugin


def counting(x, values):
    return (x >= values).sum(-1)


def test_the_kernel_is_called_as_the_sampler_calls_it_at_two_widths():
    import torch

    seen = []

    def kernel(x, values):
        seen.append((tuple(x.shape), tuple(values.shape), x.dtype))
        return counting(x, values)

    compile_logprob_ranks(kernel)
    assert seen == [((2, 8), (2, 1), torch.float32), ((2, 9), (2, 1), torch.float32)]


def test_a_kernel_that_counts_wrong_fails_the_start():
    with pytest.raises(RuntimeError, match=r"counted \[0, 0\] where \[5, 5\] was due"):
        compile_logprob_ranks(lambda x, values: (x < -1).sum(-1))


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's logprobs module with a kernel that records its calls."""
    calls = []

    def batched_count_greater_than(x, values):
        calls.append(x.shape)
        return counting(x, values)

    module = types.ModuleType("vllm.v1.sample.ops.logprobs")
    module.batched_count_greater_than = batched_count_greater_than
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.ops.logprobs", module)
    return module, calls


def in_process(monkeypatch, name):
    monkeypatch.setattr(sampler_warmup.multiprocessing, "current_process",
                        lambda: types.SimpleNamespace(name=name))


@pytest.mark.parametrize("env, process, compiles", [
    ("1", "VllmWorker-0", True),
    ("1", "EngineCore", False),   # the engine core and the API server never sample
    ("1", "MainProcess", False),
    (None, "VllmWorker-0", False),  # an encoder-only instance: the HAL set nothing
])
def test_only_workers_the_hal_switched_on_compile(monkeypatch, fake_vllm, env, process,
                                                   compiles):
    _, calls = fake_vllm
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    in_process(monkeypatch, process)
    vllm_plugin()
    assert len(calls) == (2 if compiles else 0)


def test_a_compile_that_fails_fails_the_worker_with_its_reason(monkeypatch, fake_vllm):
    module, _ = fake_vllm

    def broken(x, values):
        raise OSError("cc: not found")

    module.batched_count_greater_than = broken
    monkeypatch.setenv(ENV, "1")
    in_process(monkeypatch, "VllmWorker-0")
    with pytest.raises(RuntimeError, match="OSError: cc: not found.*logprobs would fail"):
        vllm_plugin()


def test_the_cpu_hal_switches_it_on_except_for_encoder_only_instances():
    from pathlib import Path

    from epd_serve.backends import get_platform
    from epd_serve.deployment import schema
    from epd_serve.deployment.resolve import resolve

    dep = resolve(schema.Deployment(name="t", deployment="E-P-D", model="/models/m"),
                  Path("/proj"))
    cpu = get_platform("cpu")
    switched = {l.name: cpu.environment(l).get(ENV) for l in dep.launches}
    assert switched == {"e0": None, "p0": "1", "d0": "1"}
