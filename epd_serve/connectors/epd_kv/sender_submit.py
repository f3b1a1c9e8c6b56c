"""Prefill side: starting each job's write into decode's memory, on the submit thread.

Runs in a prefill engine's worker process, on the submit thread (started by sender.py,
after it made the worker's device its own). It takes the jobs the model's thread and
the side-channel thread queue in the transfer table, waits until a job's layers are
written on the device (a blocking event, events.py; CPU kernels are done when they
return), learns the per-layer compute time from those events, then starts the job's
write and hands it to the completion thread, or parks the job on its transfer until
decode's reservation has arrived. A job that cannot be written, for whatever reason,
fails its transfer (decode recomputes), never settles it as done, and the thread goes
on with the next job. The network is never touched under the table's lock.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.events import elapsed_s
from epd_serve.connectors.epd_kv.layout import LayerLayout, block_runs, segments
from epd_serve.connectors.epd_kv.sender_table import InFlight, Job, Outgoing, TransferTable
from epd_serve.connectors.epd_kv.transfer import Link, TransferError

# The sender's one logger, whichever of its modules logs: operators filter on its name.
logger = logging.getLogger("vllm.epd_serve.kv.sender")

# Destination used by the "fail_write" fault: an address no peer has registered, so
# the transfer engine itself rejects the write.
_UNREGISTERED_ADDRESS = 4096


class Submitter:
    def __init__(self, table: TransferTable, link: Link, layouts: list[LayerLayout]):
        self.table = table
        self.link = link
        self.layouts = layouts
        self.num_layers = len(layouts)

    def run(self) -> None:
        """The submit thread: one job after the other until `None` (closing) comes."""
        while (job := self.table.jobs.get()) is not None:
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
        # An attribute looked up per job: `Sender._submit` can put another step in its
        # place (a test injects a bug there).
        self.submit(job)

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
            self.table.compute.observe(seconds / (self.num_layers - 1), job.step.num_tokens)
        with self.table.lock:
            out = self.table.transfers.get(job.transfer_id)
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
        table = self.table
        with table.lock:
            out = table.transfers.get(job.transfer_id)
            if out is not None:
                if job.queued:
                    out.queued -= 1
                    job.queued = False
                table.fail(out, reason)
                table.settle(out)

    def submit(self, job: Job) -> None:
        """Start the job's write, or park it until decode's reservation arrives. The
        network is never touched under the lock, which the model's thread takes."""
        table = self.table
        with table.lock:
            taken = self._take(job)
            if taken is None:
                return
            out, res, fault, pending = taken
        try:
            flight = self._start_write(job, res, fault, pending)
        except Exception as err:
            unfinished = None  # segments of the write that may still be running
            if isinstance(err, TransferError):
                unfinished = err.unfinished
            else:
                logger.exception("epd-kv: submitting a write of transfer %s failed",
                                 job.transfer_id)
            table.deadlines.failed(res.te_session)
            with table.lock:
                table.write_failed(out, f"write of layers {job.first_layer}-{job.last_layer} "
                                        f"failed: {err}", unfinished)
            return
        with table.lock:
            if flight is None:  # decode had these blocks cached already
                out.in_flight -= 1
                out.groups += 1
                table.settle(out)
                return
            table.in_flight[id(flight.write)] = flight
        table.writes.put(flight)

    def _take(self, job: Job) -> tuple[Outgoing, msg.Reserve, str | None, int] | None:
        """(Lock held.) Take the job off its transfer's queue; what its write needs
        (the transfer, decode's reservation, the fault to inject, the bytes already in
        flight), or None when it is not to be written now (settled or parked)."""
        table = self.table
        out = table.transfers.get(job.transfer_id)
        if out is None:
            return None
        out.queued -= 1
        job.queued = False
        if out.outcome is not None:
            table.settle(out)
            return None
        if out.reservation is None:
            out.backlog.append(job)
            return None
        age = time.monotonic() - (out.reserved_at or time.monotonic())
        if age > table.settings.stale_reservation_s:
            # This process was stopped (or stalled) that long: decode may have given
            # these blocks to another request by now. No write, ever, into them.
            table.stats.record("stale_writes_refused")
            table.fail(out, f"its reservation is {age:.0f}s old: decode holds blocks for a "
                            f"silent prefill {table.settings.fence_max_s:.0f}s at most")
            table.settle(out)
            return None
        # From here the job counts as in flight: the request's blocks stay pinned
        # until its write has ended, whatever happens below.
        out.in_flight += 1
        pending = sum(f.nbytes for f in table.in_flight.values())
        return out, out.reservation, out.fault, pending

    def _start_write(self, job: Job, res: msg.Reserve, fault: str | None,
                     pending: int) -> InFlight | None:
        """Submit the job's write into decode's reserved blocks, with a deadline sized
        to its bytes and the `pending` bytes already in flight; None if decode has all
        these blocks already. Nothing is computed after the submit, so an error here
        means nothing of the write is running, or the `TransferError` says what is."""
        pairs = [(src, res.block_ids[index - res.first_block])
                 for index, src in enumerate(job.block_ids, start=job.first_block)
                 if 0 <= index - res.first_block < len(res.block_ids)]
        if fault == "skip_block":  # decode's first reserved block keeps whatever it held
            pairs = [(src, dst) for src, dst in pairs if dst != res.block_ids[0]]
        runs = block_runs([s for s, _ in pairs], [d for _, d in pairs])
        srcs, dsts, lens = segments(self.layouts, res.layout,
                                    range(job.first_layer, job.last_layer + 1), runs)
        if not lens:
            return None
        if fault == "fail_write":
            dsts = [_UNREGISTERED_ADDRESS] * len(dsts)
        nbytes = sum(lens)
        timeout = self.table.deadlines.timeout_s(
            res.te_session, self.table.link_cost.model.transfer_s(pending + nbytes))
        if fault == "stop_process":
            # The worst moment for a pause (tests, the chaos soak): its reservation was
            # found fresh, its write not yet handed to the transfer engine. Whoever
            # injects it sends SIGCONT.
            os.kill(os.getpid(), signal.SIGSTOP)
        write = self.link.submit(res.te_session, srcs, dsts, lens)
        now = time.perf_counter()
        return InFlight(job.transfer_id, write, nbytes, job.first_layer, job.last_layer,
                        now, now + timeout, res.te_session)
