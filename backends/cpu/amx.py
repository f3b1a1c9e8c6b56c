"""AMX tile permission for the processes of a vLLM CPU engine.

Linux kills with SIGILL a process that executes AMX tile instructions before it asked
for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). oneDNN asks on its
first AMX matrix multiply, but vLLM's CPU attention kernel does not: a decode instance,
whose first forward is a one-token step on received KV, ran that kernel first and its
worker died (exit code -4). So every engine process asks at start.

`vllm_plugin` is a vLLM general plugin (entry point `vllm.general_plugins`), which vLLM
calls in each of its processes (API server, engine core, workers) before any model
code; it acts only where the CPU HAL switched it on (`ENV`). The rest are pure
functions `epd-serve doctor` uses too. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import platform
import sys

ENV = "EPD_AMX_TILE_PERMISSION"  # "1": the plugin asks in this process

# arch/x86/include/uapi/asm/prctl.h and the x86-64 syscall table.
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

GRANTED, NOT_NEEDED, REFUSED = "granted", "not needed", "refused"

log = logging.getLogger("vllm.epd_serve.amx")


@dataclasses.dataclass(frozen=True)
class Permission:
    """What asking for AMX tiles gave this process."""

    status: str  # GRANTED | NOT_NEEDED | REFUSED
    detail: str

    def __str__(self) -> str:
        return f"{self.status}: {self.detail}"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def has_amx(flags: set[str]) -> bool:
    return "amx_tile" in flags


def request_tile_permission(flags: set[str] | None = None) -> Permission:
    """Ask the kernel for AMX tile data in this process (once is enough: the permission
    is per process and kept by its threads); say what came of it."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return Permission(NOT_NEEDED, f"no AMX on {platform.system()}/{platform.machine()}")
    flags = cpu_flags() if flags is None else flags
    if not has_amx(flags):
        return Permission(NOT_NEEDED, "this CPU has no AMX")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        errno = ctypes.get_errno()
        hint = (" (Linux older than 5.16 cannot grant AMX; vLLM's AMX kernels will crash: "
                "upgrade the kernel)") if errno == 22 else ""
        return Permission(REFUSED, f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed: "
                                   f"{os.strerror(errno)}{hint}")
    granted = ctypes.c_ulong(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
        return Permission(REFUSED, "arch_prctl(ARCH_GET_XCOMP_PERM) failed: "
                                   f"{os.strerror(ctypes.get_errno())}")
    if not granted.value & (1 << XFEATURE_XTILEDATA):
        return Permission(REFUSED, f"the kernel answered without tile data "
                                   f"(permitted features {granted.value:#x})")
    return Permission(GRANTED, "AMX tile data permitted for this process")


def vllm_plugin() -> None:
    """vLLM general plugin: ask for AMX tiles in this engine process where the HAL
    switched it on, and log one line with the outcome."""
    if os.environ.get(ENV) != "1":
        return
    outcome = request_tile_permission()
    line = (f"epd-serve AMX tile permission in {multiprocessing.current_process().name} "
            f"(pid {os.getpid()}): {outcome}")
    if log.hasHandlers():
        (log.warning if outcome.status == REFUSED else log.info)(line)
    else:  # the API server loads plugins before vLLM has set up its logging
        print(line, file=sys.stderr, flush=True)
