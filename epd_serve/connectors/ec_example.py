"""vLLM's file-based ECExampleConnector with one INFO line per feature moved.

Loaded in vLLM processes via `ec_connector_module_path`. The stock connector logs
saves and loads at DEBUG only, so an operator cannot tell which instance encoded an
image; these lines ("epd-ec saved|loaded mm_hash=...") make the E->P hand-off visible
in each instance's log.
"""

from __future__ import annotations

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.logger import init_logger

# vLLM configures handlers for the "vllm" logger tree only.
logger = init_logger("vllm.epd_serve.ec_example")


class EPDExampleECConnector(ECExampleConnector):
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        before = set(encoder_cache)
        super().start_load_caches(encoder_cache, **kwargs)
        for mm_hash in set(encoder_cache) - before:
            logger.info("epd-ec loaded mm_hash=%s", mm_hash)

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        super().save_caches(encoder_cache, mm_hash, **kwargs)
        if self.is_producer:
            logger.info("epd-ec saved mm_hash=%s", mm_hash)
