"""Losing a transfer costs at most that one request, and nothing waits without a bound:
decode learns at once of a transfer prefill failed before the reservation came, gives
up a transfer prefill no longer knows or never finishes, and on prefill one failed
write (its other segments waited out) or one unexpected error holds up no other
transfer. The same sender and receiver as test_epd_kv_transfer.py; every timeout that
is not under test is far out of reach, so only the behaviour under test can end a wait.
"""

from __future__ import annotations

import ctypes
import threading
import time
import types

import pytest

from epd_serve.connectors.epd_kv import messages as msg
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.messages import RecvPlan
from epd_serve.connectors.epd_kv.sender import EndedTransfers, Sender

from .test_epd_kv_failures import link_over
from .test_epd_kv_transfer import (  # noqa: F401  (make_pair is a fixture)
    BLOCK_BYTES,
    BLOCKS,
    Pair,
    acknowledged,
    finish_prefill,
    incoming,
    make_pair,
    prefill,
    recv_plan,
    results,
    send_chunk,
    wait_for,
)

NEVER_S = 60.0  # a timeout no test here may reach
BLOCKED_S = 10.0  # far longer than any step here takes: reaching it means "hung"


class BrokenDevice:
    """Device events whose kernels failed: waiting on one raises, as CUDA does after an
    illegal memory access."""

    def mark(self):
        return self

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def elapsed_time(self, end) -> float:
        return 0.0


def test_a_reservation_of_a_transfer_prefill_already_failed_is_refused_at_once(make_pair):
    pair = make_pair(mark=BrokenDevice().mark, ack_timeout_s=NEVER_S, peer_timeout_s=NEVER_S,
                     reservation_timeout_s=NEVER_S, release_grace_s=NEVER_S)
    prefill(pair)  # the KV never reached memory: the transfer fails, no decode to tell yet
    wait_for(lambda: pair.sender._transfers["t1"].outcome == "failed",
             what="prefill failing the transfer")
    # Prefill's request runs on (it is not finished), so prefill still holds the
    # transfer when decode's reservation arrives: it must answer with the failure.
    pair.receiver.reserve(recv_plan(pair))
    got = results(pair)
    assert got["failed"] == {"d-req"}
    reason = got["reports"]["d-req"]["reason"]
    assert "illegal memory access" in reason, reason
    assert not pair.d_memory.any()


def test_a_transfer_prefill_no_longer_knows_is_given_up(make_pair):
    # Neither silence nor a deadline can end it: prefill answers every ping.
    pair = make_pair(peer_timeout_s=NEVER_S, release_grace_s=NEVER_S)
    post = pair.sender.channel.post

    def losing_done(peer, payload):  # a Done lost on the way (a full queue drops it)
        if not payload or not isinstance(msg.decode_to_decode(payload), msg.Done):
            post(peer, payload)

    pair.sender.channel.post = losing_done
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair)
    finish_prefill(pair)  # prefill is done with it and forgets it
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    got = results(pair)
    assert got["failed"] == {"d-req"}
    assert "no longer knows" in got["reports"]["d-req"]["reason"]


def test_a_transfer_that_never_ends_is_given_up_at_decodes_deadline(make_pair):
    # Prefill is alive and keeps the reservation, but its request never comes (an
    # engine that hangs with its side channel alive): only decode's deadline ends it.
    pair = make_pair(receive_timeout_base_s=0.5, receive_timeout_per_gb_s=0.0,
                     peer_timeout_s=NEVER_S, reservation_timeout_s=NEVER_S,
                     release_grace_s=NEVER_S)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    got = results(pair)  # reported once prefill confirmed nothing of it is in flight
    assert got["failed"] == {"d-req"}
    assert "within 0.5s of the reservation" in got["reports"]["d-req"]["reason"]
    # Decode cancelled it: prefill dropped its reservation, and its request, should it
    # come, is settled at once.
    wait_for(lambda: "t1" not in pair.sender._transfers, what="prefill dropping the transfer")


def test_a_reservation_acknowledged_too_late_is_cancelled_and_never_written(make_pair):
    # Decode gives up waiting for the acknowledgement; the reservation then reaches
    # prefill after all. Decode's blocks go to other requests: nothing may land there.
    pair = make_pair(ack_timeout_s=0.3, peer_timeout_s=NEVER_S, release_grace_s=NEVER_S)
    post, late = pair.receiver.channel.post, []

    def holding_reserve(peer, payload):  # a side channel backed up behind other work
        if payload and isinstance(msg.decode_to_prefill(payload), msg.Reserve):
            late.append((peer, payload))
        else:
            post(peer, payload)

    pair.receiver.channel.post = holding_reserve
    pair.receiver.reserve(recv_plan(pair))
    got = results(pair)  # reported once prefill confirmed nothing runs (Released)
    assert got["failed"] == {"d-req"}
    assert "did not acknowledge" in got["reports"]["d-req"]["reason"]
    post(*late[0])  # the reservation arrives after all...
    prefill(pair)  # ...and prefill computes the prompt
    wait_for(lambda: pair.sender._transfers.get("t1") is None
             or pair.sender._transfers["t1"].outcome is not None,
             what="prefill settling the cancelled transfer")
    assert not pair.d_memory.any()  # decode's blocks untouched


def test_prefill_remembers_ended_transfers_for_a_while_and_only_so_many():
    ended = EndedTransfers(ttl_s=NEVER_S, capacity=2)
    for transfer in ("t1", "t2", "t3"):
        ended.add(transfer, "failed", "the device failed")
    assert "t1" not in ended and ended.get("t3").reason == "the device failed"
    ended.expire(time.monotonic() + NEVER_S + 1)
    assert "t2" not in ended and "t3" not in ended


class SegmentEngine:
    """Mooncake's transfer engine as `Link` drives it: every segment is copied when it
    is submitted and reports success, except those into decode blocks `broken`: the
    first of them fails, the others keep running until `release` is set."""

    FAILED, RUNNING, LANDED = -1, 0, 1

    def __init__(self, broken: range):
        self.broken = broken
        self.d_base = 0  # where decode's KV cache starts
        self.release = threading.Event()
        self.draining = threading.Event()  # someone waits on a broken segment
        self.failed: set[int] = set()
        self.stuck: set[int] = set()
        self.submitted = 0

    def transfer_submit_write(self, peer, src, dst, length):
        self.submitted += 1
        if (dst - self.d_base) // BLOCK_BYTES % BLOCKS in self.broken:
            (self.stuck if self.failed else self.failed).add(self.submitted)
        else:
            ctypes.memmove(dst, src, length)
        return self.submitted

    def transfer_check_status(self, transfer):
        if transfer in self.failed:
            return self.FAILED
        if transfer in self.stuck:
            self.draining.set()
            return self.LANDED if self.release.is_set() else self.RUNNING
        return self.LANDED


def reserve(pair: Pair, transfer: str, blocks, request: str) -> None:
    pair.receiver.reserve(RecvPlan(request, transfer, "127.0.0.1", pair.port, list(blocks),
                                   0, 12))
    acknowledged(pair, transfer)


def compute(pair: Pair, transfer: str, blocks, request: str, mode="whole") -> None:
    chunk = send_chunk(transfer, blocks, mode=mode, request=request)
    pair.sender.begin_step(types.SimpleNamespace(sends=[chunk], finished_sends=[],
                                                 preempted=[], num_tokens=12))
    for layer in range(len(pair.sender.layouts)):
        pair.sender.layer_saved(layer)
    pair.sender.forward_done()


def reports_of(pair: Pair, collected: dict):
    """Poll the receiver as the engine does each step, keeping every report."""
    _, _, reports = pair.receiver.take_results()
    collected.update(reports)
    return collected


def test_a_failed_writes_slow_drain_holds_up_no_other_transfer(make_pair):
    engine = SegmentEngine(broken=range(9, 12))
    pair = make_pair(link=link_over(engine), release_grace_s=NEVER_S)
    engine.d_base = pair.d_memory.ctypes.data
    reserve(pair, "t-a", (9, 10, 11), "d-a")  # its write fails in decode blocks 9-11
    compute(pair, "t-a", (2, 3, 4), "p-a")
    assert engine.draining.wait(BLOCKED_S), "nobody waited out the failed write's segments"
    # While the failed write's other segments still run, another transfer comes.
    reserve(pair, "t-b", (1, 2, 3), "d-b")
    compute(pair, "t-b", (5, 6, 7), "p-b")
    collected: dict = {}
    try:
        wait_for(lambda: "d-b" in reports_of(pair, collected), timeout=BLOCKED_S,
                 what="the other transfer concluding while a failed write drains")
        assert collected["d-b"]["outcome"] == "done"
        assert (pair.d_memory[:, 1:4] == pair.p_memory[:, 5:8]).all()
        # The failed one is not reported yet: its segments may still write decode's
        # blocks, so decode holds them until prefill says they ended.
        assert "d-a" not in collected and incoming(pair, "t-a").outcome == "failed"
    finally:
        engine.release.set()
    wait_for(lambda: "d-a" in reports_of(pair, collected), timeout=BLOCKED_S,
             what="the failed transfer released once its segments ended")
    assert collected["d-a"]["outcome"] == "failed"


def _zero_bandwidth(sender: Sender) -> None:
    # A link model that says nothing moves: sizing a write's deadline divides by zero.
    sender.link_cost.model = LinkModel(1e-4, 0.0)


def _broken_submit(sender: Sender) -> None:
    submit = sender._submit

    def broken(job):
        if job.transfer_id == "t-a":
            raise KeyError("a bug")
        submit(job)

    sender._submit = broken


@pytest.mark.parametrize("inject", [_zero_bandwidth, _broken_submit])
def test_an_unexpected_error_on_the_submit_thread_fails_only_its_transfer(make_pair, inject):
    pair = make_pair(peer_timeout_s=NEVER_S, reservation_timeout_s=NEVER_S)
    model = pair.sender.link_cost.model
    inject(pair.sender)
    reserve(pair, "t-a", (9, 10, 11), "d-a")
    compute(pair, "t-a", (2, 3, 4), "p-a", mode="layer")
    collected: dict = {}
    wait_for(lambda: "d-a" in reports_of(pair, collected), timeout=BLOCKED_S,
             what="the transfer that met the error concluding")
    assert collected["d-a"]["outcome"] == "failed"
    pair.sender.link_cost.model = model
    reserve(pair, "t-b", (1, 2, 3), "d-b")
    compute(pair, "t-b", (5, 6, 7), "p-b", mode="layer")
    wait_for(lambda: "d-b" in reports_of(pair, collected), timeout=BLOCKED_S,
             what="the next transfer concluding")
    assert collected["d-b"]["outcome"] == "done"
    assert (pair.d_memory[:, 1:4] == pair.p_memory[:, 5:8]).all()
