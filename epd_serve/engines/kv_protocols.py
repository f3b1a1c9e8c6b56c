"""KV hand-off protocols: what each asks of the engines and tells the proxy.

Pure Python, imported by the HAL, the config loader and the launcher; never imports
vLLM. A protocol is how a prefill instance's KV cache reaches a decode instance:
- `epd`: our connector (epd_serve/connectors/epd_kv): decode reserves blocks with the
  prefill instance, prefill writes each layer group into them as it is computed. The
  proxy sends both requests at once (proxy/handoff/epd_push.py).
- `mooncake`: vLLM's MooncakeConnector: prefill finishes, decode pulls the whole KV
  (proxy/handoff/mooncake_pull.py).
- `ascend-layerwise`: vllm-ascend's MooncakeLayerwiseConnector: decode first, it posts
  its blocks to the proxy's /v1/metaserver, which then sends prefill
  (proxy/handoff/ascend_layerwise.py).
The platform says which connector class implements a protocol on its devices
(`Platform.kv_connectors`); the protocol adds what depends on the instance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from epd_serve.connectors.epd_kv.settings import Settings


@dataclasses.dataclass(frozen=True)
class Connector:
    """A vLLM connector: its registered name, where to import it from, extra config."""

    name: str
    module_path: str | None = None
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)


class KVProtocol:
    name: ClassVar[str]

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


class EPDPush(KVProtocol):
    name = "epd"

    def validate(self, user_config):
        Settings.from_extra_config(user_config)

    def transfer_config(self, launch, connector, user_config, tensor_parallel):
        cfg = super().transfer_config(launch, connector, user_config, tensor_parallel)
        cfg["kv_port"] = launch.kv_port  # prefill rank r serves its side channel on + r
        extra = cfg.setdefault("kv_connector_extra_config", {})
        extra["host"] = launch.host
        extra["role"] = launch.kv_role  # so decode keeps full CUDA graphs (connector.py)
        return cfg

    def proxy_endpoint(self, launch):
        return f"{launch.host}:{launch.kv_port}" if launch.kv_role == "kv_producer" else None


class MooncakePull(KVProtocol):
    name = "mooncake"

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


class AscendLayerwise(KVProtocol):
    name = "ascend-layerwise"

    def transfer_config(self, launch, connector, user_config, tensor_parallel):
        # The layer-wise connector learns the peer's parallel sizes from the request's
        # kv_transfer_params; of the extra config it reads only tls_config in the pinned
        # vllm-ascend 0.23.0 (the `prefill`/`decode` blocks are its MooncakeConnectorV1's).
        cfg = super().transfer_config(launch, connector, user_config, tensor_parallel)
        cfg["kv_buffer_device"] = "npu"
        cfg["kv_port"] = str(launch.kv_port)
        return cfg


PROTOCOLS: dict[str, KVProtocol] = {p.name: p for p in (EPDPush(), MooncakePull(),
                                                        AscendLayerwise())}


def get_protocol(name: str) -> KVProtocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]
