"""The EC connector's settings, read from `ec_connector_extra_config`. No vLLM import:
the launcher builds the same record."""

from __future__ import annotations

from typing import Any

import msgspec

from epd_serve.mmstore.spec import StoreSpec


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    store: StoreSpec
    # This instance's address: its Mooncake client registers under it, and a consumer's
    # prefetch listener binds to it.
    host: str = "127.0.0.1"
    # Consumers: where the prefetch listener takes hints (the proxy sends the hashes of
    # a request's features there as soon as the encoder is done); None: no listener.
    prefetch_port: int | None = None
    # Features read into a consumer that no request holds (prefetched, or kept for the
    # next request of the same image) are kept up to this many bytes.
    prefetch_budget_bytes: int = 1 << 30
    # The longest a request waits for its feature's read (a store that stopped
    # answering) before the consumer encodes the image itself.
    load_timeout_s: float = 5.0
    # Under a scheduler that asks only `has_cache_item`, as it schedules (vllm-ascend's
    # own copies of schedule(), its layerwise KV connector): the longest it waits for a
    # feature not read here yet (the proxy's hint lost the race with the request)
    # before vLLM encodes the image instead. A read from the store takes milliseconds,
    # an encode of the same image far longer.
    claim_wait_s: float = 0.05
    # How long an engine's first attempt to reach the store waits for an answer (beside
    # busy engines on a small host the first took over 2 s). An engine starts whether
    # or not the store answers, and attaches to it when it does (mmstore/attach.py).
    open_timeout_s: float = 5.0
    # Mooncake backend: memory a producer lends to the pool (0: a holder process does).
    segment_bytes: int = 0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> Settings:
        try:
            return msgspec.convert(extra, cls)
        except msgspec.ValidationError as err:
            raise ValueError(f"ec_connector_extra_config for EPDECConnector: {err}") from None

    def to_extra_config(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
