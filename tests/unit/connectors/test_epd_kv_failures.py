"""Failures inside the prefill sender end as a failed transfer (decode recomputes), and
the model's thread never waits on the network: the same sender and receiver as
test_epd_kv_transfer.py, with a transfer engine stand-in that breaks in new ways."""

from __future__ import annotations

import threading
import types

import pytest

from epd_serve.connectors.epd_kv.drain import Drainer
from epd_serve.connectors.epd_kv.transfer import Link, TransferError, Write

from .test_epd_kv_transfer import (  # noqa: F401  (make_pair is a fixture)
    LAYERS,
    Receiver,
    acknowledged,
    finish_prefill,
    make_pair,
    prefill,
    recv_plan,
    results,
    send_chunk,
    wait_for,
)

# Far longer than any of these operations takes; reaching it means "blocked".
BLOCKED_S = 10.0


def in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def test_an_error_while_submitting_fails_the_transfer_instead_of_settling_it(make_pair):
    pair = make_pair()

    def broken_submit(peer, srcs, dsts, lens):
        raise RuntimeError("the transfer engine went away")

    pair.link.submit = broken_submit
    pair.receiver.reserve(recv_plan(pair))
    wait_for(lambda: pair.sender._transfers.get("t1") and pair.sender._transfers["t1"].reservation)
    prefill(pair)
    got = results(pair)
    # Not one layer reached decode: it must hear "failed" (and recompute), never "done".
    assert got["failed"] == {"d-req"}
    assert "went away" in got["reports"]["d-req"]["reason"]
    assert not pair.d_memory.any()


def test_the_models_thread_never_waits_for_a_submit_on_the_network(make_pair):
    pair = make_pair()
    entered, release = threading.Event(), threading.Event()
    copy = pair.link.submit

    def slow_submit(peer, srcs, dsts, lens):
        entered.set()
        release.wait(BLOCKED_S)  # a transfer engine that takes its time to accept
        return copy(peer, srcs, dsts, lens)

    pair.link.submit = slow_submit
    pair.receiver.reserve(recv_plan(pair))
    wait_for(lambda: pair.sender._transfers.get("t1") and pair.sender._transfers["t1"].reservation)
    prefill(pair, mode="whole")
    assert entered.wait(BLOCKED_S)
    # The next step's hooks, while that submit is still inside the transfer engine.
    chunk = send_chunk("t2", [6, 7, 8], mode="layer", request="p-req-2")
    step = in_thread(lambda: (
        pair.sender.begin_step(types.SimpleNamespace(sends=[chunk], finished_sends=[],
                                                     preempted=[], num_tokens=12)),
        [pair.sender.layer_saved(layer) for layer in range(LAYERS)],
        pair.sender.forward_done()))
    step.join(BLOCKED_S)
    stalled = step.is_alive()
    release.set()
    assert not stalled, "the model's thread waited on the submit thread's network call"
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"


def test_a_preempted_request_with_writes_running_fails_at_once(make_pair):
    pair = make_pair()
    pair.link.hold = threading.Event()  # its write stays in flight
    pair.receiver.reserve(recv_plan(pair))
    wait_for(lambda: pair.sender._transfers.get("t1") and pair.sender._transfers["t1"].reservation)
    prefill(pair, mode="whole")
    wait_for(lambda: pair.sender._transfers["t1"].in_flight)
    step = in_thread(pair.sender.begin_step, types.SimpleNamespace(
        sends=[], finished_sends=[], preempted=["p-req"], num_tokens=0))
    step.join(BLOCKED_S)
    stalled = step.is_alive()
    pair.link.hold.set()
    assert not stalled, "the engine step waited for the preempted request's writes"
    got = results(pair)
    assert got["failed"] == {"d-req"} and "preempted" in got["reports"]["d-req"]["reason"]


# Far past any test here: only the behaviour under test can end a wait for a reply.
NEVER_S = 60.0


def test_a_cancel_that_reaches_prefill_before_the_request_frees_its_blocks_at_once(make_pair):
    pair = make_pair(reservation_timeout_s=NEVER_S)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    pair.receiver.abort({"d-req"})  # decode's client left before prefill got the request
    assert results(pair)["reports"]["d-req"]["outcome"] == "cancelled"
    wait_for(lambda: "t1" not in pair.sender._transfers, what="prefill dropping the transfer")
    prefill(pair)  # the request reaches prefill after all
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished, what="prefill freeing the blocks") == {"p-req"}
    assert not pair.d_memory.any()  # nothing was written for a cancelled transfer


def test_a_second_reservation_of_an_ended_transfer_is_refused_at_once(make_pair):
    """A decode instance that dies mid-request has the proxy send the request to the
    next decoder, with the same transfer: prefill, which is done with it, says so."""
    pair = make_pair(ack_timeout_s=NEVER_S, reservation_timeout_s=NEVER_S)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair)
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    retry = Receiver(pair.receiver.layouts, pair.receiver.block_size, "d2-engine", 0,
                     "d2-session", pair.settings, pair.receiver.stats)
    retry.start()
    try:
        retry.reserve(recv_plan(pair))
        collected = {}

        def failed():
            _, failed, reports = retry.take_results()
            collected.update(reports)
            return failed

        assert wait_for(failed, what="the retried reservation refused") == {"d-req"}
        assert "already ended" in collected["d-req"]["reason"]
    finally:
        retry.close()


class Engine:
    """A transfer engine stand-in: accepts `accepted` segments, refuses the rest; each
    accepted one reports `status` (0: still running) when asked."""

    def __init__(self, accepted: int, status: int):
        self.accepted, self.status = accepted, status

    def transfer_submit_write(self, peer, src, dst, length):
        self.accepted -= 1
        return 7 if self.accepted >= 0 else -1

    def transfer_check_status(self, transfer):
        return self.status


def link_over(engine: Engine) -> Link:
    link = Link.__new__(Link)  # the wrapper's own logic, without a real engine
    link.engine = engine
    return link


def test_a_refused_segment_fails_the_write_and_hands_back_the_accepted_ones():
    link = link_over(Engine(accepted=1, status=0))  # the accepted segment keeps running
    with pytest.raises(TransferError, match="not accepted") as refused:
        link.submit("peer", [1, 2], [3, 4], [8, 8])
    # Raised at once, without waiting for it: the caller waits it out elsewhere.
    assert refused.value.unfinished.ids == [7]
    assert not link.segments_ended(refused.value.unfinished)


def test_a_failed_write_waits_for_its_other_segments_only_so_long():
    link = link_over(Engine(accepted=1, status=0))  # the accepted segment never ends
    outcome = []

    def drain():
        try:
            link._drain(Write([7]), timeout_s=0.2)
        except TransferError as err:
            outcome.append(str(err))

    draining = in_thread(drain)
    draining.join(BLOCKED_S)
    assert not draining.is_alive(), "draining a stuck segment never gave up"
    assert outcome and "still running" in outcome[0]


def test_a_failed_write_whose_segments_never_end_is_let_go_after_the_drain_timeout():
    link = link_over(Engine(accepted=1, status=0))  # the accepted segment never ends
    drained = threading.Event()
    drainer = Drainer(link, lambda transfer_id, ended: drained.set(), timeout_s=0.2)
    drainer.start()
    try:
        drainer.put("t1", Write([7]))
        assert drained.wait(BLOCKED_S), "a stuck segment kept its transfer pinned for good"
    finally:
        drainer.close()
