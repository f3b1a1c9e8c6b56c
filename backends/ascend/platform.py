"""Ascend platform: how a vllm-ascend engine process is started on Atlas 800I A2.

Pure builders; must not import torch_npu or vllm_ascend at import time (importing
torch_npu without CANN breaks `import torch`): `check_available()` does it on demand.
"""

from __future__ import annotations

import importlib

from epd_serve.backends.hal import Platform
from epd_serve.protocols.registry import Connector


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    device_visibility_env = "ASCEND_RT_VISIBLE_DEVICES"
    memory_flag = "--gpu-memory-utilization"  # vllm-ascend keeps vLLM's flag name
    attention_backend = None  # vllm-ascend registers its own NPU attention
    # KV connectors (epd, the default, and vllm-ascend's ascend-layerwise): the
    # registry's entries for "ascend" (protocols/registry.py).
    ray_resource = "NPU"
    default_kv_protocol = "epd"
    # vllm-ascend has no EC connector of its own: `mm_store: {backend: file}` selects
    # vLLM's file-based one instead of our MM Store.
    ec_connector = Connector("ECExampleConnector")
    usable_memory = 0.9
    feature_refs = "pixels"  # vllm-ascend 0.23 runs on vLLM 0.23 (hal.Platform.feature_refs)
    # The Mooncake Store client of a consuming instance's engine core (prefill, decode;
    # the two-node files) starts an Ascend transfer engine on the instance's first NPU
    # after vLLM has sized the KV cache from --gpu-memory-utilization: its CANN context
    # and ADXL buffers come on top of that budget. This share of the device is kept out
    # of the budget for them (about 1 GiB of a 32 GiB NPU, 2 GiB of a 64 GiB one: a CANN
    # context and a transfer engine's buffers are a few hundred MiB each; not yet
    # measured on an Atlas node). A worker's own client is started before vLLM sizes
    # the cache, so vLLM counts it.
    engine_core_store_reserve = 0.03

    def memory_fraction(self, launch) -> float:
        fraction = super().memory_fraction(launch)
        if engine_core_store_client(launch):
            return round(fraction - self.engine_core_store_reserve, 3)
        return fraction

    def platform_env(self, launch) -> dict[str, str]:
        return {
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            "HCCL_BUFFSIZE": "256",
            "TASK_QUEUE_ENABLE": "1",
            "OMP_PROC_BIND": "false",
        }

    def check_available(self) -> None:
        for module in ("torch_npu", "vllm_ascend"):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise RuntimeError(
                    f"the Ascend backend needs {module!r} ({err}); install epd-serve[ascend] "
                    "on a machine with CANN"
                ) from err


def engine_core_store_client(launch) -> bool:
    """Whether the instance's engine core runs an Ascend Mooncake Store client: our EC
    connector's scheduler side attaches to the store where the instance consumes
    features (the encoder's client lives in its worker)."""
    store = launch.mm_store
    return (store is not None and store.backend == "mooncake" and store.protocol == "ascend"
            and launch.ec_role in ("ec_consumer", "ec_both"))


PLATFORM = AscendPlatform()
