"""Ascend backend: vllm-ascend + torch_npu instances on Atlas 800I A2 NPUs."""

from epd_serve.backends.ascend.platform import PLATFORM, AscendPlatform

__all__ = ["PLATFORM", "AscendPlatform"]
