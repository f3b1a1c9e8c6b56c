"""CUDA backend: vLLM + flashinfer instances on NVIDIA GPUs (H800 class)."""

from epd_serve.backends.cuda.platform import PLATFORM, CudaPlatform

__all__ = ["PLATFORM", "CudaPlatform"]
