"""The shared-memory store's bookkeeping, kept by the server: where each feature lies
in the arena, its directory slot, LRU order, pins and byte capacity. No I/O.

Space is handed out first-fit from a free list of (offset, size) runs that merge on
free. A reservation that does not fit evicts least-recently-used entries until it
does; pinned entries (a consumer is loading them) and uncommitted ones are not
evicted, so a store full of pinned entries refuses the put (the consumer then
recomputes). A feature also needs one of its two directory slots: if both are taken,
the less recently used occupant is evicted.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from epd_serve.mmstore.shm_layout import PAGE, Directory, meta_span


@dataclass
class Entry:
    offset: int  # where the meta starts; the bytes follow at offset + meta_span(len(meta))
    nbytes: int
    span: int  # bytes taken in the arena (page-aligned)
    meta: bytes
    slot: int
    committed: bool = False
    pins: int = 0
    # A client that dies holding a pin or a reservation must not hold the space
    # forever: both lapse after `hold_s`.
    held_until: float = 0.0
    token: int = 0  # its reservation's: the one Commit and Abort are taken with

    @property
    def data_offset(self) -> int:
        return self.offset + meta_span(len(self.meta))


@dataclass
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refused_full: int = 0


@dataclass
class Index:
    directory: Directory
    start: int  # first byte of the data region in the arena
    capacity: int  # bytes of the data region
    hold_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)  # LRU first
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self.capacity = self.capacity // PAGE * PAGE
        self._tokens = itertools.count(1)
        self._free: list[tuple[int, int]] = [(self.start, self.capacity)]  # by offset
        self._slot_owner: dict[int, str] = {}

    @property
    def used_bytes(self) -> int:
        return sum(e.span for e in self.entries.values())

    # -- space ---------------------------------------------------------------
    def _take(self, span: int) -> int | None:
        for i, (offset, size) in enumerate(self._free):
            if size >= span:
                if size == span:
                    del self._free[i]
                else:
                    self._free[i] = (offset + span, size - span)
                return offset
        return None

    def _give_back(self, offset: int, span: int) -> None:
        i = bisect.bisect(self._free, (offset, span))
        self._free.insert(i, (offset, span))
        if i + 1 < len(self._free) and offset + span == self._free[i + 1][0]:
            self._free[i] = (offset, span + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def _evictable(self, entry: Entry, now: float) -> bool:
        if not entry.committed or entry.pins:
            return now > entry.held_until
        return True

    def _drop(self, key: str) -> Entry:
        entry = self.entries.pop(key)
        # Clear the slot before the space can be handed out again: a reader still
        # copying sees the generation move and throws its copy away.
        if entry.committed:
            self.directory.clear(entry.slot)
        del self._slot_owner[entry.slot]
        self._give_back(entry.offset, entry.span)
        return entry

    def _evict(self, key: str) -> None:
        evicted = self._drop(key)
        self.counters.evictions += 1
        self.counters.evicted_bytes += evicted.nbytes

    def _free_slot(self, key: str, now: float) -> int | None:
        _, pair = self.directory.candidates(key)
        for slot in pair:
            if slot not in self._slot_owner:
                return slot
        owners = [self._slot_owner[s] for s in pair]
        order = list(self.entries)  # LRU first
        for slot, owner in sorted(zip(pair, owners), key=lambda so: order.index(so[1])):
            if self._evictable(self.entries[owner], now):
                self._evict(owner)
                return slot
        return None

    # -- operations ----------------------------------------------------------
    def reserve(self, key: str, nbytes: int, meta: bytes) -> Entry | str:
        """The entry to write the feature into, or 'exists' / 'full'."""
        if key in self.entries:
            return "exists"
        span = (meta_span(len(meta)) + nbytes + PAGE - 1) // PAGE * PAGE
        now = self.clock()
        slot = self._free_slot(key, now) if span <= self.capacity else None
        if slot is None:
            self.counters.refused_full += 1
            return "full"
        offset = self._take(span)
        while offset is None:
            victim = next((k for k, e in self.entries.items() if self._evictable(e, now)), None)
            if victim is None:
                self.counters.refused_full += 1
                return "full"
            self._evict(victim)
            offset = self._take(span)
        entry = Entry(offset, nbytes, span, meta, slot, held_until=now + self.hold_s,
                      token=next(self._tokens))
        self.entries[key] = entry
        self._slot_owner[slot] = key
        return entry

    def commit(self, key: str, token: int, digest: int) -> str | None:
        """Publish the feature its writer reserved with `token`; why not ('missing',
        'lapsed': its reservation was given away and this is not its writer's to
        publish), or None once published."""
        entry = self.entries.get(key)
        if entry is None or entry.committed:
            return "missing"
        if entry.token != token:
            return "lapsed"
        entry.committed = True
        self.directory.publish(entry.slot, key, entry.offset, len(entry.meta), entry.nbytes,
                               digest)
        self.counters.puts += 1
        self.counters.put_bytes += entry.nbytes
        return None

    def abort(self, key: str, token: int) -> None:
        entry = self.entries.get(key)
        if entry is not None and not entry.committed and entry.token == token:
            self._drop(key)

    def touch(self, key: str) -> None:
        """A client read the feature on its own: count the hit, refresh its LRU place."""
        if key in self.entries:
            self.entries.move_to_end(key)
            self.counters.hits += 1

    def acquire(self, key: str) -> Entry | None:
        entry = self.lookup(key)
        if entry is not None:
            entry.pins += 1
            entry.held_until = self.clock() + self.hold_s
        return entry

    def release(self, key: str) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.pins:
            entry.pins -= 1

    def lookup(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        if entry is None or not entry.committed:
            self.counters.misses += 1
            return None
        self.touch(key)
        return entry

    def delete(self, key: str) -> bool:
        """False if absent, or pinned: a consumer is loading it right now."""
        entry = self.entries.get(key)
        if entry is None or (entry.pins and self.clock() <= entry.held_until):
            return False
        self._drop(key)
        return True
