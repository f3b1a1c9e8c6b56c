"""Prefill side: turning each engine step's layers into write jobs, on the model's thread.

Runs in a prefill engine's worker process, on the model's thread: `begin_step` before
the forward pass, `layer_saved` after each attention layer wrote its KV, `forward_done`
after the pass. It plans the step's layer groups, records a device event where a group
ends, and queues one job per group and chunk in the transfer table for the submit
thread; it never waits on the network, and the table's lock it takes is never held
while anyone talks to the transfer engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.events import Event, Marker
from epd_serve.connectors.epd_kv.grouping import fitted_groups, plan_groups
from epd_serve.connectors.epd_kv.layout import LayerLayout
from epd_serve.connectors.epd_kv.sender_table import Job, StepStart, TransferTable

if TYPE_CHECKING:  # vLLM classes; this module itself stays importable without vLLM
    from epd_serve.connectors.epd_kv.metadata import StepPlan

# The sender's one logger, whichever of its modules logs: operators filter on its name.
logger = logging.getLogger("vllm.epd_serve.kv.sender")


class StepHooks:
    def __init__(self, table: TransferTable, layouts: list[LayerLayout],
                 mark: Marker | None = None):
        self.table = table
        self.settings = table.settings
        self.layouts = layouts
        self.num_layers = len(layouts)
        self.mark = mark  # device events (events.marker); None on the CPU
        # Per-step state, touched only by the model's thread.
        self._chunks: list[msg.SendChunk] = []
        self._step_tokens = 0
        self._groups: dict[str, list[tuple[int, int]]] = {}
        self._last_layer_at: float | None = None
        self._step_start: StepStart | None = None
        self._logged_plan: tuple[int, ...] = ()

    def begin_step(self, plan: "StepPlan") -> None:
        self._chunks = []
        self._step_tokens = plan.num_tokens
        self._groups = {}
        self._last_layer_at = None
        self._step_start = None
        table = self.table
        with table.lock:
            for chunk in plan.sends:
                out = table.record(chunk.transfer_id)
                if out.request_id not in (None, chunk.request_id):
                    # Two requests naming one transfer: the scheduler refuses the second
                    # (scheduler.py), so this is a bug of ours; it costs that chunk's
                    # transfer (decode recomputes), never the step.
                    logger.error("epd-kv: request %s names transfer %s, which request %s "
                                 "sends: not sent", chunk.request_id, chunk.transfer_id,
                                 out.request_id)
                    continue
                out.request_id = chunk.request_id
                out.mode = chunk.mode or self.settings.mode
                out.fault = chunk.fault if self.settings.fault_injection else None
                self._chunks.append(chunk)
            for finished in plan.finished_sends:
                table.finish(finished)
        for request_id in plan.preempted:
            self._release_preempted(request_id)

    def layer_saved(self, layer: int) -> None:
        """The forward pass has queued (on a device) or written (on the CPU) the KV of
        `layer`."""
        if not self._chunks:
            return
        now = time.perf_counter()
        if self._last_layer_at is None:
            self._start_step(now)
        elif self.mark is None:  # CPU: the gap between hooks is the layer's compute
            self.table.compute.observe(now - self._last_layer_at, self._step_tokens)
        self._last_layer_at = now
        event = None
        for mode, groups in self._groups.items():
            if mode == "whole":
                continue  # sent after the forward pass, as vLLM does
            for first, last in groups:
                if last == layer:
                    event = event or self._mark()
                    self._queue(mode, first, last, event)

    def forward_done(self) -> None:
        if not self._chunks:
            return
        if self._last_layer_at is None:
            # No layer hook ran (a full CUDA graph replay has none): every mode's
            # layers go after the pass, rather than none of them at all.
            self._start_step(time.perf_counter())
            after_pass = set(self._groups)
        else:
            after_pass = {"whole"} & set(self._groups)
        now, wall = time.perf_counter(), time.time()
        # Recorded after the whole forward pass was queued: the writes wait for it.
        event = self._mark() if after_pass else None
        for mode in after_pass:
            self._queue(mode, 0, self.num_layers - 1, event)
        table = self.table
        with table.lock:
            for chunk in self._chunks:
                out = table.transfers.get(chunk.transfer_id)
                if out is not None and chunk.is_last:
                    # On a device only the pass's queueing ended: the submit thread moves
                    # this to when the last layer's event completes (`Submitter._timed`),
                    # unless it has already (the device was done before this hook ran).
                    if not out.forward_end_measured:
                        out.forward_end, out.forward_end_wall = now, wall
                    out.all_queued = True
                    table.settle(out)
        self._chunks = []

    def _start_step(self, now: float) -> None:
        self._plan_step()
        if self.mark is not None:
            self._step_start = StepStart(self.mark(), self._step_tokens)
            return
        with self.table.lock:
            for out in self._records():
                if out.first_layer_at is None:
                    out.first_layer_at = now

    def _mark(self) -> Event | None:
        return self.mark() if self.mark is not None else None

    def fail_step(self, reason: str) -> None:
        """The step's hooks failed part-way (a bug of ours): its transfers fail, rather
        than settle as done with layers never queued; decode computes those prompts."""
        with self.table.lock:
            for out in self._records():
                self.table.fail(out, reason)
                out.all_queued = True
                self.table.settle(out)
        self._chunks = []

    def _records(self) -> list:
        """The records of this step's chunks that still exist, in chunk order."""
        found = (self.table.transfers.get(c.transfer_id) for c in self._chunks)
        return [out for out in found if out is not None]

    def _plan_step(self) -> None:
        modes = {out.mode for out in self._records()}
        for mode in modes:
            if mode == "group" and self.settings.group_size == "auto":
                self._groups[mode] = self._fitted_plan(mode)
            else:
                size = 1 if self.settings.group_size == "auto" else int(self.settings.group_size)
                self._groups[mode] = plan_groups(self.num_layers, mode, size)

    def _fitted_plan(self, mode: str) -> list[tuple[int, int]]:
        chunks = [c for c in self._chunks
                  if getattr(self.table.transfers.get(c.transfer_id), "mode", None) == mode]
        tokens = sum(c.end - c.start for c in chunks)
        layer_bytes = sum(c.end_block - c.first_block for c in chunks) * self.layouts[0].block_bytes
        link = self.table.link_cost.model
        compute = self.table.compute.layer_s(self._step_tokens)
        groups = fitted_groups(self.num_layers, layer_bytes, link, compute)
        sizes = tuple(last - first + 1 for first, last in groups)
        if sizes != self._logged_plan:  # the first plan at INFO, changes at DEBUG
            log = logger.debug if self._logged_plan else logger.info
            log("epd-kv layer groups %s for %d tokens (%d KB per layer; link %.3f ms + "
                "%.2f GB/s per write; layer compute %s)", list(sizes), tokens,
                layer_bytes // 1024, link.overhead_s * 1e3, link.bytes_per_s / 1e9,
                f"{compute * 1e3:.2f} ms" if compute else "not measured yet")
            self._logged_plan = sizes
        return groups

    def _queue(self, mode: str, first: int, last: int, event: Event | None) -> None:
        for chunk in self._chunks:
            if chunk.first_block >= chunk.end_block:
                continue  # every block this chunk wrote into is filled by a later one
            with self.table.lock:
                out = self.table.transfers.get(chunk.transfer_id)
                if out is None or out.mode != mode:
                    continue
                out.queued += 1
            self.table.jobs.put(Job(chunk.transfer_id, first, last, chunk.first_block,
                                    chunk.block_ids[chunk.first_block:chunk.end_block], event,
                                    self._step_start,
                                    chunk.is_last and last == self.num_layers - 1))

    def _release_preempted(self, request_id: str) -> None:
        """A preempted request's blocks are about to be reused: the engine step must not
        wait on the network for its writes, so a transfer with writes still running is
        failed (decode recomputes, and waits out those writes before reusing its own
        blocks: whatever they carry then is never read). One with nothing in flight
        stays: the request will be prefilled (and sent) again from its first token."""
        table = self.table
        with table.lock:
            for out in list(table.transfers.values()):
                if out.request_id != request_id:
                    continue
                out.backlog.clear()
                out.first_layer_at, out.forward_end_measured = None, False
                if out.in_flight or out.queued:
                    table.fail(out, "prefill was preempted while its writes were running")
                    table.settle(out)
