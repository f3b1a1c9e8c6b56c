"""The epd KV connector's prefill sender and decode receiver, talking over their real
side channel (ZeroMQ on 127.0.0.1), with an in-process stand-in for the transfer
engine that copies bytes between two numpy "KV caches" (and fails or hangs on demand).
The engine-level behaviour is tested against real vLLM instances in tests/e2e."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
import types

import numpy as np
import pytest

from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.layout import LayerLayout, Region
from epd_serve.connectors.epd_kv.messages import (
    REPORT_TIMES_KEY,
    FinishedSend,
    RecvPlan,
    SendChunk,
    blocks_to_ship,
)
from epd_serve.connectors.epd_kv.receiver import Receiver
from epd_serve.connectors.epd_kv.sender import Sender
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.transfer import TransferError

from ...ports import free_port_block
from ...waiting import wait_for

LAYERS, BLOCKS, BLOCK_BYTES, BLOCK_SIZE = 6, 16, 256, 4


class FakeLink:
    """Copies segments at once; `fail` makes writes fail, `hold` makes them hang
    until released."""

    def __init__(self):
        self.fail = False
        self.hold: threading.Event | None = None
        self.segments = 0

    def submit(self, peer, srcs, dsts, lens):
        if not self.fail:
            for src, dst, n in zip(srcs, dsts, lens):
                ctypes.memmove(dst, src, n)
        self.segments += len(lens)
        return types.SimpleNamespace(ok=not self.fail)

    def done(self, write):
        if self.hold is not None and not self.hold.is_set():
            return False
        if not write.ok:
            raise TransferError("write failed")
        return True


class Stats:
    def __init__(self):
        self.records = []

    def record(self, key):
        self.records.append(key)

    def record_send(self, *values):
        self.records.append(("sent", *values))


def cache() -> tuple[np.ndarray, list[LayerLayout]]:
    memory = np.zeros((LAYERS, BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    layouts = [LayerLayout((Region(memory[i].ctypes.data, BLOCK_BYTES, BLOCK_BYTES),))
               for i in range(LAYERS)]
    return memory, layouts


@dataclasses.dataclass
class Pair:
    sender: Sender
    receiver: Receiver
    link: FakeLink
    p_memory: np.ndarray
    d_memory: np.ndarray
    port: int
    settings: Settings


@pytest.fixture
def make_pair():
    made = []

    def make(mark=None, link=None, on_device=None, **overrides) -> Pair:
        """`mark`: the sender's device events (none: a CPU engine); `link`: the sender's
        transfer engine (a `FakeLink` unless given); `on_device`: what makes the device
        its threads' own."""
        # Timeouts long enough that a starved test process does not trip them; a test of
        # one timeout makes that one short. No first-connect allowance (FakeLink has no
        # connect): a write's deadline is its steady one unless a test says otherwise.
        settings = Settings(**{"ack_timeout_s": 5.0, "heartbeat_s": 0.1, "peer_timeout_s": 5.0,
                               "transfer_timeout_floor_s": 5.0, "first_connect_timeout_s": 0.0,
                               "reservation_timeout_s": 10.0,
                               "release_grace_s": 5.0, "fault_injection": True, **overrides})
        p_memory, p_layouts = cache()
        p_memory[:] = np.random.default_rng(0).integers(1, 255, p_memory.shape, dtype=np.uint8)
        d_memory, d_layouts = cache()
        link = link or FakeLink()
        port = free_port_block(1, start=32000)
        sender = Sender(link, p_layouts, BLOCK_SIZE, "p-engine", 0, settings,
                        LinkModel(1e-4, 1e9), Stats(), mark, on_device=on_device)
        sender.start(port)
        receiver = Receiver(d_layouts, BLOCK_SIZE, "d-engine", 0, "d-session", settings, Stats())
        receiver.start()
        pair = Pair(sender, receiver, link, p_memory, d_memory, port, settings)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.receiver.close()
        pair.sender.close()


def recv_plan(pair: Pair, transfer="t1", blocks=(9, 10, 11), first_block=0, tokens=12):
    return RecvPlan("d-req", transfer, "127.0.0.1", pair.port, list(blocks), first_block, tokens)


def prefill(pair: Pair, transfer="t1", blocks=(2, 3, 4), start=0, end=12, prompt=12,
            mode="group", fault=None):
    """One prefill step computing tokens [start, end): every layer saved, pass ends."""
    chunk = send_chunk(transfer, blocks, start, end, prompt, mode, fault)
    pair.sender.begin_step(types.SimpleNamespace(sends=[chunk], finished_sends=[],
                                                 preempted=[], num_tokens=end - start))
    for layer in range(LAYERS):
        pair.sender.layer_saved(layer)
    pair.sender.forward_done()


def send_chunk(transfer="t1", blocks=(2, 3, 4), start=0, end=12, prompt=12, mode="group",
               fault=None, request="p-req") -> SendChunk:
    """The chunk the scheduler side plans, with the blocks it ships (those before the
    chunk's first token's block went with earlier chunks)."""
    first, last = blocks_to_ship(end, prompt, BLOCK_SIZE, start // BLOCK_SIZE)
    return SendChunk(request, transfer, list(blocks), start, end, prompt, first, last, mode,
                     fault)


def finish_prefill(pair: Pair, transfer="t1", aborted=False):
    pair.sender.begin_step(types.SimpleNamespace(
        sends=[], preempted=[], num_tokens=0,
        finished_sends=[FinishedSend("p-req", transfer, aborted)]))


def incoming(pair: Pair, transfer="t1"):
    """Decode's record of a transfer it has reserved and not yet reported."""
    return pair.receiver._incoming.get(transfer)


def acknowledged(pair: Pair, transfer="t1") -> None:
    """Wait until prefill has acknowledged decode's reservation: it holds it (it acks
    after taking it), and decode knows which incarnation of prefill took it."""
    wait_for(lambda: (i := incoming(pair, transfer)) is not None and i.acked,
             what=f"prefill acknowledged the reservation of {transfer}")


def results(pair: Pair):
    """Poll the receiver as the engine does each step until something is reported."""
    collected = {"finished": set(), "failed": set(), "reports": {}}

    def poll():
        finished, failed, reports = pair.receiver.take_results()
        collected["finished"] |= finished
        collected["failed"] |= failed
        collected["reports"].update(reports)
        return collected["finished"]

    wait_for(poll)
    return collected


def test_every_layer_group_lands_in_decodes_reserved_blocks(make_pair):
    pair = make_pair()
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)  # the reservation is there before prefill computes
    prefill(pair)
    got = results(pair)
    assert got["finished"] == {"d-req"} and not got["failed"]
    report = got["reports"]["d-req"]
    assert report["outcome"] == "done" and report["bytes"] == LAYERS * 3 * BLOCK_BYTES
    assert report["groups"] >= 2  # the last layer travels on its own
    # Prefill blocks 2,3,4 are consecutive on both sides: one segment per layer group.
    assert np.array_equal(pair.d_memory[:, 9:12], pair.p_memory[:, 2:5])
    assert not pair.d_memory[:, :9].any() and not pair.d_memory[:, 12:].any()
    # Prefill frees its blocks once the request finished and nothing is in flight.
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}


def test_a_quiet_spell_between_transfers_is_not_taken_for_a_dead_prefill(make_pair):
    pair = make_pair(peer_timeout_s=0.5)
    for n, transfer in enumerate(("t1", "t2")):
        if n:
            # Time itself is what is tested: a quiet spell longer than peer_timeout_s
            # with nothing pending (so nothing pinged, nothing answered).
            time.sleep(1.0)
        pair.receiver.reserve(recv_plan(pair, transfer=transfer))
        acknowledged(pair, transfer)
        prefill(pair, transfer=transfer)
        assert results(pair)["reports"]["d-req"]["outcome"] == "done"


def test_a_late_reservation_gets_what_prefill_computed_meanwhile(make_pair):
    pair = make_pair()
    prefill(pair, blocks=(5, 7, 8))  # computed before decode has allocated anything
    finish_prefill(pair)
    assert pair.sender.take_finished() == set()  # pinned: decode has not reserved yet
    pair.receiver.reserve(recv_plan(pair, blocks=(1, 2, 3)))
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"
    assert np.array_equal(pair.d_memory[:, 1:4], pair.p_memory[:, [5, 7, 8]])
    assert wait_for(pair.sender.take_finished) == {"p-req"}


def test_chunked_prefill_and_decodes_own_prefix_hit(make_pair):
    pair = make_pair()
    # Decode already holds block 0 (a prefix-cache hit): it reserves blocks 1.. only.
    pair.receiver.reserve(recv_plan(pair, blocks=(12, 13), first_block=1, tokens=12))
    acknowledged(pair)
    prefill(pair, start=0, end=6)  # tokens 0-5: blocks 0 and 1 (half full)
    prefill(pair, start=6, end=12)  # tokens 6-11: blocks 1 (again, now full) and 2
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"
    assert np.array_equal(pair.d_memory[:, 12:14], pair.p_memory[:, 3:5])
    assert not pair.d_memory[:, :12].any()


@pytest.mark.parametrize("mode, groups", [("whole", 1), ("layer", LAYERS)])
def test_modes_send_one_write_or_one_per_layer(make_pair, mode, groups):
    pair = make_pair()
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair, mode=mode)
    report = results(pair)["reports"]["d-req"]
    assert (report["mode"], report["groups"]) == (mode, groups)
    assert np.array_equal(pair.d_memory[:, 9:12], pair.p_memory[:, 2:5])
    # For the request's timeline: when each group landed, its layers, in order.
    times = report[REPORT_TIMES_KEY]
    landed = [ns for ns, _, _ in times["landed"]]
    assert len(landed) == groups and times["reserved"] <= landed[0]
    assert landed == sorted(landed) and landed[-1] <= times["concluded"]
    layers = [layer for _, first, last in times["landed"] for layer in range(first, last + 1)]
    assert layers == list(range(LAYERS))


def test_a_failed_write_makes_decode_recompute_and_frees_both_sides(make_pair):
    pair = make_pair()
    pair.link.fail = True
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair)
    got = results(pair)
    assert got["failed"] == {"d-req"} and "failed" in got["reports"]["d-req"]["reason"]
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    assert "send_failures" in pair.sender.stats.records
    assert "receive_failures" in pair.receiver.stats.records


def test_a_write_past_its_deadline_fails_but_decode_waits_for_it_to_end(make_pair):
    pair = make_pair(transfer_timeout_floor_s=0.3)
    pair.link.hold = threading.Event()
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair, mode="whole")
    # Past its 0.3 s deadline prefill declares the write failed, and decode hears so ...
    wait_for(lambda: incoming(pair).outcome == "failed"
             and incoming(pair).waiting_release_since is not None,
             what="decode heard that the write failed while it was still running")
    assert pair.receiver.take_results()[0] == set()  # ... but the write may still land
    pair.link.hold.set()
    got = results(pair)
    assert got["failed"] == {"d-req"} and "not done after" in got["reports"]["d-req"]["reason"]


def test_a_prefill_that_restarts_fails_its_old_transfers(make_pair):
    # Neither silence nor an unmatched reservation may end the transfer first: only
    # the new incarnation answering decode's pings.
    pair = make_pair(peer_timeout_s=60.0, reservation_timeout_s=60.0)
    pair.link.hold = threading.Event()  # keep the transfer open
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)  # by the first incarnation
    pair.sender.close()  # its port is free again once this returns
    reborn = Sender(FakeLink(), pair.sender.layouts, BLOCK_SIZE, "p-engine", 0, pair.settings,
                    LinkModel(1e-4, 1e9), Stats())
    reborn.start(pair.port)
    try:
        got = results(pair)
        assert got["failed"] == {"d-req"}
        assert got["reports"]["d-req"]["reason"] == "prefill restarted"
    finally:
        reborn.close()
        pair.link.hold.set()


def test_a_prefill_whose_process_is_gone_is_given_up_at_once(make_pair):
    # Nothing but the silence can end the transfer: prefill keeps the reservation (it
    # is gone before it could drop it) and decode would wait a minute for a release.
    pair = make_pair(peer_timeout_s=0.6, reservation_timeout_s=60.0, release_grace_s=60.0)
    pair.link.hold = threading.Event()
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    pair.sender.channel.close()  # the engine is gone: its kernel closed its sockets
    got = results(pair)
    assert got["failed"] == {"d-req"}
    assert got["reports"]["d-req"]["reason"] == f"prefill worker 127.0.0.1:{pair.port} is gone"
    assert pair.receiver.stats.records.count("receive_failures") == 1
    assert "fenced" not in pair.receiver.stats.records  # a dead process writes nothing
    pair.link.hold.set()


class StoppedProcess:
    """Prefill as SIGSTOP leaves it: its connections stay up (its kernel keeps them), its
    side channel answers nothing and a write it had queued waits; `resume()` is SIGCONT."""

    def __init__(self, pair: Pair):
        self.running = threading.Event()
        channel, link = pair.sender.channel, pair.link
        handler, on_tick, submit = channel.handler, channel.on_tick, link.submit
        channel.handler = lambda *a: (self.running.wait(), handler(*a))
        channel.on_tick = lambda: (self.running.wait(), on_tick())
        link.submit = lambda *a: (self.running.wait(), submit(*a))[1]

    def resume(self):
        self.running.set()


def test_blocks_a_stopped_prefill_may_still_write_are_held_until_it_says_none_runs(make_pair):
    # Reproduces a late write into reused blocks: decode used to give a silent prefill's
    # transfer up (and vLLM its blocks to the next request) after peer_timeout_s; the
    # write prefill had queued landed there once it was continued.
    pair = make_pair(peer_timeout_s=0.5, release_grace_s=0.3, reservation_timeout_s=60.0)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    stopped = StoppedProcess(pair)
    prefill(pair)  # its write is queued in the stopped process
    wait_for(lambda: incoming(pair).fenced, what="decode fenced the silent prefill's blocks")
    assert "fenced" in pair.receiver.stats.records
    time.sleep(1.5)  # three peer timeouts, five release graces: still held
    assert pair.receiver.take_results()[0] == set()
    assert not pair.d_memory.any()
    stopped.resume()
    got = results(pair)  # reported (its blocks given back) once prefill said Released
    assert got["failed"] == {"d-req"}
    assert got["reports"]["d-req"]["reason"].startswith(
        f"prefill worker 127.0.0.1:{pair.port} silent for")
    # The write it had queued landed, in blocks that were still this request's (what
    # the Cancel stopped before it was written never is), and nothing lands after.
    landed = pair.d_memory.copy()
    assert np.array_equal(landed[:, 9:12][landed[:, 9:12] != 0],
                          pair.p_memory[:, 2:5][landed[:, 9:12] != 0])
    assert landed[:, 9:12].any() and not landed[:, :9].any() and not landed[:, 12:].any()
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    assert np.array_equal(pair.d_memory, landed)


def test_no_reservation_goes_to_a_silent_prefill_while_its_blocks_are_held(make_pair):
    # In a soak, requests kept reaching decode for the ~25 s before the proxy saw the
    # stopped prefill hung; each reservation sent to it held its blocks for the whole
    # stop, until decode had none left and was found hung as well.
    pair = make_pair(peer_timeout_s=0.5, release_grace_s=0.3, reservation_timeout_s=60.0)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    stopped = StoppedProcess(pair)
    prefill(pair)
    wait_for(lambda: incoming(pair).fenced, what="decode fenced the silent prefill's blocks")
    pair.receiver.reserve(RecvPlan("d-next", "t2", "127.0.0.1", pair.port, [13, 14], 0, 8))
    finished, failed, reports = pair.receiver.take_results()
    assert finished == failed == {"d-next"}  # at once: computed on decode, blocks free
    assert "not reserved" in reports["d-next"]["reason"]
    assert "refused_silent_peer" in pair.receiver.stats.records
    stopped.resume()
    assert results(pair)["failed"] == {"d-req"}
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    # Prefill never heard of it, so nothing of it can land; and, heard from again,
    # it is sent the next reservation.
    assert not pair.d_memory[:, 13:15].any()
    pair.receiver.reserve(RecvPlan("d-later", "t3", "127.0.0.1", pair.port, [13, 14], 0, 8))
    acknowledged(pair, "t3")


def test_a_fence_is_bounded_and_counted(make_pair):
    pair = make_pair(peer_timeout_s=0.3, reservation_timeout_s=60.0, fence_max_s=2.0)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    stopped = StoppedProcess(pair)
    started = time.monotonic()
    got = results(pair)  # given back after fence_max_s, counted
    assert got["failed"] == {"d-req"} and time.monotonic() - started >= 2.0
    assert pair.receiver.stats.records.count("fence_expired") == 1
    stopped.resume()


def test_prefill_never_writes_a_reservation_older_than_decode_may_fence(make_pair):
    # Decode gives a silent prefill's blocks back after fence_max_s: a prefill stopped
    # about that long must not write them when it is continued.
    pair = make_pair(reservation_timeout_s=60.0, fence_max_s=2.0)
    assert pair.settings.stale_reservation_s == 1.0
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    time.sleep(1.2)  # as a process stopped that long
    prefill(pair)
    got = results(pair)
    assert got["failed"] == {"d-req"} and "old" in got["reports"]["d-req"]["reason"]
    assert "stale_writes_refused" in pair.sender.stats.records
    assert not pair.d_memory.any() and pair.link.segments == 0
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}


def test_an_unreachable_prefill_is_detected_by_the_missing_acknowledgement(make_pair):
    pair = make_pair(ack_timeout_s=0.5)
    plan = recv_plan(pair)
    plan.prefill_port = free_port_block(1, start=33000)  # nothing listens there
    pair.receiver.reserve(plan)
    assert "did not acknowledge" in results(pair)["reports"]["d-req"]["reason"]


def test_an_aborted_decode_request_cancels_and_is_freed(make_pair):
    # No reservation timeout can free prefill's blocks within the test: only the cancel.
    pair = make_pair(reservation_timeout_s=60.0)
    pair.receiver.reserve(recv_plan(pair))  # decode blocks 9, 10, 11
    acknowledged(pair)
    prefill(pair, start=0, end=6)  # the first chunk (prefill blocks 2, 3 -> 9, 10)
    pair.receiver.abort({"d-req"})
    got = results(pair)  # reported once prefill has released it
    assert got["finished"] == {"d-req"} and not got["failed"]
    assert got["reports"]["d-req"]["outcome"] == "cancelled"
    # Prefill stops for it: the next chunk writes nothing (block 11 stays empty), and
    # its blocks are freed as soon as its request finished.
    prefill(pair, start=6, end=12)
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}
    assert not pair.d_memory[:, 11].any()


def test_prefill_frees_blocks_nobody_reserved(make_pair):
    pair = make_pair(reservation_timeout_s=0.3)
    prefill(pair)
    finish_prefill(pair)
    assert wait_for(pair.sender.take_finished) == {"p-req"}


def test_mismatched_layouts_are_refused_before_any_write(make_pair):
    pair = make_pair()
    other = [LayerLayout((Region(r.regions[0].base, BLOCK_BYTES, BLOCK_BYTES // 2),))
             for r in pair.receiver.layouts]
    pair.receiver.layouts = other
    pair.receiver.reserve(recv_plan(pair))
    got = results(pair)
    assert got["failed"] == {"d-req"} and "block sizes differ" in got["reports"]["d-req"]["reason"]
    assert pair.link.segments == 0
