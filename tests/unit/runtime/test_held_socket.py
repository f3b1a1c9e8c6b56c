"""The supervisor holds the proxy's listening socket across the proxy's restarts
(protocols/held_socket.py): a client that connects while no proxy runs waits and is
answered by the next one, never refused."""

from __future__ import annotations

import socket
import sys
import threading

from epd_serve.runtime.child import Child
from epd_serve.protocols.held_socket import listening_socket

from ...ports import free_port_block

# A stand-in proxy: answers every connection on the socket it was handed with its pid.
SERVER = """
import os
from epd_serve.protocols.held_socket import inherited_socket
sock = inherited_socket()
while True:
    conn, _ = sock.accept()
    conn.recv(64)
    conn.sendall(str(os.getpid()).encode())
    conn.close()
"""


def ask(port: int, timeout: float = 30.0) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(b"who?")
        return conn.recv(64).decode()


def test_a_client_that_connects_while_the_proxy_restarts_is_answered_not_refused(tmp_path):
    port = free_port_block(1, start=28700)
    child = Child(name="proxy", command=[sys.executable, "-c", SERVER], env={},
                  log_path=tmp_path / "proxy.log", health_url="", listen_on=("127.0.0.1", port))
    try:
        child.start()
        first = ask(port)
        child.process.kill()  # kill -9 of the proxy
        child.process.wait(10)
        answer: list[str] = []
        waiting = threading.Thread(target=lambda: answer.append(ask(port)))
        waiting.start()  # connects while no proxy runs
        waiting.join(1.0)
        assert waiting.is_alive() and not answer  # queued, not refused
        child.start()  # the supervisor starts it again, with the same socket
        waiting.join(30)
        assert answer and answer[0] != first and answer[0] == str(child.process.pid)
    finally:
        if child.process is not None:
            child.process.kill()
            child.process.wait(10)
        child.close_listener()
        child.close_log()


def test_a_port_someone_else_holds_is_left_to_the_proxy_to_bind(tmp_path):
    # As after adopting a running proxy: the supervisor cannot bind, hands nothing.
    port = free_port_block(1, start=28720)
    taken = listening_socket("127.0.0.1", port)
    child = Child(name="proxy", command=[sys.executable, "-c", "import os, sys; "
                                         "sys.exit(3 if 'EPD_LISTEN_FD' in os.environ else 0)"],
                  env={}, log_path=tmp_path / "proxy.log", health_url="",
                  listen_on=("127.0.0.1", port))
    try:
        child.start()
        assert child.process.wait(30) == 0 and child.listener is None
    finally:
        taken.close()
        child.close_log()
