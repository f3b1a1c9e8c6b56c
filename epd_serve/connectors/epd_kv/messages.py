"""What the epd KV connector's parts say to each other; plain data, no torch or vLLM.

- what the scheduler side tells its workers about one request in one step
  (`SendChunk`, `RecvPlan`, `FinishedSend`; carried by metadata.py's `StepPlan`);
- wire messages between a decode worker and a prefill worker over the side channel
  (msgspec structs, tagged, with a protocol version): decode reserves, prefill writes
  the KV into decode's memory and reports each landed group, then `Done` or `Failed`.

    decode                                   prefill
    Reserve(blocks, layout, te session)  ->
                                         <-  Ack(incarnation)
                                         <-  Landed(layers a..b)    (one per group)
                                         <-  Done(stats) | Failed(reason, in_flight)
    Ping                                 ->  (while anything is pending)
                                         <-  Pong(incarnation, known transfer ids)
    Cancel                               ->  (decode gave up or the request was aborted)
                                         <-  Released (no write for it is in flight)
"""

from __future__ import annotations

import dataclasses

import msgspec

from epd_serve.connectors.epd_kv.layout import LayerLayout

# 2: a layer's layout carries its tensors' block forms, the reservation the layout name.
PROTOCOL_VERSION = 2


# -- scheduler -> worker (same engine) ------------------------------------------
@dataclasses.dataclass
class SendChunk:
    """Prefill side: tokens [start, end) of a request are computed in this step."""

    request_id: str
    transfer_id: str
    block_ids: list[int]  # the request's blocks on this engine, in token order
    start: int
    end: int
    prompt_len: int
    first_block: int  # this chunk ships the request's blocks [first_block, end_block)
    end_block: int
    mode: str | None = None  # per-request override of the transfer mode
    fault: str | None = None  # fault injection (only where the deployment allows it)

    @property
    def is_last(self) -> bool:
        return self.end >= self.prompt_len


def blocks_to_ship(end: int, prompt_len: int, block_size: int, shipped: int) -> tuple[int, int]:
    """The blocks [first, end) a prefill chunk ending at token `end` ships, when the
    request's blocks before `shipped` have gone with earlier chunks. A block goes once,
    with the chunk that fills it (or the last chunk, for the prompt's partial tail):
    sending a half-written block with one chunk and again with the next would make two
    writes of the same bytes, which can land out of order and leave stale tokens. The
    first chunk also ships the blocks prefill had cached, which it computes nothing
    for: decode may not have them."""
    filled = -(-end // block_size) if end >= prompt_len else end // block_size
    return shipped, max(shipped, filled)


@dataclasses.dataclass
class RecvPlan:
    """Decode side: blocks allocated for a request whose KV a prefill worker writes."""

    request_id: str
    transfer_id: str
    prefill_host: str
    prefill_port: int  # the prefill engine's side channel (rank 0; rank r at + r)
    block_ids: list[int]  # where prompt blocks first_block, first_block+1, ... land
    first_block: int  # blocks before it are this engine's own prefix-cache hits
    num_tokens: int  # prompt tokens
    # Set: the scheduler side could not plan this receive (a bug of ours); the worker
    # fails it at once, without asking prefill, and decode computes the prompt.
    error: str = ""


@dataclasses.dataclass
class FinishedSend:
    """Prefill side: the request finished (or was aborted); report its blocks free
    once nothing of it is in flight."""

    request_id: str
    transfer_id: str
    aborted: bool


# -- worker -> scheduler (same engine), in metadata.py's `TransferReport` --------------
# A decode worker's report of a transfer keeps its steps' wall-clock times (ns) under
# this key; the scheduler side makes them a span of the request's timeline and leaves
# them out of the report it returns in kv_transfer_params.
REPORT_TIMES_KEY = "times"


# -- decode worker <-> prefill worker ---------------------------------------------
class TransferStats(msgspec.Struct, frozen=True):
    """One finished transfer, measured on the prefill side (its clock)."""

    mode: str
    nbytes: int
    groups: int
    busy_s: float  # time the link spent on it: union of [submit, complete] intervals
    span_s: float  # first submit to last completion
    exposed_s: float  # last completion after the end of the prefill forward pass
    prefill_s: float  # first layer saved to the end of the forward pass (all chunks)
    forward_end: float  # wall clock (time.time) at the end of the last forward pass


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    transfer_id: str
    decode_engine: str
    decode_rank: int
    te_session: str
    block_ids: list[int]
    first_block: int
    num_tokens: int
    block_size: int
    layout: list[LayerLayout]
    layout_name: str = ""  # the KV cache layout decode's engine reports (e.g. LBHNC)
    version: int = PROTOCOL_VERSION


class Ack(msgspec.Struct, tag="ack", frozen=True):
    transfer_id: str
    incarnation: str
    error: str | None = None  # the reservation is refused (layouts differ, ...)


class Ping(msgspec.Struct, tag="ping", frozen=True):
    transfer_ids: list[str]


class Pong(msgspec.Struct, tag="pong", frozen=True):
    incarnation: str
    # Of the pinged transfers, those prefill still holds. It lets one go only when no
    # write of it is running and after telling decode how it ended: an acknowledged
    # transfer missing here has ended, and decode gives it up.
    known: list[str]


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Landed(msgspec.Struct, tag="landed", frozen=True):
    transfer_id: str
    first_layer: int
    last_layer: int
    nbytes: int


class Done(msgspec.Struct, tag="done", frozen=True):
    transfer_id: str
    stats: TransferStats


class Failed(msgspec.Struct, tag="failed", frozen=True):
    transfer_id: str
    reason: str
    in_flight: int  # writes still running; a Released follows when they end


class Released(msgspec.Struct, tag="released", frozen=True):
    transfer_id: str


ToPrefill = Reserve | Ping | Cancel
ToDecode = Ack | Pong | Landed | Done | Failed | Released

_encoder = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_prefill(data: bytes) -> ToPrefill:
    return _to_prefill.decode(data)


def decode_to_decode(data: bytes) -> ToDecode:
    return _to_decode.decode(data)
