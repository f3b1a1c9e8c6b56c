"""A small OpenAI-compatible server that answers instantly (or with set delays).

For fast tests of the proxy and the launcher, and for measuring the load generator
without an engine in the way. It records every request it gets (GET /_requests) so a
test can check which stage saw what. Never used in a deployment.

    python -m epd_serve.testing.fake_server --port 9001 [--ttft-ms 5 --itl-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
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


def create_fake_app(name: str = "fake", ttft_ms: float = 0.0, itl_ms: float = 0.0,
                    fail_status: int | None = None, record: bool = True) -> FastAPI:
    """`record`: keep every request for GET /_requests (tests); a benchmark sending
    hundreds of thousands turns it off, or the growing heap slows the fake down."""
    app = FastAPI()
    app.state.requests = []
    app.state.fail_status = fail_status
    app.state.break_streams = False  # cut streamed answers off after the headers (a crash)
    # Fail requests that carry image references (a prefill whose feature went missing).
    app.state.reject_references = False
    app.state.delay_s = 0.0  # extra time before answering (a slow engine)
    app.state.hold = False  # answer nothing until a test sets it back (a busy engine)
    # Answer nothing at all, /health included, until a test sets it back: a stopped
    # process (SIGSTOP) whose kernel still accepts connections. Requests are recorded
    # before they hang, so a test can see which reached it.
    app.state.hang = False
    # A streamed answer stops after this many events and the whole server hangs (a
    # process stopped mid-stream); None: never.
    app.state.hang_after_events = None
    app.state.health_reads = 0  # how often /health was answered
    app.state.active = 0  # requests being answered, reported on /metrics like vLLM's
    app.state.reported_load = None  # (running, waiting, kv_usage) to report instead
    app.state.metrics_reads = 0  # how often /metrics was read
    app.state.cancelled = []  # request ids whose client went away before the answer

    async def hang_while_stopped() -> None:
        while app.state.hang:
            await asyncio.sleep(0.01)

    @app.get("/metrics")
    async def metrics():
        await hang_while_stopped()
        app.state.metrics_reads += 1
        running, waiting, kv = app.state.reported_load or (app.state.active, 0, 0.0)
        text = (f'vllm:num_requests_running{{model_name="{name}"}} {running}\n'
                f'vllm:num_requests_waiting{{model_name="{name}"}} {waiting}\n'
                f'vllm:kv_cache_usage_perc{{model_name="{name}"}} {kv}\n')
        return PlainTextResponse(text)

    @app.get("/health")
    async def health():
        await hang_while_stopped()
        app.state.health_reads += 1
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.get("/query")
    async def kv_bootstrap_query():
        # The shape of vLLM's Mooncake bootstrap server answer.
        return {"0": {"engine_id": f"engine-{name}", "worker_addr": {}}}

    @app.get("/_requests")
    async def recorded():
        return app.state.requests

    async def generate(request: Request, kind: str):
        app.state.active += 1
        try:
            return await answer(request, kind)
        finally:
            app.state.active -= 1

    async def wait_or_notice_disconnect(request: Request, seconds: float) -> bool:
        """Sleep like an engine computing (and while held); True if the client left
        meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or app.state.hold:
            if await request.is_disconnected():
                app.state.cancelled.append(request.headers.get("x-request-id"))
                return True
            await asyncio.sleep(0.01 if app.state.hold
                                else min(0.01, max(0.0, deadline - time.monotonic())))
        return False

    async def answer(request: Request, kind: str):
        body = await request.json()
        request_id = request.headers.get("x-request-id")
        if record:
            app.state.requests.append({"path": request.url.path, "body": body,
                                       "request_id": request_id,
                                       "traceparent": request.headers.get("traceparent")})
        await hang_while_stopped()
        if app.state.fail_status:
            return JSONResponse({"error": {"message": f"{name} is failing on purpose"}},
                                status_code=app.state.fail_status)
        parts = [p for m in body.get("messages") or [] if isinstance(m.get("content"), list)
                 for p in m["content"]]
        if app.state.reject_references and any(p.get("type") == "image_embeds" for p in parts):
            return JSONResponse({"error": {"message": "encoder feature not available"}},
                                status_code=500)
        kv_params = body.get("kv_transfer_params") or {}
        if kv_params.get("metaserver"):
            await _report_blocks(kv_params["metaserver"], name, kind, request_id)
        if kv_params.get("do_remote_prefill") and kv_params.get("remote_host"):
            # What our KV connector's decode side reports once the KV has landed.
            kv_params = {"epd_kv": {"transfer_id": kv_params.get("transfer_id"),
                                    "outcome": "done", "mode": "group", "bytes": 65536,
                                    "groups": 2, "transfer_ms": 0.5, "exposed_ms": 0.0}}
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt")))
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}
        # An encoder publishes each keyed image's placeholder metadata, as vLLM's do.
        keyed = [p["uuid"] for p in parts if p.get("type") == "image_url" and p.get("uuid")]
        ec_params = ({key: {"metadata": {"image_grid_thw": [1, 4, 4]}, "item_indices": [i]}
                      for i, key in enumerate(keyed)} if keyed else {"served_by": name})
        extra = {"kv_transfer_params": kv_params or None, "ec_transfer_params": ec_params}

        def choice_chunk(i: int) -> dict:
            if kind == "chat":
                return {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
            return {"index": 0, "text": f"t{i} ", "finish_reason": None}

        if (app.state.delay_s or app.state.hold) and not body.get("stream"):
            if await wait_or_notice_disconnect(request, app.state.delay_s):
                return JSONResponse({"error": {"message": "client gone"}}, status_code=499)
        if body.get("stream"):
            async def events():
                if app.state.break_streams:
                    raise RuntimeError(f"{name} breaks its stream on purpose")
                try:
                    await asyncio.sleep(ttft_ms / 1e3 + app.state.delay_s)
                    while app.state.hold:
                        await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    app.state.cancelled.append(request_id)
                    raise
                for i in range(n):
                    if i:
                        await asyncio.sleep(itl_ms / 1e3)
                    if i == app.state.hang_after_events:
                        app.state.hang = True
                    await hang_while_stopped()
                    chunk = {"id": rid, "object": f"{kind}.completion.chunk",
                             "created": int(time.time()), "model": name,
                             "choices": [choice_chunk(i)]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    final = {"id": rid, "object": f"{kind}.completion.chunk", "model": name,
                             "choices": [], "usage": usage}
                    yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        await asyncio.sleep((ttft_ms + itl_ms * max(0, n - 1)) / 1e3)
        text = " ".join(f"t{i}" for i in range(n))
        message = ({"message": {"role": "assistant", "content": text}} if kind == "chat"
                   else {"text": text})
        return {"id": rid, "object": f"{kind}.completion", "model": name,
                "choices": [{"index": 0, "finish_reason": "length", **message}],
                "usage": usage, **extra}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "text")

    return app


async def _report_blocks(metaserver: str, name: str, kind: str, request_id: str | None) -> None:
    """What vllm-ascend's layerwise decode scheduler does once it has allocated blocks:
    POST its blocks and address to the proxy's metaserver, naming the request by the id
    vLLM derives from X-Request-Id, and wait for the answer (it ignores the status)."""
    engine_request_id = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}-0"
    report = {"token_ids": [], "request_id": engine_request_id,
              "do_remote_prefill": False, "do_remote_decode": True,
              "remote_block_ids": [[7, 8, 9]], "remote_block_size": [128],
              "remote_engine_id": f"engine-{name}", "remote_host": "127.0.0.1",
              "remote_port": 30000, "remote_tp_size": 1, "remote_pcp_size": 1,
              "remote_dcp_size": 1, "remote_cached_tokens": 0}
    async with httpx.AsyncClient(timeout=None) as client:
        await client.post(metaserver, json=report)


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
