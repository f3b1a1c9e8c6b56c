"""Where a deployment's MM Store lives: one small typed record every process gets.

The launcher builds it from the deployment file and hands it, as JSON, to the store
service it starts, to each engine's EC connector and to the proxy.
"""

from __future__ import annotations

import msgspec

BACKENDS = ("shm", "mooncake")


class StoreSpec(msgspec.Struct, frozen=True, kw_only=True):
    backend: str = "shm"  # "shm": node-local shared memory; "mooncake": Mooncake Store
    host: str = "127.0.0.1"
    port: int = 8990  # shm: the store server's control port; mooncake: the master's RPC port
    metrics_port: int = 8991  # HTTP /metrics of the store server (shm) or master (mooncake)
    capacity_bytes: int = 2 << 30
    name: str = "epd"  # names the shared-memory arena; one per deployment
    protocol: str = "tcp"  # mooncake transport: tcp, rdma, ascend
    # shm: how long a reservation not yet committed, or a pin, holds its space before it
    # may be given to another feature (a writer or reader that died must not hold it).
    hold_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown MM Store backend {self.backend!r}; "
                             f"choose one of {', '.join(BACKENDS)}")
        if self.capacity_bytes <= 0:
            raise ValueError("MM Store capacity must be positive")

    @property
    def holder_port(self) -> int:
        """Mooncake: the service port of the process that lends the pool's memory."""
        return self.metrics_port + 1

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, data: str | bytes) -> StoreSpec:
        return msgspec.json.decode(data, type=cls)
