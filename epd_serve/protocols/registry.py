"""KV hand-off protocols, the one registry of them: what each asks of the engines and
tells the proxy, which proxy hand-off drives it and which connector runs it where.

Pure Python, imported by the HAL, the config loaders, the launcher and the proxy; never
imports vLLM or anything else of ours at import time: the hand-off and connector
classes it names are dotted paths, imported when asked for (vLLM's KVConnectorFactory
style), since they sit above this package. A protocol is how a prefill instance's KV
cache reaches a decode instance:
- `epd`: our connector (epd_serve/connectors/epd_kv): decode reserves blocks with the
  prefill instance, prefill writes each layer group into them as it is computed. The
  proxy sends both requests at once (proxy/handoff/epd_push.py).
- `mooncake`: vLLM's MooncakeConnector: prefill finishes, decode pulls the whole KV
  (proxy/handoff/mooncake_pull.py).
- `ascend-layerwise`: vllm-ascend's MooncakeLayerwiseConnector: decode first, it posts
  its blocks to the proxy's /v1/metaserver, which then sends prefill
  (proxy/handoff/ascend_layerwise.py).
Each names, per platform, the connector that speaks it there (pinned to a vLLM release
line: connector names change between releases); `Platform.kv_connector` reads that.
The parameters each hand-off passes are typed in this package, one module each.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar, Literal


def resolve(path: str) -> Any:
    """The object a lazy dotted path names: "package.module:Name"."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True)
class Connector:
    """A vLLM connector: its registered name, where to import it from (None: one vLLM,
    or the platform plugin, registers itself by that name), extra config."""

    name: str
    module_path: str | None = None
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def load(self) -> type:
        """The connector class, imported from `module_path` (ours); a connector that
        vLLM registers by name is vLLM's to import (KVConnectorFactory)."""
        if self.module_path is None:
            raise ValueError(f"{self.name} is registered by the engine itself, not "
                             "imported by path")
        return getattr(importlib.import_module(self.module_path), self.name)


# Ours, on every platform: `protocol` names the transport the connector's transfer
# engine uses there (connectors/epd_kv/fabric.py).
_EPD_MODULE = "epd_serve.connectors.epd_kv"


class KVProtocol:
    name: ClassVar[str]  # the config literal (deployment `kv_connector`, proxy `kv_protocol`)
    handoff: ClassVar[str]  # the proxy's hand-off class, as a lazy dotted path
    # Whether its connector runs as kv_both, sending for some requests and receiving for
    # others, which instances that switch role between P and D need.
    switches_roles: ClassVar[bool] = False
    # Whether its connector takes `fault_injection: true` (a deployment's own
    # `fault_injection` then turns it on: tests).
    injects_faults: ClassVar[bool] = False
    # Platform name -> the connector that speaks this protocol there; a platform it
    # lacks cannot run it.
    connectors: ClassVar[dict[str, Connector]]

    def handoff_class(self) -> type:
        return resolve(self.handoff)

    def validate(self, user_config: dict[str, Any]) -> None:
        """Raise ValueError for settings this protocol does not take."""

    def transfer_config(self, launch, connector: Connector, user_config: dict[str, Any],
                        tensor_parallel: int) -> dict[str, Any]:
        """The `--kv-transfer-config` JSON of one instance that sends or receives KV."""
        cfg: dict[str, Any] = {"kv_connector": connector.name, "kv_role": launch.kv_role}
        if connector.module_path:
            cfg["kv_connector_module_path"] = connector.module_path
        extra = {**connector.extra_config, **user_config}
        if extra:
            cfg["kv_connector_extra_config"] = extra
        return cfg

    def environment(self, launch) -> dict[str, str]:
        return {}

    def proxy_endpoint(self, launch) -> str | None:
        """What the proxy must know about this instance to hand KV off, if anything."""
        return None


class EPDPushProtocol(KVProtocol):
    name = "epd"
    handoff = "epd_serve.proxy.handoff.epd_push:EPDPush"
    switches_roles = True
    injects_faults = True
    # cpu: the transfer engine's TCP transport (a CPU machine has no RDMA device to
    # register KV memory with); cuda: RDMA between the GPUs' registered KV memory;
    # ascend: the NPU wheel (mooncake-transfer-engine-npu 0.3.11.post1, built
    # USE_ASCEND_DIRECT) installs its Ascend transport whatever `protocol` says (CANN's
    # ADXL, over HCCS inside a node and the NPUs' own RoCE NICs between nodes, so
    # `device_name` and `gid_index` play no part); `protocol: ascend` says so to our
    # connector (fabric.installed_transport) and is what vllm-ascend passes too.
    connectors = {
        "cpu": Connector("EPDKVConnector", _EPD_MODULE, {"protocol": "tcp"}),
        "cuda": Connector("EPDKVConnector", _EPD_MODULE, {"protocol": "rdma"}),
        "ascend": Connector("EPDKVConnector", _EPD_MODULE, {"protocol": "ascend"}),
    }

    def validate(self, user_config):
        # Looked up by name: this registry sits below the connectors it names.
        settings = importlib.import_module("epd_serve.connectors.epd_kv.settings").Settings
        settings.from_extra_config(user_config)

    def transfer_config(self, launch, connector, user_config, tensor_parallel):
        cfg = super().transfer_config(launch, connector, user_config, tensor_parallel)
        cfg["kv_port"] = launch.kv_port  # prefill rank r serves its side channel on + r
        extra = cfg.setdefault("kv_connector_extra_config", {})
        extra["host"] = launch.host
        extra["role"] = launch.kv_role  # so decode keeps full CUDA graphs (connector.py)
        return cfg

    def proxy_endpoint(self, launch):
        # kv_both: it may prefill for a decode instance whenever the proxy makes it a P.
        sends = launch.kv_role in ("kv_producer", "kv_both")
        return f"{launch.host}:{launch.kv_port}" if sends else None


class MooncakePullProtocol(KVProtocol):
    name = "mooncake"
    handoff = "epd_serve.proxy.handoff.mooncake_pull:MooncakePull"
    # cpu: vLLM's connector needs two CPU fixes (epd_serve/connectors/mooncake_cpu.py)
    # and the TCP transport; cuda: vLLM's in-tree one over RDMA. vllm-ascend 0.23 has
    # its own MooncakeConnectorV1, not wired here: ascend runs the layer-wise one.
    connectors = {
        "cpu": Connector("MooncakeCpuConnector", "epd_serve.connectors.mooncake_cpu",
                         {"mooncake_protocol": "tcp"}),
        "cuda": Connector("MooncakeConnector", None, {"mooncake_protocol": "rdma"}),
    }

    def validate(self, user_config):
        if user_config:
            raise ValueError(f"kv_connector_config is not used by 'mooncake' "
                             f"(got {sorted(user_config)})")

    def environment(self, launch):
        if launch.kv_role == "kv_producer":
            return {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(launch.kv_port)}
        return {}

    def proxy_endpoint(self, launch):
        if launch.kv_role == "kv_producer":
            return f"http://{launch.host}:{launch.kv_port}"
        return None


class AscendLayerwiseProtocol(KVProtocol):
    name = "ascend-layerwise"
    handoff = "epd_serve.proxy.handoff.ascend_layerwise:AscendLayerwise"
    # Registered by vllm-ascend itself (no module path).
    connectors = {"ascend": Connector("MooncakeLayerwiseConnector")}

    def transfer_config(self, launch, connector, user_config, tensor_parallel):
        # The layer-wise connector learns the peer's parallel sizes from the request's
        # kv_transfer_params; of the extra config it reads only tls_config in the pinned
        # vllm-ascend 0.23.0 (the `prefill`/`decode` blocks are its MooncakeConnectorV1's).
        cfg = super().transfer_config(launch, connector, user_config, tensor_parallel)
        cfg["kv_buffer_device"] = "npu"
        cfg["kv_port"] = str(launch.kv_port)
        return cfg


PROTOCOLS: dict[str, KVProtocol] = {p.name: p for p in (
    EPDPushProtocol(), MooncakePullProtocol(), AscendLayerwiseProtocol())}
# A protocol's name as a config field takes it (pydantic checks it against the registry).
ProtocolName = Literal[tuple(PROTOCOLS)]  # type: ignore[valid-type]


def get_protocol(name: str) -> KVProtocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def connectors_on(platform: str) -> dict[str, Connector]:
    """Protocol name -> the connector that runs it on `platform`, in registry order."""
    return {name: p.connectors[platform] for name, p in PROTOCOLS.items()
            if platform in p.connectors}
