"""A shared-memory MM Store for tests: its server started on free loopback ports."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from epd_serve.mmstore import StoreSpec
from epd_serve.mmstore.service import StartedStore
from epd_serve.mmstore.shm_server import arena_path

from .ports import free_port_block

STORE_CAPACITY = 8 << 20  # bytes: room for the features a test module puts


@contextlib.contextmanager
def started_shm_store(name: str, capacity_bytes: int = STORE_CAPACITY) -> Iterator[StoreSpec]:
    """A running store named `name` (its arena's name) until the block ends; then its
    server is stopped (SIGTERM) and its arena removed, as a deployment's stop does."""
    base = free_port_block(2)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1,
                     capacity_bytes=capacity_bytes, name=name)
    with StartedStore(spec):
        yield spec
    assert not arena_path(spec).exists(), "the arena is removed once the store stops"
