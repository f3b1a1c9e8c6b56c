"""Device events: when the KV a forward pass writes is really in memory, and how long
its layers took.

Runs in a prefill engine's worker process. On a GPU or NPU the model's thread only
queues kernels: when `save_kv_layer` or `wait_for_save` is called, the KV may not be
written yet. So every write job carries an event recorded on the device's current
stream (the one the forward pass runs on) at that point, and the submit thread waits on
it before the transfer engine reads a byte. The events are created blocking, so that
wait sleeps instead of spinning a core, and timed, so that the elapsed time between
two of them is the device's compute time (the CPU gaps between hooks are only kernel
launch times there). On the CPU there is nothing to wait for: kernels are done when
they return, and `marker` gives None.

`torch.Event` is not used: its `blocking` flag is accepted and ignored (torch 2.13),
so its `synchronize` spins. The device's own module (`torch.cuda`, `torch.npu` from
torch_npu) honours it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Event(Protocol):
    def synchronize(self) -> None: ...

    def elapsed_time(self, end: "Event") -> float: ...  # milliseconds


Marker = Callable[[], Event]


def marker(device, module: Any = None) -> Marker | None:
    """A function recording a blocking, timed event on `device`'s current stream, or
    None for the CPU. `module` is the device's torch module (looked up by default)."""
    if device.type == "cpu":
        return None
    if module is None:
        import torch

        module = torch.get_device_module(device.type)

    def mark() -> Event:
        event = module.Event(enable_timing=True, blocking=True)
        event.record(module.current_stream(device))
        return event

    return mark


def elapsed_s(start: Event, end: Event) -> float:
    """Device time between two completed events, in seconds."""
    return start.elapsed_time(end) / 1e3
