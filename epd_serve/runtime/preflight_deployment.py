"""Preflight of one deployment on this machine, read from its start-up plan
(epd_serve/runtime/plan.py): the model each instance loads, the port each process
binds, /dev/shm for the MM Store and vLLM's message queues, memory for the processes
that run here and, on CUDA, the KV fabric in the environment its engines start with.

Runs in the CLI process (`epd-serve doctor`: deployment_rows, every row) and in the
launcher's (`epd-serve up`: refuse_to_start, which checks the model, the ports and the
engine environment before anything starts and raises on the first error, worded as
the doctor's row). Processes on other nodes are left to the doctor run there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from epd_serve.deployment.resolve import ResolvedDeployment
from epd_serve.deployment.schema import ConfigError
from epd_serve.models.tinymodel import is_model_dir
from epd_serve.runtime.child import port_in_use
from epd_serve.runtime.plan import Step
from epd_serve.runtime import preflight_machine as machine
from epd_serve.runtime import preflight_stack as stack
from epd_serve.runtime.preflight_rows import ERROR, GIB, OK, WARNING, Row, gib_ceil, mib, ranges
from epd_serve.runtime.supervision import LaunchError

# vLLM checks at each instance's start that /dev/shm can hold its largest message
# queue: 10 chunks of 24 MiB (vllm/distributed/device_communicators/shm_broadcast.py).
VLLM_SHM_QUEUE_BYTES = 10 * (24 << 20)
# The proxy, the MM Store's server and the launcher: 65 and 41 MB resident after their
# imports (measured); the rest is room for requests in flight.
SERVING_PROCESSES_GIB = 0.25
# Warn when what is needed comes within this fraction of what there is.
MARGIN = 0.15

LocalHosts = Callable[[str], bool]


def check_model(model_dir: str, present: bool, tiny_family: str | None) -> Row:
    """`tiny_family`: the tiny model `up` builds where none is (None: nothing will)."""
    if present:
        return Row(OK, "model", f"{model_dir} holds a model")
    if tiny_family is not None:
        return Row(OK, "model", f"{model_dir} not built yet: `epd-serve up` builds the tiny "
                                f"{tiny_family} model there (about a second)")
    return Row(ERROR, "model", f"{model_dir} not found or holds no model (config.json and "
                               "*.safetensors)",
               f"put the checkpoint in {model_dir} or point 'model' at one; for a test, build "
               f"the tiny model there (`epd-serve model tiny --family qwen2_vl {model_dir}`) "
               "or add `tiny_model: qwen2_vl` to the file, which makes `up` build it")


def check_ports(ports: Sequence[tuple[str, int, str]], local_hosts: LocalHosts,
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
    found = f"all {len(here)} free on {hosts}: {ranges(p for _, p, _ in here)}" if here \
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
    parts = [f"MM Store arena {mib(store_bytes)}"] if store_bytes else []
    if instances:
        parts.append(f"vLLM's message queue {mib(VLLM_SHM_QUEUE_BYTES)}")
    what = " + ".join(parts) if parts else "nothing"
    if store_backend is not None and store_backend != "shm":
        what += f" (the {store_backend} MM Store's pool is counted under memory)"
    found = f"{mib(free_bytes)} free of {mib(total_bytes)}; needs {what}"
    size = gib_ceil(total_bytes - free_bytes + need * (1 + MARGIN))  # what is used stays
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


# -- the start-up plan, as the checks read it ----------------------------------------
def is_local_host(host: str) -> bool:
    import psutil

    if host in ("0.0.0.0", "localhost", "::", "::1") or host.startswith("127."):
        return True
    return any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def plan_ports(steps: Sequence[Step]) -> list[tuple[str, int, str]]:
    """(address, port, user) of every port a process of the plan binds."""
    return [(step.address, port, user) for step in steps for port, user in step.ports.items()]


def instances_here(steps: Sequence[Step], local_hosts: LocalHosts) -> list[Step]:
    return [s for s in steps if s.kind == "instance" and local_hosts(s.address)]


def store_here(dep: ResolvedDeployment, steps: Sequence[Step], local_hosts: LocalHosts) -> bool:
    """Whether the deployment has an MM Store and the plan starts it on this machine."""
    return dep.mm_store is not None and any(s.kind == "store" and local_hosts(s.address)
                                            for s in steps)


def model_rows(steps: Sequence[Step], local_hosts: LocalHosts,
               tiny_family: str | None) -> list[Row]:
    """One row per model the instances here load (one, in every shipped file)."""
    models = list(dict.fromkeys(s.launch.model for s in instances_here(steps, local_hosts)))
    if not models:
        return [Row(OK, "model", "no instance loads one on this machine (run doctor on "
                                 "their nodes)")]
    return [check_model(m, is_model_dir(m), tiny_family) for m in models]


def shm_row(dep: ResolvedDeployment, steps: Sequence[Step], config: str,
            local_hosts: LocalHosts) -> Row:
    """/dev/shm against the store started here (if any) and the instances here."""
    store = dep.mm_store
    here = store_here(dep, steps, local_hosts)
    arena = store_arena_bytes(store.capacity_bytes) if here and store.backend == "shm" else 0
    shm = os.statvfs("/dev/shm")
    return check_dev_shm(store.backend if here else None, arena,
                         len(instances_here(steps, local_hosts)),
                         shm.f_bavail * shm.f_frsize, shm.f_blocks * shm.f_frsize, config)


def memory_row(dep: ResolvedDeployment, steps: Sequence[Step], config: str,
               local_hosts: LocalHosts) -> Row:
    """Memory for every process of the plan that starts here."""
    import psutil

    here = instances_here(steps, local_hosts)
    # "~": a switchable instance, a full engine even where it starts as an encoder.
    needs = [(s.name + ("~" if s.launch.instance.switchable else ""),
              dep.platform.host_memory_gib(s.launch)) for s in here]
    store = dep.mm_store
    if store_here(dep, steps, local_hosts):
        needs.append((f"MM Store ({store.backend})", store.capacity_bytes / GIB))
    if any(s.kind == "proxy" and local_hosts(s.address) for s in steps):
        needs.append(("proxy and store server", SERVING_PROCESSES_GIB))
    skipped = sum(s.kind == "instance" for s in steps) - len(here)
    return check_memory(needs, psutil.virtual_memory().available / GIB,
                        dep.config.platform, config, skipped=skipped)


def kv_step(steps: Sequence[Step], local_hosts: LocalHosts) -> Step | None:
    """The first instance here that sends or receives KV (None: none does)."""
    return next((s for s in instances_here(steps, local_hosts) if s.launch.kv_role), None)


def engine_env(step: Step | None) -> dict[str, str]:
    """The environment `step`'s engine starts in: ours with the plan's on top."""
    return {**os.environ, **(step.env if step is not None else {})}


def deployment_rows(dep: ResolvedDeployment, steps: Sequence[Step], config: str,
                    local_hosts: LocalHosts = is_local_host) -> list[Row]:
    """Every check of one deployment on this machine (`steps`: its start-up plan)."""
    rows = stack.stack_rows(dep.config.platform)
    rows += model_rows(steps, local_hosts, dep.config.tiny_model)
    rows.append(check_ports(plan_ports(steps), local_hosts, port_in_use, config))
    rows.append(shm_row(dep, steps, config, local_hosts))
    rows.append(memory_row(dep, steps, config, local_hosts))
    if dep.config.platform == "cuda" and (step := kv_step(steps, local_hosts)) is not None:
        rows.append(machine.rdma_settings_row(engine_env(step),
                                              machine.kv_fabric(dep.platform, step.launch)))
    return rows


# -- the launcher's refusal ------------------------------------------------------------
def refusal(dep: ResolvedDeployment, row: Row) -> str:
    """One line: what stops the deployment and the fix, as the doctor words it."""
    return f"cannot start {dep.config.name}: {row.check} {row.found}; {row.fix}"


def refuse_to_start(dep: ResolvedDeployment, steps: Sequence[Step]) -> None:
    """What the launcher checks before it starts `steps` (every one on this host): each
    model is there (the tiny one is built before this: bringup.ensure_model) and every
    port is free (ConfigError: the file or the machine must change), then the engine
    environment imports the platform's packages (LaunchError). The first error raises."""
    everywhere: LocalHosts = lambda host: True  # noqa: E731 - one host runs it all
    rows = [*model_rows(steps, everywhere, tiny_family=None),
            check_ports(plan_ports(steps), everywhere, port_in_use, "CONFIG")]
    for row in rows:
        if row.level == ERROR:
            raise ConfigError(refusal(dep, row))
    interpreters = {s.launch.engine_python for s in steps if s.kind == "instance"}
    # An engine_python that is ours runs our packages: checked here, in this process.
    row = stack.check_engine_environment(dep.platform,
                                         sorted(interpreters - {None, sys.executable}))
    if row.level == ERROR:
        raise LaunchError(refusal(dep, row))
