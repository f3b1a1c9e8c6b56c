"""A deployment file resolved into concrete processes: the platform, the MM Store's spec
and one InstanceLaunch per instance of the plan, each computed once.

Pure Python; runs in the CLI and the launcher. Errors are one-line ConfigErrors.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from epd_serve.backends import get_platform
from epd_serve.deployment.schema import ArgValue, ConfigError, Deployment
from epd_serve.backends.hal import InstanceLaunch, Platform, ec_role_for, kv_role_for, memory_shares
from epd_serve.protocols.registry import PROTOCOLS, get_protocol
from epd_serve.mmstore.spec import StoreSpec
from epd_serve.mmstore.transfer_engines import EXCLUSIVE
from epd_serve.topology import notation
from epd_serve.topology.placement import ClusterSpec, PlacementError, Slot, place


def _flag_args(args: dict[str, ArgValue]) -> list[str]:
    """{'limit_mm_per_prompt': '{..}', 'enforce_eager': True} -> CLI flags."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value is None:
            out.append(flag)
        elif value is False:
            continue
        else:
            out += [flag, str(value)]
    return out


def resolve(config: Deployment, root: Path) -> ResolvedDeployment:
    """Turn a deployment file into one InstanceLaunch per instance of its plan."""
    plan = config.plan
    platform = get_platform(config.platform)
    model = _absolute(config.model, root)
    work_dir = _absolute(config.work_dir or f".epd/{config.name}", root)
    slots = slots_of(config)
    shares = memory_shares(plan)
    protocol = kv_protocol_of(config, platform)
    store = store_spec_of(config, platform)
    _check_switchable_store(config, store)
    engine_python = engine_python_of(config, root)
    kv_config = kv_config_of(config, protocol)
    launches = []
    next_kv_port = config.kv_base_port
    next_prefetch_port = config.mm_store.prefetch_base_port
    for index, inst in enumerate(plan.instances):
        args = dict(config.engine_args)
        for role, role_args in config.role_engine_args.items():
            if role in inst.roles:
                args.update(role_args)
        env = dict(config.env)
        for role in ("E", "P", "D"):
            if role in inst.roles:
                env.update(config.role_env.get(role, {}))
        kv_role = kv_role_for(inst)
        kv_port = None
        if kv_role is not None:
            kv_port = next_kv_port
            next_kv_port += inst.tensor_parallel
        ec_role = ec_role_for(inst, plan, decode_consumes=store is not None)
        prefetch_port = None
        may_prefill = inst.has(notation.Role.PREFILL) or inst.switchable
        if store is not None and ec_role in ("ec_consumer", "ec_both") and may_prefill:
            prefetch_port = next_prefetch_port
            next_prefetch_port += 1
        launches.append(
            InstanceLaunch(
                instance=inst,
                model=str(model),
                served_model_name=config.served_model_name or model.name,
                host=slots[inst.name].address,
                port=config.base_port + index,
                devices=slots[inst.name].devices,
                node=slots[inst.name].node,
                memory_share=shares[inst.name],
                max_model_len=config.max_model_len,
                attention_backend=config.attention_backend,
                ec_role=ec_role,
                ec_storage_path=str(work_dir / "ec_cache"),
                mm_store=store if ec_role is not None else None,
                prefetch_port=prefetch_port,
                takes_feature_refs=(store is not None and ec_role in ("ec_consumer", "ec_both")
                                    and feature_refs_of(config, platform) == "embeds"),
                kv_role=kv_role,
                kv_protocol=protocol,
                kv_port=kv_port,
                kv_config=kv_config,
                extra_args=tuple(_flag_args(args)),
                extra_env=tuple(sorted(env.items())),
                engine_python=engine_python,
                traces_endpoint=(f"http://{proxy_host_of(config)}:{config.proxy_port}"
                                 "/v1/traces" if config.engine_traces else None),
            )
        )
    if store is not None and store.backend == "shm" and config.cluster is not None:
        _check_store_on_head(config.cluster, config.name, launches)
    return ResolvedDeployment(config=config, plan=plan, platform=platform, mm_store=store,
                              model_dir=model, work_dir=work_dir, launches=launches,
                              proxy_host=proxy_host_of(config),
                              feature_refs=feature_refs_of(config, platform))


def slots_of(config: Deployment) -> dict[str, Slot]:
    """Where each instance runs: the cluster's placement, or this host's devices."""
    plan = config.plan
    if config.cluster is not None:
        try:
            return place(plan, config.cluster)
        except PlacementError as err:
            raise ConfigError(f"{config.name}: {err}") from None
    device_map = config.devices or list(range(plan.num_devices))
    if len(device_map) < plan.num_devices:
        raise ConfigError(
            f"{config.name}: the plan {plan.to_notation()!r} needs {plan.num_devices} devices "
            f"but 'devices' lists {len(device_map)}"
        )
    return {inst.name: Slot("local", config.host, tuple(device_map[d] for d in inst.devices))
            for inst in plan.instances}


def proxy_host_of(config: Deployment) -> str:
    """The proxy and the MM Store's servers run on the cluster's head, or on this host."""
    return config.cluster.head_node.address if config.cluster is not None else config.host


def _check_store_on_head(cluster: ClusterSpec, name: str, launches: list[InstanceLaunch]) -> None:
    """The shm store is one host's shared memory: every user must be on the head."""
    head = cluster.head_node.name
    away = [f"{l.name} on {l.node}" for l in launches if l.mm_store is not None and l.node != head]
    if away:
        raise ConfigError(f"{name}: mm_store backend 'shm' is shared memory on the "
                          f"head node {head}, but {', '.join(away)} also use it: set "
                          "mm_store: {backend: mooncake} to share features across nodes")


def _check_switchable_store(config: Deployment, store: StoreSpec | None) -> None:
    """A switchable instance's workers publish features (ec_both) beside their KV link:
    two transfer engines in one process, which Ascend's transport refuses (one per
    process: mmstore/transfer_engines.py). Said here, not at the engine's start."""
    switchable = [i.name for i in config.plan.instances if i.switchable]
    if switchable and store is not None and store.backend == "mooncake" \
            and store.protocol in EXCLUSIVE:
        raise ConfigError(f"{config.name}: {', '.join(switchable)} may switch role (~), so "
                          f"each worker would hold the Mooncake MM Store's client beside its "
                          f"KV transfer engine, and the {store.protocol} transport allows one "
                          "per process: use mm_store: {backend: shm} on one node, or no '~'")


def kv_config_of(config: Deployment, protocol: str) -> tuple[tuple[str, Any], ...]:
    """The KV connector's settings: the file's, and a deployment that injects faults
    (tests) has its connector honour them too, where it has faults to inject."""
    settings = dict(config.kv_connector_config)
    if config.fault_injection and get_protocol(protocol).injects_faults:
        settings.setdefault("fault_injection", True)
    return tuple(sorted(settings.items()))


def kv_protocol_of(config: Deployment, platform: Platform) -> str:
    """The deployment's KV protocol, checked against its platform and settings."""
    name = config.kv_connector or platform.default_kv_protocol
    try:
        protocol = get_protocol(name)
        platform.kv_connector(name)
        protocol.validate(dict(config.kv_connector_config))
    except ValueError as err:
        raise ConfigError(f"{config.name}: {err}") from None
    switchable = [i.name for i in config.plan.instances if i.switchable]
    if switchable and not protocol.switches_roles:
        ok = [n for n, p in PROTOCOLS.items() if p.switches_roles]
        raise ConfigError(f"{config.name}: {', '.join(switchable)} may switch role (~), which "
                          f"needs a KV connector that both sends and receives (kv_both); "
                          f"{name!r} does not: use kv_connector {' or '.join(map(repr, ok))}")
    return name


def feature_refs_of(config: Deployment, platform: Platform) -> str:
    """What prefill and decode are sent for an image whose feature the MM Store holds:
    the deployment's choice, else what the platform's pinned engine takes. vLLM 0.32
    (cpu, cuda) takes a metadata-only image_embeds reference; vllm-ascend 0.23 runs on
    vLLM 0.23, which needs the tensor in an image_embeds part, so it gets the pixels."""
    return config.feature_refs or platform.feature_refs


def store_spec_of(config: Deployment, platform: Platform) -> StoreSpec | None:
    """The deployment's MM Store, or None where features go through vLLM's file
    connector or nothing is encoded apart (no encoder instance, nor one that may
    switch to E)."""
    store = config.mm_store
    may_encode = any(i.roles == "E" or i.switchable for i in config.plan.instances)
    if store.backend == "file" or not may_encode:
        return None
    if (why := platform.own_connectors_unavailable) is not None:
        if "backend" not in store.model_fields_set:
            return None  # this platform's default is vLLM's file connector
        raise ConfigError(f"{config.name}: mm_store backend {store.backend!r} does not run on "
                          f"{config.platform}: {why}. Set mm_store: {{backend: file}}.")
    return StoreSpec(backend=store.backend, host=proxy_host_of(config), port=store.port,
                     metrics_port=store.metrics_port, capacity_bytes=int(store.capacity),
                     name=config.name, protocol=store.protocol)


def engine_python_of(config: Deployment, root: Path) -> str | None:
    """The deployment's engine interpreter as an absolute path, checked to be an
    executable file; None: epd-serve's own. Symlinks are kept, not resolved: a
    virtualenv's bin/python links to the base interpreter, and only the link's own
    path makes Python use the virtualenv's packages."""
    if config.engine_python is None:
        return None
    path = os.path.abspath(root / Path(config.engine_python).expanduser())
    fix = ("build that environment (e.g. scripts/setup-vllm023.sh) or drop the key to "
           "start the engines with epd-serve's own interpreter")
    if not os.path.isfile(path):
        raise ConfigError(f"{config.name}: engine_python {path} does not exist; {fix}")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"{config.name}: engine_python {path} is not executable; {fix}")
    return path


def _absolute(value: str, root: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path).resolve()


@dataclasses.dataclass
class ResolvedDeployment:
    """A deployment file turned into concrete processes: one launch per instance."""

    config: Deployment
    plan: notation.Plan
    platform: Platform  # the HAL backend that starts its engines
    mm_store: StoreSpec | None  # the MM Store; None: vLLM's file connector or no encoder
    model_dir: Path
    work_dir: Path
    launches: list[InstanceLaunch]
    proxy_host: str = "127.0.0.1"  # where the proxy (and the MM Store's servers) run
    feature_refs: str = "embeds"  # what P and D get for a stored image (feature_refs_of)

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy_host}:{self.config.proxy_port}"

    def store_ports(self) -> dict[int, str]:
        """The MM Store servers' ports -> what for (none without a store)."""
        if (store := self.mm_store) is None:
            return {}
        ports = {store.port: f"MM Store ({store.backend})", store.metrics_port: "MM Store metrics"}
        if store.backend == "mooncake":
            ports[store.holder_port] = "MM Store memory holder (mooncake)"
        return ports

    def ports(self) -> dict[int, str]:
        """Every port the deployment listens on -> who uses it."""
        ports = {self.config.proxy_port: "proxy", **self.store_ports()}
        for launch in self.launches:
            ports.update(launch.ports())
        return ports


__all__ = ["ResolvedDeployment", "resolve"]
