"""Layout of the shared-memory arena, shared by the store server and its clients.

The arena file in /dev/shm starts with a directory of fixed 64-byte slots, then the
data region. Each feature has two candidate slots (from its key's 128-bit xxh3 hash),
so a client finds it without asking the server: a get is a local lookup plus a copy.
Each slot is a seqlock: the server makes its generation odd, rewrites the slot, then
makes it even again; a reader copies the feature between two reads of the generation
and trusts the copy only if both are the same even number. Space of an evicted
feature is reused only after its slot was cleared, so a torn read is always caught.

Each slot also holds the checksum its writer published (xxh3_64 of the meta and the
bytes, `checksum`): a reader that finds its copy does not match reads a miss, so bytes a
late writer left in space since given to another feature are never taken for it.

A spare word of slot 0 marks an arena retired: its server stopped, or a server that
started after it was killed took over. A client that finds it set maps the new arena
(the old mapping outlives the file, so without the mark a reader would keep reading a
directory nobody writes to any more).
"""

from __future__ import annotations

import numpy as np
import xxhash

SLOT_WORDS = 8  # 64 bytes: gen, key_lo, key_hi, offset, meta_len, nbytes, spare, checksum
GEN, KEY_LO, KEY_HI, OFFSET, META_LEN, NBYTES, RETIRED, CHECKSUM = range(8)  # RETIRED: slot 0
PAGE = 4096
META_ALIGN = 64


def key_hash(key: str) -> tuple[int, int]:
    h = xxhash.xxh3_128_intdigest(key.encode())
    return h & 0xFFFF_FFFF_FFFF_FFFF, h >> 64


def slot_count(capacity: int) -> int:
    """About one slot per 64 KiB of capacity (features are rarely smaller), at least
    1024, a power of two."""
    want = max(1024, capacity // (64 << 10))
    return 1 << (want - 1).bit_length()


def directory_bytes(nslots: int) -> int:
    return nslots * SLOT_WORDS * 8


def data_start(nslots: int) -> int:
    return (directory_bytes(nslots) + PAGE - 1) // PAGE * PAGE


def meta_span(meta_len: int) -> int:
    return (meta_len + META_ALIGN - 1) // META_ALIGN * META_ALIGN


class Directory:
    """The slot table over a uint64 buffer (the mapped arena, or any array in tests)."""

    def __init__(self, words: np.ndarray):
        self.slots = words.reshape(-1, SLOT_WORDS)
        self.nslots = self.slots.shape[0]

    def candidates(self, key: str) -> tuple[tuple[int, int], tuple[int, int]]:
        lo, hi = key_hash(key)
        return (lo, hi), (lo % self.nslots, hi % self.nslots)

    # -- reader side (clients) ---------------------------------------------
    def find(self, key: str) -> tuple[int, list[int]] | None:
        """(slot, row) of the key's slot as read now, or None. The caller re-checks the
        generation with `still_valid` after copying the bytes."""
        (lo, hi), pair = self.candidates(key)
        for slot in pair:
            row = self.slots[slot].tolist()
            if row[KEY_LO] == lo and row[KEY_HI] == hi and row[GEN] and not row[GEN] & 1:
                return slot, row
        return None

    def still_valid(self, slot: int, row: list[int]) -> bool:
        return int(self.slots[slot, GEN]) == row[GEN]

    def retired(self) -> bool:
        return bool(self.slots[0, RETIRED])

    def retire(self) -> None:
        """Tell the arena's clients that no server writes to it any more."""
        self.slots[0, RETIRED] = 1

    # -- writer side (the server only) ---------------------------------------
    def publish(self, slot: int, key: str, offset: int, meta_len: int, nbytes: int,
                digest: int = 0) -> None:
        lo, hi = key_hash(key)
        s = self.slots[slot]
        gen = int(s[GEN])
        s[GEN] = gen + 1 if not gen & 1 else gen  # odd: being rewritten
        s[KEY_LO], s[KEY_HI], s[OFFSET], s[META_LEN], s[NBYTES] = lo, hi, offset, meta_len, nbytes
        s[CHECKSUM] = digest
        s[GEN] = int(s[GEN]) + 1  # even again: valid

    def clear_all(self) -> None:
        """Empty the directory of an arena a new server takes over (each slot through
        its seqlock: a client reading an old entry sees it go), and serve it again."""
        for slot in np.flatnonzero(self.slots[:, KEY_LO] | self.slots[:, KEY_HI]):
            self.clear(int(slot))
        self.slots[0, RETIRED] = 0

    def clear(self, slot: int) -> None:
        s = self.slots[slot]
        gen = int(s[GEN])
        s[GEN] = gen + 1 if not gen & 1 else gen
        s[KEY_LO] = s[KEY_HI] = 0
        # Left odd-free but keyless: readers see no match; the next publish bumps it.
        s[GEN] = int(s[GEN]) + 1
