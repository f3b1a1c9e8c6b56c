"""The parameters of vllm-ascend's layer-wise hand-off (`ascend-layerwise`): what the
proxy sends decode, what decode POSTs to the proxy's /v1/metaserver, and what the proxy
then sends prefill (exactly that report).

The proxy (proxy/handoff/ascend_layerwise.py) writes the decode parameters and reads the
report; vllm-ascend's MooncakeLayerwiseConnector (vllm_ascend/distributed/kv_transfer/
kv_p2p/mooncake_layerwise_connector.py, 0.23.0.post1) reads the parameters and writes
the report, so the keys mirror its own, exactly, with no version of ours. No vLLM or
vllm-ascend import.
"""

from __future__ import annotations

import msgspec


class DecodeParams(msgspec.Struct, kw_only=True):
    """Proxy -> decode: allocate blocks for the prompt, then POST them to `metaserver`
    (a URL of the proxy's made for this request alone)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = True
    metaserver: str


class BlocksReport(msgspec.Struct, kw_only=True):
    """Decode -> proxy (POST /v1/metaserver/<token>), then proxy -> prefill as its
    `kv_transfer_params`: decode's blocks and where to write them. The keys are those
    the connector's `update_state_after_alloc` posts; `request_id` is vLLM's id of the
    request (`chatcmpl-<X-Request-Id>`, `cmpl-<X-Request-Id>-0`)."""

    token_ids: list[int]
    request_id: str
    do_remote_prefill: bool = False
    do_remote_decode: bool = True
    remote_block_ids: list[list[int]]  # per KV cache group
    remote_block_size: list[int]  # per KV cache group
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_pcp_size: int
    remote_dcp_size: int
    remote_cached_tokens: int  # prefill reads it as params["remote_cached_tokens"]
