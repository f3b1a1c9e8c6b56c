"""The proxy's hop client against a raw HTTP server each test scripts: keep-alive reuse,
the one safe retry, broken, silent and malformed answers, aborts and back-pressure."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from epd_serve.proxy.hop_client import PAUSE_ABOVE, HopBroken, HopClient, Origin
from epd_serve.proxy.upstream import Hung

JSON = {"content-type": "application/json"}


class Server:
    """Answers each request with `answer(reader, writer, request_number, connection_number)`
    and records what it read: (connection number, request head, body)."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[tuple[int, bytes, bytes]] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.origin = Origin(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append((number, head, body))
                if await self.answer(reader, writer, len(self.requests), number) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


async def quiet(reader: asyncio.StreamReader, seconds: float) -> None:
    """Send nothing for `seconds`, noticing (ConnectionResetError) a client that hangs up."""
    try:
        if await asyncio.wait_for(reader.read(1), seconds) == b"":
            raise ConnectionResetError("the client closed the connection")
    except asyncio.TimeoutError:
        pass


def whole(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def echo(reader, writer, n, conn):
    writer.write(whole(b'{"n": %d}' % n))
    await writer.drain()


def run(coro):
    return asyncio.run(coro)


def test_answers_come_whole_and_connections_are_kept_alive():
    async def go():
        async with Server(echo) as server:
            client = HopClient()
            answers = []
            for _ in range(3):
                resp = await client.post(server.origin, "/v1/x", b'{"a": 1}',
                                         {**JSON, "X-Request-Id": "r1"})
                answers.append((resp.status, await resp.read()))
                resp.release()
            client.close()
            return server, answers

    server, answers = run(go())
    assert answers == [(200, b'{"n": 1}'), (200, b'{"n": 2}'), (200, b'{"n": 3}')]
    assert server.connections == 1  # one keep-alive connection for the three
    number, head, body = server.requests[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Request-Id: r1\r\n" in head and b"content-type: application/json" in head
    assert body == b'{"a": 1}'


def test_a_streamed_answer_is_read_as_it_comes():
    async def go():
        gate = asyncio.Event()

        async def stream(reader, writer, n, conn):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + chunk(b"data: 1\n\n"))
            await writer.drain()
            await gate.wait()
            writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await writer.drain()

        async with Server(stream) as server:
            client = HopClient()
            resp = await client.post(server.origin, "/s", b"{}", JSON)
            first = await resp.readany()  # before the rest was even written
            gate.set()
            second = await resp.readany()
            end = await resp.readany()
            resp.release()
            again = await client.post(server.origin, "/s", b"{}", JSON)  # reused after a stream
            rest = await again.read()
            again.release()
            client.close()
            return first, second, end, rest, server.connections

    first, second, end, rest, connections = run(go())
    assert (first, second, end) == (b"data: 1\n\n", b"data: 2\n\n", b"")
    assert rest == b"data: 1\n\ndata: 2\n\n" and connections == 1


def test_a_reused_connection_closed_before_the_instance_read_the_request_is_sent_again():
    # uvicorn closes an idle connection as a request arrives on it: the request was never
    # read, so the client sends it once more on a new connection.
    async def close_on_second(reader, writer, n, conn):
        if n == 2:
            return False  # closes without answering
        writer.write(whole(b"ok%d" % n))
        await writer.drain()

    async def go():
        async with Server(close_on_second) as server:
            client = HopClient()
            first = await client.post(server.origin, "/x", b"{}", JSON)
            await first.read()
            first.release()
            second = await client.post(server.origin, "/x", b"{}", JSON)
            body = await second.read()
            second.release()
            client.close()
            return body, server.connections, [r[0] for r in server.requests]

    body, connections, on = run(go())
    assert body == b"ok3" and connections == 2 and on == [1, 1, 2]


def test_a_new_connection_closed_before_answering_is_an_error_not_a_retry():
    async def go():
        async def hang_up(reader, writer, n, conn):
            return False

        async with Server(hang_up) as server:
            with pytest.raises(HopBroken) as caught:
                await HopClient().post(server.origin, "/x", b"{}", JSON)
            return caught.value, len(server.requests)

    error, requests = run(go())
    assert not error.answered and "before answering" in str(error) and requests == 1


def test_an_answer_broken_off_raises_and_its_connection_is_not_reused():
    async def go():
        async def half(reader, writer, n, conn):
            if n == 1:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
                await writer.drain()
                return False
            writer.write(whole(b"fine"))
            await writer.drain()

        async with Server(half) as server:
            client = HopClient()
            resp = await client.post(server.origin, "/x", b"{}", JSON)
            with pytest.raises(HopBroken) as caught:
                await resp.read()
            resp.release()
            again = await client.post(server.origin, "/x", b"{}", JSON)
            body = await again.read()
            client.close()
            return caught.value, body, server.connections

    error, body, connections = run(go())
    assert error.answered and "before its answer ended" in str(error)
    assert body == b"fine" and connections == 2


def test_a_silent_instance_meets_the_read_deadline():
    async def go():
        async def silent(reader, writer, n, conn):
            await asyncio.sleep(5)

        async with Server(silent) as server:
            with pytest.raises(asyncio.TimeoutError, match="no answer within 0.2 s"):
                await HopClient(read_timeout_s=0.2).post(server.origin, "/x", b"{}", JSON)

            async def trickle(reader, writer, n, conn):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
                await writer.drain()
                await asyncio.sleep(5)

            server.answer = trickle
            resp = await HopClient(read_timeout_s=0.2).post(server.origin, "/x", b"{}", JSON)
            with pytest.raises(asyncio.TimeoutError, match="rest of its answer"):
                await resp.read()
            resp.close()

    run(go())


def test_closing_an_unfinished_answer_closes_its_connection():
    # How the proxy aborts an engine's request when its client leaves.
    async def go():
        async def endless(reader, writer, n, conn):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(chunk(b"data: x\n\n"))
                await writer.drain()
                await asyncio.sleep(0.01)

        async with Server(endless) as server:
            client = HopClient()
            resp = await client.post(server.origin, "/x", b"{}", JSON)
            assert await resp.readany()
            resp.close()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            # nothing went back to the pool: a new request opens a new connection
            server.answer = echo
            again = await client.post(server.origin, "/x", b"{}", JSON)
            await again.read()
            client.close()
            return server.connections

    assert run(go()) == 2


def test_cancelling_a_wait_for_the_answer_closes_the_connection():
    async def go():
        async def silent(reader, writer, n, conn):
            await quiet(reader, 60)

        async with Server(silent) as server:
            task = asyncio.ensure_future(HopClient().post(server.origin, "/x", b"{}", JSON))
            while not server.requests:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)

    run(go())


def test_idle_connections_past_their_time_are_not_reused():
    async def go():
        async with Server(echo) as server:
            client = HopClient(idle_for_s=0.05)
            for _ in range(2):
                resp = await client.post(server.origin, "/x", b"{}", JSON)
                await resp.read()
                resp.release()
                await asyncio.sleep(0.1)
            client.close()
            return server.connections

    assert run(go()) == 2


def test_a_refused_connection_keeps_its_errno():
    # upstream.py tells a gone instance (ECONNREFUSED) from the proxy's own limits by it.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused

        async def go():
            await HopClient().post(Origin(f"http://127.0.0.1:{port}"), "/x", b"{}", JSON)

        with pytest.raises(ConnectionRefusedError) as caught:
            run(go())
    assert caught.value.errno == errno.ECONNREFUSED


def test_something_that_is_not_http_is_a_broken_answer():
    async def go():
        async def garbage(reader, writer, n, conn):
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            await writer.drain()

        async with Server(garbage) as server:
            with pytest.raises(HopBroken, match="not HTTP"):
                await HopClient().post(server.origin, "/x", b"{}", JSON)

    run(go())


def test_a_large_answer_read_slowly_pauses_the_connection_and_arrives_whole():
    size = 4 * PAUSE_ABOVE

    async def go():
        async def big(reader, writer, n, conn):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(size // 4096):
                writer.write(chunk(b"z" * 4096))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with Server(big) as server:
            resp = await HopClient().post(server.origin, "/x", b"{}", JSON)
            await asyncio.sleep(0.2)  # the server writes while nobody reads
            paused = resp._conn.paused
            got = bytearray()
            while chunk_ := await resp.readany():
                got += chunk_
            resp.release()
            return paused, len(got)

    paused, got = run(go())
    assert paused and got == size


def test_a_large_answer_read_whole_is_never_paused():
    size = 8 * PAUSE_ABOVE

    async def go():
        async def big(reader, writer, n, conn):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // 4096):
                writer.write(b"z" * 4096)
                await writer.drain()

        async with Server(big) as server:
            resp = await HopClient(read_timeout_s=5).post(server.origin, "/x", b"{}", JSON)
            body = await resp.read()
            resp.release()
            return len(body)

    assert run(go()) == size


def test_a_header_value_with_a_line_break_is_refused():
    async def go():
        async with Server(echo) as server:
            with pytest.raises(ValueError, match="line break"):
                await HopClient().post(server.origin, "/x", b"{}",
                                       {"X-Request-Id": "a\r\nX-Evil: 1"})
            return server.requests

    assert run(go()) == []


class Checks:
    """A liveness check (Upstream.still_alive's part) giving scripted verdicts."""

    def __init__(self, verdicts, takes_s=0.01):
        self.verdicts, self.takes_s, self.asked = list(verdicts), takes_s, []

    async def __call__(self, silent_s, what):
        self.asked.append(what)
        await asyncio.sleep(self.takes_s)
        if not self.verdicts.pop(0):
            raise Hung(f"sent no {what} within {silent_s:g} s")


def answer_after(head_s, rest_s=0.0):
    async def answer(reader, writer, n, conn):
        await quiet(reader, head_s)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nans")
        await writer.drain()
        await asyncio.sleep(rest_s)
        writer.write(b"wer")
        await writer.drain()
    return answer


def test_a_wait_past_its_silence_asks_for_liveness_and_only_a_failed_check_ends_it():
    """Patience: each silence_s passed asks the instance once more while the answer is
    still awaited, for its headers as for its body; a failed check ends the wait with
    what the check raised and closes the connection; a client's own cancellation
    during a check stays a cancellation."""
    async def alive_twice_then_answers():
        checks = Checks([True, True])  # asked at 0.3 s and 0.61 s; the next would be 0.92
        async with Server(answer_after(0.75)) as server:
            resp = await HopClient().post(server.origin, "/x", b"{}", JSON, (0.3, checks))
            body = await resp.read()
        return resp.status, body, checks.asked

    async def silent_mid_answer():
        checks = Checks([True])
        async with Server(answer_after(0.0, rest_s=0.45)) as server:
            resp = await HopClient().post(server.origin, "/x", b"{}", JSON, (0.3, checks))
            body = await resp.read((0.3, checks))
        return body, checks.asked

    async def found_hung():
        checks = Checks([True, False])
        async with Server(answer_after(60)) as server:
            with pytest.raises(Hung, match="sent no answer within 0.05 s"):
                await HopClient().post(server.origin, "/x", b"{}", JSON, (0.05, checks))
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
        return len(checks.asked), asyncio.current_task().cancelling()

    async def client_leaves_during_a_check():
        checks = Checks([False], takes_s=0.3)
        async with Server(answer_after(60)) as server:
            waiting = asyncio.ensure_future(
                HopClient().post(server.origin, "/x", b"{}", JSON, (0.05, checks)))
            await asyncio.sleep(0.2)  # the check has begun
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
        return len(checks.asked)

    assert run(alive_twice_then_answers()) == (200, b"answer", ["answer", "answer"])
    assert run(silent_mid_answer()) == (b"answer", ["rest of its answer"])
    assert run(found_hung()) == (2, 0)
    assert run(client_leaves_during_a_check()) == 1


def test_the_read_deadline_holds_across_checks_that_find_the_instance_alive():
    # A slow instance is waited for, but no longer than the read deadline in all.
    async def go():
        checks = Checks([True] * 100)
        async with Server(answer_after(60)) as server:
            client = HopClient(read_timeout_s=0.5)
            with pytest.raises(asyncio.TimeoutError, match="no answer within 0.5 s"):
                await client.post(server.origin, "/x", b"{}", JSON, (0.1, checks))
        return len(checks.asked)

    assert 3 <= run(go()) <= 5


def test_origins_are_parsed_once_from_instance_urls():
    origin = Origin("http://10.0.0.5:8100")
    assert (origin.host, origin.port, origin.ssl, origin.host_header) == \
        ("10.0.0.5", 8100, False, b"10.0.0.5:8100")
    secure = Origin("https://e0.internal")
    assert (secure.port, secure.ssl) == (443, True)
    with pytest.raises(ValueError):
        Origin("unix:///tmp/sock")
