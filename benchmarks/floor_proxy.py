"""The least a proxy on our stack (aiohttp on uvloop, one process) can do for the requests
`proxy_bench.py` sends: the floor under the proxy's own cost on the host it runs on.

Forwards a chat completion as the `epd` hand-off does, with nothing else: an image
request to E (whole answer), then prefill streamed with its transfer parameters, then
decode, whose answer it passes on (streamed or whole, as asked). No parsing beyond
json.loads, no checks, routing, admission, retries, liveness, metrics, logs or
timelines; one instance per role, from the proxy config `proxy_bench.py` writes. What it
costs per request is what aiohttp and the kernel cost for these three hops, so the
proxy's goals can be read against what this host allows at all. Not a server to deploy:
it trusts every byte it is sent.

    python benchmarks/floor_proxy.py --config proxy.json
"""

from __future__ import annotations

import argparse
import gc
import json

import aiohttp
from aiohttp import web

from epd_serve.protocols.epd_push import VERSION
from epd_serve.proxy.__main__ import event_loop

TRANSFER_ID = "0" * 32  # the fakes check its form, not that it is unique


def create_app(config: dict) -> web.Application:
    urls = {inst["roles"]: inst["url"] for inst in config["instances"]}
    kv_host, _, kv_port = next(inst["kv_endpoint"] for inst in config["instances"]
                               if inst["roles"] == "P").rpartition(":")
    app = web.Application(client_max_size=64 << 20)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def open_session(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        session = app[session_key]
        body = json.loads(await request.read())
        url_path = request.path
        if any(isinstance(m.get("content"), list) for m in body["messages"]):
            async with session.post(urls["E"] + url_path,
                                    json={**body, "max_tokens": 1, "stream": False}) as resp:
                await resp.read()
        prefill = {**body, "max_tokens": 1, "stream": True, "kv_transfer_params": {
            "epd_v": VERSION, "do_remote_decode": True, "transfer_id": TRANSFER_ID}}
        async with session.post(urls["P"] + url_path, json=prefill) as resp:
            await resp.read()
        decode = {**body, "kv_transfer_params": {
            "epd_v": VERSION, "do_remote_prefill": True, "transfer_id": TRANSFER_ID,
            "remote_host": kv_host, "remote_port": int(kv_port)}}
        if not body.get("stream"):
            async with session.post(urls["D"] + url_path, json=decode) as resp:
                return web.Response(body=await resp.read(), status=resp.status,
                                    content_type="application/json")
        answer = web.StreamResponse()
        answer.content_type = "text/event-stream"
        await answer.prepare(request)
        async with session.post(urls["D"] + url_path, json=decode) as resp:
            async for chunk in resp.content.iter_any():
                await answer.write(chunk)
        await answer.write_eof()
        return answer

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the proxy config proxy_bench.py wrote")
    args = parser.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    app = create_app(config)
    gc.collect()
    gc.freeze()  # as the proxy does: its long-lived objects out of the collector's scans
    gc.set_threshold(20_000, 20, 20)
    web.run_app(app, host="127.0.0.1", port=config["port"], access_log=None, print=None,
                loop=event_loop())


if __name__ == "__main__":
    main()
