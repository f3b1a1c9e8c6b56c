"""The parameters of our KV hand-off (`epd`): what the proxy sends prefill and decode in
`kv_transfer_params`, what a client may add to steer it, and the transfer report decode
returns in `kv_transfer_params["epd_kv"]`.

Both ends of every struct here are ours: the proxy (proxy/handoff/epd_push.py) writes
the requests' parameters and reads the report; the connector's scheduler
(connectors/epd_kv/scheduler.py, in the engine-core process) reads the parameters and
writes the report; the fake engine of the tests (testing/fake_server.py) reads and
writes both. So each carries a version (`epd_v`): a reader refuses one it does not know
rather than guess; and each refuses a key it does not name, so a field renamed on one
side is refused even where it is optional. No vLLM import.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

VERSION = 1
# kv_transfer_params keys of this hand-off that the proxy and the connector both name.
VERSION_KEY, MODE_KEY, FAULT_KEY, REPORT_KEY = "epd_v", "epd_mode", "epd_fault", "epd_kv"
# connectors/epd_kv/grouping.py MODES, the same three (a test checks they agree): named
# here so a client's mode is refused at the proxy, not by a prefill worker mid-request.
Mode = Literal["whole", "layer", "group"]
Version = Literal[1]  # the versions this reader takes


class Steering(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a client may set in its own `kv_transfer_params` (the proxy refuses every
    other key, proxy/request.py); passed on to prefill."""

    epd_mode: Mode | UnsetType = UNSET  # how the KV is cut into writes (grouping.py)
    # Fault injection, honoured only where the deployment allows it (tests): "stall",
    # "fail_write" (the transfer fails; decode recomputes) or "skip_block" (decode's first
    # reserved block is never written, yet the transfer reports done: a wrong answer
    # only a fingerprint sees) or "stop_process" (prefill's engine SIGSTOPs itself just
    # before handing the first write to the transfer engine), connectors/epd_kv/sender_*.py.
    epd_fault: str | UnsetType = UNSET


class PrefillParams(Steering, kw_only=True):
    """Proxy -> prefill: compute the prompt and write its KV into the blocks the decode
    instance that reserves `transfer_id` names. Absent `epd_v` reads as 1 (the version
    written before there was one)."""

    epd_v: Version = VERSION
    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    transfer_id: str


class DecodeParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Proxy -> decode: take the prompt's KV from the prefill worker whose side channel
    is `remote_host:remote_port` (the proxy's `kv_endpoint` of that instance), under
    `transfer_id`."""

    epd_v: Version = VERSION
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    transfer_id: str
    remote_host: str
    remote_port: int


Outcome = Literal["done", "failed", "cancelled", "refused"]


class TransferReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decode -> proxy, in its answer's `kv_transfer_params["epd_kv"]`: what the transfer
    did (connectors/epd_kv/receiver.py measures it). `refused`: decode's connector
    refused the parameters it was sent (`reason` names the field) and computed the
    prompt itself; the proxy answers that request with a 502."""

    epd_v: Version = VERSION
    outcome: Outcome
    transfer_id: str | UnsetType = UNSET  # unset: refused before it could be read
    reason: str | UnsetType = UNSET  # why the outcome is not "done"
    # Measured by prefill, present when the transfer ran (see receiver.py).
    mode: str | UnsetType = UNSET
    bytes: int | UnsetType = UNSET
    groups: int | UnsetType = UNSET
    transfer_ms: float | UnsetType = UNSET
    exposed_ms: float | UnsetType = UNSET
    prefill_ms: float | UnsetType = UNSET
    handoff_ms: float | UnsetType = UNSET


def refusal(reason: str) -> TransferReport:
    """The report of a request whose hand-off parameters were refused."""
    return TransferReport(outcome="refused", reason=reason)
