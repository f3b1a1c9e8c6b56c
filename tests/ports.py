"""Finding free loopback ports for test deployments."""

from __future__ import annotations

import os
import socket

# The unit tests run in parallel (pytest-xdist, scripts/test.sh): each worker searches
# ports of its own, this far above the last one's, so two workers never both find the
# same block free before either test's server has bound it. The tests ask for blocks
# from 21000 to 33000 (and a few hundred ports each).
WORKER_SPAN = 13000


def free_port_block(count: int, start: int = 21000) -> int:
    """A base port with `count` free ports after it on 127.0.0.1, in this test
    worker's own range."""
    start += _worker_index() * WORKER_SPAN
    for base in range(start, 65000 - count, 97):
        if all(_free(port) for port in range(base, base + count)):
            return base
    raise RuntimeError("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_index() -> int:
    """pytest-xdist's number of this worker (gw0 -> 0); 0 outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw"))
