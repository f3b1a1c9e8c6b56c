"""The shared-memory MM Store: the index's eviction and pin rules (pure), and the
server with real clients in separate processes."""

from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest
import zmq

from epd_serve.mmstore import FeatureMeta, StoreError, StoreSpec, open_store
from epd_serve.mmstore import shm_wire as wire
from epd_serve.mmstore.service import StartedStore, store_processes
from epd_serve.mmstore.shm_index import Index
from epd_serve.mmstore.shm_layout import META_LEN, OFFSET, PAGE, SLOT_WORDS, Directory
from epd_serve.mmstore.shm_server import arena_path, remove_arena

from ...ports import free_port_block
from ...waiting import wait_for

META = FeatureMeta((4, 8), "bfloat16", {"image_grid_thw": [1, 4, 4]})


# -- the index, no processes ----------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def index(pages: int, slots: int = 1024, clock=None) -> Index:
    directory = Directory(np.zeros(slots * SLOT_WORDS, dtype=np.uint64))
    return Index(directory, start=PAGE, capacity=pages * PAGE, clock=clock or Clock())


def put(idx: Index, key: str, nbytes: int = PAGE - 64) -> bool:
    entry = idx.reserve(key, nbytes, b"m")
    return not isinstance(entry, str) and idx.commit(key, entry.token, 0) is None


def test_full_store_evicts_least_recently_used_first():
    idx = index(pages=3)
    for key in "abc":
        assert put(idx, key)
    assert idx.lookup("a") is not None  # a is now the most recently used
    assert put(idx, "d")
    assert "b" not in idx.entries and set(idx.entries) == {"a", "c", "d"}
    assert idx.counters.evictions == 1 and idx.used_bytes == 3 * PAGE


def test_pinned_entries_are_never_evicted_and_a_full_pinned_store_refuses():
    idx = index(pages=2)
    assert put(idx, "a") and put(idx, "b")
    idx.acquire("a")
    idx.acquire("b")
    assert idx.reserve("c", 100, b"m") == "full"
    assert idx.counters.refused_full == 1
    idx.release("a")
    assert put(idx, "c") and "a" not in idx.entries and "b" in idx.entries


def test_a_pin_lapses_when_its_holder_never_releases_it():
    clock = Clock()
    idx = index(pages=1, clock=clock)
    assert put(idx, "a")
    idx.acquire("a")
    assert idx.reserve("b", 100, b"m") == "full"
    clock.now += idx.hold_s + 1  # the client died holding the pin
    assert put(idx, "b") and "a" not in idx.entries


def test_freed_space_merges_so_a_large_feature_fits_again():
    idx = index(pages=4)
    for key in "abcd":
        assert put(idx, key)
    idx.delete("b")
    idx.delete("c")
    assert put(idx, "big", nbytes=2 * PAGE - 64)  # b and c's pages merged: no eviction
    assert idx.counters.evictions == 0


def test_delete_refuses_a_pinned_entry():
    idx = index(pages=2)
    assert put(idx, "a")
    idx.acquire("a")
    assert idx.delete("a") is False
    idx.release("a")
    assert idx.delete("a") is True and idx.delete("a") is False


def test_directory_finds_committed_features_only_and_sees_eviction():
    idx = index(pages=2)
    entry = idx.reserve("a", 100, b"meta")
    assert idx.directory.find("a") is None  # reserved, not yet committed
    idx.commit("a", entry.token, 0)
    slot, row = idx.directory.find("a")
    assert slot == entry.slot
    put(idx, "b")
    put(idx, "c")  # evicts a
    assert idx.directory.find("a") is None
    assert not idx.directory.still_valid(slot, row)  # a reader mid-copy would retry


def test_two_keys_for_one_slot_pair_evict_the_older_occupant():
    idx = index(pages=8, slots=1)  # one slot: every key collides
    assert put(idx, "a")
    assert put(idx, "b")
    assert "a" not in idx.entries and idx.directory.find("b") is not None


# -- the server and its clients ---------------------------------------------------------
# `store_spec` (tests/unit/conftest.py): this module's running store, whose arena is
# checked to be removed when its server is stopped with SIGTERM.


def metrics(spec) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{spec.metrics_port}/metrics").read()
    return {line.split()[0]: float(line.split()[1]) for line in text.decode().splitlines()
            if line.startswith("epd_mmstore_")}


def _read_in_child(spec_json: str, key: str, queue) -> None:
    with open_store(StoreSpec.from_json(spec_json)) as store:
        found = store.get(key)
        queue.put(None if found is None else (found[0].tobytes(), found[1]))


def test_a_feature_put_by_one_process_is_read_by_another(store_spec):
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    with open_store(store_spec) as store:
        assert store.put("cross", data, META) is True
        assert store.put("cross", data, META) is False  # already there
        assert store.lookup("cross") == META
    queue = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(
        target=_read_in_child, args=(store_spec.to_json(), "cross", queue))
    child.start()
    got, meta = queue.get(timeout=60)
    child.join(timeout=30)
    assert got == data.tobytes() and meta == META


def test_missing_keys_are_none_and_deletes_and_pins_work(store_spec):
    with open_store(store_spec) as store:
        assert store.get("nope") is None and store.lookup("nope") is None
        assert store.pin("nope") is None
        store.put("pinned", np.ones(1000, np.uint8), META)
        assert store.pin("pinned") == META
        # Pins and unpins are not answered, but they travel on the same connection as
        # the deletes, whose messages the server handles in order: the hold is taken
        # before the first delete, and given back before the second.
        assert store.delete("pinned") is False  # a consumer holds it
        store.unpin("pinned")
        assert store.delete("pinned") is True and store.get("pinned") is None


def test_filling_past_capacity_evicts_and_never_fails(store_spec):
    assert store_spec.capacity_bytes == 8 << 20  # what the numbers below follow from
    before = metrics(store_spec)
    chunk = np.zeros(1 << 20, np.uint8)
    with open_store(store_spec) as store:
        for i in range(20):  # 20 MiB into 8 MiB
            chunk[:8] = i
            assert store.put(f"fill-{i}", chunk, META) is True
        assert store.get("fill-0") is None
        latest = store.get("fill-19")
        assert latest is not None and latest[0][0] == 19
    after = metrics(store_spec)
    assert after["epd_mmstore_evictions_total"] - before["epd_mmstore_evictions_total"] >= 12
    assert after["epd_mmstore_used_bytes"] <= 8 << 20
    assert after["epd_mmstore_puts_total"] - before["epd_mmstore_puts_total"] == 20
    assert after["epd_mmstore_put_seconds_count"] - before["epd_mmstore_put_seconds_count"] == 20


def start_server(spec: StoreSpec) -> subprocess.Popen:
    (server,) = StartedStore(spec).processes
    return server


def test_a_client_follows_the_store_server_through_a_restart():
    base = free_port_block(2, start=26500)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name="restart")
    server = start_server(spec)
    try:
        with open_store(spec) as store:
            assert store.put("before", np.full(100, 1, np.uint8), META)
            server.terminate()
            server.wait(timeout=10)
            server = start_server(spec)  # same ports, a new (empty) arena
            # The put lands in the new arena, not in the old mapping the client held.
            assert store.put("after", np.full(100, 2, np.uint8), META)
            data, _ = store.get("after")
            assert (data == 2).all()
            with open_store(spec) as fresh:
                assert fresh.get("after")[0].tobytes() == data.tobytes()
                assert fresh.get("before") is None
    finally:
        server.terminate()
        server.wait(timeout=10)
        remove_arena(spec)  # a stopped server leaves it to its successor; `down` removes it


@pytest.mark.parametrize("stop", ["terminate", "kill"])
def test_a_reader_maps_the_new_arena_after_the_server_restarted(stop):
    # A reader (prefill's loader, the proxy) that only ever gets must not keep reading
    # the old arena's directory, which no server writes to any more.
    base = free_port_block(2, start=26800)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name=f"reader-{stop}")
    server = start_server(spec)
    try:
        with open_store(spec) as reader:
            getattr(server, stop)()  # SIGTERM retires the arena; after SIGKILL the
            server.wait(timeout=10)  # next server does
            server = start_server(spec)
            with open_store(spec) as writer:
                assert writer.put("after", np.full(100, 2, np.uint8), META)
            found = wait_for(lambda: reader.get("after"), timeout=10,
                             what="the reader found a feature put after the restart")
            assert (found[0] == 2).all()
    finally:
        server.terminate()
        server.wait(timeout=10)
        remove_arena(spec)


def test_a_client_of_a_server_that_is_gone_never_blocks_on_a_send():
    base = free_port_block(2, start=26900)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name="gone")
    server = start_server(spec)
    store = open_store(spec)
    server.kill()
    server.wait(timeout=10)
    done = threading.Event()

    def pins_and_a_put():
        # More unanswered messages than a socket queues (1000): each must be dropped,
        # not wait for a server that will not come back.
        for i in range(3000):
            store.unpin(f"k{i}")
        with pytest.raises(StoreError, match="did not answer"):
            store.put("late", np.full(10, 1, np.uint8), META)
        done.set()

    worker = threading.Thread(target=pins_and_a_put, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "a send to a dead store server blocked"
    assert store.dropped_messages > 0
    store.close()
    remove_arena(spec)


def test_an_engine_starting_waits_for_a_store_that_answers_late():
    """An engine opening the store beside busy ones may not get its first answer within
    one round trip's 2 s: it keeps asking for its `wait_s`."""
    base = free_port_block(2, start=26600)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name="late")
    # First a store too busy to answer: it takes what the client sends and says nothing.
    context = zmq.Context()
    busy = context.socket(zmq.ROUTER)
    busy.setsockopt(zmq.LINGER, 0)
    busy.bind(f"tcp://{spec.address}")
    asked: list = []

    def asked_again() -> bool:
        while busy.poll(0):
            asked.append(wire.request_decoder.decode(busy.recv_multipart()[-1]))
        return len(asked) >= 2

    opened: list = []
    opening = threading.Thread(target=lambda: opened.append(open_store(spec, wait_s=60)))
    opening.start()
    server = None
    try:
        # A second Hello goes out only once the first one's round trip ended unanswered.
        wait_for(asked_again, "the client asking again", timeout=30)
        assert [type(req) for req in asked[:2]] == [wire.Hello, wire.Hello]
        assert opening.is_alive() and not opened  # no answer yet: still asking
        context.destroy(linger=0)  # the busy store goes; one that answers takes its port
        server = start_server(spec)
    finally:
        if not context.closed:
            context.destroy(linger=0)
        opening.join(timeout=60)
    try:
        (store,) = opened
        assert store.put("late", np.full(10, 3, np.uint8), META)
        store.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        remove_arena(spec)


def test_unreachable_store_raises_store_error_quickly():
    # The client's own bounded wait gives up (2 s), rather than a hang cut short.
    with pytest.raises(StoreError, match=r"did not answer in 2000 ms"):
        open_store(StoreSpec(backend="shm", port=free_port_block(1, start=27000)))


@pytest.mark.parametrize("stop", ["terminate", "kill"])
def test_a_restarted_server_serves_from_its_predecessors_arena_not_a_second_one(stop):
    """A restart needs no second arena of /dev/shm (clients still map the first): the
    next server takes the same file and its pages, emptied; only one server holds it."""
    base = free_port_block(2, start=26700)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=1 << 20,
                     name=f"again-{stop}")
    first = start_server(spec)
    with open_store(spec) as client:
        assert client.put("old", np.full(100, 1, np.uint8), META)
        inode = arena_path(spec).stat().st_ino
        getattr(first, stop)()
        first.wait(timeout=10)
        second = start_server(spec)
        try:
            arenas = list(arena_path(spec).parent.glob(f"epd-mmstore-again-{stop}-*"))
            assert arenas == [arena_path(spec)] and arena_path(spec).stat().st_ino == inode
            assert client.get("old") is None  # emptied: the old server's entries are gone
            # A second server of the same store is refused: the file is held.
            third = subprocess.run(store_processes(spec)[0].command, capture_output=True, text=True,
                                   timeout=60)
            assert third.returncode != 0 and "held by another" in third.stderr
        finally:
            second.terminate()
            second.wait(timeout=10)
    remove_arena(spec)
    assert not arena_path(spec).exists()


# -- fenced puts: a writer paused past its hold ---------------------------------------
def test_a_lapsed_writers_commit_is_refused_and_its_late_bytes_never_read_as_a_feature():
    """A writer reserves, pauses past `hold_s`; its space goes to another feature
    (committed, published with its checksum). Then the writer wakes: its bytes land in
    that space and its Commit names its old token. The Commit is refused; the other
    feature, its bytes overwritten, reads as a miss (checksum), never as wrong bytes."""
    clock = Clock()
    idx = index(pages=1, clock=clock)
    late = idx.reserve("late", PAGE - 64, b"m")
    clock.now += idx.hold_s + 1  # the writer is stopped past its reservation's hold
    other = idx.reserve("other", PAGE - 64, b"m")  # evicts the lapsed reservation
    assert other.offset == late.offset
    assert idx.commit("other", other.token, 1234) is None
    assert idx.commit("late", late.token, 0) == "missing"  # its entry is gone
    idx.reserve("late", PAGE - 64, b"m")  # someone else reserves the same key anew
    assert idx.commit("late", late.token, 0) == "lapsed"  # not the late writer's to publish


def test_a_writer_stopped_mid_put_past_its_hold_neither_publishes_nor_serves_its_bytes():
    """Real processes: an encoder stopped between its reservation and its writes (past
    the hold) while the store gives that space to another feature. When it wakes, its
    bytes land on the other feature and its Commit is refused: a reader of either key
    gets a miss or the right bytes, never the late writer's."""
    base = free_port_block(2, start=27400)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=PAGE * 4,
                     name="late-writer", hold_s=0.5)
    nbytes = PAGE * 3  # two of these cannot be held at once
    with StartedStore(spec), open_store(spec) as late, open_store(spec) as other:
        reserved, wake = threading.Event(), threading.Event()
        real_call = late._call

        def stopped_after_reserving(req, timeout_ms=None):
            reply = real_call(req, timeout_ms)
            if isinstance(req, wire.Reserve):
                reserved.set()
                wake.wait(30)  # SIGSTOP: nothing of the put runs until SIGCONT
            return reply

        late._call = stopped_after_reserving
        result = []
        writer = threading.Thread(target=lambda: result.append(
            late.put("late", np.full(nbytes, 0xEE, np.uint8), META)))
        writer.start()
        assert reserved.wait(30)
        time.sleep(spec.hold_s + 0.3)  # its reservation lapses
        assert other.put("other", np.full(nbytes, 0x11, np.uint8), META)  # takes its space
        wake.set()  # SIGCONT: the late writer writes where "other" lives, then commits
        writer.join(30)
        assert result == [False]  # its Commit was refused
        with open_store(spec) as reader:
            assert reader.get("late") is None
            found = reader.get("other")
            assert found is None or (found[0] == 0x11).all(), "another writer's bytes served"
            assert found is None and reader.corrupt_reads == 1  # its bytes were overwritten
            # Dropped: no lookup finds it any more, and the next put replaces it.
            wait_for(lambda: reader.lookup("other") is None, what="the corrupt entry dropped")
            assert other.put("other", np.full(nbytes, 0x22, np.uint8), META)
            assert (reader.get("other")[0] == 0x22).all()


def test_a_feature_whose_meta_a_late_writer_overwrote_is_a_miss_for_every_reader():
    """Found in the chaos soak: a late writer's bytes over another feature's meta made
    every lookup of that image raise (the proxy answered 500 until the store restarted).
    A lookup reads no bytes to check; its meta, not a feature's, is a miss too."""
    base = free_port_block(2, start=27420)
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=PAGE * 4,
                     name="late-meta")
    with StartedStore(spec), open_store(spec) as writer, open_store(spec) as reader:
        assert writer.put("victim", np.full(PAGE, 0x11, np.uint8), META)
        assert reader.lookup("victim") == META
        arena = reader._current_arena()
        _, row = arena.directory.find("victim")
        start = row[OFFSET]
        arena.mapping[start:start + row[META_LEN]] = b"\xee" * row[META_LEN]  # the late bytes
        assert reader.lookup("victim") is None
        assert reader.corrupt_reads == 1
        # Dropped at once: every later reader has a plain miss, and the image can be
        # stored again.
        wait_for(lambda: arena.directory.find("victim") is None, what="the entry dropped")
        assert reader.get("victim") is None and reader.corrupt_reads == 1
        assert writer.put("victim", np.full(PAGE, 0x33, np.uint8), META)
        assert (reader.get("victim")[0] == 0x33).all()
