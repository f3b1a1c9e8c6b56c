"""Our wrapper over Mooncake's TransferEngine: errors as exceptions, one write call.

Runs in engine worker processes. `mooncake.engine` is imported when a `Link` is made,
not at import time. The engine listens on every interface whatever it is asked (run
tests in a loopback-only namespace); its session id is `host:rpc_port`. Which transport
it installs is not the `protocol` it is given but what its environment and the host's
RDMA devices decide (fabric.py): a `Link` sets the environment, says which transport
that makes (`transport`), and refuses to fall back to TCP when RDMA was asked for.

Every segment is its own transfer, polled without blocking: the engine's batch status
call busy-waits on a core until the batch is done (and gives up only after its 30 s
default timeout), which on a small host steals the very CPU the prefill computes with.
Separate segments also travel in parallel. Mooncake's Python binding
(mooncake-integration/transfer_engine/transfer_engine_py.cpp, read at v0.3.11.post1,
the NPU wheel's, and on its main branch after v0.3.12.post1; the signatures match the
0.3.13 wheel we run) does have a batched submit, `batch_transfer_async_write(target,
buffers, peer_addrs, lengths) -> batch id` (one `submitTransfer` of every entry; on the
Ascend transport one ADXL `TransferSync` per batch and target, where each single
submit is one of its own). But nothing reads a batch's status without blocking:
`get_batch_transfer_status([ids])` and the `batch_transfer_sync_*` calls spin until
the batch ends, and `transfer_check_status(id)` looks at the batch's first task only,
then frees the batch, which Mooncake refuses while its other tasks are unread
(`MultiTransport::freeBatchID`: BatchBusy), so they would be lost track of and leaked.
So segments stay one transfer each, and layout.py makes them as few as the memory
allows: segments that continue one another on both sides are one (`merge_contiguous`).
A non-blocking `batch_transfer_check_status(batch_id)` in the binding would let a
layer group go as one batch. A write fails as soon as one segment fails
or is refused, while its other segments may still be running: the error hands them
back (`TransferError.unfinished`) for the caller to wait out (`segments_ended`) where
that wait holds nobody up (drain.py), before the memory they read is reused.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from epd_serve.connectors.epd_kv import fabric
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.mmstore.transfer_engines import claim_engine, release_engine

POLL_S = 0.0002  # between looks at pending writes while waiting for one
# Longest wait for the segments of a failed write to end. The engine gives up on a
# transfer after its own 30 s; decode holds a failed transfer's blocks as long
# (Settings.release_grace_s), so waiting longer would protect nothing.
DRAIN_TIMEOUT_S = 30.0


class TransferError(RuntimeError):
    """A write the transfer engine could not complete. `unfinished`: that write, if some
    of its segments may still be running (reading our memory until they end)."""

    def __init__(self, message: str, unfinished: "Write | None" = None):
        super().__init__(message)
        self.unfinished = unfinished


@dataclasses.dataclass
class Write:
    """A write in flight: one engine transfer per segment, checked in order."""

    ids: list[int]
    checked: int = 0  # segments before this one have completed


class Link:
    """One transfer engine: registered memory and writes to peers' memory."""

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "",
                 gid_index: int | None = None):
        from mooncake.engine import TransferEngine

        # Read as the engine starts; MC_GID_INDEX only by a process's first engine
        # (Mooncake loads its global config once).
        os.environ.update(fabric.engine_environment(protocol, gid_index))
        devices = ",".join(fabric.device_list(device_name))
        # Forced TCP, the engine looks at no device: neither do we.
        hcas = [] if fabric.FORCE_TCP in os.environ else fabric.read_hcas()
        usable, left_out = fabric.screen_hcas(hcas, devices, os.environ)
        # The binding cannot tell which transport the engine installed: derived from
        # what decides it, before the engine starts.
        self.transport = fabric.installed_transport(protocol, os.environ, usable)
        if protocol == fabric.RDMA and self.transport == fabric.TCP:
            why = fabric.why_not_rdma(os.environ, hcas, devices, left_out)
            raise TransferError(f"protocol rdma, but the transfer engine would fall back "
                                f"to TCP: {why}")
        self.devices = usable if self.transport == fabric.RDMA else []  # HCAs it uses
        self._claim = claim_engine("the epd KV connector", self.transport)
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, devices) != 0:
            release_engine(self._claim)
            raise TransferError(f"transfer engine failed to start ({self.transport} on {host})")
        self.host = host
        self.protocol = protocol
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, spans: list[tuple[int, int]], device_type: str = "cpu") -> None:
        """Register memory the engine may read or write: `spans` of (address, bytes) on
        `device_type` ("cpu" or "cuda")."""
        if not spans:
            return
        if device_type == "cuda" and self.transport == fabric.RDMA:
            # Without GPUDirect the engine's registration fails with no useful message.
            problem = fabric.gpudirect_problem(os.environ, *fabric.read_gpudirect_facts())
            if problem:
                raise TransferError(problem)
        addrs, sizes = zip(*spans)
        if self.engine.batch_register_memory(list(addrs), list(sizes)) != 0:
            raise TransferError(f"registering {len(spans)} KV cache allocation(s) failed")

    def submit(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> Write:
        """Start writing local `srcs` to the peer's `dsts`. If a segment is refused, the
        error carries those already accepted (they may still read our memory)."""
        write = Write([])
        for src, dst, length in zip(srcs, dsts, lens):
            transfer = self.engine.transfer_submit_write(peer, src, dst, length)
            if transfer <= 0:
                raise TransferError(f"write of {len(lens)} segment(s) to {peer} was not "
                                    f"accepted (segment {len(write.ids)})",
                                    write if write.ids else None)
            write.ids.append(transfer)
        return write

    def done(self, write: Write) -> bool:
        """Whether every segment has landed; raises at once if one failed, with the
        write as `unfinished` if later segments may still be running."""
        while write.checked < len(write.ids):
            status = self.engine.transfer_check_status(write.ids[write.checked])
            if status == 0:
                return False
            write.checked += 1
            if status < 0:
                raise TransferError("write failed" if status == -1 else "write timed out "
                                    "in the transfer engine",
                                    write if write.checked < len(write.ids) else None)
        return True

    def segments_ended(self, write: Write) -> bool:
        """For a failed write: whether its remaining segments have all ended, however
        they ended (until then they may still read our memory). Never blocks."""
        while write.checked < len(write.ids):
            if self.engine.transfer_check_status(write.ids[write.checked]) == 0:
                return False
            write.checked += 1
        return True

    def _drain(self, write: Write, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait for the rest of a failed write's segments, at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.segments_ended(write):
            if time.monotonic() > deadline:
                raise TransferError(f"{len(write.ids) - write.checked} segment(s) of a "
                                    f"failed write still running after {timeout_s:.0f}s")
            time.sleep(POLL_S)

    def wait(self, write: Write) -> None:
        while not self.done(write):
            time.sleep(POLL_S)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Write and wait (calibration): a failed write is waited out here, too."""
        try:
            self.wait(self.submit(peer, srcs, dsts, lens))
        except TransferError as err:
            if err.unfinished is not None:
                self._drain(err.unfinished)
            raise

    def calibrate(self, scratch_addr: int, scratch_bytes: int, repeats: int = 5) -> LinkModel:
        """Time writes from the first half of a registered scratch area into its second
        half through this engine's own session: the per-write overhead from small
        writes, the bandwidth from large ones."""
        half = scratch_bytes // 2
        small, large = 4096, min(half, 4 << 20)

        def timed(nbytes: int) -> float:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                self.write(self.session_id, [scratch_addr], [scratch_addr + half], [nbytes])
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        timed(small)  # the first write pays the handshake
        overhead = timed(small)
        bandwidth = (large - small) / max(timed(large) - overhead, 1e-6)
        return LinkModel(overhead_s=overhead, bytes_per_s=bandwidth)
