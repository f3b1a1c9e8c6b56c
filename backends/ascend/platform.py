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
    # Both write P's KV into D's registered NPU memory through Mooncake's transfer engine.
    # The NPU wheel (mooncake-transfer-engine-npu 0.3.11.post1, built USE_ASCEND_DIRECT)
    # installs its Ascend transport whatever `protocol` says: CANN's ADXL, over HCCS
    # inside a node and the NPUs' own RoCE NICs between nodes, so `device_name` and
    # `gid_index` (host RDMA NICs) play no part here. `protocol: ascend` says so to our
    # connector (fabric.installed_transport) and is what vllm-ascend passes too.
    # - epd (default): ours, decode reserves blocks and prefill pushes layer groups as
    #   they are computed;
    # - ascend-layerwise: vllm-ascend's MooncakeLayerwiseConnector (registered by
    #   vllm-ascend itself, no module path): decode posts its blocks to the proxy's
    #   /v1/metaserver, then prefill pushes each layer.
    kv_connectors = {
        "epd": Connector("EPDKVConnector", "epd_serve.connectors.epd_kv", {"protocol": "ascend"}),
        "ascend-layerwise": Connector("MooncakeLayerwiseConnector"),
    }
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
