"""Requests for several sequences at once, served as one engine serves them.

Runs in the proxy process. A /v1/completions request with a list of prompts is split
here into one request per prompt, each its own trip through the stages and its own KV
transfer, as an engine splits it into one request per prompt, each with its own
prefill. Where the deployment's KV hand-off cannot have decode sample `n` sequences
from one transfer (every hand-off but epd's, whose decode shares it among the samples:
connectors/epd_kv/scheduler.py), `n` is split too, each sample seeded as vLLM seeds its
samples (`seed + i`). The answers are merged into the one the engine would give:
choices in order (prompt j's sample i at index j*n + i), usage summed (each prompt's
tokens once, whatever its samples), one id; a stream's events are passed on as they
come from any part, their choices renumbered, with one usage event (if asked for) and
one `[DONE]` at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from epd_serve.proxy.errors import ProxyError

_DONE = b"[DONE]"


@dataclasses.dataclass(frozen=True)
class Part:
    """One request of a split one: its body, and where its choices go in the answer."""

    body: dict
    first_choice: int  # the answer's index of this part's choice 0
    counts_prompt: bool  # its prompt's tokens count in the usage (its prompt's first part)


def split(body: dict, prompts: list | None, samples: int, split_samples: bool) -> list[Part] | None:
    """The parts of a request for several sequences (`prompts`: a completion's list of
    prompts, None for one prompt; `samples`: its `n`), or None where the stages serve
    it as it is."""
    several = prompts is not None and len(prompts) > 1
    fan = split_samples and samples > 1
    if not (several or fan):
        return None
    bodies = [{**body, "prompt": p} for p in prompts] if several else [body]
    seed = body.get("seed")
    parts = []
    for j, one in enumerate(bodies):
        if not fan:
            parts.append(Part(one, j * samples, True))
            continue
        for i in range(samples):
            sample = {**one, "n": 1}
            if seed is not None:
                sample["seed"] = seed + i
            parts.append(Part(sample, j * samples + i, i == 0))
    return parts


def _renumbered(part: Part, choices: list[dict]) -> list[dict]:
    return [{**c, "index": part.first_choice + c.get("index", 0)} for c in choices]


class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def add(self, part: Part, usage: dict | None) -> None:
        usage = usage or {}
        if part.counts_prompt:
            self.prompt += usage.get("prompt_tokens") or 0
        self.completion += usage.get("completion_tokens") or 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion}


def merge(parts: Sequence[Part], answers: Sequence[dict]) -> dict:
    """The whole answers of `parts`, as one answer."""
    usage = _Usage()
    choices: list[dict] = []
    for part, answer in zip(parts, answers):
        choices += _renumbered(part, answer.get("choices") or [])
        usage.add(part, answer.get("usage"))
    choices.sort(key=lambda c: c["index"])
    return {**answers[0], "choices": choices, "usage": usage.as_dict()}


async def merged_stream(parts: Sequence[Part], streams: Sequence[AsyncIterator[bytes]],
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The streamed answers of `parts` as one stream. A part's stream that breaks off
    raises its error here, after the events already passed on (the client is told in
    the stream, routes_serving.py); the others are closed."""
    queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[bytes]) -> None:
        buffered = b""
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    buffered += chunk
                    *events, buffered = buffered.split(b"\n\n")
                    for event in events:
                        await queue.put((k, event))
            await queue.put((k, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, err))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    usage, shape = _Usage(), {}
    try:
        open_streams = len(tasks)
        while open_streams:
            k, event = await queue.get()
            if event is None:
                open_streams -= 1
                continue
            if isinstance(event, BaseException):
                raise event
            out = _passed_on(parts[k], event, usage, shape)
            if out is not None:
                yield out
        if include_usage:
            yield _event({**shape, "choices": [], "usage": usage.as_dict()})
        yield b"data: " + _DONE + b"\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _passed_on(part: Part, event: bytes, usage: _Usage, shape: dict[str, Any]) -> bytes | None:
    """One event of a part's stream as the merged stream carries it: its choices
    renumbered under the first part's id; usage kept for the end; None for what is not
    passed on (its usage event, its [DONE])."""
    data = event.strip().removeprefix(b"data:").strip()
    if not data or data == _DONE:
        return None
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise ProxyError(502, "an instance's stream carried an event that is not JSON",
                         "upstream_error") from None
    if not isinstance(obj, dict) or "choices" not in obj:
        return _event(obj)  # an error event: passed on as it came
    usage.add(part, obj.pop("usage", None))
    if not obj["choices"]:
        return None
    if not shape:
        shape.update({k: obj[k] for k in ("id", "object", "created", "model") if k in obj})
    obj.update(shape)
    obj["choices"] = _renumbered(part, obj["choices"])
    return _event(obj)


def _event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
