"""The proxy's view of the deployment: instances, their roles, health and load.

Runs inside the proxy process; pure data, no I/O (health polling lives in app.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class InstanceEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    roles: str = Field(description="Stages it runs, in pipeline order: E, P, D, EP, PD, EPD.")
    url: str
    kv_endpoint: str | None = Field(None, description="Where the KV hand-off reaches this "
                                    "instance's connector: a bootstrap URL (mooncake) or a "
                                    "side channel host:port (epd).")
    prefetch_endpoint: str | None = Field(None, description="host:port where this prefill "
                                          "instance takes prefetch hints (MM Store).")


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Served model name, answered on /v1/models.")
    host: str = "127.0.0.1"
    port: int = 8000
    kv_protocol: str = Field("epd", description="KV hand-off between prefill and decode: "
                             "epd | mooncake | ascend-layerwise (proxy/handoff/).")
    mm_store: str | None = Field(None, description="The MM Store's StoreSpec as JSON; None: "
                                 "features go through vLLM's file connector.")
    fault_injection: bool = Field(False, description="Honour the x-epd-fault request header "
                                  "(tests only).")
    instances: list[InstanceEntry]
    request_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    unhealthy_after: int = Field(3, description="Failed health checks in a row before an "
                                 "instance that still accepts connections is skipped.")

    @classmethod
    def from_file(cls, path: str | Path) -> "ProxyConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))


@dataclasses.dataclass
class InstanceState:
    """Live row of the status table."""

    entry: InstanceEntry
    healthy: bool = False
    health_failures: int = 0  # consecutive failed health checks
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    incarnation: int = 0  # +1 each time it comes back after being down (restarted)

    @property
    def name(self) -> str:
        return self.entry.name

    def runs(self, stage: str) -> bool:
        return stage in self.entry.roles

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "roles": self.entry.roles,
            "url": self.entry.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class InstanceTable:
    """All instances with round-robin choice among the healthy ones of a stage."""

    def __init__(self, entries: list[InstanceEntry]):
        self.instances = [InstanceState(e) for e in entries]
        self._turns: dict[str, itertools.count] = {}

    def encoders(self) -> list[InstanceState]:
        """Encoder-only instances: where the E stage of a disaggregated plan runs."""
        return [i for i in self.instances if i.entry.roles == "E"]

    def candidates(self, stage: str) -> list[InstanceState]:
        if stage == "E":
            pool = self.encoders()
        else:
            pool = [i for i in self.instances if i.runs(stage)]
        return [i for i in pool if i.healthy]

    def order(self, stage: str) -> list[InstanceState]:
        """Healthy instances of a stage, starting with the one whose turn it is; the
        rest follow so a caller can fail over without losing the request."""
        pool = self.candidates(stage)
        if not pool:
            return []
        turn = next(self._turns.setdefault(stage, itertools.count()))
        start = turn % len(pool)
        return pool[start:] + pool[:start]

    def to_dict(self) -> list[dict]:
        return [i.to_dict() for i in self.instances]
