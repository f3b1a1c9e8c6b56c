"""The per-step metadata vLLM carries between our scheduler side and its workers.

Imported by the connector's scheduler and worker sides (it subclasses vLLM's base
classes); the records inside are messages.py's plain dataclasses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from epd_serve.connectors.epd_kv.messages import FinishedSend, RecvPlan, SendChunk
from epd_serve.connectors.epd_kv.prompt_tail import KeepPlan


@dataclasses.dataclass
class StepPlan(KVConnectorMetadata):
    sends: list[SendChunk] = dataclasses.field(default_factory=list)
    finished_sends: list[FinishedSend] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)  # request ids
    recvs: list[RecvPlan] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # tokens computed in this step, all requests together
    # Decode: received prompts whose last token this step computes again, their
    # prefill-computed K/V to be put back after it (prompt_tail.py).
    keep: list[KeepPlan] = dataclasses.field(default_factory=list)
    # Exceptions of the scheduler side's own code since the last step, for the workers
    # to count (the scheduler side has no stats of its own).
    internal_errors: int = 0


# -- worker -> scheduler (same engine) ------------------------------------------
@dataclasses.dataclass
class TransferReport(KVConnectorWorkerMetadata):
    """Per request id: what its transfer did, as returned in kv_transfer_params."""

    by_request: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TransferReport):
            for request_id, stats in other.by_request.items():
                self.by_request.setdefault(request_id, stats)
        return self
