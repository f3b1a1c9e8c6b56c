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
