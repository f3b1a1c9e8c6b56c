"""Our vLLM plugins act in every engine process of a CPU instance, switched on by the
CPU HAL, before any model code runs: each process asks for AMX tiles (a decode
instance on an AMX CPU otherwise dies in its first attention), and its shared-memory
queue readers nap instead of spinning (backends/cpu/idle_wait.py), and the workers of
instances that sample compile vLLM's logprob-rank kernel (backends/cpu/
sampler_warmup.py). Read from the instances' own logs."""

from __future__ import annotations

import re

import pytest

from epd_serve.backends.cpu import idle_wait
from epd_serve.backends.cpu.amx import GRANTED, NOT_NEEDED, cpu_flags, has_amx

LINE = re.compile(r"epd-serve AMX tile permission in (\S+) \(pid (\d+)\): ([^:]+): (.*)")
NAP = re.compile(r"epd-serve queue readers nap up to (\d+) ms instead of spinning in (\S+) "
                 r"\(pid (\d+)\)")
COMPILED = re.compile(r"epd-serve compiled the sampler's logprob-rank kernel in (\S+) "
                      r"\(pid (\d+)\) in ([\d.]+) s")


@pytest.fixture(scope="module")
def dep(deployments):
    return deployments.get("e-p-d.yaml")  # still up from test_epd_cpu, which runs first


def permission_lines(dep, name: str) -> list[tuple[str, int, str, str]]:
    log = (dep.work_dir / "logs" / f"{name}.log").read_text(errors="replace")
    return [(m[1], int(m[2]), m[3], m[4]) for m in LINE.finditer(log)]


def test_every_engine_process_of_every_instance_asked(dep):
    for launch in dep.launches:
        lines = permission_lines(dep, launch.name)
        processes = {process for process, *_ in lines}
        # The API server, the engine core and the worker: three processes, one line each.
        assert len({pid for _, pid, *_ in lines}) >= 3, (launch.name, lines)
        assert any("Worker" in process for process in processes), (launch.name, processes)
        expected = GRANTED if has_amx(cpu_flags()) else NOT_NEEDED
        assert {status for *_, status, _ in lines} == {expected}, (launch.name, lines)


def test_the_decode_worker_holds_amx_permission_on_an_amx_cpu(dep):
    if not has_amx(cpu_flags()):
        pytest.skip("this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing to grant")
    decode = next(l.name for l in dep.launches if l.instance.roles == "D")
    workers = [line for line in permission_lines(dep, decode) if "Worker" in line[0]]
    assert workers and all(status == GRANTED for _, _, status, _ in workers), workers


def test_every_engine_process_of_every_instance_naps_instead_of_spinning(dep):
    for launch in dep.launches:
        log = (dep.work_dir / "logs" / f"{launch.name}.log").read_text(errors="replace")
        naps = [(int(m[1]), m[2], int(m[3])) for m in NAP.finditer(log)]
        assert len({pid for *_, pid in naps}) >= 3, (launch.name, naps)
        assert any("Worker" in process for _, process, _ in naps), (launch.name, naps)
        assert {ms for ms, *_ in naps} == {idle_wait.NAP_MS}, (launch.name, naps)


def test_the_workers_of_sampling_instances_compiled_the_logprob_rank_kernel_at_start(dep):
    for launch in dep.launches:
        log = (dep.work_dir / "logs" / f"{launch.name}.log").read_text(errors="replace")
        compiled = [(m[1], int(m[2])) for m in COMPILED.finditer(log)]
        if launch.encoder_only:
            assert compiled == [], (launch.name, compiled)  # an encoder never samples
        else:
            assert compiled and all(p.startswith("VllmWorker") for p, _ in compiled), \
                (launch.name, compiled)
