"""The routes that serve the model: chat and text completions, the model list, and the
metaserver URL a request's decode instance reports its KV blocks to.

Runs in the proxy process. A generation request is admitted within the proxy's limits
and its body read (admission.py: 503, 408, 413, 429), parsed once and checked before any
engine sees it (request.py), its media keyed by the proxy (`seal`), served by
pipeline.py and answered here, streamed or whole, with `x-request-id`, `x-epd-trace-id`
and, for the operator (`stage_headers`), `x-epd-stages`; every request leaves one line
in the request log and a timeline in the trace store. Handlers reach the running Proxy as `request.app[PROXY]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import msgspec
from aiohttp import web

from epd_serve.proxy import fanout
from epd_serve.proxy.context import PROXY, TENANT, Proxy
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.pipeline import Request
from epd_serve.proxy.request import ParsedRequest, parse_request
from epd_serve.proxy.tenancy import Tenant
from epd_serve.proxy.timeline import client_trace_id, new_timeline_id, timeline_of
from epd_serve.proxy.trip import Trip

# The proxy's own logger names, so log settings and tests that read them still apply.
log = logging.getLogger("epd_serve.proxy")
request_log = logging.getLogger("epd_serve.proxy.requests")

STAGES_HEADER = "x-epd-stages"
TRACE_HEADER = "x-epd-trace-id"  # the request's timeline: GET /v1/traces/{this id}
GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions")
RESPONSES = "/v1/responses"
METASERVER = "/v1/metaserver/"
# The largest report a decode instance posts to its metaserver URL (block ids).
MAX_METASERVER_BODY = 1 << 20


async def generate(request: web.Request) -> web.StreamResponse:
    # A place is taken before the body is read: past the limits it is refused unread.
    with request.app[PROXY].admission.admit(request[TENANT],
                                            request.remote or "unknown") as ticket:
        return await serve(request, ticket)


async def serve(request: web.Request, ticket) -> web.StreamResponse:
    proxy = request.app[PROXY]
    arrived = time.perf_counter()
    received_ns = time.time_ns()
    tenant = request[TENANT]
    parsed = await _parse(request, proxy, tenant, ticket)
    client_id, engine_id = proxy.request_ids_for(request.headers.get("x-request-id", ""))
    reqs, parts = _requests(request, proxy, parsed, engine_id)
    timeline_ids = [req.timeline_id for req in reqs]
    metrics = proxy.metrics
    trips: list[Trip] = []
    stages = None  # x-epd-stages as answered; a stream's grows until its end
    status = 500
    try:
        results = await _run_all(proxy, reqs, trips)
        ticket.sent()
        stages = _stages(trips)
        headers = {"x-request-id": client_id, TRACE_HEADER: ",".join(timeline_ids)}
        if proxy.shows_stages(request):
            headers[STAGES_HEADER] = stages
        if not parsed.stream:
            status = 200
            for trip in trips:
                _observe_transfer(metrics, trip)
            result = results[0] if parts is None else fanout.merge(parts, results)
            response = web.Response(body=msgspec.json.encode(result), headers=headers,
                                    content_type="application/json")
            broken = await _send_whole(request, response,
                                       proxy.config.limits.client_write_timeout_s)
            if broken is not None:
                status = broken.status
                metrics.failures.labels(broken.reason).inc()
                log.warning("%s %s -> %d while sent: %s", request.method, request.path,
                            broken.status, broken.message)
            return response
        stream = results[0] if parts is None else fanout.merged_stream(
            parts, results, bool((parsed.body.get("stream_options") or {})
                                 .get("include_usage")))
        response = web.StreamResponse(headers=headers)
        response.content_type = "text/event-stream"
        status = 200
        broken = await _relay(request, response, stream, metrics, trips[0], arrived,
                              proxy.config.limits.client_write_timeout_s)
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
        modality = "multimodal" if trips and trips[0].multimodal else "text"
        metrics.child(metrics.requests, modality, str(status)).inc()
        for trip, timeline_id in zip(trips, timeline_ids):
            proxy.traces.add(timeline_of(trip, timeline_id, tenant.id, client_id,
                                         status, received_ns))
        if trips and (stages is None or parsed.stream):  # a stream's hops have ended since
            stages = _stages(trips)
        request_log.info(msgspec.json.encode({
            "request_id": client_id, "engine_request_id": engine_id,
            "tenant": tenant.name, "path": parsed.path, "status": status,
            "stream": parsed.stream, "modality": modality,
            "stages": stages or "", "retries": sum(t.retries for t in trips),
            "ms": round((time.perf_counter() - arrived) * 1e3, 2)}).decode())


def _requests(request: web.Request, proxy: Proxy, parsed: ParsedRequest,
              engine_id: str) -> tuple[list[Request], list[fanout.Part] | None]:
    """The request as the stages run it: itself, or the parts of one asking for several
    sequences (fanout.py), each with an engine id of its own."""
    pipeline = proxy.pipeline
    split_samples = pipeline.table.roster.split and not pipeline.handoff.decode_samples
    parts = fanout.split(parsed.sent, parsed.prompts, parsed.samples, split_samples)
    fault = request.headers.get("x-epd-fault")
    trace_id = client_trace_id(request.headers.get("traceparent"))

    def run_as(one: ParsedRequest, request_id: str) -> Request:
        timeline_id = new_timeline_id()
        return Request(one, request_id, fault, trace_id or timeline_id, timeline_id)

    if parts is None:
        return [run_as(parsed, engine_id)], None
    return [run_as(dataclasses.replace(parsed, sent=part.body, prompts=None),
                   f"{engine_id}-{k}") for k, part in enumerate(parts)], parts


async def _run_all(proxy: Proxy, reqs: list[Request], trips: list[Trip]) -> list:
    """Run every request through the stages at once; their answers (or streams), in
    order. One that fails fails them all (the others are cancelled)."""
    if len(reqs) == 1:  # the usual request: run here, without a task and a gather
        trip, result = await proxy.pipeline.run(reqs[0])
        trips.append(trip)
        return [result]
    done: dict[int, Trip] = {}

    async def one(k: int, req: Request):
        done[k], result = await proxy.pipeline.run(req)
        return result

    tasks = [asyncio.ensure_future(one(k, req)) for k, req in enumerate(reqs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        trips.extend(done[k] for k in sorted(done))


def _stages(trips: list[Trip]) -> str:
    """x-epd-stages: one trip's, or each part's in order, ` | `-separated."""
    return " | ".join(trip.header() for trip in trips)


async def _parse(request: web.Request, proxy: Proxy, tenant: Tenant,
                 ticket) -> ParsedRequest:
    """The request's body read within its admission, parsed, its remote media fetched,
    its videos decoded and every media item keyed in `tenant`'s namespace."""
    limits = proxy.config.limits
    raw = await proxy.admission.read_body(request, ticket, limits.max_body_bytes)
    parsed = parse_request(raw, request.path, limits, proxy.client_kv_keys)
    del raw  # nothing needs the raw body past parsing: let it go before the downloads
    downloads = parsed.downloads()
    if downloads:
        if proxy.fetcher is None:  # parse_request refuses them: defence in depth
            raise bad_request("remote media URLs are off in this deployment",
                              "remote_url_disabled")
        await proxy.fetcher.inline(downloads, ticket)
    if parsed.videos:  # decoded once, here: every stage is sent the same frames
        await proxy.videos.prepare(parsed.videos, request.remote or "unknown")
    parsed.seal(proxy.key_of(tenant, parsed), tenant.cache_salt(parsed.client_salt))
    return parsed


def _not_reading(request: web.Request, write_timeout_s: float) -> ProxyError:
    """Drop a client that took none of its answer for `write_timeout_s`."""
    if request.transport is not None:
        request.transport.abort()
    return ProxyError(408, f"the client took no bytes of its answer for "
                      f"{write_timeout_s:g} s (proxy.limits.client_write_timeout_s): "
                      "dropped, its request cancelled", reason="client_not_reading")


async def _send_whole(request: web.Request, response: web.Response,
                      write_timeout_s: float) -> ProxyError | None:
    """Send a whole answer here, within the request's admission and the write deadline
    (aiohttp would send it after the handler returns, with no deadline: a client that
    never reads would keep the answer's bytes and its connection for good)."""
    try:
        async with asyncio.timeout(write_timeout_s):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        return _not_reading(request, write_timeout_s)
    except ConnectionError:  # the client left while its answer was on its way
        return ProxyError(499, "the client closed its connection before its answer was "
                          "sent", reason="client_gone")
    return None


async def _relay(request: web.Request, response: web.StreamResponse, stream, metrics,
                 trip: Trip, arrived: float, write_timeout_s: float) -> ProxyError | None:
    """Pass the answer on as it comes, timing the first event and the ones after it.
    If the client leaves, the write fails (or the handler is cancelled) and closing the
    stream closes the instance's connection, which makes its engine abort; so does a
    client that takes nothing for `write_timeout_s` (it would hold its place and the
    instance's blocks for as long as it likes). If the instance breaks off (or hangs)
    mid-stream, the status has long been sent: the stream ends with an error event, as
    vLLM ends one that fails, and the error is returned."""
    first = last = None
    events = 0
    broken = None
    async with contextlib.aclosing(stream):
        await response.prepare(request)
        try:
            try:
                async for chunk in stream:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    events += chunk.count(b"data: ")
                    last = now
                    async with asyncio.timeout(write_timeout_s):
                        await response.write(chunk)
                    trip.relayed_ns.append(time.time_ns())
            except ProxyError as err:
                broken = err
                # An event may have been cut mid-line: start the error on a line of its own.
                async with asyncio.timeout(write_timeout_s):
                    await response.write(b"\n\ndata: " + msgspec.json.encode(err.to_body())
                                         + b"\n\ndata: [DONE]\n\n")
        except TimeoutError:
            return _not_reading(request, write_timeout_s)
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


async def responses(request: web.Request) -> web.Response:
    """The Responses API is refused, saying why: a response is stored in the engine
    that made it (`store`, `previous_response_id`, background runs), which another
    request routed to another instance cannot see, and its input items would reach the
    engines unkeyed by the proxy (cache identities are the proxy's alone)."""
    raise bad_request(
        f"{request.path} is not served by this deployment: the Responses API keeps each "
        "response in the engine that made it, which the next request (routed to any "
        "instance) cannot read. Send the same input to /v1/chat/completions, which every "
        "stage serves.", "unsupported_endpoint")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[PROXY].config.model, "object": "model", "owned_by": "epd-serve"}]})


async def metaserver(request: web.Request) -> web.Response:
    """Decode instances of the ascend-layerwise hand-off report their blocks here,
    each at the URL made for its request. Nothing is read from a caller without such
    a URL; the report is not counted in admission, since every request in flight
    may be waiting for its own."""
    token = request.match_info["token"]
    handoff = request.app[PROXY].pipeline.handoff
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
