"""The trace routes: the engines' span exports taken in, and each request's timeline
given back to the tenant whose request it was.

Runs in the proxy process. Engines post OTLP/HTTP spans with the deployment's internal
token (the door in app.py checks it); clients read timelines with their own API key, by
`x-epd-trace-id` or request id (in an open deployment, by trace id only: the rest is
the operator's); the operator (admin key) reads every tenant's. Handlers reach the running Proxy as `request.app[PROXY]`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from epd_serve.proxy.context import PROXY, TENANT
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.tenancy import ADMIN_KEY_HEADER
from epd_serve.proxy.timeline import parse_otlp


async def receive_spans(request: web.Request) -> web.Response:
    """OTLP/HTTP (protobuf) trace export: the engines' spans of our requests. Counted
    like a request (admission), parsed on a worker thread."""
    proxy = request.app[PROXY]
    if request.content_type != "application/x-protobuf":
        raise bad_request("OTLP traces are taken as application/x-protobuf "
                          "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)",
                          "malformed", 415)
    with proxy.admission.admit() as ticket:
        raw = await proxy.admission.read_body(request, ticket,
                                              proxy.config.limits.max_trace_body_bytes)
        try:
            spans = await asyncio.to_thread(parse_otlp, bytes(raw))
        except Exception as err:  # protobuf's DecodeError and friends
            raise bad_request(f"not an OTLP trace export: {type(err).__name__}: {err}",
                              "malformed") from None
    proxy.traces.add_engine_spans(spans)
    return web.Response(body=b"", content_type="application/x-protobuf")


def _sees_every_request(request: web.Request) -> bool:
    """In an open deployment every client is the one anonymous tenant: its list of
    requests, and its requests by the ids clients choose, are everyone's, so they are
    the operator's (admin key). A timeline's own id (random, given to the client that
    sent the request) opens that one timeline to anyone who holds it."""
    proxy = request.app[PROXY]
    return not proxy.tenants.open or proxy.is_operator(request)


def _whose(request: web.Request) -> str | None:
    """The tenant whose timelines the request reads; None: every tenant's (the operator,
    who needs no API key of a tenant for it: app.guard)."""
    return None if request.app[PROXY].is_operator(request) else request[TENANT].id


def _check_shown(request: web.Request) -> None:
    """A timeline shows which stages ran and for how long: what x-epd-stages shows."""
    if not request.app[PROXY].shows_stages(request):
        raise ProxyError(403, "request timelines tell what is cached: in this deployment "
                         f"they are the operator's (proxy.stage_headers; {ADMIN_KEY_HEADER})",
                         "permission_error", reason="admin_only")


async def get_trace(request: web.Request) -> web.Response:
    _check_shown(request)
    traces = request.app[PROXY].traces
    key = request.match_info["id"]
    timeline = traces.get(key, _whose(request), by_client_id=_sees_every_request(request))
    if timeline is None:
        raise ProxyError(404, f"no timeline of {key!r}: the proxy keeps the last "
                         f"{traces.capacity} requests' (by x-epd-trace-id, or by "
                         "request id), each readable with its own API key",
                         "invalid_request_error", reason="unknown_trace")
    return web.json_response(timeline.to_dict())


async def recent_traces(request: web.Request) -> web.Response:
    _check_shown(request)
    if not _sees_every_request(request):
        raise ProxyError(403, "this deployment has no API keys, so every client's requests "
                         "are one tenant's: listing them takes the admin key "
                         f"({ADMIN_KEY_HEADER}); a timeline is read by its own id "
                         "(x-epd-trace-id)", "permission_error", reason="admin_only")
    try:
        last = int(request.query.get("last", "20"))
    except ValueError:
        raise bad_request("last: a whole number of requests", "malformed") from None
    return web.json_response([
        {k: v for k, v in t.to_dict().items() if k != "spans"}
        for t in request.app[PROXY].traces.recent(max(0, last), _whose(request))])
