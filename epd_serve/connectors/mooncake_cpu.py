"""vLLM's MooncakeConnector, made to run on the CPU backend.

Loaded in vLLM processes via `kv_connector_module_path`. Two adjustments, both
confined to the construction of the connector's worker side:
- `torch.accelerator.current_device_index()` raises when there is no accelerator;
  on the CPU the "device" is index 0.
- the prefill side's bootstrap server binds 0.0.0.0; we bind it to the instance's
  own address (VLLM_HOST_IP, 127.0.0.1 by default) so nothing listens on outside
  interfaces that we can avoid.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as _mooncake
from vllm.platforms import current_platform


def bootstrap_bind_host() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


class _LocalBootstrapServer(_mooncake.MooncakeBootstrapServer):
    def __init__(self, host: str, port: int):
        super().__init__(bootstrap_bind_host(), port)


@contextlib.contextmanager
def _cpu_adjustments():
    with contextlib.ExitStack() as stack:
        # torch may be a CUDA build running without a driver, so ask vLLM, not torch.
        if current_platform.is_cpu():
            stack.enter_context(
                mock.patch.object(torch.accelerator, "current_device_index", lambda: 0)
            )
        stack.enter_context(
            mock.patch.object(_mooncake, "MooncakeBootstrapServer", _LocalBootstrapServer)
        )
        yield


class MooncakeCpuConnector(_mooncake.MooncakeConnector):
    """MooncakeConnector with the CPU adjustments; the protocol is unchanged."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        with _cpu_adjustments():
            super().__init__(vllm_config, role, kv_cache_config)
