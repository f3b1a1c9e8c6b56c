"""The side channel between decode and prefill workers: ZeroMQ, one I/O thread.

Runs in engine worker processes. ZeroMQ sockets are not thread-safe, so one thread
owns them all: it receives, calls the owner's handler, and sends what other threads
posted through `post()` (an inproc queue that wakes it at once). The same thread calls
`on_tick()` every `tick_s`, which is where timeouts are checked.
- prefill: `Channel.serve(host, port)` binds a ROUTER; replies go to the peer's identity.
- decode: `Channel.client()` keeps one DEALER per prefill address (ZeroMQ reconnects
  it by itself when that prefill restarts on the same address), and watches its
  connection (a ZeroMQ socket monitor): `connected(address)` is False once it is closed
  or refused (the process is gone: the kernel closed its sockets), and stays True for a
  process that is there but stopped (its kernel keeps the connection).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger("vllm.epd_serve.kv.channel")

Handler = Callable[[str, bytes], None]  # (peer, payload)


class Channel:
    def __init__(self, name: str, handler: Handler, on_tick: Callable[[], None],
                 tick_s: float = 0.05):
        self.name = name
        self.handler = handler
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.context = zmq.Context()
        self._mailbox_addr = f"inproc://epd-kv-{uuid.uuid4().hex}"
        self._mailbox = self.context.socket(zmq.PULL)
        self._mailbox.bind(self._mailbox_addr)
        self._local = threading.local()
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # a dealer's monitor -> its address
        self._connected: dict[str, bool] = {}  # address -> its connection is up
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- set-up ---------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://{host}:{port}")
        self._router = router

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"epd-kv-{self.name}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.post("", b"")  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.context.destroy(linger=0)

    # -- any thread -----------------------------------------------------------
    def post(self, peer: str, payload: bytes) -> None:
        """Queue `payload` for `peer` (a prefill address for clients, a client
        identity for servers); sent by the I/O thread."""
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.connect(self._mailbox_addr)
            self._local.push = sock
        sock.send_multipart([peer.encode(), payload])

    # -- the I/O thread -----------------------------------------------------
    def _dealer(self, address: str) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # A readable identity: the prefill side keys its replies by it.
            sock.setsockopt(zmq.IDENTITY, f"{self.name}-{uuid.uuid4().hex[:12]}".encode())
            # Unsent messages to a prefill that is gone are dropped after a while
            # instead of piling up; the timeouts above us decide what happens.
            sock.setsockopt(zmq.SNDHWM, 10000)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_CONNECT_RETRIED)
            sock.connect(f"tcp://{address}")
            self._dealers[address] = sock
            self._monitors[monitor] = address
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
        return sock

    def connected(self, address: str) -> bool | None:
        """(The I/O thread.) Whether the connection to the prefill at `address` is up:
        False once it closed or was refused (its process is gone), None before any."""
        return self._connected.get(address)

    def _watch(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            self._connected[self._monitors[monitor]] = event == zmq.EVENT_CONNECTED

    def _send(self, peer: str, payload: bytes) -> None:
        if self._router is not None:
            self._router.send_multipart([peer.encode(), payload], zmq.NOBLOCK)
        else:
            self._dealer(peer).send(payload, zmq.NOBLOCK)

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._mailbox, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = dict(self._poller.poll(timeout=self.tick_s * 1000))
                if self._mailbox in ready:
                    while True:
                        try:
                            peer, payload = self._mailbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if payload:
                            try:
                                self._send(peer.decode(), payload)
                            except zmq.Again:
                                logger.warning("epd-kv: dropped a message to %s (queue full)",
                                               peer.decode())
                if self._router is not None and self._router in ready:
                    while True:
                        try:
                            identity, payload = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handler(identity.decode(), payload)
                for monitor in [m for m in self._monitors if m in ready]:
                    self._watch(monitor)
                addresses = {sock: addr for addr, sock in self._dealers.items()}
                for sock, address in addresses.items():
                    if sock in ready:
                        while True:
                            try:
                                payload = sock.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self.handler(address, payload)
                self.on_tick()
            except zmq.ContextTerminated:
                return
            except Exception:  # one bad message must not end the channel
                logger.exception("epd-kv: side channel %s", self.name)
