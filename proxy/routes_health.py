"""The routes that say how the deployment is doing: /health, /ready, /status and
/metrics.

Runs in the proxy process. /health, /ready and /metrics are open (launchers wait on
/ready, monitors read /health and /metrics); /status takes an API key. Handlers reach
the running Proxy as `request.app[PROXY]`.
"""

from __future__ import annotations

from aiohttp import web

from epd_serve.proxy.context import PROXY
from epd_serve.proxy.routes_roles import roles_view
from epd_serve.proxy.routing import computing_hop, down_hops, eligible, plan_stages


async def health(request: web.Request) -> web.Response:
    """ok: every stage has a healthy instance. degraded (200): a stage has none (each
    down, or found hung: upstream.py), but text is served, and its work is done by
    another stage (stand_ins, e.g. "P>D": the stages that run on stand-ins) or
    only the requests that need it are refused (images without an encoder, with
    encode_fallback: refuse). unavailable (503): text cannot be served."""
    proxy = request.app[PROXY]
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
    if "E" in down and proxy.config.routing.encode_fallback == "prefill":
        stand_ins.insert(0, ("E", computing_hop(text)))
    return web.json_response({"status": "degraded",
                              "stages_without_healthy_instance": missing,
                              "stand_ins": [f"{m}>{s}" for m, s in stand_ins]})


async def ready(request: web.Request) -> web.Response:
    """Every instance of the roster has answered a probe: a deployment that was just
    started serves every stage (its engines answering /health is not enough: the
    proxy probes on its own schedule)."""
    waiting = [i.name for i in request.app[PROXY].table.instances
               if not i.healthy and not i.draining]
    if waiting:
        return web.json_response({"status": "starting", "waiting_for": waiting}, status=503)
    return web.json_response({"status": "ready"})


async def status(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    await proxy.membership.refresh_engine_loads()
    return web.json_response({
        "model": proxy.config.model,
        "policies": {hop: p.name for hop, p in proxy.router.policies.items()},
        "instances": proxy.table.to_dict(),
        "roles": roles_view(proxy)})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[PROXY].metrics.render(),
                        headers={"content-type": "text/plain; version=0.0.4"})
