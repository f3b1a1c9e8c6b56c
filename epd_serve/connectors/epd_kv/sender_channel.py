"""Prefill side: decode's messages and the timeouts, on the side-channel thread.

Runs in a prefill engine's worker process, on the side channel's I/O thread
(channel.py), which calls `on_message` for each message from decode and `on_tick`
every tick. A reservation (`Reserve`) is checked and acknowledged, and the jobs parked
for it go to the submit thread; one of a transfer this worker already ended is
refused with the reason, so decode recomputes at once. `Ping` says which transfers
this worker still knows; `Cancel` ends one. Every tick fails the writes past their
deadline (sized to the bytes in flight, deadlines.py) and the transfers whose
reservation or request never came.
"""

from __future__ import annotations

import logging
import time

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.layout import LayerLayout, check_compatible
from epd_serve.connectors.epd_kv.sender_table import Job, Outgoing, TransferTable

# The sender's one logger, whichever of its modules logs: operators filter on its name.
logger = logging.getLogger("vllm.epd_serve.kv.sender")


class DecodeMessages:
    def __init__(self, table: TransferTable, layouts: list[LayerLayout], block_size: int,
                 layout_name: str, incarnation: str):
        self.table = table
        self.layouts = layouts
        self.block_size = block_size
        self.layout_name = layout_name
        self.incarnation = incarnation  # tells decode a restarted prefill from this one

    def on_message(self, peer: str, payload: bytes) -> None:
        message = msg.decode_to_prefill(payload)
        if isinstance(message, msg.Reserve):
            self._on_reserve(peer, message)
        elif isinstance(message, msg.Ping):
            with self.table.lock:
                known = [t for t in message.transfer_ids if self.table.known(t)]
            self._reply(peer, msg.Pong(self.incarnation, known))
        elif isinstance(message, msg.Cancel):
            self._on_cancel(peer, message)

    def _on_cancel(self, peer: str, cancel: msg.Cancel) -> None:
        table = self.table
        with table.lock:
            out = table.transfers.get(cancel.transfer_id)
            if out is None:
                # Decode gave up before this worker saw the request (or after it was
                # done): its chunks, if they come, are settled at once.
                if cancel.transfer_id not in table.ended:
                    table.ended.add(cancel.transfer_id, "cancelled", "cancelled by decode")
                self._reply(peer, msg.Released(cancel.transfer_id))
                return
            out.peer = peer
            if out.outcome is None:
                out.outcome, out.reason = "cancelled", "cancelled by decode"
                out.announced_failure = True  # decode knows: it asked
            out.backlog.clear()
            table.settle(out)

    def _on_reserve(self, peer: str, res: msg.Reserve) -> None:
        error = self._incompatibility(res)
        backlog: list[Job] = []
        table = self.table
        with table.lock:
            out = table.transfers.get(res.transfer_id)
            # Over here already: a decode instance retrying a request another one
            # started, or a transfer this worker failed before the reservation came
            # (nobody to tell then). Decode computes the prompt itself, now.
            ended = table.ended.get(res.transfer_id) if out is None else out
            if not error and ended is not None and ended.outcome is not None:
                how = f"{ended.outcome}: {ended.reason}" if ended.reason else ended.outcome
                error = f"transfer {res.transfer_id} already ended on this prefill ({how})"
            if not error and out is not None and out.reservation is not None \
                    and out.reservation != res:
                # One transfer, one set of blocks: a second reservation (another decode
                # request naming the same transfer) is refused, and that request
                # computes its prompt itself; the first keeps its blocks.
                error = f"transfer {res.transfer_id} is already reserved by {out.peer}"
            if not error:
                out = table.transfers.setdefault(res.transfer_id, Outgoing(res.transfer_id))
                out.reservation, out.peer = res, peer
                out.reserved_at = time.monotonic()
                backlog, out.backlog = out.backlog, []
                out.queued += len(backlog)
                for job in backlog:
                    job.queued = True
        if error:
            logger.warning("epd-kv: refused reservation %s: %s", res.transfer_id, error)
            self._reply(peer, msg.Ack(res.transfer_id, self.incarnation, error))
            return
        self._reply(peer, msg.Ack(res.transfer_id, self.incarnation))
        for job in backlog:
            table.jobs.put(job)

    def _incompatibility(self, res: msg.Reserve) -> str | None:
        """Why decode's side cannot take this worker's KV, or None (falsy) if it can."""
        if res.version != msg.PROTOCOL_VERSION:
            return f"protocol version {res.version}, prefill speaks {msg.PROTOCOL_VERSION}"
        if res.block_size != self.block_size:
            return f"block size {res.block_size}, prefill uses {self.block_size}"
        return check_compatible(self.layouts, res.layout, self.layout_name, res.layout_name)

    def _reply(self, peer: str, message) -> None:
        self.table.channel.post(peer, msg.encode(message))

    def on_tick(self) -> None:
        now_perf, now = time.perf_counter(), time.monotonic()
        table = self.table
        with table.lock:
            for flight in list(table.in_flight.values()):
                out = table.transfers.get(flight.transfer_id)
                if out is not None and out.outcome is None and now_perf > flight.deadline:
                    table.fail(out, f"write of {flight.nbytes} B not done after "
                                    f"{flight.deadline - flight.submitted:.2f}s")
                    table.settle(out)
            limit = table.settings.reservation_timeout_s
            for out in list(table.transfers.values()):
                if out.outcome is not None:
                    continue
                if out.reservation is None and out.finished_at is not None \
                        and now - out.finished_at > limit:
                    table.fail(out, f"no decode reservation {limit:.0f}s after prefill")
                elif out.request_id is None and now - out.created > limit:
                    table.fail(out, f"the request did not reach this prefill instance "
                                    f"within {limit:.0f}s of the reservation")
                else:
                    continue
                table.settle(out)
            table.ended.expire(now)
