"""`EPDECConnector`: vLLM's view of our MM Store connector.

Runs as ec_producer (encoder: stores), ec_consumer (prefill, decode: loads) or ec_both
(both, for every request: scheduler.py says how).

Loaded in every vLLM process through `ec_connector_module_path` (API server for its
stats classes, engine core for the scheduler side, workers for the worker side). A
thin facade: each call goes to `EPDECScheduler` or `EPDECWorker`. An exception of the
scheduler side's own code (a bug of ours) does not leave it into vLLM's step: it is
logged with the request, counted (`epd_ec_features_total{event="internal_error"}`) and
costs that request (it fails, and the proxy sends it again), never the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.scheduler import ECStep, EPDECScheduler
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.stats import EPDECPromMetrics, EPDECStats
from epd_serve.connectors.spans import ConnectorSpans

log = logging.getLogger("vllm.epd_serve.ec")


class EPDECConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config, role)
        settings = Settings.from_extra_config(
            dict(vllm_config.ec_transfer_config.ec_connector_extra_config))
        self.scheduler: EPDECScheduler | None = None
        self.worker = None
        if role == ECConnectorRole.SCHEDULER:
            self.scheduler = EPDECScheduler(vllm_config, settings, self.is_producer,
                                            self.is_consumer)
        else:
            from epd_serve.connectors.epd_ec.worker import EPDECWorker

            spans = ConnectorSpans.of(vllm_config) if self.is_consumer else None
            self.worker = EPDECWorker(settings, self.is_producer, self.is_consumer, spans)
        # The model runner's encoder cache, as last seen in save_caches or
        # start_load_caches: where vLLM never calls start_save_caches,
        # bind_connector_metadata does its work with it.
        self._encoder_cache: dict | None = None

    # -- classmethods vLLM calls in the API server ----------------------------------
    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        return EPDECStats(data=data) if data is not None else EPDECStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EPDECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _own_error(self, what: str, request=None) -> None:
        whose = f" of request {request.request_id}" if request is not None else ""
        log.exception("epd-ec: internal error %s%s; it costs %s, not the engine", what,
                      whose, "that request" if request is not None else "this step")
        self.scheduler.recorder.count("internal_error")

    # -- scheduler side --------------------------------------------------------------
    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        try:
            return self.scheduler.ensure_cache_available(request, num_computed_tokens)
        except Exception as err:
            self._own_error("deciding on its features", request)
            self.scheduler.fail_request(request, repr(err))
            return False

    def has_cache_item(self, identifier: str) -> bool:
        try:
            return self.scheduler.has_cache_item(identifier)
        except Exception:
            self._own_error(f"looking up {identifier}")
            return False  # vLLM encodes it

    def update_state_after_alloc(self, request, index: int) -> None:
        try:
            self.scheduler.update_state_after_alloc(request, index)
        except Exception:
            self._own_error(f"loading feature {index}", request)

    def build_connector_meta(self, scheduler_output) -> ECStep:
        try:
            return self.scheduler.build_connector_meta(scheduler_output)
        except Exception as err:
            self._own_error("planning the step")
            return self.scheduler.abandon_step(repr(err))

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler.take_unavailable_requests()

    def update_connector_output(self, connector_output) -> None:
        try:
            self.scheduler.update_connector_output(connector_output)
        except Exception:
            self._own_error("reading the workers' counts")

    def request_finished(self, request):
        try:
            return self.scheduler.request_finished(request)
        except Exception:
            self._own_error("finishing", request)
            return False, None

    def get_ec_connector_stats(self):
        side = self.scheduler or self.worker
        data = side.recorder.take()
        return EPDECStats(data=data) if data is not None else None

    # -- worker side -------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM before 0.32 binds the step's metadata where it would call
        # start_save_caches, before the encoder runs.
        if self.worker is not None and self.is_producer and not compat.EC_START_SAVE_CACHES:
            self.worker.start_save_caches(connector_metadata, self._encoder_cache or {})

    def start_save_caches(self, **kwargs: Any) -> None:
        self.worker.start_save_caches(self._get_connector_metadata(), kwargs["encoder_cache"])

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        self._encoder_cache = encoder_cache
        if self.is_producer:
            self.worker.save(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        # An ec_both instance may not have encoded anything yet (save_caches never came)
        # while its encoder cache holds what it loaded, which an E hop for the same image
        # finds there and does not encode: the next step's saves must see that cache.
        self._encoder_cache = encoder_cache
        self.worker.start_load_caches(self._get_connector_metadata(), encoder_cache)

    def get_finished(self, finished_req_ids):
        # Called after every step, by every vLLM.
        self.worker.step_done()
        return None, None

    def build_connector_worker_meta(self):
        return self.worker.worker_meta()

    def shutdown(self) -> None:
        (self.scheduler or self.worker).shutdown()
