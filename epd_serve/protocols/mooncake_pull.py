"""The parameters of vLLM's Mooncake hand-off (`mooncake`): what the proxy sends prefill
and decode in `kv_transfer_params`, and the one thing it reads from prefill's bootstrap
server.

The proxy (proxy/handoff/mooncake_pull.py) writes them; vLLM's own MooncakeConnector
(vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py) reads
them, so the keys mirror what it reads, exactly, with no version of ours (it would
ignore one; nothing of ours reads these). No vLLM import.
"""

from __future__ import annotations

import msgspec


class PrefillParams(msgspec.Struct, kw_only=True):
    """Proxy -> prefill: compute the prompt and keep its KV for the decode instance
    that asks for `transfer_id`."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    transfer_id: str


class DecodeParams(msgspec.Struct, kw_only=True):
    """Proxy -> decode: pull the prompt's KV of `transfer_id` from the prefill engine
    `remote_engine_id`, whose bootstrap server is `remote_bootstrap_addr`."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = True
    remote_bootstrap_addr: str
    remote_engine_id: str
    transfer_id: str


class BootstrapWorker(msgspec.Struct, kw_only=True):
    """One entry of the answer of a prefill instance's bootstrap server (`GET /query`:
    {data-parallel rank: entry}, vLLM's mooncake_utils.EngineEntry); the proxy reads
    only its engine id."""

    engine_id: str


BootstrapWorkers = dict[str, BootstrapWorker]
