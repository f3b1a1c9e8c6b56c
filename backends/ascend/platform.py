"""Ascend platform: how a vllm-ascend engine process is started on Atlas 800I A2.

Pure builders; must not import torch_npu or vllm_ascend at import time (importing
torch_npu without CANN breaks `import torch`): `check_available()` does it on demand.
"""

from __future__ import annotations

import importlib

from epd_serve.hal import Connector, InstanceLaunch, Platform

# Bootstrap/KV ports of vllm-ascend's Mooncake connectors are offset from the
# instance's HTTP port so co-located instances never collide.
KV_PORT_OFFSET = 20000


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    device_visibility_env = "ASCEND_RT_VISIBLE_DEVICES"
    memory_flag = "--gpu-memory-utilization"  # vllm-ascend keeps vLLM's flag name
    attention_backend = None  # vllm-ascend registers its own NPU attention
    # vllm-ascend registers MooncakeLayerwiseConnector itself (no module path): the
    # prefill side pushes each layer's KV into decode's registered NPU memory.
    kv_connector = Connector("MooncakeLayerwiseConnector", None, {})
    # vllm-ascend has no EC connector of its own and uses vLLM's file-based one.
    ec_connector = Connector("ECExampleConnector")
    usable_memory = 0.9

    def kv_transfer_config(self, launch: InstanceLaunch):
        cfg = super().kv_transfer_config(launch)
        if cfg is None:
            return None
        tp = launch.instance.tensor_parallel
        cfg["kv_buffer_device"] = "npu"
        cfg["kv_port"] = str(launch.port + KV_PORT_OFFSET)
        cfg["kv_connector_extra_config"] = {
            "prefill": {"dp_size": 1, "tp_size": tp},
            "decode": {"dp_size": 1, "tp_size": tp},
        }
        return cfg

    def platform_env(self, launch: InstanceLaunch) -> dict[str, str]:
        return {
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            "HCCL_BUFFSIZE": "256",
            "TASK_QUEUE_ENABLE": "1",
            "OMP_PROC_BIND": "false",
            "VLLM_USE_V1": "1",
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
