"""The node-local shared-memory store server: `python -m epd_serve.mmstore.shm_server`.

One process per node, started by the launcher. It owns the arena (a file in /dev/shm
that clients map; layout in shm_layout.py) and the index (shm_index.py), and is the
only writer of the directory. Clients talk to it over a ZeroMQ socket on 127.0.0.1 to
reserve, commit, pin and delete; gets need no message. Counters are served as
Prometheus metrics on the spec's metrics port.

The arena's file is the store's, not one server's: a server that restarts (killed,
stopped, crashed) opens the same file, empties its directory and serves from the same
pages. So a restart never needs a second arena's worth of /dev/shm (clients still map
the first one until they follow; a fresh file would be charged on top of it), and the
clients' mappings stay valid: they see the emptied directory, then the new entries. One
server at a time holds the file (a lock); the launcher removes the file when the
deployment stops (`remove_arena`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import numpy as np
import zmq
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epd_serve.mmstore import shm_layout as layout
from epd_serve.mmstore import shm_wire as wire
from epd_serve.mmstore.shm_index import Index
from epd_serve.mmstore.spec import StoreSpec

log = logging.getLogger("epd_serve.mmstore")

SHM_DIR = Path("/dev/shm")


ARENA_PREFIX = "epd-mmstore-"
ARENA_SUFFIX = ".arena"


def arena_path(spec: StoreSpec) -> Path:
    """The store's arena file: the same for every server of this store."""
    return SHM_DIR / f"{ARENA_PREFIX}{spec.name}-{spec.port}{ARENA_SUFFIX}"


def remove_arena(spec: StoreSpec) -> bool:
    """The deployment stops: retire the arena (a client still mapping it stops reading
    it) and remove its file, which frees its memory once the last mapping goes."""
    path = arena_path(spec)
    with contextlib.suppress(OSError, ValueError):
        retire_arena(path)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def remove_stale_arenas() -> list[Path]:
    """Delete arenas of earlier releases, one per server (named by its pid), whose
    server is gone: they hold memory. Each is marked retired first."""
    removed = []
    for path in SHM_DIR.glob(f"{ARENA_PREFIX}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError, ValueError):
                retire_arena(path)
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def retire_arena(path: Path) -> None:
    with path.open("r+b") as file, mmap.mmap(file.fileno(), layout.PAGE) as head:
        layout.Directory(np.frombuffer(head, dtype=np.uint64, count=layout.SLOT_WORDS)).retire()
        del head  # the numpy view must go before the mapping closes


class _Metrics:
    """Exposes the index's counters at scrape time (no double bookkeeping)."""

    def __init__(self, index: Index):
        self.index = index

    def collect(self):
        c = self.index.counters
        for name, value, doc in (
            ("puts", c.puts, "Features stored"),
            ("put_bytes", c.put_bytes, "Bytes of features stored"),
            ("hits", c.hits, "Lookups and gets that found the feature"),
            ("misses", c.misses, "Lookups and gets that did not"),
            ("evictions", c.evictions, "Features evicted to make room"),
            ("evicted_bytes", c.evicted_bytes, "Bytes evicted"),
            ("refused_full", c.refused_full, "Puts refused: everything else pinned"),
        ):
            yield CounterMetricFamily(f"epd_mmstore_{name}", doc, value=value)
        yield GaugeMetricFamily("epd_mmstore_used_bytes", "Arena bytes in use",
                                value=self.index.used_bytes)
        yield GaugeMetricFamily("epd_mmstore_entries", "Features held",
                                value=len(self.index.entries))
        yield GaugeMetricFamily("epd_mmstore_capacity_bytes", "Arena size",
                                value=self.index.capacity)


class StoreServer:
    def __init__(self, spec: StoreSpec):
        self.spec = spec
        self.arena_id = secrets.token_hex(8)
        for stale in remove_stale_arenas():
            log.info("removed %s, left by a server that was killed", stale)
        self.path = arena_path(spec)
        nslots = layout.slot_count(spec.capacity_bytes)
        start = layout.data_start(nslots)
        size = start + spec.capacity_bytes
        self._fd, reused = _take_arena_file(self.path, size)
        try:
            # The store's memory is taken at start, as Mooncake's segments are: a
            # /dev/shm too small fails here, not at some later put. (A file taken over
            # from the server before has its pages already: this allocates none.)
            os.posix_fallocate(self._fd, 0, size)
            self.arena = mmap.mmap(self._fd, size)
        except OSError as err:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise SystemExit(f"cannot take {size >> 20} MiB in {SHM_DIR} for the MM Store: "
                             f"{err}; lower mm_store.capacity or enlarge {SHM_DIR}") from None
        words = np.frombuffer(self.arena, dtype=np.uint64, count=nslots * layout.SLOT_WORDS)
        directory = layout.Directory(words)
        if reused:
            directory.clear_all()  # what the server before held is not this one's
        self.index = Index(directory, start, spec.capacity_bytes, hold_s=spec.hold_s)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{spec.host}:{spec.port}")
        registry = CollectorRegistry()
        registry.register(_Metrics(self.index))
        # Reserve to commit: the client's copy into the arena plus one round trip.
        self.put_seconds = Histogram(
            "epd_mmstore_put_seconds", "Time from reserving space to committing a feature",
            buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1],
            registry=registry)
        self._reserved_at: dict[str, float] = {}
        start_http_server(spec.metrics_port, addr=spec.host, registry=registry)

    def handle(self, req: wire.Request) -> wire.Reply | None:
        idx = self.index
        match req:
            case wire.Hello():
                if req.version != wire.VERSION:
                    return wire.Refused(req.seq, f"bad request: protocol {req.version}, "
                                                 f"server speaks {wire.VERSION}")
                return wire.Welcome(req.seq, self.arena_id, str(self.path), len(self.arena),
                                    idx.directory.nslots)
            case wire.Reserve():
                placed = idx.reserve(req.key, req.nbytes, req.meta)
                if isinstance(placed, str):
                    return wire.Refused(req.seq, placed)
                if len(self._reserved_at) > 10_000:  # clients that died before committing
                    self._reserved_at.clear()
                self._reserved_at[req.key] = time.perf_counter()
                return wire.Placed(req.seq, self.arena_id, placed.offset, placed.token)
            case wire.Commit():
                refused = idx.commit(req.key, req.token, req.checksum)
                reserved = self._reserved_at.pop(req.key, None)
                if reserved is not None and refused is None:
                    self.put_seconds.observe(time.perf_counter() - reserved)
                return wire.Done(req.seq) if refused is None else wire.Refused(req.seq, refused)
            case wire.Abort():
                self._reserved_at.pop(req.key, None)
                idx.abort(req.key, req.token)
                return wire.Done(req.seq)
            case wire.Hold():
                idx.acquire(req.key)
            case wire.Release():
                idx.release(req.key)
            case wire.Touched():
                idx.touch(req.key)
            case wire.Missed():
                idx.counters.misses += 1
            case wire.Delete():
                done = idx.delete(req.key)
                return wire.Done(req.seq) if done else wire.Refused(req.seq, "missing")
        return None

    def serve_forever(self) -> None:
        log.info("MM Store (shm) on %s, %d MiB arena %s, metrics :%d", self.spec.address,
                 self.index.capacity >> 20, self.path, self.spec.metrics_port)
        try:
            while True:
                # Poll with a timeout: a signal delivered to one of the metrics threads
                # would not interrupt a blocking receive, and SIGTERM must stop us.
                if not self.sock.poll(500):
                    continue
                ident, payload = self.sock.recv_multipart()
                try:
                    reply = self.handle(wire.request_decoder.decode(payload))
                except Exception as err:  # a bad message must not take the store down
                    log.warning("bad request: %s", err)
                    reply = wire.Refused(-1, f"bad request: {err}")
                if reply is not None:
                    self.sock.send_multipart([ident, wire.encoder.encode(reply)])
        finally:
            self.close()

    def close(self) -> None:
        """The arena stays for the next server of this store (the launcher removes it
        when the deployment stops)."""
        self.sock.close()
        self.ctx.term()


def _take_arena_file(path: Path, size: int) -> tuple[int, bool]:
    """The arena file, open and locked for this server: the one a server before left
    (True) when it has this size, else a new one. The lock, held until this process
    ends, keeps a second server of the same store from writing the same directory."""
    for attempt in (1, 2):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SystemExit(f"{path} is held by another MM Store server of this "
                             "store") from None
        held = os.fstat(fd).st_size
        if held in (0, size) or attempt == 2:
            return fd, held == size
        # Another capacity: clients of the old file move to a new one.
        with contextlib.suppress(OSError, ValueError):
            retire_arena(path)
        path.unlink(missing_ok=True)
        os.close(fd)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="epd-serve MM Store, shared-memory tier")
    parser.add_argument("--spec", required=True, help="StoreSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Every put waits on this process twice. Beside busy engines on few cores it may
    # otherwise wait tens of milliseconds to be scheduled (measured: put p90 60 ms on 2
    # cores, median 1.8 ms); it uses little CPU, so it may go first.
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    server = StoreServer(StoreSpec.from_json(args.spec))
    # SIGTERM from the launcher: leave the loop and close the socket.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
