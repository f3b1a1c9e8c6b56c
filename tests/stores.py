"""A shared-memory MM Store for tests: its server started on free loopback ports."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from epd_serve.mmstore import StoreSpec
from epd_serve.mmstore.service import StartedStore

from .ports import free_port_block


@contextlib.contextmanager
def started_shm_store(name: str, capacity_bytes: int, port_start: int) -> Iterator[StoreSpec]:
    """A running store named `name` (its arena's name) until the block ends."""
    base = free_port_block(2, start=port_start)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1,
                     capacity_bytes=capacity_bytes, name=name)
    with StartedStore(spec):
        yield spec
