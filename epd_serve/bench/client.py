"""The load generator: sends pre-built requests on schedule and times every chunk.
It also keeps the epd-serve proxy's per-stage header of each answer, where there is one.

Runs in its own asyncio loop (uvloop when installed) in the bench process. aiohttp
rather than httpx: its client costs far less CPU per request, which is what keeps the
schedule at thousands of requests per second on two cores. All clocks are
time.perf_counter() offsets from the run's start.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from epd_serve.bench.timings import RequestRecord
from epd_serve.bench.stages import HEADER as STAGES_HEADER

TRACE_HEADER = "x-epd-trace-id"  # the proxy's id of the request's timeline

# Sleep until this close to a send time, then yield to the loop until it is due:
# epoll waits in whole milliseconds, which alone would cost up to 1 ms of lag.
SPIN_WINDOW_S = 0.0015
START_DELAY_S = 0.05


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, rec: RequestRecord,
               t0: float) -> None:
    now = time.perf_counter
    chunks = 0
    try:
        async with session.post(url, data=body) as resp:
            rec.stages_header = resp.headers.get(STAGES_HEADER)
            rec.trace_id = resp.headers.get(TRACE_HEADER)
            if resp.status != 200:
                text = (await resp.text())[:300]
                rec.error = f"HTTP {resp.status}: {text}"
                rec.end = None
                return
            async for raw in resp.content:
                if not raw.startswith(b"data: "):
                    continue
                payload = raw[6:].strip()
                if payload == b"[DONE]":
                    break
                stamp = now() - t0
                event = json.loads(payload)
                usage = event.get("usage")
                if usage:
                    rec.input_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                if event.get("choices"):
                    if rec.first_token is None:
                        rec.first_token = stamp
                    rec.token_times.append(stamp)
                    chunks += 1
        rec.end = now() - t0
        if rec.output_tokens == 0:
            rec.output_tokens = chunks
        if rec.first_token is None:
            rec.error = "empty stream: no token arrived"
    except asyncio.TimeoutError:
        rec.error = "timeout: no complete answer in time"
    except aiohttp.ClientError as err:
        rec.error = f"{type(err).__name__}: {err}"
    except ValueError as err:
        rec.error = f"bad stream: {err}"


async def run_schedule(url: str, bodies: Sequence[bytes], offsets: Sequence[float],
                       modalities: Sequence[str | bool], max_concurrency: int | None = None,
                       timeout_s: float = 600.0,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       headers: Mapping[str, str] | None = None) -> list[RequestRecord]:
    """Send bodies[i] at offsets[i] seconds after the start, each with `headers` (an
    API key, the admin key); return one record each. modalities[i]: the request's
    modality ("text", "image", "video", ...), or whether it is multimodal (True counts
    as an image request)."""
    records = [_record(i, modalities[i], float(offsets[i])) for i in range(len(bodies))]
    limit = max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers={
            "content-type": "application/json", **(headers or {})}) as session:
        t0 = time.perf_counter() + START_DELAY_S

        async def send(rec: RequestRecord, body: bytes) -> None:
            if gate is not None:
                async with gate:
                    rec.sent = time.perf_counter() - t0
                    await _one(session, url, body, rec, t0)
            else:
                rec.sent = time.perf_counter() - t0
                await _one(session, url, body, rec, t0)
            if on_done:
                on_done(rec)

        tasks = []
        for rec, body in zip(records, bodies):
            due = t0 + rec.scheduled
            wait = due - time.perf_counter()
            if wait > SPIN_WINDOW_S:
                await asyncio.sleep(wait - SPIN_WINDOW_S)
            while time.perf_counter() < due:
                await asyncio.sleep(0)
            tasks.append(asyncio.create_task(send(rec, body)))
        await asyncio.gather(*tasks)
    return records


def _record(index: int, modality: str | bool, scheduled: float) -> RequestRecord:
    if isinstance(modality, str):
        return RequestRecord(index, modality != "text", scheduled, modality=modality)
    return RequestRecord(index, bool(modality), scheduled)


def run(coro):
    """Run a coroutine on uvloop when it is installed (lower per-request overhead)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
