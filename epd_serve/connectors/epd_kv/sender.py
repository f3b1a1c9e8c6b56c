"""Prefill side: write each layer group's KV into the decode instance's memory while
later layers are still computing.

Runs in a prefill engine's worker process, on five threads:
- the model's thread calls `begin_step` (before the forward pass), `layer_saved`
  (after each attention layer wrote its KV) and `forward_done` (after the pass); it
  only queues jobs and never waits on the network (no thread holds the lock it takes
  while talking to the transfer engine);
- the submit thread waits until a job's layers are written on the device (a blocking
  event recorded on the forward's stream, events.py; CPU kernels are done when they
  return), learns the per-layer compute time from those events, then starts a write
  per job, or parks the job until decode's reservation has arrived; a job that cannot
  be written, for whatever reason, fails its transfer (decode recomputes), never
  settles it as done, and the thread goes on with the next job;
- the completion thread polls the writes in flight (sleeping between looks, never
  spinning), tells decode what landed, and finally sends `Done` with the numbers;
- the drain thread (drain.py) waits out the segments of failed writes that may still
  be running, so that wait holds up no other transfer's writes;
- the side-channel thread handles decode's messages and, every tick, the timeouts:
  a write must finish within a time sized to the bytes in flight (deadlines.py).
The submit and completion threads first take the worker's device (events.py).
Blocks stay pinned (vLLM's delayed free) until no write of the request is in flight.
A transfer that fails before decode's reservation has come has nobody to tell yet:
its failure is kept (on its record, then in `EndedTransfers`) and the reservation,
when it comes, is refused with the reason, so decode recomputes at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.channel import Channel
from epd_serve.connectors.epd_kv.deadlines import WriteDeadlines
from epd_serve.connectors.epd_kv.drain import Drainer, poll_until_closed
from epd_serve.connectors.epd_kv.events import Event, Marker, elapsed_s, start_thread
from epd_serve.connectors.epd_kv.grouping import (
    ComputeModel,
    LinkEstimator,
    LinkModel,
    fitted_groups,
    plan_groups,
)
from epd_serve.connectors.epd_kv.layout import (
    LayerLayout,
    block_runs,
    check_compatible,
    segments,
)
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.transfer import Link, TransferError, Write

if TYPE_CHECKING:  # vLLM classes; this module itself stays importable without vLLM
    from epd_serve.connectors.epd_kv.metadata import StepPlan
    from epd_serve.connectors.epd_kv.stats import EPDKVStats

logger = logging.getLogger("vllm.epd_serve.kv.sender")

# Destination used by the "fail_write" fault: an address no peer has registered, so
# the transfer engine itself rejects the write.
_UNREGISTERED_ADDRESS = 4096
# Most ended transfers remembered (beyond it the oldest are forgotten early): far more
# than end within reservation_timeout_s at any real rate, and a few MB at most.
ENDED_CAPACITY = 100_000


@dataclasses.dataclass
class StepStart:
    """The device event at the end of a step's first layer, shared by its jobs."""

    event: Event
    num_tokens: int
    timed: bool = False  # the step's per-layer compute time was learned from it


@dataclasses.dataclass
class Job:
    """Layers [first, last] of one prefill chunk of one request."""

    transfer_id: str
    first_layer: int
    last_layer: int
    first_block: int  # index of the chunk's first block within the request
    block_ids: list[int]  # this engine's ids of those blocks
    ready: Event | None = None  # device event recorded after the last layer's KV write
    step: StepStart | None = None  # on a device: when the step's first layer ended
    ends_forward: bool = False  # the request's last layer of its last chunk
    queued: bool = True  # counted in its transfer's `queued` (not yet taken or parked)


@dataclasses.dataclass
class Outgoing:
    """Everything known about one transfer on this prefill worker."""

    transfer_id: str
    created: float = dataclasses.field(default_factory=time.monotonic)
    request_id: str | None = None  # None while only decode's reservation is here
    mode: str = "group"
    fault: str | None = None
    reservation: msg.Reserve | None = None
    peer: str = ""  # decode's side-channel identity
    backlog: list[Job] = dataclasses.field(default_factory=list)
    queued: int = 0  # jobs waiting in the submit queue
    in_flight: int = 0  # batches submitted and not yet completed
    all_queued: bool = False  # the last chunk's forward pass is over
    finished_at: float | None = None  # the scheduler finished the request
    outcome: str | None = None  # "done" | "failed" | "cancelled"
    reason: str = ""  # why it failed or was cancelled
    announced_failure: bool = False
    nbytes: int = 0
    groups: int = 0
    intervals: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    first_layer_at: float | None = None
    forward_end: float | None = None  # perf_counter at the end of the last chunk's pass
    forward_end_wall: float = 0.0
    forward_end_measured: bool = False  # forward_end is the device's (its event's)

    @property
    def settled(self) -> bool:
        return self.outcome is not None and self.in_flight == 0 and self.queued == 0


@dataclasses.dataclass
class InFlight:
    transfer_id: str
    write: Write
    nbytes: int
    first_layer: int
    last_layer: int
    submitted: float
    deadline: float
    session: str  # decode's transfer engine


@dataclasses.dataclass(frozen=True)
class Ended:
    outcome: str
    reason: str
    at: float  # time.monotonic()


class EndedTransfers:
    """Transfers this worker is done with, by id: a late chunk or a reservation of one
    is answered at once (decode recomputes) instead of waiting out a timeout. Bounded:
    each is kept for `ttl_s`, and at most `capacity` of them (the oldest go first)."""

    def __init__(self, ttl_s: float, capacity: int = ENDED_CAPACITY):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._ended: dict[str, Ended] = {}  # oldest first (insertion order)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._ended

    def get(self, transfer_id: str) -> Ended | None:
        return self._ended.get(transfer_id)

    def add(self, transfer_id: str, outcome: str, reason: str) -> None:
        self._ended.pop(transfer_id, None)  # an entry made again is the newest
        self._ended[transfer_id] = Ended(outcome, reason, time.monotonic())
        while len(self._ended) > self.capacity:
            del self._ended[next(iter(self._ended))]

    def expire(self, now: float) -> None:
        while self._ended:  # oldest first: stop at the first fresh one
            oldest = next(iter(self._ended))
            if now - self._ended[oldest].at <= self.ttl_s:
                break
            del self._ended[oldest]


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class Sender:
    def __init__(self, link: Link, layouts: list[LayerLayout], block_size: int, engine_id: str,
                 rank: int, settings: Settings, link_model: LinkModel, stats: "EPDKVStats",
                 mark: Marker | None = None, layout_name: str = "",
                 on_device: Callable[[], None] | None = None):
        self.link = link
        self.mark = mark  # device events (events.marker); None on the CPU
        self.on_device = on_device  # makes the device a thread's own (events.device_setter)
        self.deadlines = WriteDeadlines(settings)
        self.layout_name = layout_name
        self.layouts = layouts
        self.num_layers = len(layouts)
        self.block_size = block_size
        self.settings = settings
        self.link_cost = LinkEstimator(link_model)
        self.compute = ComputeModel()
        self.stats = stats
        self.incarnation = f"{engine_id}:{rank}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._ended = EndedTransfers(settings.reservation_timeout_s)
        self._in_flight: dict[int, InFlight] = {}  # by id(write)
        self._finished_sending: set[str] = set()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._writes: queue.Queue[InFlight | None] = queue.Queue()
        self.channel = Channel("prefill", self._on_message, self._on_tick)
        self.drainer = Drainer(link, self._drained)
        # Per-step state, touched only by the model's thread.
        self._chunks: list[msg.SendChunk] = []
        self._step_tokens = 0
        self._groups: dict[str, list[tuple[int, int]]] = {}
        self._last_layer_at: float | None = None
        self._step_start: StepStart | None = None
        self._logged_plan: tuple[int, ...] = ()

    def start(self, port: int) -> None:
        self.channel.serve(self.settings.host, port)
        self.channel.start()
        self.drainer.start()
        for target in (self._submit_loop, self._complete_loop):
            start_thread(target, f"epd-kv-{target.__name__}", self.on_device)

    def close(self) -> None:
        self._jobs.put(None)
        self._writes.put(None)
        self.drainer.close()
        self.channel.close()

    # -- the model's thread -------------------------------------------------
    def begin_step(self, plan: "StepPlan") -> None:
        self._chunks = list(plan.sends)
        self._step_tokens = plan.num_tokens
        self._groups = {}
        self._last_layer_at = None
        self._step_start = None
        with self._lock:
            for chunk in self._chunks:
                out = self._transfer(chunk.transfer_id)
                out.request_id = chunk.request_id
                out.mode = chunk.mode or self.settings.mode
                out.fault = chunk.fault if self.settings.fault_injection else None
            for finished in plan.finished_sends:
                self._finish(finished)
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
            self.compute.observe(now - self._last_layer_at, self._step_tokens)
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
        with self._lock:
            for chunk in self._chunks:
                out = self._transfers[chunk.transfer_id]
                if chunk.is_last:
                    # On a device only the pass's queueing ended: the submit thread moves
                    # this to when the last layer's event completes (`_timed`), unless it
                    # has already (the device was done before this hook ran).
                    if not out.forward_end_measured:
                        out.forward_end, out.forward_end_wall = now, wall
                    out.all_queued = True
                    self._settle(out)
        self._chunks = []

    def _start_step(self, now: float) -> None:
        self._plan_step()
        if self.mark is not None:
            self._step_start = StepStart(self.mark(), self._step_tokens)
            return
        with self._lock:
            for chunk in self._chunks:
                out = self._transfers[chunk.transfer_id]
                if out.first_layer_at is None:
                    out.first_layer_at = now

    def _mark(self) -> Event | None:
        return self.mark() if self.mark is not None else None

    def _plan_step(self) -> None:
        modes = {self._transfers[c.transfer_id].mode for c in self._chunks}
        for mode in modes:
            if mode == "group" and self.settings.group_size == "auto":
                self._groups[mode] = self._fitted_plan(mode)
            else:
                size = 1 if self.settings.group_size == "auto" else int(self.settings.group_size)
                self._groups[mode] = plan_groups(self.num_layers, mode, size)

    def _fitted_plan(self, mode: str) -> list[tuple[int, int]]:
        chunks = [c for c in self._chunks if self._transfers[c.transfer_id].mode == mode]
        tokens = sum(c.end - c.start for c in chunks)
        layer_bytes = sum(c.end_block - c.first_block for c in chunks) * self.layouts[0].block_bytes
        link = self.link_cost.model
        compute = self.compute.layer_s(self._step_tokens)
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
            with self._lock:
                out = self._transfers[chunk.transfer_id]
                if out.mode != mode:
                    continue
                out.queued += 1
            self._jobs.put(Job(chunk.transfer_id, first, last, chunk.first_block,
                               chunk.block_ids[chunk.first_block:chunk.end_block], event,
                               self._step_start,
                               chunk.is_last and last == self.num_layers - 1))

    def _release_preempted(self, request_id: str) -> None:
        """A preempted request's blocks are about to be reused: the engine step must not
        wait on the network for its writes, so a transfer with writes still running is
        failed (decode recomputes, and waits out those writes before reusing its own
        blocks: whatever they carry then is never read). One with nothing in flight
        stays: the request will be prefilled (and sent) again from its first token."""
        with self._lock:
            for out in list(self._transfers.values()):
                if out.request_id != request_id:
                    continue
                out.backlog.clear()
                out.first_layer_at, out.forward_end_measured = None, False
                if out.in_flight or out.queued:
                    self._fail(out, "prefill was preempted while its writes were running")
                    self._settle(out)

    # -- the submit thread --------------------------------------------------
    def _submit_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write_job(job)
            except Exception as err:
                # A bug: the device's and the network's errors are handled where they
                # happen. Only this job's transfer fails; the other transfers need this
                # thread to go on.
                logger.exception("epd-kv: transfer %s: writing layers %d-%d failed",
                                 job.transfer_id, job.first_layer, job.last_layer)
                self._job_failed(job, f"writing layers {job.first_layer}-{job.last_layer} "
                                      f"failed: {type(err).__name__}: {err}")

    def _write_job(self, job: Job) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()  # blocking: sleeps until the kernels ran
                self._timed(job)
        except Exception as err:  # the device failed the kernels that wrote the KV
            reason = f"waiting for layers {job.first_layer}-{job.last_layer} on the " \
                     f"device failed: {err}"
            logger.error("epd-kv: transfer %s: %s", job.transfer_id, reason)
            self._job_failed(job, reason)
            return
        self._submit(job)

    def _timed(self, job: Job) -> None:
        """What a device event that just completed tells: the per-layer compute time
        (from the step's first layer to the last one), and when a request's forward
        pass really ended (this thread was waiting on it, so now is that moment)."""
        if job.step is None or job.last_layer != self.num_layers - 1:
            return
        now, wall = time.perf_counter(), time.time()
        seconds = elapsed_s(job.step.event, job.ready)
        if not job.step.timed and self.num_layers > 1:
            job.step.timed = True
            self.compute.observe(seconds / (self.num_layers - 1), job.step.num_tokens)
        with self._lock:
            out = self._transfers.get(job.transfer_id)
            if out is None:
                return
            if out.first_layer_at is None:
                out.first_layer_at = now - seconds
            if job.ends_forward:
                out.forward_end, out.forward_end_wall = now, wall
                out.forward_end_measured = True

    def _job_failed(self, job: Job, reason: str) -> None:
        """A job that will never be written: its transfer fails (decode recomputes the
        prompt) instead of settling as done with layers missing."""
        with self._lock:
            out = self._transfers.get(job.transfer_id)
            if out is not None:
                if job.queued:
                    out.queued -= 1
                    job.queued = False
                self._fail(out, reason)
                self._settle(out)

    def _submit(self, job: Job) -> None:
        """Start the job's write, or park it until decode's reservation arrives. The
        network is never touched under the lock, which the model's thread takes."""
        with self._lock:
            out = self._transfers.get(job.transfer_id)
            if out is None:
                return
            out.queued -= 1
            job.queued = False
            if out.outcome is not None:
                self._settle(out)
                return
            if out.reservation is None:
                out.backlog.append(job)
                return
            # From here the job counts as in flight: the request's blocks stay pinned
            # until its write has ended, whatever happens below.
            out.in_flight += 1
            res, fault = out.reservation, out.fault
            pending = sum(f.nbytes for f in self._in_flight.values())
        try:
            flight = self._start_write(job, res, fault, pending)
        except Exception as err:
            unfinished = None  # segments of the write that may still be running
            if isinstance(err, TransferError):
                unfinished = err.unfinished
            else:
                logger.exception("epd-kv: submitting a write of transfer %s failed",
                                 job.transfer_id)
            self.deadlines.failed(res.te_session)
            with self._lock:
                self._write_failed(out, f"write of layers {job.first_layer}-{job.last_layer} "
                                        f"failed: {err}", unfinished)
            return
        with self._lock:
            if flight is None:  # decode had these blocks cached already
                out.in_flight -= 1
                out.groups += 1
                self._settle(out)
                return
            self._in_flight[id(flight.write)] = flight
        self._writes.put(flight)

    def _start_write(self, job: Job, res: msg.Reserve, fault: str | None,
                     pending: int) -> InFlight | None:
        """Submit the job's write into decode's reserved blocks, with a deadline sized
        to its bytes and the `pending` bytes already in flight; None if decode has all
        these blocks already. Nothing is computed after the submit, so an error here
        means nothing of the write is running, or the `TransferError` says what is."""
        pairs = [(src, res.block_ids[index - res.first_block])
                 for index, src in enumerate(job.block_ids, start=job.first_block)
                 if 0 <= index - res.first_block < len(res.block_ids)]
        runs = block_runs([s for s, _ in pairs], [d for _, d in pairs])
        srcs, dsts, lens = segments(self.layouts, res.layout,
                                    range(job.first_layer, job.last_layer + 1), runs)
        if not lens:
            return None
        if fault == "fail_write":
            dsts = [_UNREGISTERED_ADDRESS] * len(dsts)
        nbytes = sum(lens)
        timeout = self.deadlines.timeout_s(res.te_session, self.link_cost.model.transfer_s(
            pending + nbytes))
        write = self.link.submit(res.te_session, srcs, dsts, lens)
        now = time.perf_counter()
        return InFlight(job.transfer_id, write, nbytes, job.first_layer, job.last_layer,
                        now, now + timeout, res.te_session)

    # -- the completion thread ----------------------------------------------
    def _complete_loop(self) -> None:
        poll_until_closed(self._writes, self._landed)

    def _landed(self, flight: InFlight) -> bool:
        """Look at one write in flight; True once it has ended (landed or failed)."""
        now = time.perf_counter()
        with self._lock:
            out = self._transfers.get(flight.transfer_id)
        if out is not None and out.fault == "stall" and out.groups == 0 \
                and now < flight.deadline + 0.5:
            return False  # a write that hangs past its deadline, then lands
        unfinished = None
        try:
            if not self.link.done(flight.write):
                return False
            error = None
        except TransferError as err:
            error, unfinished = str(err), err.unfinished
        except Exception as err:  # never let one odd answer end the completion thread
            logger.exception("epd-kv: checking a write of transfer %s failed",
                             flight.transfer_id)
            error = f"{type(err).__name__}: {err}"
        if error is None:
            self.deadlines.landed(flight.session)
        else:
            self.deadlines.failed(flight.session)
        with self._lock:
            self._in_flight.pop(id(flight.write), None)
            out = self._transfers.get(flight.transfer_id)
            if out is None:
                return True
            if error is not None:
                self._write_failed(out, f"write of layers {flight.first_layer}-"
                                        f"{flight.last_layer} failed: {error}", unfinished)
                return True
            out.in_flight -= 1
            if out.outcome is None:
                self.link_cost.observe(flight.nbytes, now - flight.submitted)
                out.nbytes += flight.nbytes
                out.groups += 1
                out.intervals.append((flight.submitted, now))
                self._post(out, msg.Landed(out.transfer_id, flight.first_layer,
                                           flight.last_layer, flight.nbytes))
            self._settle(out)
        return True

    # -- the drain thread -----------------------------------------------------
    def _drained(self, transfer_id: str) -> None:
        """A failed write's last segments have ended: it is no longer in flight."""
        with self._lock:
            out = self._transfers.get(transfer_id)
            if out is not None:
                out.in_flight -= 1
                self._settle(out)

    # -- the side-channel thread --------------------------------------------
    def _on_message(self, peer: str, payload: bytes) -> None:
        message = msg.decode_to_prefill(payload)
        if isinstance(message, msg.Reserve):
            self._on_reserve(peer, message)
        elif isinstance(message, msg.Ping):
            with self._lock:
                known = [t for t in message.transfer_ids if t in self._transfers]
            self.channel.post(peer, msg.encode(msg.Pong(self.incarnation, known)))
        elif isinstance(message, msg.Cancel):
            with self._lock:
                out = self._transfers.get(message.transfer_id)
                if out is None:
                    # Decode gave up before this worker saw the request (or after it was
                    # done): its chunks, if they come, are settled at once.
                    if message.transfer_id not in self._ended:
                        self._ended.add(message.transfer_id, "cancelled", "cancelled by decode")
                    self.channel.post(peer, msg.encode(msg.Released(message.transfer_id)))
                    return
                out.peer = peer
                if out.outcome is None:
                    out.outcome, out.reason = "cancelled", "cancelled by decode"
                    out.announced_failure = True  # decode knows: it asked
                out.backlog.clear()
                self._settle(out)

    def _on_reserve(self, peer: str, res: msg.Reserve) -> None:
        error = None
        if res.version != msg.PROTOCOL_VERSION:
            error = f"protocol version {res.version}, prefill speaks {msg.PROTOCOL_VERSION}"
        elif res.block_size != self.block_size:
            error = f"block size {res.block_size}, prefill uses {self.block_size}"
        else:
            error = check_compatible(self.layouts, res.layout, self.layout_name,
                                     res.layout_name)
        backlog: list[Job] = []
        with self._lock:
            out = self._transfers.get(res.transfer_id)
            # Over here already: a decode instance retrying a request another one
            # started, or a transfer this worker failed before the reservation came
            # (nobody to tell then). Decode computes the prompt itself, now.
            ended = self._ended.get(res.transfer_id) if out is None else out
            if not error and ended is not None and ended.outcome is not None:
                how = f"{ended.outcome}: {ended.reason}" if ended.reason else ended.outcome
                error = f"transfer {res.transfer_id} already ended on this prefill ({how})"
            if not error:
                out = self._transfers.setdefault(res.transfer_id, Outgoing(res.transfer_id))
                out.reservation, out.peer = res, peer
                backlog, out.backlog = out.backlog, []
                out.queued += len(backlog)
                for job in backlog:
                    job.queued = True
        if error:
            logger.warning("epd-kv: refused reservation %s: %s", res.transfer_id, error)
            self.channel.post(peer, msg.encode(msg.Ack(res.transfer_id, self.incarnation, error)))
            return
        self.channel.post(peer, msg.encode(msg.Ack(res.transfer_id, self.incarnation)))
        for job in backlog:
            self._jobs.put(job)

    def _on_tick(self) -> None:
        now_perf, now = time.perf_counter(), time.monotonic()
        with self._lock:
            for flight in list(self._in_flight.values()):
                out = self._transfers.get(flight.transfer_id)
                if out is not None and out.outcome is None and now_perf > flight.deadline:
                    self._fail(out, f"write of {flight.nbytes} B not done after "
                                    f"{flight.deadline - flight.submitted:.2f}s")
                    self._settle(out)
            limit = self.settings.reservation_timeout_s
            for out in list(self._transfers.values()):
                if out.outcome is not None:
                    continue
                if out.reservation is None and out.finished_at is not None \
                        and now - out.finished_at > limit:
                    self._fail(out, f"no decode reservation {limit:.0f}s after prefill")
                elif out.request_id is None and now - out.created > limit:
                    self._fail(out, f"the request did not reach this prefill instance "
                                    f"within {limit:.0f}s of the reservation")
                else:
                    continue
                self._settle(out)
            self._ended.expire(now)

    # -- state changes (caller holds the lock) ------------------------------
    def _transfer(self, transfer_id: str) -> Outgoing:
        """The transfer's record, made on first sight; one this worker already ended
        comes back ended, so its jobs settle without waiting for anything."""
        out = self._transfers.get(transfer_id)
        if out is None:
            out = self._transfers[transfer_id] = Outgoing(transfer_id)
            ended = self._ended.get(transfer_id)
            if ended is not None:
                out.outcome, out.reason = ended.outcome, ended.reason
        return out

    def _finish(self, finished: msg.FinishedSend) -> None:
        out = self._transfer(finished.transfer_id)
        out.request_id = finished.request_id
        out.finished_at = time.monotonic()
        if finished.aborted or not out.all_queued:
            out.backlog.clear()
            self._fail(out, "the prefill request was aborted")
        self._settle(out)

    def _fail(self, out: Outgoing, reason: str) -> None:
        if out.outcome is not None:
            return
        out.outcome, out.reason = "failed", reason
        out.backlog.clear()
        self.stats.record("send_failures")
        logger.warning("epd-kv: transfer %s (request %s) failed: %s", out.transfer_id,
                       out.request_id, reason)
        if out.peer:
            out.announced_failure = True
            self._post(out, msg.Failed(out.transfer_id, reason, out.in_flight))

    def _settle(self, out: Outgoing) -> None:
        """Send what decode should hear next and release the request's blocks once
        nothing of it is in flight."""
        if (out.outcome is None and out.all_queued and out.queued == 0
                and out.in_flight == 0 and not out.backlog and out.reservation is not None):
            out.outcome = "done"
            stats = self._transfer_stats(out)
            self.stats.record_send(stats.nbytes, stats.busy_s, stats.exposed_s, stats.groups)
            self._post(out, msg.Done(out.transfer_id, stats))
        if not out.settled:
            return
        if out.outcome in ("failed", "cancelled") and out.announced_failure and out.peer:
            self._post(out, msg.Released(out.transfer_id))
            out.announced_failure = False
        if out.finished_at is not None and out.request_id is not None:
            self._finished_sending.add(out.request_id)
        elif not (out.request_id is None and out.outcome != "done"):
            return  # the request is still running here
        # Its blocks are released (finished), or it was a reservation nobody will use.
        del self._transfers[out.transfer_id]
        self._ended.add(out.transfer_id, out.outcome, out.reason)

    def _write_failed(self, out: Outgoing, reason: str, unfinished: Write | None) -> None:
        """One of the transfer's writes failed. If some of its segments may still be
        running (`unfinished`), it stays in flight until the drain thread has seen them
        end: the request's blocks stay pinned, and decode, told so, waits for
        `Released` before reusing its own."""
        if unfinished is None:
            out.in_flight -= 1
        else:
            self.drainer.put(out.transfer_id, unfinished)  # `_drained` when they end
        self._fail(out, reason)
        self._settle(out)

    def _transfer_stats(self, out: Outgoing) -> msg.TransferStats:
        starts = [s for s, _ in out.intervals] or [out.forward_end or 0.0]
        ends = [e for _, e in out.intervals] or [out.forward_end or 0.0]
        forward_end = out.forward_end or max(ends)
        return msg.TransferStats(
            mode=out.mode, nbytes=out.nbytes, groups=out.groups,
            busy_s=busy_time(out.intervals), span_s=max(ends) - min(starts),
            exposed_s=max(0.0, max(ends) - forward_end),
            prefill_s=forward_end - (out.first_layer_at or forward_end),
            forward_end=out.forward_end_wall)

    def _post(self, out: Outgoing, message) -> None:
        if out.peer:
            self.channel.post(out.peer, msg.encode(message))

    # -- the model's thread, after the step ------------------------------------
    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed: finished, and nothing in flight."""
        with self._lock:
            done, self._finished_sending = self._finished_sending, set()
        return done
