"""MM Store: a hash-keyed pool of encoder features shared by E, P, D and the proxy.

`open_store(spec)` returns the client for the deployment's backend; backends are
imported only when chosen (Mooncake's client needs its native library).
"""

from __future__ import annotations

from epd_serve.mmstore.attach import AttachingStore
from epd_serve.mmstore.base import FeatureMeta, FeatureStore, StoreError
from epd_serve.mmstore.spec import BACKENDS, StoreSpec


def open_store(spec: StoreSpec, *, segment_bytes: int = 0,
               local_host: str | None = None, wait_s: float = 0.0) -> FeatureStore:
    """A client of the deployment's store. `segment_bytes` > 0 makes a Mooncake client
    lend that much of its own memory to the pool; `local_host` is the address a Mooncake
    client registers under (default: the store's host, i.e. the same machine). The shm
    backend ignores both, and keeps asking a server that does not answer for `wait_s`
    (Mooncake's client has its own connect retries)."""
    if spec.backend == "shm":
        from epd_serve.mmstore.shm import ShmStore

        return ShmStore(spec, open_wait_s=wait_s)
    from epd_serve.mmstore.mooncake import MooncakeStore

    return MooncakeStore(spec, segment_bytes=segment_bytes, local_host=local_host)


def attach_store(spec: StoreSpec, **options) -> AttachingStore:
    """A client that needs no store to be there (what an engine holds: mmstore/attach.py):
    `open_store(spec, **options)` now, and again in the background until one answers."""
    return AttachingStore(lambda: open_store(spec, **options),
                          f"{spec.backend} MM Store at {spec.address}")


__all__ = ["BACKENDS", "AttachingStore", "FeatureMeta", "FeatureStore", "StoreError",
           "StoreSpec", "attach_store", "open_store"]
