"""The seam between the proxy's request flow and a KV hand-off protocol.

Runs inside the proxy process. The pipeline runs the encode stage, then gives the
request to the deployment's `Handoff`, which owns every prefill and decode call and
everything protocol-specific about them (the `kv_transfer_params`, the order of the
calls, what to do when one side fails). One file per protocol in this package.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import ClassVar

from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import Upstream


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The request as decode runs it: it needs the KV, not the encoder's feature."""
    out = {k: v for k, v in body.items() if k != "ec_transfer_params"}
    out["kv_transfer_params"] = kv_transfer_params
    return out


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` (a hop whose other half failed) and wait until it has ended, so its
    connection is closed before we go on. How it ended is of no interest: its failure
    or its own cancellation is dropped. The caller's own cancellation (the client left)
    is not: it propagates, so the handler ends."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we were cancelled while waiting, not just the task
    except Exception:
        pass  # the task failed before the cancellation reached it: that is its outcome


class Handoff(ABC):
    name: ClassVar[str]
    # kv_transfer_params keys a client may set to steer the protocol per request, and
    # those it may set only where the deployment injects faults (tests); the proxy
    # refuses any other (request.py): the rest say where KV goes.
    client_kv_keys: ClassVar[frozenset[str]] = frozenset()
    fault_kv_keys: ClassVar[frozenset[str]] = frozenset()
    # Whether decode draws a request's `n` samples from its one transfer (prefill is
    # sent `n: 1`); where not, the proxy sends each sample as a request of its own
    # (fanout.py).
    decode_samples: ClassVar[bool] = False

    @classmethod
    def allowed_client_keys(cls, fault_injection: bool) -> frozenset[str]:
        return cls.client_kv_keys | (cls.fault_kv_keys if fault_injection else frozenset())

    def __init__(self, upstream: Upstream, config: ProxyConfig):
        self.upstream = upstream
        self.config = config

    @abstractmethod
    async def complete(self, path: str, body: dict, trip: Trip,
                       prefill: list[InstanceState]) -> dict:
        """Prefill on one of `prefill` (in turn order), decode elsewhere; the answer."""

    @abstractmethod
    async def stream(self, path: str, body: dict, trip: Trip,
                     prefill: list[InstanceState]) -> AsyncIterator[bytes]:
        """As `complete`, streamed; errors before the first byte raise ProxyError."""

    def expects_report(self, token: str) -> bool:
        """Whether a request waits for a decode instance's report at this token's URL."""
        return False

    async def metaserver(self, token: str, body: dict) -> dict:
        """A decode instance reporting its allocation (protocols that use it), at the
        URL made for its request (`token`)."""
        raise ProxyError(404, f"/v1/metaserver is not used by the {self.name!r} KV hand-off",
                         "invalid_request_error")
