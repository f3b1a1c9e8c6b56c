"""Deployment files: a typed model of `configs/<platform>/*.yaml`, read and validated.

Pure Python (pydantic + PyYAML); runs in the CLI and the launcher. Every error a user
can cause here comes out as a one-line ConfigError that says what to fix.
"""

from __future__ import annotations

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

from epd_serve.backends import PLATFORMS
from epd_serve.protocols.registry import ProtocolName
from epd_serve.models.tinymodel import FAMILIES
from epd_serve.mmstore.spec import BACKENDS
from epd_serve.proxy.config import FeatureRefs, ProxySettings
from epd_serve.topology import notation
from epd_serve.topology.placement import ClusterSpec

ArgValue = str | int | float | bool | None


class ConfigError(ValueError):
    """A deployment file that cannot be used; the message is one line."""


class MMStoreConfig(BaseModel):
    """Where encoder features travel from E to P (and D), keyed by content hash."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal[(*BACKENDS, "file")] = Field(
        "shm", description="'shm': our node-local shared-memory store (E and P on one "
        "host); 'mooncake': Mooncake Store (across nodes); 'file': vLLM's file-per-image "
        "connector, no capacity bound (for comparison)."
    )
    capacity: ByteSize = Field(ByteSize(2 << 30), description="Bytes of features kept; "
                               "least recently used ones are evicted beyond it, e.g. 2GiB.")
    port: int = Field(8990, description="Store server (shm) or Mooncake master RPC port.")
    protocol: Literal["tcp", "rdma", "ascend"] = Field(
        "tcp", description="mooncake: the transfer engine's transport between nodes "
        "('ascend' on Atlas nodes: Mooncake's NPU build has no other).")
    metrics_port: int = Field(8991, description="HTTP /metrics of the store (mooncake: the "
                              "holder of the pool's memory also takes the next port).")
    prefetch_base_port: int = Field(
        8960, description="Prefill instances listen for prefetch hints on consecutive "
        "ports from here, in plan order.")


class Supervision(BaseModel):
    """How the launcher keeps every process up and its log bounded; the defaults here are
    the ones the launchers, the Ray hosts and the tests use. A process that exits is
    restarted, with no limit: a stage comes back once whatever broke it is fixed. Crashes
    in a row beyond `rapid_restarts` wait a back-off that doubles from `backoff_s` up to
    `backoff_max_s` (as Kubernetes' CrashLoopBackOff); a process that stayed up
    `healthy_after_s` starts its count of crashes over."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rapid_restarts: int = Field(
        3, ge=0, description="Crashes in a row restarted at once; later ones wait the "
        "back-off. The top-level key `max_restarts` is its older name.")
    backoff_s: float = Field(1.0, gt=0, description="Wait before the first restart past "
                             "rapid_restarts; doubles with every further crash in a row.")
    backoff_max_s: float = Field(60.0, gt=0, description="The longest wait between restarts.")
    healthy_after_s: float = Field(
        60.0, gt=0, description="A process up this long counts as healthy: its next crash "
        "is the first in a row again.")
    hung_restart_s: float = Field(
        30.0, gt=0, description="A process that answered once since its start, then is "
        "there but silent this long, is killed and restarted: an engine the proxy sees "
        "hung (its /health, or its engine core a one-token request), the proxy or the MM "
        "Store server not answering their health URL.")
    log_max_bytes: ByteSize = Field(
        ByteSize(50 << 20), ge=64 << 10, description="Size at which a process's log "
        "<name>.log rolls over to <name>.log.1 (the older ones move up one).")
    log_files: int = Field(3, ge=2, description="Log files kept per process, the current "
                           "one included (so at least 2): at most log_files x log_max_bytes.")

    @model_validator(mode="after")
    def _cap_not_below_start(self) -> Supervision:
        if self.backoff_max_s < self.backoff_s:
            raise ValueError("backoff_max_s must be at least backoff_s")
        return self


class Deployment(BaseModel):
    """One deployment of one model: on one host, or across the nodes of `cluster`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Name used for the work directory and logs.")
    platform: Literal[PLATFORMS] = Field(
        "cpu", description="Which HAL backend starts the engines."
    )
    deployment: str = Field(description="Notation, e.g. 'E-P-D', '(E-P)-D', '2E1P1D'.")
    model: str = Field(description="Model directory; relative paths start at the project root.")
    tiny_model: Literal[FAMILIES] | None = Field(
        None, description="If set and 'model' holds no model yet, build the tiny "
        "random-weight model of this family there before starting (CPU testing).",
    )
    engine_python: str | None = Field(
        None, min_length=1, description="The Python interpreter that starts the engines, "
        "e.g. '.venv-vllm023/bin/python' (an environment holding another vLLM release "
        "and epd-serve); relative paths start at the project root; with a cluster, the "
        "same path on every node; default: the interpreter running epd-serve.",
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
    kv_connector: ProtocolName | None = Field(
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
    feature_refs: FeatureRefs | None = Field(
        None, description="What prefill and decode are sent for an image whose feature the "
        "MM Store holds: 'embeds' (a metadata-only image_embeds part with the image's uuid; "
        "vLLM 0.32) or 'pixels' (the image with its uuid; vLLM 0.23, e.g. vllm-ascend); "
        "default: the platform's engine's."
    )
    proxy: ProxySettings = Field(default_factory=ProxySettings, description="The proxy: "
                                 "routing policy per stage, request limits, keys.")
    devices: list[int] | None = Field(
        None, description="Physical device ids, in plan order; default 0..N-1 (one host; "
        "with a cluster, each node lists its own)."
    )
    cluster: ClusterSpec | None = Field(
        None, description="Run across the nodes of a Ray cluster: which nodes, their "
        "addresses and devices (epd_serve/topology/placement.py); none: one host, no Ray.")
    max_model_len: int = Field(4096, description="Context length of every instance.")
    attention_backend: str | None = Field(
        None, description="The engine's attention backend for every instance, by the name "
        "vLLM gives it (--attention-backend: FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...); "
        "`epd-serve check-flags` checks it against the engine's own table; default: the "
        "platform's choice (on CUDA and CPU, vLLM's own; on Ascend, vllm-ascend's).",
    )
    work_dir: str | None = Field(None, description="Logs, EC storage, state; default .epd/<name>.")
    engine_args: dict[str, ArgValue] = Field(
        default_factory=dict, description="Extra engine flags for every instance."
    )
    role_engine_args: dict[Literal["E", "P", "D"], dict[str, ArgValue]] = Field(
        default_factory=dict, description="Extra engine flags for instances running a stage."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every instance.")
    role_env: dict[Literal["E", "P", "D"], dict[str, str]] = Field(
        default_factory=dict, description="Extra environment for instances running a stage "
        "(over `env`; an instance running several takes each, in E, P, D order).")
    engine_traces: bool = Field(
        True, description="Engines export each request's spans (OTLP/HTTP) to the proxy, "
        "which files them under the request's timeline (`epd-serve trace`, the load "
        "tool's per-stage breakdown).")
    fault_injection: bool = Field(
        False, description="Tests only: the proxy honours the request header "
        "'x-epd-fault: drop-features' (deletes the request's features from the MM Store "
        "after the encoder, so prefill must recompute), and prefill's KV connector a "
        "client's kv_transfer_params epd_fault: stall, fail_write (decode recomputes) or "
        "skip_block (a block of decode's never written: a wrong answer on purpose) or "
        "stop_process (prefill's engine SIGSTOPs itself just before its first write).")
    health_timeout_s: float = Field(600.0, description="How long start-up may take.")
    supervision: Supervision = Field(
        default_factory=Supervision, description="Restarts (back-off, no limit) and log "
        "rotation of every process the launcher starts.")

    @model_validator(mode="before")
    @classmethod
    def _older_max_restarts(cls, data: Any) -> Any:
        # Files written when the launcher gave up after `max_restarts` keep working: the
        # key still says how many restarts come at once, only now the back-off follows
        # instead of giving up.
        if not isinstance(data, dict) or "max_restarts" not in data:
            return data
        data = dict(data)
        rapid = data.pop("max_restarts")
        supervision = data.get("supervision") or {}
        if isinstance(supervision, Supervision):
            supervision = supervision.model_dump(exclude_unset=True)
        if not isinstance(supervision, dict):
            return data  # the field's own validation names what is wrong with it
        if supervision.get("rapid_restarts", rapid) != rapid:
            raise ValueError("max_restarts is the older name of supervision.rapid_restarts; "
                             "give only one of them")
        data["supervision"] = {**supervision, "rapid_restarts": rapid}
        return data

    @field_validator("deployment")
    @classmethod
    def _parse_notation(cls, value: str) -> str:
        notation.parse(value)  # raises NotationError with the position
        return value

    @field_validator("attention_backend")
    @classmethod
    def _backend_name(cls, value: str | None) -> str | None:
        # vLLM upper-cases the name before looking it up (vllm/config/attention.py).
        if value is not None and not value.replace("_", "a").isalnum():
            raise ValueError(f"an attention backend is named by letters, digits and '_' "
                             f"(FLASH_ATTN, FLASHINFER), not {value!r}")
        return value.upper() if value is not None else None

    @field_validator("devices")
    @classmethod
    def _unique_devices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("device ids must be unique")
        return value

    @model_validator(mode="after")
    def _one_attention_backend(self) -> Deployment:
        flags = [self.engine_args, *self.role_engine_args.values()]
        if self.attention_backend is not None and any(
                key.replace("-", "_") == "attention_backend" for args in flags for key in args):
            raise ValueError("attention_backend is given twice: as a key and in "
                             "engine_args / role_engine_args; keep the key")
        return self

    @model_validator(mode="after")
    def _one_source_of_hosts_and_devices(self) -> Deployment:
        if self.cluster is not None:
            for key in ("devices", "host"):
                if getattr(self, key) != Deployment.model_fields[key].default:
                    raise ValueError(f"'{key}' is for one host; with a cluster, each node "
                                     "in cluster.nodes gives its own address and devices")
        return self

    @property
    def plan(self) -> notation.Plan:
        return notation.parse(self.deployment)


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
    except notation.NotationError as err:
        raise ConfigError(f"{path}: {err}") from None
    return config, project_root_for(path)


def project_root_for(config_path: Path) -> Path:
    """Relative paths in a deployment file resolve against the project root: the
    nearest parent holding a `configs` folder, else the file's own folder."""
    for parent in config_path.resolve().parents:
        if parent.name == "configs":
            return parent.parent
    return config_path.resolve().parent



__all__ = ["PLATFORMS", "ConfigError", "Deployment", "load"]
