"""CUDA backend: vLLM instances on NVIDIA GPUs (H800 class); vLLM picks the attention
backend unless the deployment file names one."""

from epd_serve.backends.cuda.platform import PLATFORM, CudaPlatform

__all__ = ["PLATFORM", "CudaPlatform"]
