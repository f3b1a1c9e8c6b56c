"""The request router: an OpenAI-compatible aiohttp app in front of E, P and D instances.

Runs in its own process (`python -m epd_serve.proxy --config proxy.json`, started by
the launcher). `create_app(config)` builds the running Proxy (context.py), puts it on
the app, and lays out the middleware and the route table; the handlers are module
functions, one module per job (routes_serving.py, routes_traces.py, routes_health.py,
routes_instances.py), that reach the Proxy as `request.app[PROXY]`: there are no
module globals. aiohttp serves and sends (one library, little CPU per request) and
msgspec parses. Every route is behind one door (`guard`): clients' routes take the
deployment's API key (tenancy.py: the key names the tenant), engines' span exports the
internal token, the KV metaserver a URL made for one request, instance registration
the admin key; only /health, /ready and /metrics are open. Every failure becomes an
OpenAI-style error with a status (`errors`). The client's X-Request-Id is echoed;
engines get an id of the proxy's own, unique and unguessable per request
(`Proxy.request_ids_for`).
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from epd_serve.proxy import (
    routes_health,
    routes_instances,
    routes_roles,
    routes_serving,
    routes_traces,
)
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.context import PROXY, REQUEST_ID, TENANT, Proxy
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.routes_serving import (
    GENERATE_ROUTES,
    MAX_METASERVER_BODY,
    METASERVER,
    RESPONSES,
    STAGES_HEADER,
    TRACE_HEADER,
)
from epd_serve.proxy.tenancy import is_internal

# Names that lived here before the handlers moved out, for code that imports them here.
__all__ = ["GENERATE_ROUTES", "MAX_METASERVER_BODY", "METASERVER", "OPEN_PATHS", "PROXY",
           "REQUEST_ID", "STAGES_HEADER", "TENANT", "TRACE_HEADER", "Proxy", "create_app"]

log = logging.getLogger("epd_serve.proxy")

# Launchers wait on /ready, monitors read /health and /metrics: no key.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def create_app(config: ProxyConfig) -> web.Application:
    app = web.Application(client_max_size=config.limits.max_body_bytes,
                          middlewares=[errors])
    app[PROXY] = Proxy(config)
    app.cleanup_ctx.append(lifespan)
    for path in GENERATE_ROUTES:
        app.router.add_post(path, routes_serving.generate)
    app.router.add_route("*", RESPONSES + "{tail:.*}", routes_serving.responses)
    app.router.add_post(METASERVER + "{token}", routes_serving.metaserver)
    app.router.add_post("/v1/traces", routes_traces.receive_spans)
    app.router.add_get("/v1/traces", routes_traces.recent_traces)
    app.router.add_get("/v1/traces/{id}", routes_traces.get_trace)
    app.router.add_get("/v1/models", routes_serving.models)
    app.router.add_get("/health", routes_health.health)
    app.router.add_get("/ready", routes_health.ready)
    app.router.add_get("/status", routes_health.status)
    app.router.add_get("/metrics", routes_health.metrics)
    app.router.add_get("/instances", routes_instances.list_instances)
    app.router.add_post("/instances", routes_instances.add_instance)
    app.router.add_delete("/instances/{name}", routes_instances.remove_instance)
    app.router.add_get("/roles", routes_roles.list_roles)
    app.router.add_post("/instances/{name}/role", routes_roles.switch_role)
    app.router.add_post("/roles/controller", routes_roles.set_controller)
    return app


async def lifespan(app: web.Application):
    proxy = app[PROXY]
    await proxy.start()
    yield
    await proxy.stop()


@web.middleware
async def errors(request: web.Request, handler):
    """Every failure is an OpenAI-style error with a status; nothing escapes."""
    proxy = request.app[PROXY]
    try:
        guard(request)
        return await handler(request)
    except ProxyError as err:
        proxy.metrics.failures.labels(err.reason).inc()
        if err.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, err.status,
                        err.message)
        return _error_response(err)
    except web.HTTPException:
        raise
    except Exception as err:  # a bug of ours: say so instead of dropping the request
        log.exception("%s %s failed", request.method, request.path)
        proxy.metrics.failures.labels("internal").inc()
        return _error_response(ProxyError(500, f"proxy error: {type(err).__name__}: {err}",
                                          reason="internal"))


def guard(request: web.Request) -> None:
    """The one door: who may call which route (401/403 otherwise)."""
    path = request.path
    if path in OPEN_PATHS or path.startswith(METASERVER):
        return  # the metaserver URL is itself the secret (ascend_layerwise.py)
    if (path.startswith("/instances") or path == "/roles/controller") \
            and request.method not in ("GET", "HEAD"):
        return  # the handler asks for the admin key (or says registration is off)
    proxy = request.app[PROXY]
    if path == "/v1/traces" and request.method == "POST":
        # Engines' door only: with no internal token (a proxy started by hand) span
        # exports are off, never open to a client key.
        if not proxy.internal_token:
            raise ProxyError(403, "span exports are off: the proxy was started without "
                             "the deployment's internal token", "permission_error",
                             reason="unauthorized")
        if not is_internal(request, proxy.internal_token):
            raise ProxyError(401, "span exports take the deployment's internal token",
                             "authentication_error", reason="unauthorized")
        return
    if path.startswith("/v1/traces") and proxy.is_operator(request):
        return  # the operator reads every tenant's timelines, with no tenant's key
    request[TENANT] = proxy.tenants.authenticate(request)


def _error_response(err: ProxyError) -> web.Response:
    headers = {"retry-after": "2"} if err.status == 503 else None
    return web.json_response(err.to_body(), status=err.status, headers=headers,
                             dumps=lambda o: msgspec.json.encode(o).decode())
