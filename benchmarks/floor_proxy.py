"""The least a proxy on our stack (aiohttp's server on uvloop, the proxy's hop client,
one process) can do for the requests `proxy_bench.py` sends: the floor under the
proxy's own cost on the host it runs on.

Forwards a chat completion as the `epd` hand-off does, with nothing else: an image
request to E (whole answer), then prefill streamed with its transfer parameters, then
decode, whose answer it passes on (streamed or whole, as asked). No parsing beyond
json.loads, no checks, routing, admission, retries, liveness, metrics, logs or
timelines; one instance per role, from the proxy config `proxy_bench.py` writes. What it
costs per request is what the stack and the kernel cost for these three hops, so the
proxy's goals can be read against what this host allows at all. Not a server to deploy:
it trusts every byte it is sent.

    python benchmarks/floor_proxy.py --config proxy.json
"""

from __future__ import annotations

import argparse
import gc
import json

from aiohttp import web

from epd_serve.protocols.epd_push import VERSION
from epd_serve.proxy.__main__ import event_loop
from epd_serve.proxy.hop_client import HopClient, HopResponse, Origin

TRANSFER_ID = "0" * 32  # the fakes check its form, not that it is unique
JSON = {"content-type": "application/json"}


def create_app(config: dict) -> web.Application:
    origins = {inst["roles"]: Origin(inst["url"]) for inst in config["instances"]}
    kv_host, _, kv_port = next(inst["kv_endpoint"] for inst in config["instances"]
                               if inst["roles"] == "P").rpartition(":")
    app = web.Application(client_max_size=64 << 20)
    hops = HopClient()

    async def close_hops(app: web.Application) -> None:
        hops.close()

    async def send(role: str, path: str, body: dict) -> HopResponse:
        return await hops.post(origins[role], path, json.dumps(body).encode(), JSON)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        url_path = request.path
        if any(isinstance(m.get("content"), list) for m in body["messages"]):
            resp = await send("E", url_path, {**body, "max_tokens": 1, "stream": False})
            await resp.read()
            resp.release()
        prefill = {**body, "max_tokens": 1, "stream": True, "kv_transfer_params": {
            "epd_v": VERSION, "do_remote_decode": True, "transfer_id": TRANSFER_ID}}
        resp = await send("P", url_path, prefill)
        await resp.read()
        resp.release()
        decode = {**body, "kv_transfer_params": {
            "epd_v": VERSION, "do_remote_prefill": True, "transfer_id": TRANSFER_ID,
            "remote_host": kv_host, "remote_port": int(kv_port)}}
        resp = await send("D", url_path, decode)
        if not body.get("stream"):
            answer = web.Response(body=await resp.read(), status=resp.status,
                                  content_type="application/json")
            resp.release()
            return answer
        answer = web.StreamResponse()
        answer.content_type = "text/event-stream"
        await answer.prepare(request)
        while chunk := await resp.readany():
            await answer.write(chunk)
        resp.release()
        await answer.write_eof()
        return answer

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.on_cleanup.append(close_hops)
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
