"""The proxy's listening socket, handed by the supervisor to each proxy it starts.

A proxy process that dies closes its own listening socket, and until its successor
has bound the port again every client is refused (a few seconds of Python start-up).
So the supervisor binds the port itself and hands the socket to each proxy process it
starts (as systemd's socket activation does): while no proxy runs, the kernel keeps
accepting connections into the socket's backlog, and the next proxy answers them. Only
the requests the dead process was answering are lost.

The supervisor opens it (`listening_socket`) when it first starts the proxy; the proxy
finds it in `LISTEN_FD_ENV` (`inherited_socket`). A supervisor that adopts a running
proxy cannot bind the port that proxy holds: the proxy's next restart binds it then.
"""

from __future__ import annotations

import os
import socket

LISTEN_FD_ENV = "EPD_LISTEN_FD"
BACKLOG = 1024  # connections the kernel queues while no proxy accepts them


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (raises OSError if the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def inherited_socket() -> socket.socket | None:
    """The listening socket this process was handed, if any (taken out of the
    environment: whatever this process starts was handed nothing)."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if not fd:
        return None
    return socket.socket(fileno=int(fd))
