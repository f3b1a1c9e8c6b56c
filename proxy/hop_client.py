"""The HTTP/1.1 client the proxy sends its hops with: one POST to an instance, its answer
read whole or relayed as it arrives, over keep-alive connections kept per instance.

Why not aiohttp's client, which the proxy keeps for everything else (probes, /metrics,
liveness checks, remote media): a hop is bytes the proxy built, posted to a server it
knows, and the proxy sends two or three of them per request. aiohttp's client spends
about 0.26 ms of CPU on each (its request and response objects, URL handling, cookie
jar, tracing hooks, timer bookkeeping), this one about 0.09 ms on a 2-vCPU host
(benchmarks/hop_client_bench.py); on a small host the proxy's CPU per request is its
request rate. The answer is parsed by httptools (llhttp, the parser uvicorn uses):
status line, headers, a Content-Length or chunked body (what uvicorn sends; an answer
that would end only with its connection is taken as broken off).

What it keeps of aiohttp's behaviour, because upstream.py relies on it:
- a connect deadline (asyncio.TimeoutError) and a read deadline: no byte of the answer
  for that long (the proxy's request_timeout_s) fails the wait;
- connection errors as OSError (ConnectionRefusedError keeps its errno, so upstream.py
  tells a gone instance from the proxy's own exhausted descriptors), a connection that
  breaks off an answer as HopBroken (a ConnectionError);
- idle connections dropped before the instances drop them (uvicorn closes them after
  5 s), and one retry on a fresh connection when a reused one was closed before any
  byte of the answer came: the instance never read the request;
- `close()` of an unfinished answer closes its connection, which makes vLLM abort the
  request; `release()` of a finished one returns its connection to the pool;
- reading paused while 256 KiB of a streamed answer wait unread (a slow client of a
  stream); an answer read whole is read whole.

And what the proxy needs of a hop besides: patience. A wait given `patience=(silence_s,
on_silence)` calls `on_silence(silence_s, what)` each time the instance has sent nothing
for silence_s; the wait goes on if it returns and ends with what it raises (upstream.py
asks the instance's /health there, and raises Hung). One timer per wait does both this
and the read deadline, where a task and asyncio.wait around each wait cost 20 us more.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import httptools

__all__ = ["HopBroken", "HopClient", "HopResponse", "Origin", "Patience"]

# (silence_s, on_silence): see the module's docstring.
Patience = tuple[float, Callable[[float, str], Awaitable[None]]]

# An answer's unread bytes above which the connection stops reading (and the instance's
# writes wait): a stream relayed to a slow client is not buffered whole here.
PAUSE_ABOVE = 256 << 10


class HopBroken(ConnectionError):
    """The instance closed the connection, or sent something that is not HTTP, before
    its answer ended. `answered` is False when not one byte of the answer came."""

    def __init__(self, message: str, answered: bool = True):
        super().__init__(message)
        self.answered = answered


class Origin:
    """Where an instance listens, parsed once from its URL."""

    __slots__ = ("host", "port", "ssl", "host_header")

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("ascii")

    def __repr__(self) -> str:
        return f"Origin({self.host}:{self.port})"


class HopResponse:
    """One answer: `status` once its headers came, its body by `read()` (whole) or
    `readany()` (what has come so far; b"" at its end)."""

    def __init__(self, conn: "_Connection", read_timeout_s: float | None):
        self._conn = conn
        self._read_timeout_s = read_timeout_s
        self.status = 0
        self._has_headers = False
        self._news_at = conn.loop.time()  # when the instance last sent something
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._answered = False
        self._waiter: asyncio.Future[bool] | None = None  # True: news; False: silence
        self._released = False
        self._whole = False  # read() is collecting the whole body: never pause it

    # -- fed by the connection -------------------------------------------------------------
    def _got_headers(self, status: int) -> None:
        self.status, self._has_headers = status, True
        self._wake()

    def _got_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE and not self._whole:
            self._conn.pause()
        self._wake()

    def _got_end(self, keep_alive: bool) -> None:
        self._complete, self._keep_alive = True, keep_alive
        self._wake()

    def _broke(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._wake()

    def _wake(self) -> None:
        self._news_at = self._conn.loop.time()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    # -- read by the proxy -----------------------------------------------------------------
    async def _wait_headers(self, patience: Patience | None) -> None:
        while not self._has_headers:
            await self._wait("answer", patience)

    async def read(self, patience: Patience | None = None) -> bytes:
        """The whole body."""
        self._whole = True
        self._conn.resume()
        while not self._complete:
            await self._wait("rest of its answer", patience)
        return self._take()

    async def readany(self, patience: Patience | None = None) -> bytes:
        """The bytes that have come since the last read, waiting for some; b"" once the
        body has ended."""
        while not self._chunks and not self._complete:
            await self._wait("rest of its answer", patience)
        return self._take()

    def _take(self) -> bytes:
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def _wait(self, what: str, patience: Patience | None) -> None:
        """Return once the connection has news (headers, bytes, the end, a failure: the
        caller looks which), or once `patience` found the instance alive after a
        silence; raise the connection's failure, the read deadline, or what `patience`
        raised."""
        if self._error is not None:
            raise self._error
        loop = self._conn.loop
        silence_s = patience[0] if patience is not None else self._read_timeout_s
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(silence_s, _silent, waiter) if silence_s is not None else None
        try:
            if await waiter:
                return
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        limit = self._read_timeout_s
        if patience is None or (limit is not None and loop.time() - self._news_at >= limit):
            raise asyncio.TimeoutError(f"no {what} within {limit:g} s")
        await patience[1](silence_s, what)

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool when the answer
        ended cleanly, else it is closed."""
        if self._released:
            return
        self._released = True
        if self._complete and self._keep_alive and self._error is None:
            self._conn.idle()
        else:
            self._conn.close()

    def close(self) -> None:
        """Drop this answer and its connection (an unfinished request is aborted)."""
        if not self._released:
            self._released = True
            self._conn.close()


def _silent(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one answer in flight (no pipelining)."""

    def __init__(self, pool: "_Pool", loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.response: HopResponse | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0

    def start(self, response: HopResponse, request: Iterable[bytes]) -> None:
        if self.closed or self.transport.is_closing():  # the instance hung up meanwhile
            raise HopBroken("the instance closed the connection before answering", False)
        self.response = response
        self.parser = httptools.HttpResponseParser(self)
        self.transport.writelines(request)

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for on an idle connection: not reusable
            self.close()
            return
        response._answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            response._broke(HopBroken(f"the instance sent something that is not HTTP: {err}"))
            self.close()

    def eof_received(self) -> None:
        # The instance hung up (the transport closes itself): not for a new request.
        self.closed = True
        self.pool.forget(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self.response
        if response is not None:
            answered = response._answered
            why = f": {exc}" if exc else ""
            response._broke(HopBroken(
                f"the instance closed the connection before its answer ended{why}"
                if answered else f"the instance closed the connection before answering{why}",
                answered))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.response._got_headers(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.response._got_body(body)

    def on_message_complete(self) -> None:
        self.response._got_end(self.parser.should_keep_alive())

    # -- used by the response and the pool -------------------------------------------------
    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def idle(self) -> None:
        self.response = self.parser = None
        self.resume()
        self.idle_since = time.monotonic()
        self.pool.put(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            self.transport.close()


class _Pool:
    """Idle connections to one origin, the most recently used first."""

    def __init__(self) -> None:
        self.idle: list[_Connection] = []

    def put(self, conn: _Connection) -> None:
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def take(self, idle_for_s: float) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < idle_for_s:
                return conn
            conn.close()
        return None


class HopClient:
    """POSTs to instances over pooled keep-alive connections (no cap on their number:
    the proxy's admission caps requests at what its open files carry)."""

    def __init__(self, connect_timeout_s: float = 10.0, read_timeout_s: float | None = None,
                 idle_for_s: float = 2.0):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_for_s = idle_for_s
        self._pools: dict[tuple[str, int, bool], _Pool] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, origin: Origin, path: str, payload: bytes, headers: dict[str, str],
                   patience: Patience | None = None) -> HopResponse:
        """Send the request and return its answer once the status line and headers came
        (the body not read yet), waiting for them with `patience`. The caller releases
        or closes the answer."""
        request = _request_lines(origin, path, payload, headers)
        pool = self._pools.get((origin.host, origin.port, origin.ssl))
        if pool is None:
            pool = self._pools[origin.host, origin.port, origin.ssl] = _Pool()
        conn = pool.take(self.idle_for_s)
        if conn is not None:
            try:
                return await self._exchange(conn, request, patience)
            except HopBroken as err:
                if err.answered:
                    raise
                # The instance closed this idle connection as we reused it: it never
                # read the request, so it is safe to send again on a new one.
        return await self._exchange(await self._connect(origin, pool), request, patience)

    async def _connect(self, origin: Origin, pool: _Pool) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.ssl:
            context = self._ssl = self._ssl or ssl.create_default_context()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Connection(pool, loop), origin.host, origin.port, ssl=context)
        return conn

    async def _exchange(self, conn: _Connection, request: list[bytes],
                        patience: Patience | None) -> HopResponse:
        response = HopResponse(conn, self.read_timeout_s)
        try:
            conn.start(response, request)
            await response._wait_headers(patience)
        except BaseException:
            response.close()  # cancelled, timed out or broken: the instance drops the request
            raise
        return response

    def close(self) -> None:
        """Close every idle connection (answers in flight close their own)."""
        for pool in self._pools.values():
            for conn in list(pool.idle):
                conn.close()
        self._pools.clear()


def _request_lines(origin: Origin, path: str, payload: bytes,
                   headers: dict[str, str]) -> list[bytes]:
    lines = [b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nHost: ", origin.host_header,
             b"\r\nContent-Length: ", str(len(payload)).encode(), b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"\r\n")
    return [b"".join(lines), payload]
