"""CUDA platform: how a vLLM engine process is started on NVIDIA GPUs.

Pure builders; must not import torch, vllm or flashinfer at import time (the CPU
install has none of them): `check_available()` imports them when a launch needs it.

Attention and sampling are vLLM's choice unless the deployment file names a backend
(`attention_backend:`): on Hopper vLLM 0.32 takes FlashAttention, whose kernels ship
prebuilt in its wheel. Forcing FlashInfer (and VLLM_USE_FLASHINFER_SAMPLER=1, which makes
an unusable FlashInfer sampler stop the engine instead of falling back) needs
flashinfer-cubin or nvcc on the node: without its cubins FlashInfer compiles its
kernels at first use.
"""

from __future__ import annotations

import importlib

from epd_serve.backends.hal import InstanceLaunch, Platform
from epd_serve.protocols.registry import Connector


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    device_visibility_env = "CUDA_VISIBLE_DEVICES"
    memory_flag = "--gpu-memory-utilization"
    attention_backend = None  # vLLM's choice (FlashAttention on Hopper)
    # KV connectors (epd, mooncake): the registry's entries for "cuda"
    # (protocols/registry.py).
    ray_resource = "GPU"
    default_kv_protocol = "epd"
    ec_connector = Connector("ECExampleConnector")
    usable_memory = 0.9

    def platform_env(self, launch: InstanceLaunch) -> dict[str, str]:
        env = {}
        if len(launch.devices) > 1:
            # NCCL over NVLink inside one H800 node.
            env["NCCL_CUMEM_ENABLE"] = "0"
        return env

    def check_available(self) -> None:
        # flashinfer: vLLM's CUDA build requires it (its sampler imports it).
        for module, extra in (("torch", "cuda"), ("vllm", "cuda"), ("flashinfer", "cuda")):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise RuntimeError(
                    f"the CUDA backend needs {module!r} ({err}); install epd-serve[{extra}]"
                ) from err
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA backend found no usable GPU (torch.cuda.is_available() is False)")


PLATFORM = CudaPlatform()
