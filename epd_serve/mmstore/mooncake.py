"""MM Store backend over Mooncake Store: a master keeps the index, a holder lends memory.

Used by the processes that open a "mooncake" store (the EC connector in E, P and D, the
proxy, the benchmarks); the launcher runs `master_command` then `holder_command`.
Importing this module must not import `mooncake` (its native library needs libibverbs):
only `MooncakeStore()` does.

Pool memory is lent by a standalone `mooncake_client` (the holder), so the pool survives
engine restarts; our clients lend none unless given `segment_bytes`. Every read and
existence check (not a write) takes a lease of `LEASE_TTL_MS` on the object: the master
evicts (roughly oldest first, above `EVICTION_HIGH_WATERMARK`) and removes only
unleased objects. There are no pins: a `lookup` protects a feature for one lease instead.
Mooncake's transfer engine listens on all interfaces whatever host it is given; tests
run in a network namespace.

On the `ascend` protocol the client's transfer engine is Mooncake's Ascend transport,
which takes the NPU of the thread that sets it up: `AscendDirectTransport` calls
`aclrtGetDevice` when it installs (allocateLocalSegmentID) and on every submit
(mooncake-transfer-engine/src/transport/ascend_transport/ascend_direct_transport/
ascend_direct_transport.cpp, v0.3.11.post1, the NPU wheel's). A process that holds no
NPU has none: the EC connector's scheduler side (the engine core of a prefill or decode
instance) failed there. So before the setup a thread without a device is given the
instance's first visible NPU (local index 0 under ASCEND_RT_VISIBLE_DEVICES), as a
worker thread of vllm-ascend's connectors is given its own (`torch.npu.set_device`);
one that has a device (the encoder's worker, where vLLM set it) keeps it
(`npu_to_set`). Which device a thread has is asked of CANN itself (`aclrtGetDevice`
through ctypes): torch_npu's `current_device()` would set device 0 as it answers.
Each client starts a transfer engine of its own (`setup` is given none).

One Mooncake transfer engine of ours per process where the transport needs it: the KV
connector's `Link` (epd_serve/connectors/epd_kv/transfer.py) and this client both
`claim_engine` before they start one. With vLLM's multiprocessing executor (what our
launcher runs) they never meet: the EC connector's store client lives in the engine
core (consumer) or in the encoder's worker (producer, which has no KV connector), the
KV `Link` in each prefill or decode worker. They would meet in one process only under
`--distributed-executor-backend uni`. A second engine is refused where one of them is
Ascend's: each starts its own ADXL engine on the thread's NPU, and both count against
HCCL's 256 registered regions per process (epd_kv/registration.py). Other transports
may share a process (our tests, CPU deployments), though over RDMA Mooncake reads its
global settings (MC_GID_INDEX, ...) once, with the first engine.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import numpy as np

from epd_serve.mmstore.base import FeatureMeta, FeatureStore, StoreError, checksum
from epd_serve.mmstore.spec import StoreSpec
from epd_serve.mmstore.transfer_engines import claim_engine, release_engine

# A read must finish within its lease, or eviction may hand its bytes to a new put
# mid-transfer. 100 MB reads took 0.1 s idle, up to 1.3 s (median) with this 2-core host
# loaded 3x over; 5 s keeps that margin and is half Mooncake's default (10 s).
LEASE_TTL_MS = 5000
EVICTION_HIGH_WATERMARK = 0.9
EVICTION_RATIO = 0.1  # of the objects, roughly oldest first, each time the mark is hit

# Mooncake's get of Python bytes goes through this client-side buffer; only the small
# meta values use it, feature bytes move straight from and into registered arrays.
META_BUFFER_BYTES = 4 << 20
# Without this probe, setup() against a dead master retries for about 90 s.
MASTER_PROBE_TIMEOUT_S = 2.0
_OBJECT_HAS_LEASE = -706
# The meta value: the feature's byte count (so that `get` sizes its buffer without
# another round trip) and checksum, then the msgpack FeatureMeta. The feature and its
# meta are two objects: a feature whose bytes are not the ones its meta was written with
# (the meta outlived it and another writer's value took its key, or a write Mooncake
# had revoked landed late in its space) reads as a miss.
_HEADER = struct.Struct("<QQ")

logger = logging.getLogger("epd_serve.mmstore")


def master_command(spec: StoreSpec, master_binary: str = "mooncake_master") -> list[str]:
    """The master: RPC on spec.port, /metrics on spec.metrics_port, both on spec.host."""
    return [
        master_binary,
        f"--rpc_address={spec.host}",
        f"--rpc_port={spec.port}",
        f"--metrics_host={spec.host}",
        f"--metrics_port={spec.metrics_port}",
        f"--default_kv_lease_ttl={LEASE_TTL_MS}",
        f"--eviction_high_watermark_ratio={EVICTION_HIGH_WATERMARK}",
        f"--eviction_ratio={EVICTION_RATIO}",
    ]


def holder_command(spec: StoreSpec, client_binary: str = "mooncake_client") -> list[str]:
    """The process lending spec.capacity_bytes to the pool; start it after the master.
    Its own service port serves only Mooncake's IPC clients, which we do not use, but it
    also names the holder's abstract unix socket (`@mooncake_client_<port>.sock`, one
    name per network namespace): a fixed port would keep a second deployment's holder
    on the host from starting, so each deployment gives its own (`spec.holder_port`)."""
    return [
        client_binary,
        f"--host={spec.host}",
        "--metadata_server=P2PHANDSHAKE",
        f"--master_server_address={spec.address}",
        f"--global_segment_size={spec.capacity_bytes}",
        f"--protocol={spec.protocol}",
        f"--port={spec.holder_port}",
    ]


def npu_to_set(protocol: str, current: int | None) -> int | None:
    """The NPU (local index) to make the setting-up thread's own before the store's
    setup, given the one it has (`current`, None: none); None: nothing to do."""
    return 0 if protocol == "ascend" and current is None else None


def current_npu() -> int | None:
    """The NPU CANN has for this thread, or None; sets none."""
    import ctypes

    try:
        acl = ctypes.CDLL("libascendcl.so")
    except OSError as exc:
        raise StoreError(f"the Mooncake Store's ascend protocol needs CANN's "
                         f"libascendcl.so (source CANN's set_env.sh): {exc}") from exc
    device = ctypes.c_int32(-1)
    return device.value if acl.aclrtGetDevice(ctypes.byref(device)) == 0 else None


def set_npu(index: int) -> None:
    import torch
    import torch_npu  # noqa: F401  (adds torch.npu)

    torch.npu.set_device(index)


def prepare_thread(protocol: str, current=current_npu, set_device=set_npu) -> None:
    """Give this thread the NPU the store's transfer engine needs, if it has none."""
    if protocol != "ascend":
        return
    index = npu_to_set(protocol, current())
    if index is not None:
        set_device(index)


def _meta_key(key: str) -> str:
    return f"{key}/meta"


def _byte_view(data: memoryview | bytes | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


class MooncakeStore(FeatureStore):
    """A Mooncake Store client. Feature bytes under `key`, meta under `key/meta`, so a
    lookup reads only the small value (0.2-0.4 ms). `segment_bytes` > 0 lends that much
    of this process's memory to the pool; what lands there vanishes when it exits.
    `local_host` is this client's own address, where other nodes reach its transfer
    engine (default: the master's host, i.e. one machine)."""

    name = "mooncake"

    def __init__(self, spec: StoreSpec, *, segment_bytes: int = 0,
                 local_host: str | None = None) -> None:
        from mooncake.store import MooncakeDistributedStore

        try:
            socket.create_connection((spec.host, spec.port), MASTER_PROBE_TIMEOUT_S).close()
        except OSError as exc:
            raise StoreError(
                f"Mooncake master at {spec.address} is not reachable: {exc}") from exc
        prepare_thread(spec.protocol)
        self._claim = claim_engine("the MM Store's Mooncake client", spec.protocol)
        self._store = MooncakeDistributedStore()
        # segment_bytes=0 is accepted: a pure client that only reads and writes the pool.
        code = self._store.setup(local_host or spec.host, "P2PHANDSHAKE", segment_bytes,
                                 META_BUFFER_BYTES, spec.protocol, "", spec.address)
        if code != 0:
            release_engine(self._claim)
            raise StoreError(f"Mooncake client setup against {spec.address} failed ({code})")
        self._lock = threading.Lock()
        self._closed = False
        self.corrupt_reads = 0  # features whose bytes did not match their meta's checksum

    @contextmanager
    def _registered(self, array: np.ndarray) -> Iterator[int]:
        # Registering per call costs ~0 on TCP and saves a copy through the client's
        # buffer. RDMA would pin pages each time; a registered staging pool would then win.
        address = array.ctypes.data
        if self._store.register_buffer(address, array.nbytes) != 0:
            raise StoreError("Mooncake refused to register a buffer")
        try:
            yield address
        finally:
            self._store.unregister_buffer(address)

    def put(self, key: str, data: memoryview | bytes | np.ndarray, meta: FeatureMeta) -> bool:
        # Zero-copy batch_put_from of both values in one RPC beat put_from + put(meta) by
        # 0.2-0.5 ms at 1 MB; put_from beat put of the array (median ms, loopback TCP):
        # 1 MB 1.3 vs 3.3, 8 MB 6.7-10.9 vs 10-13, 100 MB 75 vs 86.
        payload = _byte_view(data)
        if payload.nbytes == 0:
            return False  # Mooncake cannot register, hence store, an empty buffer
        meta_bytes = meta.encode()
        header = np.frombuffer(_HEADER.pack(payload.nbytes, checksum(meta_bytes, payload))
                               + meta_bytes, dtype=np.uint8)
        with self._lock:
            # Mooncake's put of an existing key keeps the old value and still returns 0.
            if self._store.is_exist(key) == 1:
                return False
            with self._registered(payload) as data_address, \
                    self._registered(header) as meta_address:
                codes = self._store.batch_put_from([key, _meta_key(key)],
                                                   [data_address, meta_address],
                                                   [payload.nbytes, header.nbytes])
        # Else no room (all leased, eviction lags) or no holder; a feature left without
        # its meta reads as missing and gets evicted like any other.
        return codes == [0, 0]

    def get(self, key: str) -> tuple[np.ndarray, FeatureMeta] | None:
        with self._lock:
            found = self._read_meta(key)
            if found is None:
                return None
            nbytes, digest, meta_bytes = found
            out = np.empty(nbytes, dtype=np.uint8)
            with self._registered(out) as address:
                read = self._store.get_into(key, address, nbytes)
        if read != nbytes:
            return None
        if checksum(meta_bytes, out) != digest:
            self.corrupt_reads += 1
            logger.warning("mmstore: %s does not match its meta's checksum; read as a miss",
                           key)
            return None
        return out, FeatureMeta.decode(meta_bytes)

    def lookup(self, key: str) -> FeatureMeta | None:
        with self._lock:
            # The meta can outlive its evicted feature: ask for the feature itself too.
            if self._store.is_exist(key) != 1:
                return None
            found = self._read_meta(key)
        return None if found is None else FeatureMeta.decode(found[2])

    def _read_meta(self, key: str) -> tuple[int, int, bytes] | None:
        """(byte count, checksum, encoded meta) of `key`, or None."""
        value = self._store.get(_meta_key(key))  # b"" when missing or unreadable
        if len(value) < _HEADER.size:
            return None
        meta_bytes = value[_HEADER.size:]
        try:
            FeatureMeta.decode(meta_bytes)
        except msgspec.DecodeError:  # a value that is not ours reads as a miss
            return None
        return (*_HEADER.unpack_from(value), meta_bytes)

    def delete(self, key: str) -> bool:
        """Waits out the lease a recent read holds (up to one TTL), then gives up."""
        deadline = time.monotonic() + LEASE_TTL_MS / 1000 + 0.5
        pending = [key, _meta_key(key)]
        feature_removed = False
        while True:
            with self._lock:
                codes = self._store.batch_remove(pending)
            feature_removed |= any(k == key and c == 0 for k, c in zip(pending, codes))
            pending = [k for k, c in zip(pending, codes) if c == _OBJECT_HAS_LEASE]
            if not pending or time.monotonic() > deadline:
                return feature_removed
            time.sleep(0.05)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._store.close()
                release_engine(self._claim)
