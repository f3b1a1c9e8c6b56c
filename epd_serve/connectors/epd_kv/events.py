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

The current device is a thread's own: a thread we start begins on device 0 (CUDA) or
on none at all (CANN: `aclrtGetDevice` fails there, and Mooncake's Ascend transport
asks it on every submit). So every thread of ours that waits on these events or
submits writes first makes the worker's device its own (`device_setter`,
`start_thread`), as vllm-ascend's sending threads do (`torch.npu.set_device` in
vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py:266-269,
and as the thread pool's initializer in kv_p2p/mooncake_connector.py:478-487).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

THREAD_START_TIMEOUT_S = 30.0


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


def device_setter(device, module: Any = None) -> Callable[[], None] | None:
    """A function making `device` the calling thread's current device
    (`torch.cuda.set_device`, `torch.npu.set_device`), or None for the CPU. `module` is
    the device's torch module (looked up by default)."""
    if device.type == "cpu":
        return None
    if module is None:
        import torch

        module = torch.get_device_module(device.type)
    return lambda: module.set_device(device)


def start_thread(target: Callable[[], None], name: str,
                 on_device: Callable[[], None] | None = None,
                 timeout_s: float = THREAD_START_TIMEOUT_S) -> threading.Thread:
    """Start a daemon thread that runs `on_device()` (if given), then `target()`.
    Returns once the thread has its device; raises if it could not take it, so a worker
    that cannot run its transfers fails at start-up instead of at its first request."""
    ready = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        if on_device is not None:
            try:
                on_device()
            except BaseException as err:  # handed to the starting thread, raised there
                failed.append(err)
                return
            finally:
                ready.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if on_device is None:
        return thread
    if not ready.wait(timeout_s):
        raise RuntimeError(f"thread {name} did not set its device within {timeout_s:.0f}s")
    if failed:
        raise RuntimeError(f"thread {name} could not make the worker's device its own: "
                           f"{type(failed[0]).__name__}: {failed[0]}") from failed[0]
    return thread
