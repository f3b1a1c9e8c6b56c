"""The request router: an OpenAI-compatible aiohttp app in front of E, P and D instances.

Runs in its own process (`python -m epd_serve.proxy --config proxy.json`, started by
the launcher). `create_app(config)` builds everything; there are no module globals.
aiohttp serves and sends (one library, little CPU per request) and msgspec parses.
Every route is behind one door (`guard`): clients' routes take the deployment's API key
(tenancy.py: the key names the tenant), engines' span exports the internal token,
the KV metaserver a URL made for one request, instance registration the admin key;
only /health, /ready and /metrics are open. A request is admitted within the proxy's
limits and its body read (admission.py: 503, 408, 413, 429), parsed once and checked
before any engine sees it (request.py), its media keyed by the proxy (`seal`), served
by pipeline.py, and answered here: every failure becomes an OpenAI-style error with a
status. The client's X-Request-Id is echoed; engines get an id of the proxy's own,
unique and unguessable per request (`request_ids_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import resource
import time

import aiohttp
import msgspec
from aiohttp import web
from pydantic import ValidationError

from epd_serve.proxy.admission import Admission, requests_for_descriptors
from epd_serve.proxy.config import InstanceEntry, ProxyConfig
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.handoff import HANDOFFS
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.membership import Membership, load_roster
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.pipeline import Pipeline, Request
from epd_serve.proxy.remote_media import RemoteFetcher
from epd_serve.proxy.request import ParsedRequest, parse_request
from epd_serve.proxy.routing import Router, computing_hop, down_hops, eligible, plan_stages
from epd_serve.proxy.state import InstanceTable
from epd_serve.proxy.tenancy import (
    INTERNAL_TOKEN_ENV,
    Tenant,
    Tenants,
    bearer_token,
    is_internal,
)
from epd_serve.proxy.timeline import (
    TraceStore,
    client_trace_id,
    new_timeline_id,
    parse_otlp,
    timeline_of,
)
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import Upstream

log = logging.getLogger("epd_serve.proxy")
request_log = logging.getLogger("epd_serve.proxy.requests")

STAGES_HEADER = "x-epd-stages"
TRACE_HEADER = "x-epd-trace-id"  # the request's timeline: GET /v1/traces/{this id}
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,96}$")
PROXY = web.AppKey("proxy", object)  # the running Proxy, for tests that look inside
TENANT = web.RequestKey("tenant", Tenant)  # whose request it is (the door decides)
GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions")
# Launchers wait on /ready, monitors read /health and /metrics: no key.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
METASERVER = "/v1/metaserver/"
# The largest report a decode instance posts to its metaserver URL (block ids).
MAX_METASERVER_BODY = 1 << 20


class Proxy:
    """Everything one proxy holds while it runs."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.table = InstanceTable()
        for entry, source in load_roster(config):
            self.table.add(entry, source)
        self.metrics = ProxyMetrics()
        self.router = Router(lambda: self.table.instances, {
            "E": config.routing.E, "P": config.routing.P, "D": config.routing.D})
        # Asked for keys but given none: refuse to start rather than serve openly.
        self.tenants = Tenants.from_env(config.api_key_env, config.tenant_isolation)
        self.admin_key = os.environ.get(config.admin_key_env) if config.admin_key_env else None
        self.internal_token = os.environ.get(INTERNAL_TOKEN_ENV) or None
        self.fetcher = RemoteFetcher(config.limits) if config.limits.allow_remote_urls else None
        self.admission = Admission(config.limits, self.metrics, requests_for_descriptors(
            config.limits, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        self.client_kv_keys = HANDOFFS[config.kv_protocol].allowed_client_keys(
            config.fault_injection) if config.kv_protocol in HANDOFFS else frozenset()
        self.traces = TraceStore()
        self.session: aiohttp.ClientSession | None = None
        self.pipeline: Pipeline | None = None
        self.membership: Membership | None = None

    @staticmethod
    def request_ids_for(given: str) -> tuple[str, str]:
        """(the id the client knows the request by, the id the engines get). Engines,
        the KV hand-offs and their connectors key state by the second, so it is ours,
        unique per request, and unguessable (a client who saw its own cannot name
        another's); a client's valid X-Request-Id leads it, so engine logs still say
        whose request it was, and is what the answer and the log carry."""
        own = f"epd-{random_hex(12)}"
        if not REQUEST_ID.match(given):
            return own, own
        return given, f"{given}-{own}"

    def key_of(self, tenant: Tenant, parsed: ParsedRequest):
        """The content key of each media item of `parsed`, in `tenant`'s namespace."""
        model = self.config.model

        def key(item) -> str:
            modality = item.part_type if item.kind.embeddings else item.modality
            return tenant.media_key(model, modality, parsed.hash_factors, item.payload())

        return key

    async def start(self) -> None:
        # Drop idle connections before the instances do (uvicorn closes them after 5 s),
        # so a request is rarely sent on a connection that is being closed. No cap on
        # connections here: admission.py caps the requests at what the process's open
        # files carry, and a per-connector cap would queue a hand-off's decode behind
        # another request's prefill (ascend-layerwise: decode waits on that prefill).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0,
                                        sock_read=self.config.request_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             auto_decompress=False)
        upstream = Upstream(self.router, self.session, self.metrics, self.config.deadlines)
        self.pipeline = Pipeline(self.table, self.router, upstream, self.config)
        self.membership = Membership(self.table, self.session, self.metrics, self.config)
        self.membership.save()
        self.membership.start()

    async def stop(self) -> None:
        await self.membership.stop()
        self.pipeline.close()
        if self.fetcher is not None:
            await self.fetcher.close()
        await self.session.close()


def _error_response(err: ProxyError) -> web.Response:
    headers = {"retry-after": "2"} if err.status == 503 else None
    return web.json_response(err.to_body(), status=err.status, headers=headers,
                             dumps=lambda o: msgspec.json.encode(o).decode())


def create_app(config: ProxyConfig) -> web.Application:
    proxy = Proxy(config)

    @web.middleware
    async def errors(request: web.Request, handler):
        """Every failure is an OpenAI-style error with a status; nothing escapes."""
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
        if path.startswith("/instances") and request.method != "GET":
            return  # the handler asks for the admin key (or says registration is off)
        if path == "/v1/traces" and request.method == "POST" and proxy.internal_token:
            if not is_internal(request, proxy.internal_token):
                raise ProxyError(401, "span exports take the deployment's internal token",
                                 "authentication_error", reason="unauthorized")
            return
        request[TENANT] = proxy.tenants.authenticate(request)

    app = web.Application(client_max_size=config.limits.max_body_bytes,
                          middlewares=[errors])
    app[PROXY] = proxy

    async def lifespan(app: web.Application):
        await proxy.start()
        yield
        await proxy.stop()

    app.cleanup_ctx.append(lifespan)

    async def generate(request: web.Request) -> web.StreamResponse:
        # A place is taken before the body is read: past the limits it is refused unread.
        with proxy.admission.admit() as ticket:
            return await serve(request, ticket)

    async def serve(request: web.Request, ticket) -> web.StreamResponse:
        arrived = time.perf_counter()
        received_ns = time.time_ns()
        raw = await proxy.admission.read_body(request, ticket, config.limits.max_body_bytes)
        parsed = parse_request(raw, request.path, config.limits, proxy.client_kv_keys)
        del raw
        downloads = parsed.downloads()
        if downloads:
            if proxy.fetcher is None:  # parse_request refuses them: defence in depth
                raise bad_request("remote media URLs are off in this deployment",
                                  "remote_url_disabled")
            await proxy.fetcher.inline(downloads, ticket)
        tenant = request[TENANT]
        parsed.seal(proxy.key_of(tenant, parsed), tenant.cache_salt(parsed.client_salt))
        client_id, engine_id = proxy.request_ids_for(request.headers.get("x-request-id", ""))
        timeline_id = new_timeline_id()
        req = Request(parsed, request_id=engine_id, fault=request.headers.get("x-epd-fault"),
                      trace_id=client_trace_id(request.headers.get("traceparent"))
                      or timeline_id)
        metrics = proxy.metrics
        trip: Trip | None = None
        stages = None  # x-epd-stages as answered; a stream's grows until its end
        status = 500
        try:
            trip, result = await proxy.pipeline.run(req)
            stages = trip.header()
            headers = {STAGES_HEADER: stages, "x-request-id": client_id,
                       TRACE_HEADER: timeline_id}
            if not req.stream:
                status = 200
                _observe_transfer(metrics, trip)
                return web.Response(body=msgspec.json.encode(result), headers=headers,
                                    content_type="application/json")
            response = web.StreamResponse(headers=headers)
            response.content_type = "text/event-stream"
            status = 200
            broken = await _relay(request, response, result, metrics, trip, arrived)
            if broken is not None:  # the client was told inside the stream
                status = broken.status
                metrics.failures.labels(broken.reason).inc()
                log.warning("%s %s -> %d mid-stream: %s", request.method, request.path,
                            broken.status, broken.message)
            return response
        except ProxyError as err:
            status = err.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away: every hop was closed on the way out
            raise
        finally:
            modality = "multimodal" if trip and trip.multimodal else "text"
            metrics.child(metrics.requests, modality, str(status)).inc()
            if trip is not None:
                proxy.traces.add(timeline_of(trip, timeline_id, tenant.name, client_id,
                                             status, received_ns))
                if stages is None or req.stream:  # a stream's hops have ended since
                    stages = trip.header()
            request_log.info(msgspec.json.encode({
                "request_id": client_id, "engine_request_id": engine_id,
                "tenant": tenant.name, "path": req.path, "status": status,
                "stream": req.stream, "modality": modality,
                "stages": stages or "", "retries": trip.retries if trip else 0,
                "ms": round((time.perf_counter() - arrived) * 1e3, 2)}).decode())

    async def metaserver(request: web.Request) -> web.Response:
        """Decode instances of the ascend-layerwise hand-off report their blocks here,
        each at the URL made for its request. Nothing is read from a caller without such
        a URL; the report is not counted in admission, since every request in flight
        may be waiting for its own."""
        token = request.match_info["token"]
        handoff = proxy.pipeline.handoff
        if not handoff.expects_report(token):
            raise ProxyError(404, "no request is waiting for its blocks at this metaserver "
                             "URL", "invalid_request_error", reason="unknown_metaserver")
        if request.content_length is None or request.content_length > MAX_METASERVER_BODY:
            raise bad_request(f"a metaserver report takes a Content-Length of at most "
                              f"{MAX_METASERVER_BODY} bytes", "body_too_large", 413)
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            raise bad_request("metaserver body is not JSON", "malformed") from None
        if not isinstance(body, dict):
            raise bad_request("metaserver body must be a JSON object", "malformed")
        return web.json_response(await handoff.metaserver(token, body))

    async def receive_spans(request: web.Request) -> web.Response:
        """OTLP/HTTP (protobuf) trace export: the engines' spans of our requests. Counted
        like a request (admission), parsed on a worker thread."""
        if request.content_type != "application/x-protobuf":
            raise bad_request("OTLP traces are taken as application/x-protobuf "
                              "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)",
                              "malformed", 415)
        with proxy.admission.admit() as ticket:
            raw = await proxy.admission.read_body(request, ticket,
                                                  config.limits.max_trace_body_bytes)
            try:
                spans = await asyncio.to_thread(parse_otlp, bytes(raw))
            except Exception as err:  # protobuf's DecodeError and friends
                raise bad_request(f"not an OTLP trace export: {type(err).__name__}: {err}",
                                  "malformed") from None
        proxy.traces.add_engine_spans(spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def get_trace(request: web.Request) -> web.Response:
        key = request.match_info["id"]
        timeline = proxy.traces.get(key, request[TENANT].name)
        if timeline is None:
            raise ProxyError(404, f"no timeline of {key!r}: the proxy keeps the last "
                             f"{proxy.traces.capacity} requests' (by x-epd-trace-id, or by "
                             "request id), each readable with its own API key",
                             "invalid_request_error", reason="unknown_trace")
        return web.json_response(timeline.to_dict())

    async def recent_traces(request: web.Request) -> web.Response:
        try:
            last = int(request.query.get("last", "20"))
        except ValueError:
            raise bad_request("last: a whole number of requests", "malformed") from None
        return web.json_response([
            {k: v for k, v in t.to_dict().items() if k != "spans"}
            for t in proxy.traces.recent(max(0, last), request[TENANT].name)])

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": config.model, "object": "model", "owned_by": "epd-serve"}]})

    async def health(request: web.Request) -> web.Response:
        """ok: every stage has a healthy instance. degraded (200): a stage has none (each
        down, or found hung: upstream.py), but text is served, and its work is done by
        another stage (stand_ins, e.g. "P>D": the stages that run on stand-ins) or
        only the requests that need it are refused (images without an encoder, with
        encode_fallback: refuse). unavailable (503): text cannot be served."""
        instances, roster = proxy.table.instances, proxy.table.roster
        down = down_hops(instances, roster)
        text = plan_stages(0, (), False, roster, down, proxy.pipeline.stand_in)
        missing = [hop for hop in roster.hops if hop in down]
        if not all(eligible(instances, hop) for hop in text.hops):
            return web.json_response({"status": "unavailable",
                                      "stages_without_healthy_instance": missing or
                                      list(text.hops)}, status=503)
        if not missing:
            return web.json_response({"status": "ok"})
        stand_ins = list(text.stand_ins)
        if "E" in down and config.routing.encode_fallback == "prefill":
            stand_ins.insert(0, ("E", computing_hop(text)))
        return web.json_response({"status": "degraded",
                                  "stages_without_healthy_instance": missing,
                                  "stand_ins": [f"{m}>{s}" for m, s in stand_ins]})

    async def ready(request: web.Request) -> web.Response:
        """Every instance of the roster has answered a probe: a deployment that was just
        started serves every stage (its engines answering /health is not enough: the
        proxy probes on its own schedule)."""
        waiting = [i.name for i in proxy.table.instances if not i.healthy and not i.draining]
        if waiting:
            return web.json_response({"status": "starting", "waiting_for": waiting}, status=503)
        return web.json_response({"status": "ready"})

    async def status(request: web.Request) -> web.Response:
        await proxy.membership.refresh_engine_loads()
        return web.json_response({
            "model": config.model,
            "policies": {hop: p.name for hop, p in proxy.router.policies.items()},
            "instances": proxy.table.to_dict()})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=proxy.metrics.render(),
                            headers={"content-type": "text/plain; version=0.0.4"})

    def require_admin(request: web.Request) -> None:
        if proxy.admin_key is None:
            raise ProxyError(403, f"instance registration is off: set {config.admin_key_env} "
                             "in the proxy's environment to enable it", "permission_error",
                             reason="admin_disabled")
        if not hmac.compare_digest(bearer_token(request).encode(), proxy.admin_key.encode()):
            raise ProxyError(401, "missing or wrong admin key", "authentication_error",
                             reason="unauthorized")

    async def list_instances(request: web.Request) -> web.Response:
        return web.json_response(proxy.table.to_dict())

    async def add_instance(request: web.Request) -> web.Response:
        require_admin(request)
        try:
            entry = InstanceEntry.model_validate_json(await request.read())
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise bad_request(f"invalid instance: {where}: {first['msg']}", "malformed") from None
        try:
            inst = proxy.membership.register(entry)
        except KeyError:
            raise ProxyError(409, f"an instance named {entry.name!r} is already registered",
                             "invalid_request_error", reason="duplicate") from None
        return web.json_response(inst.to_dict(), status=201)

    async def remove_instance(request: web.Request) -> web.Response:
        require_admin(request)
        name = request.match_info["name"]
        try:
            inst = proxy.membership.deregister(name)
        except KeyError:
            raise ProxyError(404, f"no instance named {name!r}", "invalid_request_error",
                             reason="unknown_instance") from None
        return web.json_response(inst.to_dict())

    for path in GENERATE_ROUTES:
        app.router.add_post(path, generate)
    app.router.add_post(METASERVER + "{token}", metaserver)
    app.router.add_post("/v1/traces", receive_spans)
    app.router.add_get("/v1/traces", recent_traces)
    app.router.add_get("/v1/traces/{id}", get_trace)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instances", list_instances)
    app.router.add_post("/instances", add_instance)
    app.router.add_delete("/instances/{name}", remove_instance)
    return app


async def _relay(request: web.Request, response: web.StreamResponse, stream, metrics,
                 trip: Trip, arrived: float) -> ProxyError | None:
    """Pass the answer on as it comes, timing the first event and the ones after it.
    If the client leaves, the write fails (or the handler is cancelled) and closing the
    stream closes the instance's connection, which makes its engine abort. If the
    instance breaks off (or hangs) mid-stream, the status has long been sent: the
    stream ends with an error event, as vLLM ends one that fails, and the error is
    returned."""
    first = last = None
    events = 0
    broken = None
    async with contextlib.aclosing(stream):
        await response.prepare(request)
        try:
            async for chunk in stream:
                now = time.perf_counter()
                if first is None:
                    first = now
                events += chunk.count(b"data: ")
                last = now
                await response.write(chunk)
                trip.relayed_ns.append(time.time_ns())
        except ProxyError as err:
            broken = err
            # An event may have been cut mid-line: start the error on a line of its own.
            await response.write(b"\n\ndata: " + msgspec.json.encode(err.to_body())
                                 + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    final = next((s.instance for s in reversed(trip.stages)
                  if s.stage == trip.final_hop and not s.failed), "?")
    if first is not None:
        metrics.child(metrics.first_token_seconds, final).observe(first - arrived)
        if events > 2 and broken is None:  # the last event is [DONE]
            metrics.child(metrics.token_seconds, final).observe(
                (last - first) / (events - 2))
    return broken


def _observe_transfer(metrics: ProxyMetrics, trip: Trip) -> None:
    """The KV hand-off's own timing, where its answer reports one (non-streamed)."""
    transfer_ms = (trip.kv or {}).get("transfer_ms")
    decode = next((s.instance for s in trip.stages if s.stage == "D" and not s.failed), None)
    if isinstance(transfer_ms, (int, float)) and decode:
        metrics.child(metrics.transfer_seconds, decode).observe(transfer_ms / 1e3)
