"""Encoder outputs to store bytes and back, on any device. Needs torch, not vLLM."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from epd_serve.mmstore import FeatureMeta


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """Page-locked host memory: the device copies it by DMA, and a copy from it can
    run asynchronously. Raises without an accelerator (CPU-only torch or no driver),
    which is why a CPU worker never builds a `HostStaging`."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def copy_done_event(device: torch.device) -> torch.Event:
    """An event to wait for a copy queued on `device`'s current stream; blocking, so
    waiting on it sleeps instead of spinning a core. From the device's own module
    (`torch.cuda`, `torch.npu`): `torch.Event` ignores `blocking` (torch 2.13)."""
    return torch.get_device_module(device.type).Event(blocking=True)


class _Slot:
    def __init__(self):
        self.buffer: torch.Tensor | None = None
        # Recorded after an asynchronous copy out of `buffer`: its bytes must stay
        # untouched until the event completes.
        self.reading: torch.Event | None = None


class HostStaging:
    """A few reusable pinned host buffers, used in turn, for copies between host and
    device. From pageable memory a 110 MB feature took 97 ms to leave an H100, from
    pinned memory a few ms; and only from pinned memory does a host-to-device copy
    leave the model's thread at once instead of synchronising the stream.

    A buffer an asynchronous copy may still be reading is waited for before its bytes
    are written again. With `slots` buffers, that many features loaded one after
    another (one step's, say) are queued without waiting at all."""

    def __init__(self, slots: int = 1,
                 allocate: Callable[[int], torch.Tensor] = pinned_bytes,
                 new_event: Callable[[torch.device], torch.Event] = copy_done_event):
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._allocate = allocate
        self._new_event = new_event

    def _take(self, nbytes: int) -> _Slot:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.reading is not None:
            slot.reading.synchronize()  # an earlier copy out of this buffer must finish
            slot.reading = None
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            slot.buffer = self._allocate(nbytes)
        return slot

    def download(self, flat: torch.Tensor) -> np.ndarray:
        """The bytes of device tensor `flat` (uint8) in host memory, valid until the
        staging is used again (store them before encoding another)."""
        host = self._take(flat.numel()).buffer[:flat.numel()]
        host.copy_(flat)  # synchronous: the bytes are there when this returns
        return host.numpy()

    def upload(self, data: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of host tensor `data` on `device`, queued on the current stream: work
        queued after it on that stream sees the whole tensor. `data` may be freed or
        changed as soon as this returns."""
        nbytes = data.numel() * data.element_size()
        slot = self._take(nbytes)
        host = slot.buffer[:nbytes].view(data.dtype).reshape(data.shape)
        host.copy_(data)
        # copy=True: a tensor of its own even where `device` is where `host` lives.
        on_device = host.to(device, non_blocking=True, copy=True)
        slot.reading = self._new_event(device)
        slot.reading.record()
        return on_device


def to_bytes(tensor: torch.Tensor, staging: HostStaging | None = None,
             ) -> tuple[np.ndarray, FeatureMeta]:
    """The tensor's bytes in host memory and its meta. Off the CPU, the bytes land in
    `staging` (valid until its next use: store them before encoding another)."""
    tensor = tensor.detach().contiguous()
    meta = FeatureMeta(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    flat = tensor.view(torch.uint8).reshape(-1)
    if tensor.device.type == "cpu":
        return flat.numpy(), meta
    if staging is None:
        return flat.to("cpu").numpy(), meta
    return staging.download(flat), meta


def to_tensor(data: np.ndarray, meta: FeatureMeta, device: str,
              staging: HostStaging | None = None) -> torch.Tensor:
    """The feature as a tensor on `device`: on the CPU a view of `data`, elsewhere one
    host-to-device copy. Through `staging` that copy is queued on the current stream
    and this returns at once (the model's kernels, queued after it on the same stream,
    wait for it); without, it waits for the copy."""
    tensor = torch.from_numpy(data).view(getattr(torch, meta.dtype)).reshape(meta.shape)
    if device == "cpu":
        return tensor
    if staging is None:
        return tensor.to(device)
    return staging.upload(tensor, torch.device(device))
