"""The request router: an OpenAI-compatible FastAPI app in front of E, P and D instances.

Runs in its own process (`python -m epd_serve.proxy --config proxy.json`, started by
the launcher). `create_app(config)` builds everything; there are no module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from epd_serve.proxy.pipeline import Pipeline
from epd_serve.proxy.state import InstanceTable, ProxyConfig
from epd_serve.proxy.upstream import ProxyError

logger = logging.getLogger("epd_serve.proxy")

STAGES_HEADER = "x-epd-stages"


async def _check_health(inst, client: httpx.AsyncClient, unhealthy_after: int) -> None:
    """An instance that refuses connections is down at once (its process is gone); one
    that answers slowly or with an error is down after `unhealthy_after` checks in a
    row, since a busy engine can miss a single poll while it is still serving."""
    try:
        resp = await client.get(inst.entry.url + "/health", timeout=5.0)
        ok, refused = resp.status_code == 200, False
    except httpx.ConnectError as err:
        ok, refused = False, True
        inst.last_error = f"health: {type(err).__name__}"
    except httpx.HTTPError as err:
        ok, refused = False, False
        inst.last_error = f"health: {type(err).__name__}"
    inst.health_failures = 0 if ok else inst.health_failures + 1
    healthy = ok or (inst.healthy and not refused and inst.health_failures < unhealthy_after)
    if healthy != inst.healthy:
        logger.info("instance %s is now %s", inst.name, "healthy" if healthy else "DOWN")
        if healthy:
            inst.incarnation += 1  # it may be a restarted engine: forget what we knew
    inst.healthy = healthy


async def _poll_health(table: InstanceTable, client: httpx.AsyncClient, interval: float,
                       unhealthy_after: int) -> None:
    """Keep the status table's health column current; an instance that stops answering
    is skipped by routing until it answers again."""
    while True:
        await asyncio.gather(*(_check_health(i, client, unhealthy_after)
                               for i in table.instances))
        await asyncio.sleep(interval)


async def _read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise ProxyError(400, f"request body is not valid JSON: {err}",
                         "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_request_error")
    return body


def create_app(config: ProxyConfig) -> FastAPI:
    table = InstanceTable(config.instances)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
        # Drop idle connections before the instances do (uvicorn closes them after 5 s),
        # so a request is rarely sent on a connection that is being closed.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            app.state.pipeline = Pipeline(table, client, config)
            poller = asyncio.create_task(_poll_health(table, client, config.health_interval_s,
                                                      config.unhealthy_after))
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
                app.state.pipeline.close()

    app = FastAPI(title="epd-serve proxy", lifespan=lifespan)
    app.state.table = table
    app.state.config = config

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, err: ProxyError):
        if err.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, err.status,
                           err.message)
        return JSONResponse(err.to_body(), status_code=err.status)

    async def generate(request: Request, path: str, required: str) -> object:
        body = await _read_body(request)
        if not isinstance(body.get(required), (list, str)) or not body.get(required):
            raise ProxyError(400, f"'{required}' is required and must not be empty",
                             "invalid_request_error")
        pipeline: Pipeline = request.app.state.pipeline
        start = time.perf_counter()
        fault = request.headers.get("x-epd-fault")
        if body.get("stream"):
            trip, stream = await pipeline.open_stream(path, body, fault)
            logger.info("%s mm=%s %s", trip.request_id, trip.multimodal, trip.header())
            return StreamingResponse(
                stream, media_type="text/event-stream",
                headers={STAGES_HEADER: trip.header(), "x-request-id": trip.request_id},
            )
        trip, result = await pipeline.complete(path, body, fault)
        logger.info("%s mm=%s %s total=%.1fms", trip.request_id, trip.multimodal, trip.header(),
                    (time.perf_counter() - start) * 1e3)
        return JSONResponse(
            result, headers={STAGES_HEADER: trip.header(), "x-request-id": trip.request_id}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", "messages")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", "prompt")

    @app.post("/v1/metaserver")
    async def metaserver(request: Request):
        """Decode instances of the ascend-layerwise hand-off report their blocks here."""
        pipeline: Pipeline = request.app.state.pipeline
        return await pipeline.handoff.metaserver(await _read_body(request))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model, "object": "model", "owned_by": "epd-serve"}],
        }

    @app.get("/health")
    async def health():
        missing = [s for s in ("P", "D") if not table.candidates(s)]
        if missing:
            return JSONResponse(
                {"status": "unavailable", "stages_without_healthy_instance": missing},
                status_code=503,
            )
        if table.encoders() and not table.candidates("E"):
            # Still serving: prefill instances encode images themselves meanwhile.
            return {"status": "degraded", "stages_without_healthy_instance": ["E"]}
        return {"status": "ok"}

    @app.get("/status")
    async def status():
        return {"model": config.model, "instances": table.to_dict()}

    return app
