"""Messages between shared-memory store clients and the store server (msgpack).

Only control travels here; feature bytes go through the mapped arena. Gets need no
message at all (shm_layout.py): clients only report them afterwards (`Touched`,
`Missed`) so the server keeps LRU order and counters. Every request carries a sequence
number that its reply echoes: a reply that arrives after its request timed out is
recognised and dropped.

A put is fenced: its reservation (`Placed`) carries a token, the only one its `Commit`
or `Abort` is taken with. A writer paused past its reservation's hold finds its space
given to another feature and its late Commit refused ("lapsed"); the bytes it wrote
meanwhile into that space are caught by the checksum its Commit publishes (xxh3 of the
meta and the bytes, checked by every reader), so they are never read as a feature.
"""

from __future__ import annotations

import msgspec

VERSION = 2  # 2: fenced puts (tokens, checksums)


class Hello(msgspec.Struct, tag=True):
    seq: int
    version: int = VERSION


class _OnKey(msgspec.Struct):
    """A request about one feature."""

    seq: int
    key: str


class Reserve(_OnKey, tag=True):
    nbytes: int
    meta: bytes


class Commit(_OnKey, tag=True):
    token: int  # the reservation's (Placed.token)
    checksum: int  # xxh3_64 of the meta and the bytes written


class Abort(_OnKey, tag=True):
    token: int


class Hold(_OnKey, tag=True):
    """Pin a feature the client found in the directory (no reply: a consumer's
    scheduler must not wait on the server, which a busy host may not run for a while)."""


class Release(_OnKey, tag=True):
    """Drop one pin (no reply)."""


class Touched(_OnKey, tag=True):
    """A client read the feature through the directory (no reply)."""


class Missed(_OnKey, tag=True):
    """A client looked for the feature and did not find it (no reply)."""


class Delete(_OnKey, tag=True):
    pass


Request = Hello | Reserve | Commit | Abort | Hold | Release | Touched | Missed | Delete


class Welcome(msgspec.Struct, tag=True):
    seq: int
    arena_id: str  # new for every server start: a restarted server has a new arena
    arena_path: str
    arena_bytes: int
    nslots: int
    version: int = VERSION


class Placed(msgspec.Struct, tag=True):
    seq: int
    arena_id: str
    offset: int  # where the meta goes; the bytes follow after it, 64-byte aligned
    token: int  # this reservation's, never reused: Commit and Abort name it


class Refused(msgspec.Struct, tag=True):
    """`exists`, `full`, `missing`, `lapsed` or `bad request: ...`."""

    seq: int
    reason: str


class Done(msgspec.Struct, tag=True):
    seq: int


Reply = Welcome | Placed | Refused | Done

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
