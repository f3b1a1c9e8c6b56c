"""Prefill side: write each layer group's KV into the decode instance's memory while
later layers are still computing.

Runs in a prefill engine's worker process (a kv_producer, or a kv_both one beside a
Receiver, which shares only the link and the stats with it), on five threads, which
share one state, the transfer table (sender_table.py), and change it only there, under
its lock:
- the model's thread calls `begin_step` (before the forward pass), `layer_saved`
  (after each attention layer wrote its KV) and `forward_done` (after the pass); it
  only queues jobs and never waits on the network (no thread holds the lock it takes
  while talking to the transfer engine) (sender_steps.py);
- the submit thread waits until a job's layers are written on the device (a blocking
  event recorded on the forward's stream, events.py; CPU kernels are done when they
  return), learns the per-layer compute time from those events, then starts a write
  per job, or parks the job until decode's reservation has arrived; a job that cannot
  be written, for whatever reason, fails its transfer (decode recomputes), never
  settles it as done, and the thread goes on with the next job (sender_submit.py);
- the completion thread polls the writes in flight (sleeping between looks, never
  spinning), tells decode what landed, and finally sends `Done` with the numbers
  (sender_complete.py);
- the drain thread (drain.py) waits out the segments of failed writes that may still
  be running, so that wait holds up no other transfer's writes (sender_complete.py
  settles what it reports);
- the side-channel thread handles decode's messages and, every tick, the timeouts:
  a write must finish within a time sized to the bytes in flight (deadlines.py)
  (sender_channel.py).
The submit and completion threads first take the worker's device (events.py).
Blocks stay pinned (vLLM's delayed free) until no write of the request is in flight.
A transfer that fails before decode's reservation has come has nobody to tell yet:
its failure is kept (on its record, then in `EndedTransfers`) and the reservation,
when it comes, is refused with the reason, so decode recomputes at once.
This module is the owner the worker holds: it builds the table and the threads'
parts, starts and stops the threads, and passes the model's hooks on.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from epd_serve.connectors.epd_kv.channel import Channel
from epd_serve.connectors.epd_kv.drain import Drainer
from epd_serve.connectors.epd_kv.events import Marker, start_thread
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.layout import LayerLayout
from epd_serve.connectors.epd_kv.sender_channel import DecodeMessages
from epd_serve.connectors.epd_kv.sender_complete import Completer
from epd_serve.connectors.epd_kv.sender_steps import StepHooks
from epd_serve.connectors.epd_kv.sender_submit import Submitter
from epd_serve.connectors.epd_kv.sender_table import EndedTransfers, Outgoing, TransferTable
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.transfer import Link

if TYPE_CHECKING:  # vLLM classes; this module itself stays importable without vLLM
    from epd_serve.connectors.epd_kv.metadata import StepPlan
    from epd_serve.connectors.epd_kv.stats import EPDKVStats

# `EndedTransfers` is part of what this module offers, as before the table moved out.
__all__ = ["EndedTransfers", "Sender"]


class Sender:
    def __init__(self, link: Link, layouts: list[LayerLayout], block_size: int, engine_id: str,
                 rank: int, settings: Settings, link_model: LinkModel, stats: "EPDKVStats",
                 mark: Marker | None = None, layout_name: str = "",
                 on_device: Callable[[], None] | None = None,
                 results_ready: threading.Event | None = None):
        self.link = link
        self.mark = mark  # device events (events.marker); None on the CPU
        self.on_device = on_device  # makes the device a thread's own (events.device_setter)
        self.layout_name = layout_name
        self.layouts = layouts
        self.num_layers = len(layouts)
        self.block_size = block_size
        self.settings = settings
        self.stats = stats
        self.incarnation = f"{engine_id}:{rank}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.table = TransferTable(settings, stats, link_model, results_ready)
        # The table's estimates, under the names the engine's checks and tests use.
        self.deadlines = self.table.deadlines
        self.link_cost = self.table.link_cost
        self.compute = self.table.compute
        self.steps = StepHooks(self.table, layouts, mark)
        self.submitter = Submitter(self.table, link, layouts)
        self.completer = Completer(self.table, link)
        self.decode = DecodeMessages(self.table, layouts, block_size, layout_name,
                                     self.incarnation)
        self.channel = Channel("prefill", self.decode.on_message, self.decode.on_tick)
        self.drainer = Drainer(link, self.completer.drained)
        self.table.attach(self.channel, self.drainer)

    def start(self, port: int) -> None:
        self.channel.serve(self.settings.host, port)
        self.channel.start()
        self.drainer.start()
        # The thread names the loops had when they were this class's methods: logs
        # and thread dumps are read by them.
        start_thread(self.submitter.run, "epd-kv-_submit_loop", self.on_device)
        start_thread(self.completer.run, "epd-kv-_complete_loop", self.on_device)

    def close(self) -> None:
        self.table.jobs.put(None)
        self.table.writes.put(None)
        self.drainer.close()
        self.channel.close()

    # -- the model's thread -------------------------------------------------
    def begin_step(self, plan: "StepPlan") -> None:
        self.steps.begin_step(plan)

    def layer_saved(self, layer: int) -> None:
        """The forward pass has queued (on a device) or written (on the CPU) the KV of
        `layer`."""
        self.steps.layer_saved(layer)

    def forward_done(self) -> None:
        self.steps.forward_done()

    def fail_step(self, reason: str) -> None:
        self.steps.fail_step(reason)

    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed: finished, and nothing in flight."""
        return self.table.take_finished()

    def awaiting(self) -> bool:
        """Whether a finished request's blocks are still held for its writes."""
        return self.table.awaiting()

    # -- the tests' views into the threads' state ------------------------------------
    @property
    def _transfers(self) -> dict[str, Outgoing]:
        return self.table.transfers

    @property
    def _submit(self) -> Callable:
        """The submit thread's step for a job whose layers are written; a test puts a
        failing one in its place to see that only that job's transfer fails."""
        return self.submitter.submit

    @_submit.setter
    def _submit(self, step: Callable) -> None:
        self.submitter.submit = step
