"""Prefill side: how long a write may take before its transfer is failed.

Runs in a prefill engine's worker process, for the sender (its submit thread asks,
sender_submit.py; its completion thread reports, sender_complete.py). A write's steady-state deadline is sized to the bytes
in flight (`Settings.transfer_timeout_s`, at least `transfer_timeout_floor_s`). The
first write to a decode session also pays for the transport's connect, which the floor
is not meant to cover: Mooncake's Ascend transport connects ADXL to the peer on its
first transfer there (`checkAndConnect`, up to ASCEND_CONNECT_TIMEOUT, 10 s by default
in v0.3.11.post1: transfer_executor_base.h), TCP and RDMA make their handshake. So
until a write to a session has landed, its writes get `first_connect_timeout_s` more.
A failed write makes the session new again: the Ascend transport drops the connection
of a failed transfer and connects afresh on the next one.
"""

from __future__ import annotations

import threading

from epd_serve.connectors.epd_kv.settings import Settings


class WriteDeadlines:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._connected: set[str] = set()  # sessions a write has landed in

    def timeout_s(self, session: str, expected_s: float) -> float:
        """The time a write to `session` expected to take `expected_s` may take."""
        timeout = self.settings.transfer_timeout_s(expected_s)
        with self._lock:
            connected = session in self._connected
        return timeout if connected else timeout + self.settings.first_connect_timeout_s

    def landed(self, session: str) -> None:
        with self._lock:
            self._connected.add(session)

    def failed(self, session: str) -> None:
        with self._lock:
            self._connected.discard(session)
