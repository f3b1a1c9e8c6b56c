"""Deployment files: a typed model of `configs/<platform>/*.yaml` and their resolution.

Pure Python (pydantic + PyYAML); runs in the CLI and the launcher. Every error a user
can cause here comes out as a one-line ConfigError that says what to fix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from epd_serve import topology
from epd_serve.hal import (
    PLATFORMS,
    InstanceLaunch,
    ec_role_for,
    get_platform,
    kv_role_for,
    memory_shares,
)
from epd_serve.kv_protocols import get_protocol
from epd_serve.mmstore.spec import StoreSpec
from epd_serve.placement import ClusterSpec, PlacementError, Slot, place
from epd_serve.proxy.config import ProxySettings

ArgValue = str | int | float | bool | None


class ConfigError(ValueError):
    """A deployment file that cannot be used; the message is one line."""


class MMStoreConfig(BaseModel):
    """Where encoder features travel from E to P (and D), keyed by content hash."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["shm", "mooncake", "file"] = Field(
        "shm", description="'shm': our node-local shared-memory store (E and P on one "
        "host); 'mooncake': Mooncake Store (across nodes); 'file': vLLM's file-per-image "
        "connector, no capacity bound (for comparison)."
    )
    capacity: ByteSize = Field(ByteSize(2 << 30), description="Bytes of features kept; "
                               "least recently used ones are evicted beyond it, e.g. 2GiB.")
    port: int = Field(8990, description="Store server (shm) or Mooncake master RPC port.")
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="mooncake: the transfer engine's transport between nodes.")
    metrics_port: int = Field(8991, description="HTTP /metrics of the store (mooncake: the "
                              "holder of the pool's memory also takes the next port).")
    prefetch_base_port: int = Field(
        8960, description="Prefill instances listen for prefetch hints on consecutive "
        "ports from here, in plan order.")


class Deployment(BaseModel):
    """One deployment of one model: on one host, or across the nodes of `cluster`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Name used for the work directory and logs.")
    platform: Literal["cpu", "cuda", "ascend"] = Field(
        "cpu", description="Which HAL backend starts the engines."
    )
    deployment: str = Field(description="Notation, e.g. 'E-P-D', '(E-P)-D', '2E1P1D'.")
    model: str = Field(description="Model directory; relative paths start at the project root.")
    tiny_model: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] | None = Field(
        None, description="If set and 'model' holds no model yet, build the tiny "
        "random-weight model of this family there before starting (CPU testing).",
    )
    served_model_name: str | None = Field(None, description="Name clients use; default: the folder name.")
    host: str = Field("127.0.0.1", description="Address every server binds to (one host; "
                      "with a cluster, each node's address).")
    proxy_port: int = Field(8000, description="Port of the OpenAI-compatible proxy.")
    base_port: int = Field(8100, description="Instance i serves HTTP on base_port + i.")
    kv_base_port: int = Field(
        8900, description="KV ports, handed out in plan order to instances that send or "
        "receive KV, one per tensor-parallel rank (side channel or bootstrap server)."
    )
    kv_connector: str | None = Field(
        None, description="How KV travels from prefill to decode: 'epd' (ours, layer groups "
        "pushed during prefill), 'mooncake' (vLLM's, pulled after prefill) or "
        "'ascend-layerwise' (vllm-ascend's); default: the platform's choice."
    )
    kv_connector_config: dict[str, Any] = Field(
        default_factory=dict, description="Settings for the KV connector, e.g. for 'epd': "
        "mode (whole | layer | group), group_size ('auto' or layers), timeouts."
    )
    mm_store: MMStoreConfig = Field(default_factory=MMStoreConfig,
                                    description="The MM Store (encoder features E -> P).")
    proxy: ProxySettings = Field(default_factory=ProxySettings, description="The proxy: "
                                 "routing policy per stage, request limits, keys.")
    devices: list[int] | None = Field(
        None, description="Physical device ids, in plan order; default 0..N-1 (one host; "
        "with a cluster, each node lists its own)."
    )
    cluster: ClusterSpec | None = Field(
        None, description="Run across the nodes of a Ray cluster: which nodes, their "
        "addresses and devices (epd_serve/placement.py); none: one host, no Ray.")
    max_model_len: int = Field(4096, description="Context length of every instance.")
    work_dir: str | None = Field(None, description="Logs, EC storage, state; default .epd/<name>.")
    engine_args: dict[str, ArgValue] = Field(
        default_factory=dict, description="Extra engine flags for every instance."
    )
    role_engine_args: dict[Literal["E", "P", "D"], dict[str, ArgValue]] = Field(
        default_factory=dict, description="Extra engine flags for instances running a stage."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every instance.")
    fault_injection: bool = Field(
        False, description="Tests only: the proxy honours the request header "
        "'x-epd-fault: drop-features' (deletes the request's features from the MM Store "
        "after the encoder, so prefill must recompute).")
    health_timeout_s: float = Field(600.0, description="How long start-up may take.")
    max_restarts: int = Field(3, description="Restarts per instance before the launcher gives up.")

    @field_validator("deployment")
    @classmethod
    def _parse_notation(cls, value: str) -> str:
        topology.parse(value)  # raises NotationError with the position
        return value

    @field_validator("devices")
    @classmethod
    def _unique_devices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("device ids must be unique")
        return value

    @model_validator(mode="after")
    def _one_source_of_hosts_and_devices(self) -> Deployment:
        if self.cluster is not None:
            for key in ("devices", "host"):
                if getattr(self, key) != Deployment.model_fields[key].default:
                    raise ValueError(f"'{key}' is for one host; with a cluster, each node "
                                     "in cluster.nodes gives its own address and devices")
        return self

    @property
    def plan(self) -> topology.Plan:
        return topology.parse(self.deployment)


def _format_validation_error(path: str, err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(Deployment.model_fields)
        return f"{path}: unknown key {where!r}; allowed keys: {allowed}"
    if first["type"] == "missing":
        return f"{path}: missing required key {where!r}"
    return f"{path}: {where}: {first['msg']}"


def load(path: str | Path) -> tuple[Deployment, Path]:
    """Read a deployment file; returns the config and the folder paths resolve against."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deployment file {str(path)!r} not found; see configs/ for examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    try:
        config = Deployment.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(str(path), err)) from None
    except topology.NotationError as err:
        raise ConfigError(f"{path}: {err}") from None
    return config, project_root_for(path)


def project_root_for(config_path: Path) -> Path:
    """Relative paths in a deployment file resolve against the project root: the
    nearest parent holding a `configs` folder, else the file's own folder."""
    for parent in config_path.resolve().parents:
        if parent.name == "configs":
            return parent.parent
    return config_path.resolve().parent


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
    model = _absolute(config.model, root)
    work_dir = _absolute(config.work_dir or f".epd/{config.name}", root)
    slots = slots_of(config)
    shares = memory_shares(plan)
    protocol = kv_protocol_of(config)
    store = store_spec_of(config)
    launches = []
    next_kv_port = config.kv_base_port
    next_prefetch_port = config.mm_store.prefetch_base_port
    for index, inst in enumerate(plan.instances):
        args = dict(config.engine_args)
        for role, role_args in config.role_engine_args.items():
            if role in inst.roles:
                args.update(role_args)
        kv_role = kv_role_for(inst)
        kv_port = None
        if kv_role is not None:
            kv_port = next_kv_port
            next_kv_port += inst.tensor_parallel
        ec_role = ec_role_for(inst, plan, decode_consumes=store is not None)
        prefetch_port = None
        if store is not None and ec_role == "ec_consumer" and inst.has(topology.Role.PREFILL):
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
                ec_role=ec_role,
                ec_storage_path=str(work_dir / "ec_cache"),
                mm_store=store if ec_role is not None else None,
                prefetch_port=prefetch_port,
                kv_role=kv_role,
                kv_protocol=protocol,
                kv_port=kv_port,
                kv_config=tuple(sorted(config.kv_connector_config.items())),
                extra_args=tuple(_flag_args(args)),
                extra_env=tuple(sorted(config.env.items())),
            )
        )
    if store is not None and store.backend == "shm" and config.cluster is not None:
        _check_store_on_head(config.cluster, config.name, launches)
    return ResolvedDeployment(config=config, plan=plan, model_dir=model, work_dir=work_dir,
                              launches=launches, proxy_host=proxy_host_of(config))


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


def kv_protocol_of(config: Deployment) -> str:
    """The deployment's KV protocol, checked against its platform and settings."""
    platform = get_platform(config.platform)
    name = config.kv_connector or platform.default_kv_protocol
    try:
        protocol = get_protocol(name)
        platform.kv_connector(name)
        protocol.validate(dict(config.kv_connector_config))
    except ValueError as err:
        raise ConfigError(f"{config.name}: {err}") from None
    return name


def store_spec_of(config: Deployment) -> StoreSpec | None:
    """The deployment's MM Store, or None where features go through vLLM's file
    connector or nothing is encoded apart (no encoder-only instance)."""
    store = config.mm_store
    if store.backend == "file" or not any(i.roles == "E" for i in config.plan.instances):
        return None
    if (why := get_platform(config.platform).own_connectors_unavailable) is not None:
        if "backend" not in store.model_fields_set:
            return None  # this platform's default is vLLM's file connector
        raise ConfigError(f"{config.name}: mm_store backend {store.backend!r} does not run on "
                          f"{config.platform}: {why}. Set mm_store: {{backend: file}}.")
    return StoreSpec(backend=store.backend, host=proxy_host_of(config), port=store.port,
                     metrics_port=store.metrics_port, capacity_bytes=int(store.capacity),
                     name=config.name, protocol=store.protocol)


def _absolute(value: str, root: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path).resolve()


@dataclasses.dataclass
class ResolvedDeployment:
    """A deployment file turned into concrete processes: one launch per instance."""

    config: Deployment
    plan: topology.Plan
    model_dir: Path
    work_dir: Path
    launches: list[InstanceLaunch]
    proxy_host: str = "127.0.0.1"  # where the proxy (and the MM Store's servers) run

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy_host}:{self.config.proxy_port}"

    @property
    def mm_store(self) -> StoreSpec | None:
        return store_spec_of(self.config)

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


__all__ = ["PLATFORMS", "ConfigError", "Deployment", "ResolvedDeployment", "load", "resolve"]
