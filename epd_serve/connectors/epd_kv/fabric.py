"""What Mooncake's transfer engine will make of this host's network, decided ahead.

Imported by the KV connector's `Link` (engine worker processes) and usable anywhere:
no torch, vLLM or Mooncake imports. The decisions are pure functions of the facts they
are handed; the readers of the real facts (libibverbs, sysfs, /proc) are at the bottom.

Read against Mooncake's sources of the 0.3.13 wheels (the installed engine's log lines
match them; CUDA x86_64 wheels are built with USE_INTRA_NVLINK, without MNNVL or TENT):
- `TransferEngineImpl::init` (mooncake-transfer-engine/src/transfer_engine_impl.cpp)
  installs exactly one transport: TCP when MC_FORCE_TCP is set (any value, checked
  with getenv before anything else); on NPU builds the Ascend transport; on CUDA builds
  the intra-node NVLink transport when MC_INTRANODE_NVLINK is set; otherwise RDMA when
  topology discovery found an HCA (or MC_FORCE_HCA is set), else TCP. The `protocol`
  given to the Python binding's `initialize` only picks its memory allocator
  (`initMemoryAllocator`, mooncake-integration/transfer_engine/transfer_engine_py.cpp).
  The binding has no call that names the installed transport, hence `installed_transport`.
- Discovery (`listInfiniBandDevices`, mooncake-transfer-engine/src/topology.cpp) takes
  libibverbs' devices, keeps those named by `device_name` (split on ",", nothing
  trimmed) and by MC_TE_FILTERS, and drops a device whose /dev/infiniband/<uverbsN> is
  not readable and writable or which has no ACTIVE port.
- GPU memory (`RdmaContext::exportDmabuf`, .../rdma_transport/rdma_context.cpp) is
  registered with ibv_reg_mr, which needs the nvidia_peermem kernel module, unless
  WITH_NVIDIA_PEERMEM is false (its default is true: mooncake-common/src/environ.cpp):
  then it is exported as a DMA-BUF and imported with ibv_reg_dmabuf_mr, which needs
  Linux >= 5.12 and NVIDIA's open GPU kernel modules.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection, Mapping, Sequence

RDMA, TCP = "rdma", "tcp"
FORCE_TCP = "MC_FORCE_TCP"
GID_INDEX = "MC_GID_INDEX"
PEERMEM = "WITH_NVIDIA_PEERMEM"
# The peer-memory clients that let an HCA pin GPU memory: the driver's own module
# (R470+) and MLNX_OFED's older one.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMABUF_KERNEL = (5, 12)  # ibv_reg_dmabuf_mr: RDMA import of a dma-buf since Linux 5.12


# -- the environment the engine is started with --------------------------------------
def engine_environment(protocol: str, gid_index: int | None) -> dict[str, str]:
    """Variables to set before the engine starts. "tcp" must force TCP: on a host with
    HCAs the engine would otherwise install RDMA whatever `protocol` says."""
    env = {}
    if protocol == TCP:
        env[FORCE_TCP] = "1"
    if gid_index is not None:
        if not 0 <= gid_index <= 255:  # Mooncake ignores other values with a warning
            raise ValueError(f"gid_index must be 0-255 (see show_gids), not {gid_index}")
        env[GID_INDEX] = str(gid_index)
    return env


def device_list(device_name: str) -> list[str]:
    """`device_name` ("mlx5_0, mlx5_1") as names: Mooncake splits it on "," and trims
    nothing, so we pass it on only in this form."""
    return [name.strip() for name in device_name.split(",") if name.strip()]


# -- which transport the engine installs ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hca:
    """An RDMA device as libibverbs lists it, with what Mooncake checks of it."""

    name: str  # mlx5_0
    dev_name: str  # uverbs0: its /dev/infiniband node
    active: bool  # has a port in state ACTIVE
    accessible: bool  # /dev/infiniband/<dev_name> opens for reading and writing


def screen_hcas(hcas: Sequence[Hca], device_name: str,
                env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the HCAs Mooncake's discovery keeps, why each other one is left out)."""
    wanted = device_list(device_name)
    allowed = {n.strip() for n in env.get("MC_TE_FILTERS", "").split(",") if n.strip()}
    present = {h.name for h in hcas}
    used: list[str] = []
    why = [f"{name}: no such RDMA device" for name in wanted if name not in present]
    for hca in hcas:
        if wanted and hca.name not in wanted:
            continue  # not asked for: not a fault
        if allowed and hca.name not in allowed:
            why.append(f"{hca.name}: not in MC_TE_FILTERS")
        elif not hca.accessible:
            why.append(f"{hca.name}: /dev/infiniband/{hca.dev_name} is not readable and "
                       "writable here (a container needs --device /dev/infiniband)")
        elif not hca.active:
            why.append(f"{hca.name}: no port is ACTIVE (ibstat {hca.name})")
        else:
            used.append(hca.name)
    return used, why


def installed_transport(protocol: str, env: Mapping[str, str], hcas: Sequence[str]) -> str:
    """The transport `TransferEngineImpl::init` installs, given the environment it
    starts in and the HCAs its discovery keeps (`screen_hcas`)."""
    if protocol == "ascend":
        # NPU builds (USE_ASCEND_DIRECT) install theirs whatever the environment and
        # HCAs: they never read MC_FORCE_TCP.
        return "ascend"
    if FORCE_TCP in env:
        return TCP
    if "MC_INTRANODE_NVLINK" in env:
        return "nvlink_intra"
    if hcas or "MC_FORCE_HCA" in env:
        return RDMA
    return TCP


def why_not_rdma(env: Mapping[str, str], hcas: Sequence[Hca], device_name: str,
                 left_out: Sequence[str]) -> str:
    """Why the engine would fall back to TCP although RDMA was asked for."""
    if FORCE_TCP in env:
        return f"{FORCE_TCP} is set in the environment (remove it, e.g. from the " \
               "deployment file's env)"
    if not hcas:
        return "libibverbs lists no RDMA device here (ibv_devices; is ibverbs-providers " \
               "installed, and /dev/infiniband passed into a container?)"
    detail = "; ".join(left_out) or f"none of {device_name!r} is usable"
    return f"{detail}; this host has {', '.join(h.name for h in hcas)}"


# -- GPUDirect ----------------------------------------------------------------------
def peermem_wanted(env: Mapping[str, str]) -> bool:
    """Whether Mooncake registers GPU memory through nvidia_peermem: WITH_NVIDIA_PEERMEM
    parsed as Mooncake does (mooncake-common/include/bool_parser.h), invalid or unset
    taken as its default, true."""
    value = env.get(PEERMEM, "").strip().lower()
    if value in ("1", "true", "yes", "on", "enable"):
        return True
    if value in ("0", "false", "no", "off", "disable"):
        return False
    return True


def loaded_modules(proc_modules: str) -> set[str]:
    """Module names from /proc/modules text (the first word of each line)."""
    return {line.split()[0] for line in proc_modules.splitlines() if line.strip()}


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of `uname -r` ("5.15.0-91-generic"); (0, 0) if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def gpudirect_problem(env: Mapping[str, str], modules: Collection[str],
                      driver_version: str, kernel_release: str) -> str | None:
    """Why the RDMA NICs could not register GPU memory here, with what to do; None if
    they can. `modules`: loaded kernel modules; `driver_version`: the text of
    /proc/driver/nvidia/version ("" if absent); `kernel_release`: `uname -r`."""
    tcp = "or set protocol: tcp in kv_connector_config (slower: KV then goes through " \
          "host memory)"
    if peermem_wanted(env):
        if any(m in modules for m in PEERMEM_MODULES):
            return None
        return ("GPU memory cannot be registered with the RDMA NICs: Mooncake registers it "
                f"through the nvidia_peermem kernel module ({PEERMEM} unset or true), which "
                "is not loaded. Load it: sudo modprobe nvidia_peermem (and list it in "
                "/etc/modules-load.d/ to keep it after a reboot); or set "
                f"{PEERMEM}=0 to use DMA-BUF (Linux >= 5.12 with NVIDIA's open kernel "
                f"modules); {tcp}")
    kernel_ok = kernel_version(kernel_release) >= DMABUF_KERNEL
    open_modules = "open kernel module" in driver_version.lower()
    if kernel_ok and open_modules:
        return None
    missing = [] if kernel_ok else [f"Linux >= 5.12 (this kernel: {kernel_release})"]
    if not open_modules:
        missing.append("NVIDIA's open GPU kernel modules (/proc/driver/nvidia/version: "
                       f"{driver_version.splitlines()[0] if driver_version else 'absent'})")
    return (f"GPU memory cannot be registered with the RDMA NICs: {PEERMEM}=0 makes "
            f"Mooncake export it as a DMA-BUF, which needs {' and '.join(missing)}. "
            f"Install those, or unset {PEERMEM} and load nvidia_peermem (sudo modprobe "
            f"nvidia_peermem); {tcp}")


# -- readers of the real facts ------------------------------------------------------
def read_hcas() -> list[Hca]:
    """libibverbs' device list (what Mooncake's discovery starts from: only devices
    with an installed provider appear), with each device's port states and node."""
    import ctypes

    class Device(ctypes.Structure):  # struct ibv_device, <infiniband/verbs.h>
        _fields_ = [("ops", ctypes.c_void_p * 2), ("node_type", ctypes.c_int),
                    ("transport_type", ctypes.c_int), ("name", ctypes.c_char * 64),
                    ("dev_name", ctypes.c_char * 64), ("dev_path", ctypes.c_char * 256),
                    ("ibdev_path", ctypes.c_char * 256)]

    try:
        verbs = ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return []
    verbs.ibv_get_device_list.restype = ctypes.POINTER(ctypes.POINTER(Device))
    verbs.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    verbs.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.POINTER(Device))]
    count = ctypes.c_int(0)
    devices = verbs.ibv_get_device_list(ctypes.byref(count))
    if not devices:
        return []
    try:
        found = [devices[i].contents for i in range(count.value)]
        return [Hca(d.name.decode(), d.dev_name.decode(),
                    has_active_port(d.ibdev_path.decode()),
                    os.access(f"/dev/infiniband/{d.dev_name.decode()}", os.R_OK | os.W_OK))
                for d in found]
    finally:
        verbs.ibv_free_device_list(devices)


def has_active_port(ibdev_path: str) -> bool:
    """Any of /sys/class/infiniband/<name>/ports/*/state is "4: ACTIVE" (IBV_PORT_ACTIVE,
    what Mooncake asks for; not ACTIVE_DEFER)."""
    ports = os.path.join(ibdev_path, "ports")
    try:
        names = os.listdir(ports)
    except OSError:
        return False
    for port in names:
        try:
            with open(os.path.join(ports, port, "state")) as state:
                if state.read().partition(":")[0].strip() == "4":
                    return True
        except OSError:
            continue
    return False


def read_gpudirect_facts() -> tuple[set[str], str, str]:
    """(loaded kernel modules, /proc/driver/nvidia/version, kernel release)."""
    import platform

    modules = set()
    try:
        with open("/proc/modules") as text:
            modules = loaded_modules(text.read())
    except OSError:
        pass
    modules |= {m for m in PEERMEM_MODULES if os.path.isdir(f"/sys/module/{m}")}
    try:
        with open("/proc/driver/nvidia/version") as text:
            driver = text.read()
    except OSError:
        driver = ""
    return modules, driver, platform.release()
