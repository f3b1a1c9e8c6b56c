"""Client of the node-local shared-memory store (shm_server.py).

Used in E/P/D engine processes, the proxy and the benchmarks. The arena is mapped
once, all of it; a get finds the feature in the directory and copies it out with no
message to the server (shm_layout.py explains why that is safe), then reports the read
without waiting; a pin is a lookup plus an unanswered message. Puts and deletes are
round trips over one ZeroMQ DEALER socket. Nothing waits on a server that is gone:
each round trip has a deadline, messages that need no answer are dropped when they
cannot leave at once, and a reader maps the new arena when the server restarted.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time
from typing import NamedTuple

import msgspec
import numpy as np
import zmq

from epd_serve.mmstore import shm_layout as layout
from epd_serve.mmstore import shm_wire as wire
from epd_serve.mmstore.base import FeatureMeta, FeatureStore, StoreError, checksum
from epd_serve.mmstore.spec import StoreSpec

READ_ATTEMPTS = 3  # a read torn by a concurrent eviction is retried, then a miss
# Reads are reported to the server in batches: one message per read would wake the
# server (and take a core from the reader) for every get.
REPORT_EVERY = 32
REPORT_AFTER_S = 0.2
# A reader that finds its arena retired asks for the new one at most this often (the
# server may not be back yet; meanwhile it reads the old copy, still mapped).
REMAP_EVERY_S = 1.0
REMAP_TIMEOUT_MS = 500  # that question's deadline

logger = logging.getLogger("epd_serve.mmstore")


class Arena(NamedTuple):
    """One mapping of a server's arena, swapped whole when the server restarted so a
    read in another thread never mixes two arenas."""

    arena_id: str
    mapping: mmap.mmap
    bytes: np.ndarray
    directory: layout.Directory


class NoAnswer(StoreError):
    """The server did not answer in time (it may be busy or not started yet)."""


class ShmStore(FeatureStore):
    name = "shm"

    def __init__(self, spec: StoreSpec, timeout_s: float = 2.0, open_wait_s: float = 0.0):
        """`timeout_s` bounds each round trip; opening keeps asking a server that does
        not answer for up to `open_wait_s` more (an engine starting beside busy ones)."""
        self.spec = spec
        self.timeout_ms = int(timeout_s * 1000)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue messages only on a live connection: a send to a server that is gone
        # waits at most a round trip's deadline, and nothing stale reaches its successor.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(f"tcp://{spec.address}")
        self._reads: list[wire.Request] = []
        self._reported_at = time.monotonic()
        self._remap_after = 0.0
        self._remapping = threading.Lock()
        self.dropped_messages = 0  # pins, releases and read reports that could not leave
        self.corrupt_reads = 0  # entries whose bytes did not match their checksum
        try:
            deadline = time.monotonic() + open_wait_s
            while True:
                try:
                    self._map_arena()
                    break
                except NoAnswer:
                    if time.monotonic() >= deadline:
                        raise
        except BaseException:
            self._sock.close()
            self._ctx.term()
            raise

    def _map_arena(self, timeout_ms: int | None = None) -> None:
        """Map the server's arena; again after the server restarted (new arena)."""
        welcome = self._call(wire.Hello(0), timeout_ms)
        if not isinstance(welcome, wire.Welcome):
            raise StoreError(f"MM Store at {self.spec.address}: {welcome.reason}")
        fd = os.open(welcome.arena_path, os.O_RDWR)
        try:
            # Map every page now (the server allocated them all): a first read of a
            # feature then copies at memcpy speed instead of faulting page by page, which
            # doubles its time. Costs 2 MiB of page tables per GiB, once per process.
            mapping = mmap.mmap(fd, welcome.arena_bytes,
                                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        words = np.frombuffer(mapping, dtype=np.uint64,
                              count=welcome.nslots * layout.SLOT_WORDS)
        self._arena = Arena(welcome.arena_id, mapping, np.frombuffer(mapping, dtype=np.uint8),
                            layout.Directory(words))

    def _current_arena(self) -> Arena:
        """The arena to read. When the server has retired it (a restart), the new one is
        mapped on a thread of its own: asking the server may take its deadline, and a
        read (on the proxy's event loop, say) must not wait for that; until then reads
        go on in the old mapping, which still holds what it held."""
        arena = self._arena
        if (arena.directory.retired() and time.monotonic() >= self._remap_after
                and not self._remapping.locked()):
            self._remap_after = time.monotonic() + REMAP_EVERY_S
            threading.Thread(target=self._remap, name="mmstore-remap", daemon=True).start()
        return arena

    def _remap(self) -> None:
        with self._remapping:
            try:
                self._map_arena(REMAP_TIMEOUT_MS)
            except (StoreError, OSError, zmq.ZMQError):
                pass  # not back yet (or this client is closing): tried again later

    # -- transport -------------------------------------------------------------
    def _call(self, req: wire.Request, timeout_ms: int | None = None) -> wire.Reply:
        timeout_ms = timeout_ms or self.timeout_ms
        with self._lock:
            req.seq = next(self._seq)
            try:
                self._sock.send(wire.encoder.encode(req), zmq.NOBLOCK)
            except zmq.Again:  # no live connection to queue it on
                if not self._sock.poll(timeout_ms, zmq.POLLOUT):
                    raise NoAnswer(f"MM Store at {self.spec.address} did not answer in "
                                   f"{timeout_ms} ms (no connection); is the store server "
                                   "running?") from None
                self._sock.send(wire.encoder.encode(req), zmq.NOBLOCK)
            while True:
                if not self._sock.poll(timeout_ms):
                    raise NoAnswer(f"MM Store at {self.spec.address} did not answer in "
                                   f"{timeout_ms} ms; is the store server running?")
                reply = wire.reply_decoder.decode(self._sock.recv())
                if reply.seq == req.seq:
                    return reply
                # else: the late answer to a request that already timed out

    def _tell(self, req: wire.Request) -> None:
        """Send a message that needs no answer, or drop it if it cannot leave now: each
        is advisory (a pin or a hold lapses by itself, a read report only counts)."""
        with self._lock:
            req.seq = next(self._seq)
            try:
                self._sock.send(wire.encoder.encode(req), zmq.NOBLOCK)
            except zmq.Again:
                self.dropped_messages += 1

    def _report(self, read: wire.Request) -> None:
        with self._lock:
            self._reads.append(read)
            now = time.monotonic()
            if len(self._reads) < REPORT_EVERY and now - self._reported_at < REPORT_AFTER_S:
                return
            batch, self._reads, self._reported_at = self._reads, [], now
        for req in batch:
            self._tell(req)

    # -- reads through the directory --------------------------------------------
    def _read(self, key: str, with_bytes: bool) -> tuple[np.ndarray | None, FeatureMeta] | None:
        arena = self._current_arena()
        for _ in range(READ_ATTEMPTS):
            found = arena.directory.find(key)
            if found is None:
                break
            slot, row = found
            start = row[layout.OFFSET]
            meta_bytes = bytes(arena.mapping[start:start + row[layout.META_LEN]])
            data = None
            if with_bytes:
                begin = start + layout.meta_span(row[layout.META_LEN])
                data = arena.bytes[begin:begin + row[layout.NBYTES]].copy()
            if not arena.directory.still_valid(slot, row):
                continue
            if data is not None and checksum(meta_bytes, data) != row[layout.CHECKSUM]:
                # Not what its writer published: bytes a late writer left there. A miss,
                # never another feature.
                self._corrupt(key, "does not match its checksum")
                return None
            try:
                # A lookup reads no bytes to check: its meta may be what a late writer
                # left there. Not ours to decode: a miss. (One that decodes is checked
                # with the bytes by the get that follows.)
                return data, FeatureMeta.decode(meta_bytes)
            except msgspec.DecodeError:
                self._corrupt(key, "has a meta that is not a feature's")
                return None
        return None

    def _corrupt(self, key: str, what: str) -> None:
        """A miss, counted, logged, and the entry dropped: left in the directory it
        would be found by every lookup (the proxy would keep sending references to it,
        each failing) until evicted; dropped, the next encode of the image replaces it."""
        self.corrupt_reads += 1
        logger.warning("mmstore: %s %s (a late writer's bytes); read as a miss and "
                       "dropped", key, what)
        self._tell(wire.Delete(0, key))

    # -- FeatureStore ------------------------------------------------------------
    def put(self, key: str, data, meta: FeatureMeta) -> bool:
        view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        meta_bytes = meta.encode()
        placed = self._call(wire.Reserve(0, key, view.nbytes, meta_bytes))
        if isinstance(placed, wire.Placed) and placed.arena_id != self._arena.arena_id:
            # The server restarted since we mapped its arena: give the reservation
            # back, map the new arena, then ask again.
            self._call(wire.Abort(0, key, placed.token))
            self._map_arena()
            placed = self._call(wire.Reserve(0, key, view.nbytes, meta_bytes))
        arena = self._arena
        if not isinstance(placed, wire.Placed) or placed.arena_id != arena.arena_id:
            return False
        try:
            start = placed.offset
            arena.mapping[start:start + len(meta_bytes)] = meta_bytes
            begin = start + layout.meta_span(len(meta_bytes))
            arena.bytes[begin:begin + view.nbytes] = view
        except BaseException:
            self._call(wire.Abort(0, key, placed.token))
            raise
        digest = checksum(meta_bytes, view)
        return isinstance(self._call(wire.Commit(0, key, placed.token, digest)), wire.Done)

    def get(self, key: str) -> tuple[np.ndarray, FeatureMeta] | None:
        found = self._read(key, with_bytes=True)
        self._report(wire.Touched(0, key) if found else wire.Missed(0, key))
        return found

    def lookup(self, key: str) -> FeatureMeta | None:
        found = self._read(key, with_bytes=False)
        return found[1] if found else None

    def pin(self, key: str) -> FeatureMeta | None:
        """Found in the directory, then held without waiting for the server. Until the
        server has taken the hold, only a full turn of the LRU order could evict a
        feature that was just found (it is the most recently used)."""
        found = self._read(key, with_bytes=False)
        if found is None:
            return None
        self._tell(wire.Hold(0, key))
        return found[1]

    def unpin(self, key: str) -> None:
        self._tell(wire.Release(0, key))

    def delete(self, key: str) -> bool:
        return isinstance(self._call(wire.Delete(0, key)), wire.Done)

    def close(self) -> None:
        for req in self._reads:
            self._tell(req)
        self._sock.close()
        self._ctx.term()
        # Views of the mapping keep it open until they are collected; nothing else to do.
