"""The start-up plan: a resolved deployment as the ordered list of processes to start,
each with its command line, environment, node and devices, what answers when it is up,
and which earlier processes must be serving before it starts, and why.

Pure (no I/O). The local launcher, the Ray launcher and the shell emitter all start
exactly this list in this order, so the three cannot drift apart. The order: the MM
Store's servers (engines connect to the store as they start, so each must serve before
anything after it starts), then the instances, then the proxy, which is up when its
/ready answers (every instance has answered the proxy's own probe).

Instances that share a device start one after another: vLLM sizes its KV cache from
how the device's free memory changes while it profiles, so a neighbour that allocates
at the same time skews that size or fails the start. An instance therefore waits for
the health of the instance before it on each of its devices. Instances start in plan
order, except that those that must wait come after every instance that need not (and
so on, round by round), so instances on distinct devices still start together.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Literal

from epd_serve.deployment.resolve import ResolvedDeployment
from epd_serve.backends.hal import InstanceLaunch
from epd_serve.protocols.registry import get_protocol
from epd_serve.mmstore.service import store_processes
from epd_serve.proxy.config import InstanceEntry, ProxyConfig
from epd_serve.proxy.tenancy import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER

# Stands for the folder that holds a process's own files (the proxy's config and its
# roster) in commands and file contents: the work directory on one host, a node-local
# folder on Ray, "$WORK" in a shell script.
RUN_DIR = "{run_dir}"
PROXY_CONFIG_FILE = "proxy.json"
ROSTER_FILE = "proxy-roster.json"
# Stands for the deployment's internal token (proxy/tenancy.py) in environments: the
# proxy takes it from INTERNAL_TOKEN_ENV, the engines send it with their span exports.
# Each starter makes a new one per bring-up (the launchers a random one, the shell
# script its $EPD_INTERNAL_TOKEN), so it is never written into a file.
INTERNAL_TOKEN = "{internal_token}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One process of the deployment."""

    name: str
    kind: Literal["store", "instance", "proxy"]
    command: tuple[str, ...]
    env: dict[str, str]  # on top of the starter's own environment
    node: str  # the cluster node it runs on ("local": one host, no cluster)
    address: str  # the address it serves on
    health_url: str  # answers 200 once the process is up
    start_timeout_s: float  # how long it may take to answer health_url
    # Earlier steps that must be serving before it starts -> why ("they share cuda:0").
    waits_on: dict[str, str] = dataclasses.field(default_factory=dict)
    ports: dict[int, str] = dataclasses.field(default_factory=dict)  # must be free first
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # written into RUN_DIR
    launch: InstanceLaunch | None = None  # instances: devices, memory share, stages

    @property
    def devices(self) -> tuple[int, ...]:
        return self.launch.devices if self.launch is not None else ()


STORE_START_TIMEOUT_S = 60.0
SERVES_THE_STORE = "the MM Store serves first"  # engines connect to it as they start


def startup_plan(dep: ResolvedDeployment) -> list[Step]:
    """Every process of `dep`, in start order."""
    head = dep.config.cluster.head_node.name if dep.config.cluster is not None else "local"
    steps: list[Step] = []
    stores: dict[str, str] = {}
    if dep.mm_store is not None:
        for index, proc in enumerate(store_processes(dep.mm_store)):
            # The first claims every store port: a later one's port must not be taken
            # by anything else while the first starts.
            steps.append(Step(name=proc.name, kind="store", command=tuple(proc.command), env={},
                              node=head, address=dep.proxy_host, health_url=proc.health_url,
                              start_timeout_s=STORE_START_TIMEOUT_S, waits_on=dict(stores),
                              ports=dep.store_ports() if index == 0 else {}))
            stores[proc.name] = SERVES_THE_STORE
    shared = device_waits(dep)
    instances = [Step(name=launch.name, kind="instance",
                      command=tuple(dep.platform.command(launch)),
                      env={**dep.platform.environment(launch), **span_export_env(launch)},
                      node=launch.node,
                      address=launch.host, health_url=f"{launch.url}/health",
                      start_timeout_s=dep.config.health_timeout_s,
                      waits_on={**stores, **shared[launch.name]}, ports=launch.ports(),
                      launch=launch)
                 for launch in dep.launches]
    # Round by round: an instance starts in the round after the last instance it waits
    # for; within a round, in plan order (sorted() keeps it).
    rounds: dict[str, int] = {}
    for step in instances:
        rounds[step.name] = 1 + max((rounds[name] for name in shared[step.name]), default=-1)
    steps += sorted(instances, key=lambda step: rounds[step.name])
    steps.append(Step(
        name="proxy", kind="proxy",
        command=(sys.executable, "-m", "epd_serve.proxy", "--config",
                 f"{RUN_DIR}/{PROXY_CONFIG_FILE}"),
        env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}, node=head, address=dep.proxy_host,
        # Ready, not only up: every instance has answered the proxy's own probe (else
        # the first image may find no encoder the proxy knows is healthy).
        health_url=f"{dep.proxy_url}/ready", start_timeout_s=dep.config.health_timeout_s,
        waits_on=dict(stores), ports={dep.config.proxy_port: "proxy"},
        files={PROXY_CONFIG_FILE: proxy_config(dep).model_dump_json(indent=2)}))
    return steps


def span_export_env(launch: InstanceLaunch) -> dict[str, str]:
    """An engine exporting spans to the proxy sends the internal token with them."""
    if not launch.traces_endpoint:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"{INTERNAL_TOKEN_HEADER}={INTERNAL_TOKEN}"}


def device_waits(dep: ResolvedDeployment) -> dict[str, dict[str, str]]:
    """Instance name -> the earlier instances it must wait for because they share a
    device, each with why ("they share cuda:0"): on each of its devices, the instance
    placed there before it in plan order. No waits on a platform without devices (cpu:
    a "device" is a logical slot on the host's cores and each engine is given its KV
    cache size), so CPU deployments start every instance at once."""
    waits: dict[str, dict[str, str]] = {launch.name: {} for launch in dep.launches}
    if dep.platform.device_visibility_env is None:
        return waits
    last_on: dict[tuple[str, int], str] = {}  # (node, device) -> the latest instance there
    for launch in dep.launches:
        shared: dict[str, list[int]] = {}
        for device in launch.devices:
            if (earlier := last_on.get((launch.node, device))) is not None:
                shared.setdefault(earlier, []).append(device)
            last_on[launch.node, device] = launch.name
        where = f" on {launch.node}" if launch.node != "local" else ""
        for earlier, devices in shared.items():
            names = ", ".join(f"{dep.platform.device_type}:{d}" for d in devices)
            waits[launch.name][earlier] = f"they share {names}{where}"
    return waits


def carry_out(steps: list[Step], start: Callable[[Step], object],
              wait_for: Callable[[Step], object],
              note: Callable[[str], object] = lambda message: None) -> None:
    """Start `steps` in order, each after waiting for the earlier steps it waits on to
    serve: how every launcher walks the plan. Each step is waited for once, and `note`
    is told why first ("p0 waits for e0's health: they share cuda:0")."""
    started: dict[str, Step] = {}
    serving: set[str] = set()
    for step in steps:
        for name, why in step.waits_on.items():
            if name not in serving:
                note(f"{step.name} waits for {name}'s health: {why}")
                wait_for(started[name])
                serving.add(name)
        start(step)
        started[step.name] = step


def proxy_config(dep: ResolvedDeployment) -> ProxyConfig:
    """The proxy's typed view of the deployment, KV hand-off and MM Store included. Its
    roster (instances registered at run time) is kept in RUN_DIR across proxy restarts."""
    instances = []
    for launch in dep.launches:
        endpoint = None
        if launch.kv_role is not None:
            endpoint = get_protocol(launch.kv_protocol).proxy_endpoint(launch)
        prefetch = None
        if launch.prefetch_port is not None:
            prefetch = f"{launch.host}:{launch.prefetch_port}"
        instances.append(InstanceEntry(name=launch.name, roles=launch.instance.roles,
                                       url=launch.url, kv_endpoint=endpoint,
                                       prefetch_endpoint=prefetch,
                                       switchable=launch.instance.switchable))
    return ProxyConfig(
        **dep.config.proxy.model_dump(),
        roster_path=f"{RUN_DIR}/{ROSTER_FILE}",
        model=dep.launches[0].served_model_name,
        host=dep.proxy_host,
        port=dep.config.proxy_port,
        kv_protocol=dep.launches[0].kv_protocol,
        mm_store=dep.mm_store.to_json() if dep.mm_store is not None else None,
        feature_refs=dep.feature_refs,
        fault_injection=dep.config.fault_injection,
        instances=instances,
    )


def fill_run_dir(text: str, run_dir: str) -> str:
    """`text` with RUN_DIR replaced by where the process's files are."""
    return text.replace(RUN_DIR, run_dir)


def with_internal_token(env: dict[str, str], token: str) -> dict[str, str]:
    """A step's environment with INTERNAL_TOKEN replaced by this bring-up's token."""
    return {key: value.replace(INTERNAL_TOKEN, token) for key, value in env.items()}
