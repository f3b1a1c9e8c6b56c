"""A transfer engine within one process: writes between registered memory as copies on
a stream of their own, for a prefill and a decode that share a device (no Mooncake).

Runs in the process that holds both KV caches (benchmarks/gpu_check.py, tests). Imports
torch, not vLLM or Mooncake, and touches no device at import or until a `DeviceCopyLink`
is made. It has `transfer.Link`'s methods (its `wait`, `write` and `calibrate` are
Link's own), so a `Sender` drives it unchanged. Every segment is one `copy_` between
byte views of the registered memory, which torch issues as one `cudaMemcpyAsync`
(device to device) on this link's stream; a write is done when an event recorded after
its last segment has completed, and `take_copy_times` says how long the device spent
copying each write. On the CPU the copies run when they are submitted.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
from typing import Any

import torch

from epd_serve.connectors.epd_kv.transfer import Link, TransferError

TRANSPORT = "device-copy"


@dataclasses.dataclass
class CopyWrite:
    """A write in flight: its segments are queued on the link's stream between two
    events (none on the CPU, where they ran at submit)."""

    nbytes: int
    start: Any = None
    end: Any = None
    timed: bool = False  # its device time is in the link's log


class _CudaBytes:
    """`bytes` of device memory at `address`, as torch reads a foreign pointer
    (the CUDA Array Interface, version 2: no stream to synchronise with)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


def byte_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over memory this process already holds (nothing is copied or
    owned: the memory must outlive the view)."""
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address),
                                dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(address, nbytes), device=device)
    raise TransferError(f"a {TRANSPORT} link copies on CPU or CUDA memory, not {device.type}")


class DeviceCopyLink(Link):
    """Copies between memory registered with it, on `device`'s copy stream."""

    def __init__(self, device: torch.device | str, session_id: str = "local"):
        # Link's own start-up is Mooncake's: none of it applies here.
        self.device = torch.device(device)
        self.transport = TRANSPORT
        self.devices: list[str] = []
        self.host = "127.0.0.1"
        self.protocol = TRANSPORT
        self.session_id = session_id
        self._module = None if self.device.type == "cpu" else torch.get_device_module(
            self.device.type)
        self._stream = None if self._module is None else self._module.Stream(self.device)
        self._bases: list[int] = []  # registered spans, by address
        self._spans: list[tuple[int, torch.Tensor]] = []
        self._copy_times: list[tuple[int, float]] = []

    def register(self, spans: list[tuple[int, int]], device_type: str = "cpu") -> None:
        if device_type != self.device.type:
            raise TransferError(f"this {TRANSPORT} link copies on {self.device}, not on "
                                f"{device_type} memory")
        for address, nbytes in spans:
            index = bisect.bisect(self._bases, address)
            self._bases.insert(index, address)
            self._spans.insert(index, (address, byte_view(address, nbytes, self.device)))

    def _view(self, address: int, nbytes: int) -> torch.Tensor:
        index = bisect.bisect(self._bases, address) - 1
        if index >= 0:
            base, memory = self._spans[index]
            if address + nbytes <= base + memory.numel():
                return memory[address - base:address - base + nbytes]
        raise TransferError(f"{nbytes} B at {address:#x} are not in registered memory")

    def submit(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> CopyWrite:
        """Queue one copy per segment. Every address is checked first, so a refused
        write has started nothing."""
        if peer != self.session_id:
            raise TransferError(f"no peer {peer}: a {TRANSPORT} link writes only within "
                                f"its own process ({self.session_id})")
        pairs = [(self._view(src, n), self._view(dst, n)) for src, dst, n in zip(srcs, dsts, lens)]
        write = CopyWrite(sum(lens))
        if self._module is None:
            for src, dst in pairs:
                dst.copy_(src)
            return write
        write.start = self._module.Event(enable_timing=True)
        write.end = self._module.Event(enable_timing=True)
        with self._module.stream(self._stream):
            write.start.record(self._stream)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            write.end.record(self._stream)
        return write

    def done(self, write: CopyWrite) -> bool:
        if write.end is None:
            return True
        try:
            if not write.end.query():
                return False
        except RuntimeError as err:  # the device failed the copies
            raise TransferError(f"device copy failed: {err}") from err
        if not write.timed:
            write.timed = True
            self._copy_times.append((write.nbytes, write.start.elapsed_time(write.end) / 1e3))
        return True

    def segments_ended(self, write: CopyWrite) -> bool:
        try:
            return self.done(write)
        except TransferError:
            return True  # a failed copy reads nothing any more

    def take_copy_times(self) -> list[tuple[int, float]]:
        """(bytes, device seconds) of each write completed since the last call."""
        times, self._copy_times = self._copy_times, []
        return times
