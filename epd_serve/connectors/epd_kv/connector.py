"""`EPDKVConnector`: vLLM's view of our layer-grouped push connector.

Runs as kv_producer (prefill: sends), kv_consumer (decode: receives) or kv_both
(either, decided request by request from its `kv_transfer_params`: scheduler.py).

Loaded in every vLLM process through `kv_connector_module_path` (API server for its
stats classes, engine core for the scheduler side, workers for the worker side). A
thin facade: each call goes to `EPDKVScheduler` or `EPDKVWorker`; nothing here touches
a device or the network at import time. No exception of ours leaves it into vLLM's step:
one (a bug of ours) is logged with the request it happened for, counted
(`epd_kv_internal_errors_total`), and costs that request its transfer (decode then
computes the prompt) or, where no single request is at fault, that step's transfers;
never the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from epd_serve.connectors import compat
from epd_serve.connectors.epd_kv.metadata import StepPlan
from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import KV_ROLES, SENDING_ROLES, Settings
from epd_serve.connectors.epd_kv.stats import EPDKVPromMetrics, EPDKVStats

logger = logging.getLogger("vllm.epd_serve.kv.connector")


class EPDKVConnector(KVConnectorBase_V1):
    if compat.P2P_CACHE_HIT_SOURCE is not None:  # vLLM's prefix-cache hit metrics
        _cache_hit_source = compat.P2P_CACHE_HIT_SOURCE

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in KV_ROLES:
            raise ValueError(f"EPDKVConnector runs as kv_producer (prefill), kv_consumer "
                             f"(decode) or kv_both (either, request by request), not "
                             f"{transfer.kv_role!r}")
        settings = Settings.from_extra_config(dict(transfer.kv_connector_extra_config))
        self.scheduler: EPDKVScheduler | None = None
        self.worker = None
        self._load_errors: set[int] = set()  # blocks of failed receives, older vLLM
        self._writes_ended = False  # this step's forward_done ran (finish_forward)
        self._idle_step = False  # this step computes nothing (settings.idle_step_wait_ms)
        if role == KVConnectorRole.SCHEDULER:
            if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
                raise ValueError("EPDKVConnector supports models with one KV cache group "
                                 "(full attention in every layer)")
            self.scheduler = EPDKVScheduler(vllm_config, settings)
        else:
            from epd_serve.connectors.epd_kv.worker import EPDKVWorker

            self.worker = EPDKVWorker(vllm_config, kv_cache_config, settings)

    # -- classmethods vLLM calls in the API server ----------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return EPDKVStats(data=data) if data is not None else EPDKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EPDKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Prefill's per-layer save hook must run between graph pieces, and so must that
        # of a kv_both instance, which may prefill for another instance at any step.
        # Decode's hooks do nothing, so a kv_consumer keeps full decode graphs (the HAL
        # writes the role into the extra config; without it, assume prefill), as does
        # `whole` mode, which sends after the pass.
        settings = Settings.from_extra_config(dict(extra_config))
        may_send = settings.role in ("", *SENDING_ROLES)
        return may_send and settings.mode != "whole"

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # vLLM asks before it allocates the KV cache. Both engines of a transfer must
        # store blocks alike; settings.py says why LBHNC (HND before vLLM 0.32) is the
        # default.
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        return compat.kv_cache_layout_request(Settings.from_extra_config(extra).kv_cache_layout)

    def _own_error(self, what: str, request=None) -> None:
        """Log (with its traceback) and count an exception of our own code."""
        whose = f" of request {request.request_id}" if request is not None else ""
        logger.exception("epd-kv: internal error %s%s; it costs %s, not the engine", what,
                         whose, "that request its transfer" if request is not None
                         else "this step's transfers")
        if self.scheduler is not None:
            self.scheduler.internal_errors += 1
        elif self.worker is not None:
            self.worker.stats.record("internal_errors")

    # -- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            self._own_error("deciding where the prompt's KV comes from", request)
            return 0, False  # computed here

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        try:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as err:
            self._own_error("planning the transfer", request)
            self.scheduler.fail_receive(request, blocks, num_external_tokens, repr(err))

    def build_connector_meta(self, scheduler_output):
        try:
            return self.scheduler.build_connector_meta(scheduler_output)
        except Exception as err:
            self._own_error("planning the step")
            return self.scheduler.abandon_step(scheduler_output, repr(err))

    def update_connector_output(self, connector_output):
        try:
            self.scheduler.update_connector_output(connector_output)
        except Exception:
            self._own_error("reading the workers' reports")

    def request_finished(self, request, block_ids):
        try:
            return self.scheduler.request_finished(request, block_ids)
        except Exception:
            self._own_error("finishing", request)
            return False, None

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._writes_ended = False
        self._idle_step = isinstance(connector_metadata, StepPlan) \
            and connector_metadata.num_tokens == 0
        # Before the forward pass: decode reserves at once, prefill plans its writes.
        if isinstance(connector_metadata, StepPlan):
            try:
                self.worker.begin_step(connector_metadata)
            except Exception as err:
                self._own_error("starting the step")
                self.worker.fail_step(f"starting the step failed: {err!r}")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass  # prefill writes into our memory; nothing to pull

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        try:
            self.worker.layer_saved(layer_name)
        except Exception as err:
            self._own_error(f"queueing the writes of {layer_name}")
            self.worker.fail_step(f"queueing the writes of {layer_name} failed: {err!r}")

    def finish_forward(self) -> None:
        # Model Runner V2 calls this right after the forward pass and wait_for_save only
        # after sampling: the step's last writes (a `whole` send, the last layer group)
        # start here, as soon as under V1, whose only call is wait_for_save.
        self._end_writes()

    def wait_for_save(self) -> None:
        self._end_writes()

    def _end_writes(self) -> None:
        """The forward pass is over: submit what is left of the step's writes, once a
        step. Writes continue in the background; blocks stay pinned until they end."""
        if self._writes_ended:
            return
        self._writes_ended = True
        try:
            self.worker.forward_done()
        except Exception as err:
            self._own_error("ending the step's writes")
            self.worker.fail_step(f"ending the step's writes failed: {err!r}")

    # Whichever of the two vLLM calls after a step decides how failed receives are
    # told (both end in the same recompute): vLLM 0.32+ takes them by request id;
    # older vLLM by their blocks, from get_block_ids_with_load_errors called next.
    def get_transfer_results(self, finished_req_ids):
        results = self.worker.transfer_results(finished_req_ids, self._idle_step)
        return compat.KVConnectorTransferResults(finished_sending=results.sending,
                                                 finished_recving=results.recving,
                                                 failed_recving=results.failed)

    def get_finished(self, finished_req_ids):
        results = self.worker.transfer_results(finished_req_ids, self._idle_step)
        self._load_errors |= results.failed_blocks
        return results.sending or None, results.recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self):
        return self.worker.take_reports()

    def get_kv_connector_stats(self):
        return self.worker.take_stats() if self.worker is not None else None

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
