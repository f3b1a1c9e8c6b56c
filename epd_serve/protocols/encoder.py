"""The parameters an encoder publishes (`ec_transfer_params`): per feature hash, the
placeholder metadata of the item (e.g. the image grid) and where it occurs among the
media the encoder was sent.

Written by the encoder's EC connector (connectors/epd_ec/scheduler.py, with vLLM's
`collect_ec_item_metadata`; vLLM's own EC connectors make the same entries), read by the
proxy (proxy/features.py, proxy/encoding.py), which passes the whole on to prefill.
The entries mirror vLLM's, with no version of ours. No vLLM import.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ItemParams(msgspec.Struct, kw_only=True):
    """One feature: what a consumer needs to skip preprocessing the item (`metadata`,
    the keys the model's placeholder is sized by) and which of the request's media items
    it is (`item_indices`, every occurrence). A connector may add keys of its own beside
    these (vLLM's NIXL connector adds its peer's address): they are read by the
    consumer's connector, not here."""

    metadata: dict[str, Any]
    item_indices: list[int]


EncoderParams = dict[str, ItemParams]  # feature hash (mm_hash) -> its entry
