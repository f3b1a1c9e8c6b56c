"""Unguessable ids, cheaply: every id the proxy issues (engine request ids, timeline
and span ids, transfer ids, metaserver tokens) is random hex from the operating
system's CSPRNG, so a client that sees its own cannot name another's.

A request takes five or six of them; one `os.urandom` call per id cost the proxy 2.6%
of its CPU at 470 image requests a second (py-spy), so the bytes are drawn 4 KiB at a
time and handed out in slices: still the CSPRNG's output, never reused. One buffer per
thread: the proxy's event loop and the worker threads it uses never share one.
"""

from __future__ import annotations

import os
import threading

_REFILL_BYTES = 4096


class _Entropy(threading.local):
    def __init__(self) -> None:
        self.buffer = b""
        self.at = 0

    def take(self, nbytes: int) -> bytes:
        if self.at + nbytes > len(self.buffer):
            self.buffer, self.at = os.urandom(_REFILL_BYTES), 0
        out = self.buffer[self.at:self.at + nbytes]
        self.at += nbytes
        return out


_entropy = _Entropy()


def random_hex(nbytes: int) -> str:
    """`nbytes` random bytes as hex (twice as many characters)."""
    return _entropy.take(nbytes).hex()
