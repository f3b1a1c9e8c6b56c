"""The preflight's machine checks (epd_serve/runtime/preflight_machine.py), each on
made-up facts: CPU, vector units, AMX, network namespace and interfaces."""

from __future__ import annotations

import pytest

from epd_serve.backends.cpu import amx
from epd_serve.runtime import preflight_machine as preflight
from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_ZEN3 = """processor\t: 0
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx2 fma
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd
Hardware\t: Ampere Altra
"""


@pytest.mark.parametrize("cpuinfo, model", [
    (XEON, "Intel(R) Xeon(R) Platinum 8480+"),
    (EPYC_ZEN3, "AMD EPYC 7763 64-Core Processor"),
    (ARM, "Ampere Altra"),
    ("", ""),
])
def test_cpu_model_from_cpuinfo(cpuinfo, model):
    assert preflight.cpu_model(cpuinfo) == model


@pytest.mark.parametrize("cpuinfo, machine, on_cpu, level, says", [
    (XEON, "x86_64", True, OK, "full kernels (vllm._C)"),
    ("flags : avx2 avx512f", "x86_64", True, OK, "vllm._C_AVX512"),
    (EPYC_ZEN3, "x86_64", True, WARNING, "AVX2 kernels"),
    (EPYC_ZEN3, "x86_64", False, OK, "AVX2 kernels"),  # the engine runs on a device
    ("flags : sse2", "x86_64", True, ERROR, "need at least AVX2"),
    (ARM, "aarch64", True, OK, "not an x86 CPU"),
])
def test_vector_units(cpuinfo, machine, on_cpu, level, says):
    row = preflight.check_vector_units(amx.cpu_flags(cpuinfo), machine, on_cpu)
    assert (row.level, row.check) == (level, "AVX-512")
    assert says in row.found
    assert bool(row.fix) == (level != OK)


def test_amx_presence_from_cpuinfo():
    present = preflight.check_amx(amx.cpu_flags(XEON))
    assert present.level == OK and "amx_bf16, amx_int8, amx_tile" in present.found
    assert "AMX kernels" in present.found
    assert "absent" in preflight.check_amx(amx.cpu_flags(EPYC_ZEN3)).found


@pytest.mark.parametrize("status, plugin, level, says", [
    (amx.GRANTED, True, OK, "granted"),
    (amx.GRANTED, None, OK, "granted"),
    (amx.GRANTED, False, ERROR, "epd_serve_amx"),  # engines would not ask: SIGILL
    (amx.NOT_NEEDED, False, OK, "not needed"),  # no AMX: the plugin does not matter
    (amx.REFUSED, True, ERROR, "SIGILL"),
])
def test_amx_permission(status, plugin, level, says):
    row = preflight.check_amx_permission(amx.Permission(status, "detail"), plugin)
    assert row.level == level and says in row.found
    if status == amx.REFUSED:
        assert "5.16" in row.fix
    assert bool(row.fix) == (level == ERROR)


@pytest.mark.parametrize("method, probe_ok, loopback_only, level", [
    ("ip netns", True, False, OK),
    ("user namespace", True, False, OK),
    ("user namespace", False, True, OK),  # already inside one
    ("user namespace", False, False, ERROR),
])
def test_network_namespace(method, probe_ok, loopback_only, level):
    row = preflight.check_netns(method, probe_ok, "Operation not permitted", loopback_only)
    assert row.level == level
    if level == ERROR:
        assert "Operation not permitted" in row.found and "unprivileged_userns" in row.fix


def test_interfaces_other_than_loopback_warn():
    assert preflight.check_interfaces(["lo"]).level == OK
    row = preflight.check_interfaces(["eth0", "lo", "docker0"])
    assert row.level == WARNING and "docker0, eth0 besides lo" in row.found
    assert "scripts/in-netns.sh" in row.fix

