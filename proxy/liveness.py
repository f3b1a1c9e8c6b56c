"""Whether an instance's engine is stepping, not only its API server answering.

Runs in the proxy process. vLLM's /health answers 200 as long as its engine core
process exists: a core that hangs (stopped, a wedged device) leaves /health green while
every request waits. So where /health cannot be believed (a hop silent past its
deadline; an instance taken out as hung), the proxy asks the engine for one token of a
tiny request of the kind it serves: text for prefill and decode, a 16x16 image for an
encoder-only instance. No answer within the timeout: the core is hung, the instance is
out of routing until such a request answers again, and the time since (`hung_since`)
is published (/metrics `epd_proxy_instance_hung_seconds`) for the supervisor, which
restarts an instance hung too long (epd_serve/runtime/launcher.py).
"""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
from PIL import Image

from epd_serve.proxy.state import InstanceState

PROBE_TEXT = "ping"


def _tiny_image() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 60, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


TINY_IMAGE = _tiny_image()


def probe_request(inst: InstanceState, model: str) -> tuple[str, dict]:
    """(path, body) of the one-token request that shows `inst`'s engine steps. An
    instance that only encodes runs no language model: it is given an image."""
    if inst.roles == "E" and not inst.entry.switchable:
        return "/v1/chat/completions", {
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": TINY_IMAGE}},
                {"type": "text", "text": PROBE_TEXT}]}]}
    return "/v1/completions", {"model": model, "prompt": PROBE_TEXT, "max_tokens": 1}


async def engine_silent(session: aiohttp.ClientSession, inst: InstanceState, model: str,
                        timeout_s: float) -> str | None:
    """None if `inst`'s engine answers a one-token request within `timeout_s`, else
    what went wrong (its API server answering an error is an answer: the core ran)."""
    path, body = probe_request(inst, model)
    try:
        async with session.post(inst.entry.url + path, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            if resp.status < 500:
                return None
            return f"its engine answered a one-token request with HTTP {resp.status}"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
        return (f"its engine did not answer a one-token request within {timeout_s:g} s "
                f"({type(err).__name__})")
