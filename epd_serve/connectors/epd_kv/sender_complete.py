"""Prefill side: ending the writes in flight, on the completion and drain threads.

Runs in a prefill engine's worker process. `Completer.run` is the completion thread
(started by sender.py, after it made the worker's device its own): it polls the writes
the submit thread handed over in the transfer table (sleeping between looks, never
spinning), tells decode what landed, and settles the transfer, which sends `Done` with
the numbers once its last write has landed. `Completer.drained` runs on the drain
thread (drain.py): a failed write whose last segments have ended is no longer in
flight. Both end a write, so both live here.
"""

from __future__ import annotations

import logging
import time

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.drain import poll_until_closed
from epd_serve.connectors.epd_kv.sender_table import InFlight, TransferTable
from epd_serve.connectors.epd_kv.transfer import Link, TransferError, Write

# The sender's one logger, whichever of its modules logs: operators filter on its name.
logger = logging.getLogger("vllm.epd_serve.kv.sender")


class Completer:
    def __init__(self, table: TransferTable, link: Link):
        self.table = table
        self.link = link

    # -- the completion thread ----------------------------------------------
    def run(self) -> None:
        poll_until_closed(self.table.writes, self._landed)

    def _landed(self, flight: InFlight) -> bool:
        """Look at one write in flight; True once it has ended (landed or failed)."""
        now = time.perf_counter()
        table = self.table
        with table.lock:
            out = table.transfers.get(flight.transfer_id)
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
            table.deadlines.landed(flight.session)
        else:
            table.deadlines.failed(flight.session)
        with table.lock:
            self._ended(flight, now, error, unfinished)
        return True

    def _ended(self, flight: InFlight, now: float, error: str | None,
               unfinished: Write | None) -> None:
        """(Lock held.) The write has landed (`error` None) or failed: count it out of
        its transfer, tell decode what landed, and settle the transfer."""
        table = self.table
        table.in_flight.pop(id(flight.write), None)
        out = table.transfers.get(flight.transfer_id)
        if out is None:
            return
        if error is not None:
            table.write_failed(out, f"write of layers {flight.first_layer}-"
                                    f"{flight.last_layer} failed: {error}", unfinished)
            return
        out.in_flight -= 1
        if out.outcome is None:
            table.link_cost.observe(flight.nbytes, now - flight.submitted)
            out.nbytes += flight.nbytes
            out.groups += 1
            out.intervals.append((flight.submitted, now))
            table.post(out, msg.Landed(out.transfer_id, flight.first_layer,
                                       flight.last_layer, flight.nbytes))
        table.settle(out)

    # -- the drain thread -----------------------------------------------------
    def drained(self, transfer_id: str, ended: bool) -> None:
        """A failed write's last segments have ended (or are given up on: `ended`
        False, and decode is then never told its writes ended): no longer in flight."""
        with self.table.lock:
            out = self.table.transfers.get(transfer_id)
            if out is not None:
                out.in_flight -= 1
                out.segments_unknown |= not ended
                self.table.settle(out)
