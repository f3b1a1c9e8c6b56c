"""vLLM's file-based ECExampleConnector with one INFO line per feature moved, and
file names made only from hash-shaped feature ids.

Loaded in vLLM processes via `ec_connector_module_path`. The stock connector logs
saves and loads at DEBUG only, so an operator cannot tell which instance encoded an
image; these lines ("epd-ec saved|loaded mm_hash=...") make the E->P hand-off visible
in each instance's log. It also names each feature's folder after its id as given
(`os.path.join(storage, mm_hash)`), and vLLM takes a request's `uuid` as that id: the
proxy only ever sends its own hex keys, and here any other id is neither written nor
looked for (the feature is encoded where it is needed instead), so no id can become a
path outside the storage folder.
"""

from __future__ import annotations

import re

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.logger import init_logger

# vLLM configures handlers for the "vllm" logger tree only.
logger = init_logger("vllm.epd_serve.ec_example")

# The proxy's keys and vLLM's own feature hashes: hex digests.
SAFE_FEATURE_ID = re.compile(r"^[0-9a-fA-F]{16,128}$")


def safe_feature_id(mm_hash: object) -> bool:
    return isinstance(mm_hash, str) and SAFE_FEATURE_ID.fullmatch(mm_hash) is not None


class EPDExampleECConnector(ECExampleConnector):
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        before = set(encoder_cache)
        super().start_load_caches(encoder_cache, **kwargs)
        for mm_hash in set(encoder_cache) - before:
            logger.info("epd-ec loaded mm_hash=%s", mm_hash)

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        if not safe_feature_id(mm_hash):
            logger.warning("epd-ec not saving a feature whose id is not a hash: %.80r", mm_hash)
            return
        super().save_caches(encoder_cache, mm_hash, **kwargs)
        if self.is_producer:
            logger.info("epd-ec saved mm_hash=%s", mm_hash)

    def _found_match_for_mm_data(self, mm_hash) -> bool:
        # Not a hash: not ours, never on disk; the consumer encodes the image itself.
        return safe_feature_id(mm_hash) and super()._found_match_for_mm_data(mm_hash)

    def _generate_foldername_debug(self, mm_hash: str, *args, **kwargs) -> str:
        if not safe_feature_id(mm_hash):  # the checks above keep every caller from here
            raise ValueError(f"feature id {mm_hash!r:.80} is not a hash")
        return super()._generate_foldername_debug(mm_hash, *args, **kwargs)
