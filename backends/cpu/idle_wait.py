"""Engine processes that wait for work without spinning, on hosts whose cores they share.

vLLM's shared-memory message queue (scheduler -> worker, worker -> engine core) keeps
each reader spinning with `sched_yield` for `SpinCondition.busy_loop_s` (1 s) after
every read, before it sleeps on the writer's notification socket. With every instance
of a deployment on one small host, the idle instances' workers spin for a second after
each request they served, on the cores the busy instance computes on: measured on E-P-D
with 2 cores, each idle worker burned ~30% of a core for that second and a 16-token
decode took 70-320 ms. So within the busy window a reader here naps on the socket for
at most `nap` milliseconds instead of yielding in a loop: woken at once by a
notification that arrives, and at most `nap` late for one that was lost.

Notifications were lost, most of an engine step's: the writer's PUB socket counts a
notification as queued (SNDHWM 1) until it takes in its I/O thread's word that it
left, and zmq takes that in on a send only if about a millisecond has passed since it
last did. A step's messages follow each other well within that (vLLM 0.32 sends the
model run and the sampling as two calls), so a notification was dropped and its
reader napped to the end: with 50 ms naps decode ran 3-5x slower (E-P-D, 16 tokens),
most of its waits ended by the nap. `notify_without_drops` has the writer take in its
socket's news first (reading ZMQ_EVENTS does, unthrottled), so a notification is sent
whenever the reader has taken the previous one (benchmarks/shm_queue_wake.py).

`vllm_plugin` is a vLLM general plugin (entry point `vllm.general_plugins`), called in
every engine process before model code; it acts only where the HAL sets `ENV` (the CPU
platform does; GPU and NPU hosts have cores to spare for the spin). It patches the
wait and the notify themselves, not the constructor, so a queue built before the plugin
ran naps too, and its writer drops nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time

ENV = "EPD_SHM_NAP_MS"  # longest nap of a queue reader in its busy window, in ms
# What the CPU HAL asks for. Naps of 1 ms woke each reader 1000 times a second for the
# second after its last read: in E-P-D on 2 cores the six readers of the three
# instances then took turns with the OpenMP threads of the one computing. Measured per
# request on one E-P-D (benchmarks/request_latency.py's requests, the nap switched
# request by request, 30 of each): image 255.6 ms with 1 ms naps, 238.4 with 50,
# 238.5 with 500; text 137.1 / 135.2 / 127.1. A notification ends a nap at once now
# that writers drop none (benchmarks/shm_queue_wake.py: second read 0.03 ms median,
# 3.0 max, with 50 ms naps on an idle host); 50 ms bounds the wait where one is lost
# after all.
NAP_MS = 50

log = logging.getLogger("vllm.epd_serve.idle_wait")


def nap_ms(environ: dict[str, str] | os._Environ = os.environ) -> int | None:
    """The nap the HAL asked for, or None where it asked for nothing; a value that is
    not a positive whole number is refused (a typo must not silently keep the spin)."""
    raw = environ.get(ENV)
    if raw is None or raw == "":
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a whole number of milliseconds") from None
    if ms < 1:
        raise ValueError(f"{ENV}={raw!r}: a nap is at least 1 ms")
    return ms


def nap_instead_of_spin(condition_cls: type, ms: int) -> bool:
    """Make every reader of `condition_cls` (vLLM's SpinCondition) nap on its
    notification socket, at most `ms` at a time, where it would spin. False where the
    class is not the one this was written against (another vLLM)."""
    original = getattr(condition_cls, "wait", None)
    if original is None or not hasattr(condition_cls, "record_read"):
        return False
    original = getattr(original, "__wrapped__", original)  # patched before: patch anew
    from zmq import NOBLOCK  # vLLM's queue runs on pyzmq

    def wait(self, timeout_ms: int | None = None) -> None:
        if not (self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s):
            return original(self, timeout_ms)  # vLLM's idle mode (or a writer's error)
        if self.local_notify_socket in dict(self.poller.poll(timeout=ms)):
            self.local_notify_socket.recv(flags=NOBLOCK, copy=False)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    wait.epd_nap_ms = ms  # type: ignore[attr-defined]
    condition_cls.wait = wait
    return True


def notify_without_drops(condition_cls: type) -> bool:
    """Make every writer of `condition_cls` (vLLM's SpinCondition) process its socket's
    pending commands before it notifies, so that a notification is dropped only when
    the previous one really is still on its way. False where the class is not the one
    this was written against."""
    original = getattr(condition_cls, "notify", None)
    if original is None:
        return False
    original = getattr(original, "__wrapped__", original)
    from zmq import EVENTS

    def notify(self) -> None:
        self.local_notify_socket.getsockopt(EVENTS)  # takes in the I/O thread's news
        original(self)

    notify.__wrapped__ = original  # type: ignore[attr-defined]
    condition_cls.notify = notify
    return True


def vllm_plugin() -> None:
    """vLLM general plugin: queue readers nap instead of spinning, and writers drop no
    notification, where the HAL asked."""
    ms = nap_ms()
    if ms is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not (nap_instead_of_spin(condition, ms)
                                 and notify_without_drops(condition)):
        log.warning("epd-serve: this vLLM's shared-memory queue has no SpinCondition; its "
                    "readers wait as vLLM decides (%s=%s not applied)", ENV, ms)
        return
    line = (f"epd-serve queue readers nap up to {ms} ms instead of spinning in "
            f"{multiprocessing.current_process().name} (pid {os.getpid()})")
    if log.hasHandlers():
        log.info(line)
    else:  # the API server loads plugins before vLLM has set up its logging
        print(line, file=sys.stderr, flush=True)
