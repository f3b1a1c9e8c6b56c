"""The MM Store interface: encoder features keyed by a content hash.

Imported by the EC connector (vLLM processes), the proxy and the benchmarks. No torch:
values are raw bytes plus a `FeatureMeta` that says how to view them (shape, dtype) and
what a consumer needs to size the prompt's placeholder (e.g. `image_grid_thw`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import msgspec
import numpy as np
import xxhash


class FeatureMeta(msgspec.Struct, frozen=True):
    """What travels with a feature: enough to rebuild the tensor and the request."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the prefix: "bfloat16", "float16", ...
    placeholder: dict[str, Any] = {}  # the model's placeholder metadata, e.g. image_grid_thw

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> FeatureMeta:
        return msgspec.msgpack.decode(data, type=cls)


def checksum(meta: bytes, data) -> int:
    """What a writer publishes with a feature and a reader checks before using it (a
    mismatch is a miss): xxh3_64 of the encoded meta, then the bytes. Measured against a
    plain copy of the same bytes by benchmarks/mmstore_bench.py."""
    digest = xxhash.xxh3_64(meta)
    digest.update(data)
    return digest.intdigest()


class StoreError(RuntimeError):
    """The store could not be reached or answered nonsense (callers recompute)."""


class FeatureStore(ABC):
    """One backend. Every method is thread-safe; none raises for a missing key."""

    name: str

    @abstractmethod
    def put(self, key: str, data: memoryview | bytes | np.ndarray, meta: FeatureMeta) -> bool:
        """Store a feature; False if the key is already there or the store is full of
        pinned entries (the consumer then recomputes, never fails)."""

    @abstractmethod
    def get(self, key: str) -> tuple[np.ndarray, FeatureMeta] | None:
        """A private copy of the feature's bytes (uint8) and its meta, or None."""

    @abstractmethod
    def lookup(self, key: str) -> FeatureMeta | None:
        """The meta of a stored feature without reading its bytes, or None."""

    def pin(self, key: str) -> FeatureMeta | None:
        """Like lookup, and hold the entry against eviction until `unpin`. Backends
        without pins answer like lookup (their own leases protect a read)."""
        return self.lookup(key)

    def unpin(self, key: str) -> None:
        return None

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Drop a feature (tests and operators); False if it was not there."""

    def close(self) -> None:
        return None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
