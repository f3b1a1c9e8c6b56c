"""Prefill side: the transfer table, the one state the sender's threads share.

Runs in a prefill engine's worker process, on no thread of its own: every thread of
the sender (sender.py lists them) reads and changes transfers only through this table,
under its `lock`. It holds each transfer's record (`Outgoing`), the writes in flight,
the transfers ended lately, the requests whose blocks may be freed, the two queues that
hand jobs and writes from one thread to the next, and the estimates more than one
thread uses (link cost, layer compute, write deadlines). Its state changes (`fail`,
`settle`, ...) run with the lock held by their caller and post what decode should hear
while holding it, so one transfer's messages leave in the order its state changed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.channel import Channel
from epd_serve.connectors.epd_kv.deadlines import WriteDeadlines
from epd_serve.connectors.epd_kv.drain import Drainer
from epd_serve.connectors.epd_kv.events import Event
from epd_serve.connectors.epd_kv.grouping import ComputeModel, LinkEstimator, LinkModel
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.transfer import Write

if TYPE_CHECKING:  # vLLM classes; this module itself stays importable without vLLM
    from epd_serve.connectors.epd_kv.stats import EPDKVStats

# The sender's one logger, whichever of its modules logs: operators filter on its name.
logger = logging.getLogger("vllm.epd_serve.kv.sender")

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
    reserved_at: float | None = None  # time.monotonic() when the reservation came
    # A failed write was given up on with segments maybe still running: decode is not
    # told `Released` (its blocks stay fenced until its own bound).
    segments_unknown: bool = False
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
    writes_may_run: bool = False  # a failed write given up on: still "known" to decode


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

    def add(self, transfer_id: str, outcome: str, reason: str,
            writes_may_run: bool = False) -> None:
        self._ended.pop(transfer_id, None)  # an entry made again is the newest
        self._ended[transfer_id] = Ended(outcome, reason, time.monotonic(), writes_may_run)
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


def transfer_stats(out: Outgoing) -> msg.TransferStats:
    """The numbers `Done` carries for a transfer whose writes have all landed."""
    starts = [s for s, _ in out.intervals] or [out.forward_end or 0.0]
    ends = [e for _, e in out.intervals] or [out.forward_end or 0.0]
    forward_end = out.forward_end or max(ends)
    return msg.TransferStats(
        mode=out.mode, nbytes=out.nbytes, groups=out.groups,
        busy_s=busy_time(out.intervals), span_s=max(ends) - min(starts),
        exposed_s=max(0.0, max(ends) - forward_end),
        prefill_s=forward_end - (out.first_layer_at or forward_end),
        forward_end=out.forward_end_wall)


class TransferTable:
    """The transfers of one prefill worker and the operations on them. Methods below
    `attach` expect the caller to hold `lock`, except `take_finished`."""

    def __init__(self, settings: Settings, stats: "EPDKVStats", link_model: LinkModel,
                 results_ready: threading.Event | None = None):
        self.settings = settings
        self.stats = stats
        self.lock = threading.Lock()
        self.transfers: dict[str, Outgoing] = {}
        self.ended = EndedTransfers(settings.reservation_timeout_s)
        self.in_flight: dict[int, InFlight] = {}  # by id(write)
        self.finished_sending: set[str] = set()
        # Set when a request's blocks become free to go (the worker's empty steps wait
        # on it: worker.py).
        self.results_ready = results_ready or threading.Event()
        # Model's thread and side-channel thread -> submit thread -> completion thread.
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.writes: queue.Queue[InFlight | None] = queue.Queue()
        # What the threads learn for one another, each written by one thread only: the
        # link cost by the completion thread (it replaces its frozen model whole, so
        # reading `.model` needs no lock), the layer compute by the model's thread on
        # the CPU or the submit thread on a device; the deadlines keep their own lock.
        self.deadlines = WriteDeadlines(settings)
        self.link_cost = LinkEstimator(link_model)
        self.compute = ComputeModel()
        # Set by `attach`: both are made after the table, as their callbacks use it.
        self.channel: Channel | None = None
        self.drainer: Drainer | None = None

    def attach(self, channel: Channel, drainer: Drainer) -> None:
        """Where decode's messages go and failed writes wait out their segments."""
        self.channel, self.drainer = channel, drainer

    # -- state changes (caller holds the lock) ------------------------------
    def record(self, transfer_id: str) -> Outgoing:
        """The transfer's record, made on first sight; one this worker already ended
        comes back ended, so its jobs settle without waiting for anything."""
        out = self.transfers.get(transfer_id)
        if out is None:
            out = self.transfers[transfer_id] = Outgoing(transfer_id)
            ended = self.ended.get(transfer_id)
            if ended is not None:
                out.outcome, out.reason = ended.outcome, ended.reason
        return out

    def finish(self, finished: msg.FinishedSend) -> None:
        out = self.record(finished.transfer_id)
        out.request_id = finished.request_id
        out.finished_at = time.monotonic()
        if finished.aborted or not out.all_queued:
            out.backlog.clear()
            self.fail(out, "the prefill request was aborted")
        self.settle(out)

    def fail(self, out: Outgoing, reason: str) -> None:
        if out.outcome is not None:
            return
        out.outcome, out.reason = "failed", reason
        out.backlog.clear()
        self.stats.record("send_failures")
        logger.warning("epd-kv: transfer %s (request %s) failed: %s", out.transfer_id,
                       out.request_id, reason)
        if out.peer:
            out.announced_failure = True
            self.post(out, msg.Failed(out.transfer_id, reason, out.in_flight))

    def settle(self, out: Outgoing) -> None:
        """Send what decode should hear next and release the request's blocks once
        nothing of it is in flight."""
        if (out.outcome is None and out.all_queued and out.queued == 0
                and out.in_flight == 0 and not out.backlog and out.reservation is not None):
            out.outcome = "done"
            stats = transfer_stats(out)
            self.stats.record_send(stats.nbytes, stats.busy_s, stats.exposed_s, stats.groups)
            self.post(out, msg.Done(out.transfer_id, stats))
        if not out.settled:
            return
        if out.outcome in ("failed", "cancelled") and out.announced_failure and out.peer \
                and not out.segments_unknown:
            self.post(out, msg.Released(out.transfer_id))
            out.announced_failure = False
        if out.finished_at is not None and out.request_id is not None:
            self.finished_sending.add(out.request_id)
            self.results_ready.set()
        elif not (out.request_id is None and out.outcome != "done"):
            return  # the request is still running here
        # Its blocks are released (finished), or it was a reservation nobody will use.
        del self.transfers[out.transfer_id]
        self.ended.add(out.transfer_id, out.outcome, out.reason, out.segments_unknown)

    def known(self, transfer_id: str) -> bool:
        """Whether decode must still count this transfer as one whose writes may land:
        running here, or ended with a write given up on while it may still run."""
        ended = self.ended.get(transfer_id)
        return transfer_id in self.transfers or (ended is not None and ended.writes_may_run)

    def write_failed(self, out: Outgoing, reason: str, unfinished: Write | None) -> None:
        """One of the transfer's writes failed. If some of its segments may still be
        running (`unfinished`), it stays in flight until the drain thread has seen them
        end: the request's blocks stay pinned, and decode, told so, waits for
        `Released` before reusing its own."""
        if unfinished is None:
            out.in_flight -= 1
        else:
            self.drainer.put(out.transfer_id, unfinished)  # `drained` when they end
        self.fail(out, reason)
        self.settle(out)

    def post(self, out: Outgoing, message) -> None:
        if out.peer:
            self.channel.post(out.peer, msg.encode(message))

    # -- the model's thread, after the step ------------------------------------
    def take_finished(self) -> set[str]:
        """Requests whose blocks can be freed: finished, and nothing in flight."""
        with self.lock:
            done, self.finished_sending = self.finished_sending, set()
        return done

    def awaiting(self) -> bool:
        """Whether a finished request's blocks are still held for its writes."""
        with self.lock:
            return any(out.finished_at is not None for out in self.transfers.values())
