"""Prefill side: waiting out the segments of failed writes, on a thread of its own.

Runs in a prefill engine's worker process, for the sender (sender_complete.py). A write fails as soon as one
of its segments fails or is refused, but its other segments may still be running and
reading the request's blocks, which must stay pinned until they have ended. That can
take up to the transfer engine's own timeout (`DRAIN_TIMEOUT_S`); on the submit or
completion thread it would hold up every other transfer's writes, past their deadlines.
Here every failed write is polled without blocking, each with its own deadline, so a
stuck one delays no other.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from epd_serve.connectors.epd_kv.transfer import DRAIN_TIMEOUT_S, POLL_S, Link, Write

T = TypeVar("T")

logger = logging.getLogger("vllm.epd_serve.kv.drain")



def poll_until_closed(arrivals: queue.Queue, done_with: Callable[[T], bool]) -> None:
    """Take items from `arrivals` and look at each pending one every POLL_S with
    `done_with` (True: drop it) until a None arrives. Blocks only while nothing is
    pending. The completion thread and the drain thread both run on this."""
    pending: list[T] = []
    while True:
        taken: list[T | None] = []
        try:
            taken.append(arrivals.get(block=not pending))
            while True:
                taken.append(arrivals.get_nowait())
        except queue.Empty:
            pass
        if None in taken:
            return
        pending += taken
        pending = [item for item in pending if not done_with(item)]
        if pending:
            time.sleep(POLL_S)

@dataclasses.dataclass
class Draining:
    transfer_id: str
    write: Write
    deadline: float  # time.monotonic(): past it the write counts as ended anyway


class Drainer:
    """Calls `on_drained(transfer_id, ended)` once a failed write's segments have all
    ended (True), or after `timeout_s` without knowing (False): the request's own blocks
    are released then, but decode is not told `Released` (its blocks stay fenced: a
    segment still running may land in them)."""

    def __init__(self, link: Link, on_drained: Callable[[str, bool], None],
                 timeout_s: float = DRAIN_TIMEOUT_S):
        self.link = link
        self.on_drained = on_drained
        self.timeout_s = timeout_s
        self._arrivals: queue.Queue[Draining | None] = queue.Queue()

    def start(self) -> None:
        threading.Thread(target=self._run, name="epd-kv-drain", daemon=True).start()

    def close(self) -> None:
        self._arrivals.put(None)

    def put(self, transfer_id: str, write: Write) -> None:
        self._arrivals.put(Draining(transfer_id, write, time.monotonic() + self.timeout_s))

    def _run(self) -> None:
        poll_until_closed(self._arrivals, self._done_with)

    def _done_with(self, draining: Draining) -> bool:
        """Look at one failed write; True once it is done with (and reported)."""
        ended = False
        try:
            ended = self.link.segments_ended(draining.write)
            if not ended:
                if time.monotonic() < draining.deadline:
                    return False
                logger.error("epd-kv: transfer %s: %d segment(s) of a failed write still "
                             "running after %.0fs; this request's blocks are released, "
                             "decode's stay fenced", draining.transfer_id,
                             len(draining.write.ids) - draining.write.checked, self.timeout_s)
        except Exception:  # one odd answer must not leave the transfer pinned for good
            logger.exception("epd-kv: transfer %s: checking a failed write's segments failed",
                             draining.transfer_id)
        try:
            self.on_drained(draining.transfer_id, ended)
        except Exception:  # nor end this thread, which the other failed writes need
            logger.exception("epd-kv: transfer %s: settling a drained write failed",
                             draining.transfer_id)
        return True
