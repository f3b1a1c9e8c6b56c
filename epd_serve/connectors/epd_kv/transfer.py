"""Our wrapper over Mooncake's TransferEngine: errors as exceptions, one write call.

Runs in engine worker processes. `mooncake.engine` is imported when a `Link` is made,
not at import time. The engine listens on every interface whatever it is asked (run
tests in a loopback-only namespace); its session id is `host:rpc_port`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

from epd_serve.connectors.epd_kv.grouping import LinkModel

logger = logging.getLogger("vllm.epd_serve.kv.transfer")


class TransferError(RuntimeError):
    """A write the transfer engine could not complete."""


class Link:
    """One transfer engine: registered memory and batch writes to peers' memory."""

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = ""):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise TransferError(f"transfer engine failed to start ({protocol} on {host})")
        self.host = host
        self.protocol = protocol
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, spans: Sequence[tuple[int, int]]) -> None:
        if not spans:
            return
        addrs, sizes = zip(*spans)
        if self.engine.batch_register_memory(list(addrs), list(sizes)) != 0:
            raise TransferError(f"registering {len(spans)} KV cache allocation(s) failed")

    def submit(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """Start writing local `srcs` to the peer's `dsts`; returns a batch id."""
        batch = self.engine.batch_transfer_async_write(peer, srcs, dsts, lens)
        if batch <= 0:
            raise TransferError(f"write of {len(lens)} segment(s) to {peer} was not accepted")
        return batch

    def wait(self, batch: int) -> None:
        """Block until a submitted batch has landed (raises if it failed)."""
        status = self.engine.get_batch_transfer_status([batch])
        if status != 0:
            raise TransferError(f"write batch failed with status {status}")

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        self.wait(self.submit(peer, srcs, dsts, lens))

    def calibrate(self, scratch_addr: int, scratch_bytes: int, repeats: int = 5) -> LinkModel:
        """Time writes from the first half of a registered scratch area into its second
        half through this engine's own session: the per-batch overhead from small
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
