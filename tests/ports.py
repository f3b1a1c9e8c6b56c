"""Finding free loopback ports for test deployments."""

from __future__ import annotations

import socket


def free_port_block(count: int, start: int = 21000) -> int:
    """A base port with `count` free ports after it on 127.0.0.1."""
    for base in range(start, 60000, 97):
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
