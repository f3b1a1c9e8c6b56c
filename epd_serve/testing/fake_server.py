"""A small OpenAI-compatible server that answers instantly (or with set delays).

For fast tests of the proxy and the launcher, and for measuring the load generator
without an engine in the way. It records every request it gets (GET /_requests) so a
test can check which stage saw what. It speaks every KV hand-off and publishes encoder
params as the engines do, reading and writing them through the structs of
epd_serve/protocols: hand-off parameters that do not match are refused naming the
field, so a key renamed on one side fails the tests instead of passing unread. Never
used in a deployment.

    python -m epd_serve.testing.fake_server --port 9001 [--ttft-ms 5 --itl-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from epd_serve.bench.client import run
from epd_serve.protocols import ascend_layerwise, encoder, epd_push, mooncake_pull
from epd_serve.protocols.params import ParamsError, from_dict, to_dict
from epd_serve.proxy.liveness import PROBE_TEXT
from epd_serve.proxy.request import MEDIA_PARTS

# The parts an encoder computes a feature of: the proxy's one table of media parts,
# less the embeddings a client computed itself.
ENCODED_PARTS = frozenset(t for t, kind in MEDIA_PARTS.items() if not kind.embeddings)


@dataclasses.dataclass(frozen=True)
class FakeSpec:
    """What a fake engine is: its name (also its model's) and how fast it answers."""

    name: str = "fake"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    record: bool = True  # keep every request for GET /_requests


def create_fake_app(name: str = "fake", ttft_ms: float = 0.0, itl_ms: float = 0.0,
                    fail_status: int | None = None, record: bool = True) -> FastAPI:
    """`record`: keep every request for GET /_requests (tests); a benchmark sending
    hundreds of thousands turns it off, or the growing heap slows the fake down."""
    app = FastAPI()
    app.state.spec = FakeSpec(name, ttft_ms, itl_ms, record)
    _init_state(app.state, fail_status)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/query", kv_bootstrap_query, methods=["GET"])
    app.add_api_route("/_requests", recorded, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def _init_state(state, fail_status: int | None) -> None:
    """The knobs a test turns, and what the fake counts."""
    state.requests = []
    state.fail_status = fail_status
    state.break_streams = False  # cut streamed answers off after the headers (a crash)
    # Fail requests that carry image references (a prefill whose feature went missing).
    state.reject_references = False
    state.delay_s = 0.0  # extra time before answering (a slow engine)
    # Answer nothing until a test sets it back (a busy engine computing a long request):
    # a one-token liveness request (proxy/liveness.py) is still answered, as a busy
    # engine answers it at its next step.
    state.hold = False
    # /health answers, generation never does (the proxy's one-token check included):
    # an engine core stopped or wedged under a live API server.
    state.core_stopped = False
    # Answer nothing at all, /health included, until a test sets it back: a stopped
    # process (SIGSTOP) whose kernel still accepts connections. Requests are recorded
    # before they hang, so a test can see which reached it.
    state.hang = False
    # A streamed answer stops after this many events and the whole server hangs (a
    # process stopped mid-stream); None: never.
    state.hang_after_events = None
    state.health_reads = 0  # how often /health was answered
    state.active = 0  # requests being answered, reported on /metrics like vLLM's
    state.reported_load = None  # (running, waiting, kv_usage) to report instead
    state.metrics_reads = 0  # how often /metrics was read
    state.cancelled = []  # request ids whose client went away before the answer


# -- probes and bookkeeping ---------------------------------------------------------------
async def _hang_while_stopped(state) -> None:
    while state.hang:
        await asyncio.sleep(0.01)


async def metrics(request: Request):
    state = request.app.state
    await _hang_while_stopped(state)
    state.metrics_reads += 1
    name = state.spec.name
    running, waiting, kv = state.reported_load or (state.active, 0, 0.0)
    text = (f'vllm:num_requests_running{{model_name="{name}"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="{name}"}} {waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{name}"}} {kv}\n')
    return PlainTextResponse(text)


async def health(request: Request):
    state = request.app.state
    await _hang_while_stopped(state)
    state.health_reads += 1
    return {"status": "ok"}


async def models(request: Request):
    return {"object": "list", "data": [{"id": request.app.state.spec.name, "object": "model"}]}


async def kv_bootstrap_query(request: Request):
    # The shape of vLLM's Mooncake bootstrap server answer.
    return {"0": {"engine_id": f"engine-{request.app.state.spec.name}", "worker_addr": {}}}


async def recorded(request: Request):
    return request.app.state.requests


async def chat(request: Request):
    return await _generate(request, "chat")


async def completions(request: Request):
    return await _generate(request, "text")


async def _generate(request: Request, kind: str):
    state = request.app.state
    state.active += 1
    try:
        return await _answer(request, kind)
    finally:
        state.active -= 1


async def _wait_or_notice_disconnect(request: Request, seconds: float) -> bool:
    """Sleep like an engine computing (and while held); True if the client left
    meanwhile."""
    state = request.app.state
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or state.hold:
        if await request.is_disconnected():
            state.cancelled.append(request.headers.get("x-request-id"))
            return True
        await asyncio.sleep(0.01 if state.hold
                            else min(0.01, max(0.0, deadline - time.monotonic())))
    return False


# -- the hand-offs, read and written through protocols/ -----------------------------------
def read_kv_params(kv: dict) -> object | None:
    """The KV hand-off parameters an instance was sent, as the struct of the protocol
    they are for; None where there are none (a whole request). Each connector reads
    only its own keys; the fake, which speaks all three, tells them apart by the one
    key only that protocol's sender writes (our `epd_v`, ascend's `metaserver` for
    decode and `request_id` for prefill; else Mooncake's). Raises ParamsError, naming
    the field, where they do not match."""
    if not (kv.get("do_remote_prefill") or kv.get("do_remote_decode")):
        return None
    to_decode = bool(kv.get("do_remote_prefill"))
    if epd_push.VERSION_KEY in kv:
        kind = epd_push.DecodeParams if to_decode else epd_push.PrefillParams
    elif "metaserver" in kv or "request_id" in kv:
        kind = ascend_layerwise.DecodeParams if to_decode else ascend_layerwise.BlocksReport
    else:
        kind = mooncake_pull.DecodeParams if to_decode else mooncake_pull.PrefillParams
    return from_dict(kind, kv, "kv_transfer_params")


async def _kv_answer(kv: dict, spec: FakeSpec, kind: str, request_id: str | None,
                     stream: bool) -> dict | JSONResponse | None:
    """What the fake's answer carries in `kv_transfer_params`, after doing what the
    instance's connector does with the hand-off it was sent; a JSONResponse where it
    refuses them. Our connector's decode side refuses by its report (the proxy answers
    502), which a stream cannot carry: there, and for the other protocols, a 400 names
    the field."""
    try:
        params = read_kv_params(kv)
    except ParamsError as err:
        if kv.get("do_remote_prefill") and epd_push.VERSION_KEY in kv and not stream:
            return {epd_push.REPORT_KEY: to_dict(epd_push.refusal(str(err)))}
        return JSONResponse({"error": {"message": str(err), "type": "BadRequestError",
                                       "code": 400}}, status_code=400)
    if isinstance(params, ascend_layerwise.DecodeParams):
        await _report_blocks(params.metaserver, spec.name, kind, request_id)
    if isinstance(params, epd_push.DecodeParams):
        # What our KV connector's decode side reports once the KV has landed.
        return {epd_push.REPORT_KEY: to_dict(epd_push.TransferReport(
            transfer_id=params.transfer_id, outcome="done", mode="group", bytes=65536,
            groups=2, transfer_ms=0.5, exposed_ms=0.0))}
    return kv or None


def _published(parts: list[dict]) -> dict:
    """What an encoder publishes (`ec_transfer_params`), as vLLM's do: per media item
    its placeholder metadata and index, keyed by its uuid (else a hash of the part). A
    video (a frame list) gets a Qwen-VL grid of one temporal patch per two frames."""
    media = [p for p in parts if p.get("type") in ENCODED_PARTS]

    def metadata(part: dict) -> dict:
        video = part.get("video_url")
        if isinstance(video, dict) and isinstance(video.get("url"), str):
            frames = len(video["url"].split(",")) - 1
            return {"video_grid_thw": [-(-frames // 2), 4, 4]}
        return {"image_grid_thw": [1, 4, 4]}

    return to_dict({
        p.get("uuid") or hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest():
        encoder.ItemParams(metadata=metadata(p), item_indices=[i])
        for i, p in enumerate(media)})


# -- answers ------------------------------------------------------------------------------
async def _answer(request: Request, kind: str):
    state, spec = request.app.state, request.app.state.spec
    body = await request.json()
    request_id = request.headers.get("x-request-id")
    if spec.record:
        state.requests.append({"path": request.url.path, "body": body,
                               "request_id": request_id,
                               "traceparent": request.headers.get("traceparent")})
    await _hang_while_stopped(state)
    while state.core_stopped:
        await asyncio.sleep(0.01)
    if _is_liveness_probe(body):
        return {"id": "probe", "object": f"{kind}.completion", "model": spec.name,
                "choices": [{"index": 0, "finish_reason": "length", "text": "t0"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    if state.fail_status:
        return JSONResponse({"error": {"message": f"{spec.name} is failing on purpose"}},
                            status_code=state.fail_status)
    parts = [p for m in body.get("messages") or [] if isinstance(m.get("content"), list)
             for p in m["content"]]
    if state.reject_references and any(p.get("type") == "image_embeds" for p in parts):
        return JSONResponse({"error": {"message": "encoder feature not available"}},
                            status_code=500)
    kv_params = await _kv_answer(body.get("kv_transfer_params") or {}, spec, kind,
                                 request_id, bool(body.get("stream")))
    if isinstance(kv_params, JSONResponse):
        return kv_params
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt")))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
             "total_tokens": prompt_tokens + n}
    rid = f"cmpl-{uuid.uuid4().hex[:12]}"
    if (state.delay_s or state.hold) and not body.get("stream"):
        if await _wait_or_notice_disconnect(request, state.delay_s):
            return JSONResponse({"error": {"message": "client gone"}}, status_code=499)
    if body.get("stream"):
        return StreamingResponse(_events(state, body, kind, rid, n, usage, request_id),
                                 media_type="text/event-stream")
    await asyncio.sleep((spec.ttft_ms + spec.itl_ms * max(0, n - 1)) / 1e3)
    text = " ".join(f"t{i}" for i in range(n))
    message = ({"message": {"role": "assistant", "content": text}} if kind == "chat"
               else {"text": text})
    return {"id": rid, "object": f"{kind}.completion", "model": spec.name,
            "choices": [{"index": 0, "finish_reason": "length", **message}],
            "usage": usage, "kv_transfer_params": kv_params,
            "ec_transfer_params": _published(parts) or None}


def _is_liveness_probe(body: dict) -> bool:
    """The proxy's one-token request that shows the engine steps (proxy/liveness.py)."""
    if body.get("max_tokens") != 1:
        return False
    if body.get("prompt") == PROBE_TEXT:
        return True
    parts = [p for m in body.get("messages") or [] if isinstance(m.get("content"), list)
             for p in m["content"]]
    return any(p.get("text") == PROBE_TEXT for p in parts)


def _choice_chunk(kind: str, i: int) -> dict:
    if kind == "chat":
        return {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
    return {"index": 0, "text": f"t{i} ", "finish_reason": None}


async def _events(state, body: dict, kind: str, rid: str, n: int, usage: dict,
                  request_id: str | None):
    """A streamed answer: n tokens, then usage where asked for, then [DONE]."""
    spec = state.spec
    if state.break_streams:
        raise RuntimeError(f"{spec.name} breaks its stream on purpose")
    try:
        await asyncio.sleep(spec.ttft_ms / 1e3 + state.delay_s)
        while state.hold:
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        state.cancelled.append(request_id)
        raise
    for i in range(n):
        if i:
            await asyncio.sleep(spec.itl_ms / 1e3)
        if i == state.hang_after_events:
            state.hang = True
        await _hang_while_stopped(state)
        chunk = {"id": rid, "object": f"{kind}.completion.chunk", "created": int(time.time()),
                 "model": spec.name, "choices": [_choice_chunk(kind, i)]}
        yield f"data: {json.dumps(chunk)}\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        final = {"id": rid, "object": f"{kind}.completion.chunk", "model": spec.name,
                 "choices": [], "usage": usage}
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


async def _report_blocks(metaserver: str, name: str, kind: str, request_id: str | None) -> None:
    """What vllm-ascend's layerwise decode scheduler does once it has allocated blocks:
    POST its blocks and address to the proxy's metaserver, naming the request by the id
    vLLM derives from X-Request-Id, and wait for the answer (it ignores the status)."""
    engine_request_id = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}-0"
    report = ascend_layerwise.BlocksReport(
        token_ids=[], request_id=engine_request_id, remote_block_ids=[[7, 8, 9]],
        remote_block_size=[128], remote_engine_id=f"engine-{name}", remote_host="127.0.0.1",
        remote_port=30000, remote_tp_size=1, remote_pcp_size=1, remote_dcp_size=1,
        remote_cached_tokens=0)
    async with httpx.AsyncClient(timeout=None) as client:
        await client.post(metaserver, json=to_dict(report))


class ThreadedServer:
    """Run an ASGI app with uvicorn on a background thread (tests)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                     access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--forget-requests", action="store_true",
                        help="keep no record of the requests (long benchmark runs)")
    args, _unknown = parser.parse_known_args()  # tolerate engine flags from a launcher
    app = create_fake_app(args.name, args.ttft_ms, args.itl_ms,
                          record=not args.forget_requests)
    # Like a vLLM KV producer, also answer the Mooncake bootstrap query on its own port.
    ports = [args.port]
    if os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        ports.append(int(os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"]))
    sockets = []
    for port in ports:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say they are TCP
        # (without it every small answer waits ~40 ms for a delayed ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, port))
        sockets.append(sock)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    run(server.serve(sockets=sockets))  # on uvloop where installed, like vLLM's server


if __name__ == "__main__":
    main()
