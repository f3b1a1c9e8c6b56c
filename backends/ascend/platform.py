"""Ascend platform: how a vllm-ascend engine process is started on Atlas 800I A2.

Pure builders; must not import torch_npu or vllm_ascend at import time (importing
torch_npu without CANN breaks `import torch`): `check_available()` does it on demand.
"""

from __future__ import annotations

import importlib

from epd_serve.engines.hal import Platform
from epd_serve.engines.kv_protocols import Connector


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    device_visibility_env = "ASCEND_RT_VISIBLE_DEVICES"
    memory_flag = "--gpu-memory-utilization"  # vllm-ascend keeps vLLM's flag name
    attention_backend = None  # vllm-ascend registers its own NPU attention
    # vllm-ascend registers MooncakeLayerwiseConnector itself (no module path): the
    # prefill side pushes each layer's KV into decode's registered NPU memory.
    kv_connectors = {"ascend-layerwise": Connector("MooncakeLayerwiseConnector")}
    ray_resource = "NPU"
    default_kv_protocol = "ascend-layerwise"
    # vllm-ascend has no EC connector of its own and uses vLLM's file-based one.
    ec_connector = Connector("ECExampleConnector")
    own_connectors_unavailable = (
        "the pinned vllm-ascend 0.23.0 runs on vLLM 0.23.0, whose connector API lacks what "
        "our MM Store and layer-grouped KV connectors are built on (vLLM 0.32's EC "
        "placeholder metadata and KV transfer results), so `epd-serve check-flags` rejects "
        "them there; Atlas deployments hand features over with vLLM's file-based "
        "ECExampleConnector and KV with vllm-ascend's MooncakeLayerwiseConnector")
    usable_memory = 0.9

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


PLATFORM = AscendPlatform()
