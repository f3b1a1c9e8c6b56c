"""vLLM's MooncakeConnector, made to run on the CPU backend, with hand-off timing.

Loaded in vLLM processes via `kv_connector_module_path`. Two adjustments, both
confined to the construction of the connector's worker side:
- `torch.accelerator.current_device_index()` raises when there is no accelerator;
  on the CPU the "device" is index 0.
- the prefill side's bootstrap server binds 0.0.0.0; we bind it to the instance's
  own address (VLLM_HOST_IP, 127.0.0.1 by default) so nothing listens on outside
  interfaces that we can avoid.
And one log line per request and side, so the KV benchmark can time vLLM's hand-off
the way our connector reports its own (wall clock, one host):
  epd-kv-timing role=prefill request=ID forward_end=T
  epd-kv-timing role=decode request=ID recv_start=T ready=T ok=0|1
"""

from __future__ import annotations

import contextlib
import os
import time
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as _mooncake
from vllm.logger import init_logger
from vllm.platforms import current_platform

logger = init_logger("vllm.epd_serve.mooncake_cpu")


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
        self._prefilling: dict = {}  # scheduler side: request id -> Request
        self._recv_started: dict[str, float] = {}  # worker side: request id -> wall clock

    # -- scheduler side: which step completes each prefill ----------------------------
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._prefilling[request.request_id] = request
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        ends = []
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self._prefilling.get(request_id)
            if request is not None and request.num_computed_tokens + count >= request.num_prompt_tokens:
                ends.append(request_id)
                del self._prefilling[request_id]
        meta.epd_prefill_ends = ends
        return meta

    def request_finished_all_groups(self, request, block_ids):
        self._prefilling.pop(request.request_id, None)
        return super().request_finished_all_groups(request, block_ids)

    # -- worker side: when the prefill pass ended, when decode had the KV -------------
    def wait_for_save(self):
        super().wait_for_save()
        now = time.time()
        for request_id in getattr(self._connector_metadata, "epd_prefill_ends", ()):
            logger.info("epd-kv-timing role=prefill request=%s forward_end=%.6f", request_id, now)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        now = time.time()
        for requests in getattr(connector_metadata, "reqs_to_recv", {}).values():
            for request_id in requests:
                self._recv_started.setdefault(request_id, now)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        now = time.time()
        for request_id in results.finished_recving:
            started = self._recv_started.pop(request_id, None)
            if started is not None:
                logger.info("epd-kv-timing role=decode request=%s recv_start=%.6f ready=%.6f "
                            "ok=%d", request_id, started, now,
                            request_id not in results.failed_recving)
        return results
