"""The CPU backend's AMX plugin: the request itself, and the plugin vLLM runs in each
engine process (one line, only where the HAL switched it on)."""

from __future__ import annotations

import subprocess
import sys


from epd_serve.backends.cpu import amx
from epd_serve.backends.cpu.platform import CpuPlatform
from epd_serve.backends.hal import InstanceLaunch
from epd_serve.topology.notation import parse

SAPPHIRE_RAPIDS = "processor : 0\nflags : fpu avx512f amx_bf16 amx_tile amx_int8\n"


def test_flags_come_from_the_first_cpu():
    flags = amx.cpu_flags(SAPPHIRE_RAPIDS + "processor : 1\nflags : fpu\n")
    assert amx.has_amx(flags) and "avx512f" in flags
    assert not amx.has_amx(amx.cpu_flags("flags : fpu avx2\n"))
    assert amx.cpu_flags("") == set()


def test_a_cpu_without_amx_needs_no_permission():
    outcome = amx.request_tile_permission({"avx2", "avx512f"})
    assert outcome.status == amx.NOT_NEEDED and "no AMX" in outcome.detail


def test_this_process_asks_the_kernel_on_an_amx_cpu():
    if not amx.has_amx(amx.cpu_flags()):
        # The kernel answers for its own CPU: told "AMX" on one without, it refuses.
        outcome = amx.request_tile_permission({"amx_tile"})
        assert outcome.status == amx.REFUSED and "ARCH_REQ_XCOMP_PERM" in outcome.detail
        return
    assert amx.request_tile_permission().status == amx.GRANTED


def run_plugin(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", "from epd_serve.backends.cpu.amx import "
                           "vllm_plugin; vllm_plugin()"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env}, check=True)
    return done.stderr


def test_the_plugin_acts_only_where_the_hal_switched_it_on():
    assert run_plugin({}) == ""
    (line,) = run_plugin({amx.ENV: "1"}).splitlines()
    expected = amx.GRANTED if amx.has_amx(amx.cpu_flags()) else amx.NOT_NEEDED
    assert line.startswith("epd-serve AMX tile permission in MainProcess (pid ")
    assert f"): {expected}: " in line


def test_the_cpu_hal_switches_it_on_for_every_instance():
    plan = parse("E-P-D")
    for instance in plan.instances:
        launch = InstanceLaunch(instance=instance, model="m", served_model_name="m",
                                host="127.0.0.1", port=8100, devices=(0,), memory_share=1.0,
                                max_model_len=4096)
        assert CpuPlatform().environment(launch)[amx.ENV] == "1"


def test_vllm_finds_the_plugin_among_its_general_plugins():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="vllm.general_plugins")
                if e.name == "epd_serve_amx"]
    assert entry.load() is amx.vllm_plugin
