"""The role routes: which stage each instance serves and the switches made (GET
/roles), a switch by hand (POST /instances/{name}/role, `epd-serve role`), and the
controller turned on or off (POST /roles/controller).

Runs in the proxy process. Listing takes an API key like /status; switching takes the
admin key (routes_instances.require_admin). A switch answers 200 once the instance
serves its new role, 202 if it is still draining after `wait_s` (poll /roles), and
the refusal's own status otherwise (roles.SwitchRefused: 400, 404, 409).
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from epd_serve.proxy.context import PROXY
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.roles import SwitchRefused
from epd_serve.proxy.routes_instances import read_admin_body, require_admin


class SwitchAsked(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(description="E, P or D.")
    wait_s: float = Field(30.0, ge=0, le=600, description="How long to wait for the drain "
                          "before answering 202 (the switch goes on).")


def roles_view(proxy) -> dict:
    """What /roles and /status show: each instance's role, the switches, and the
    controller (on or off, and its recent decisions with their reasons)."""
    view = proxy.roles.to_dict()
    controller = proxy.controller
    view["controller"] = {"enabled": controller.enabled, "decisions": list(controller.decisions)}
    return view


class ControllerAsked(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool


async def set_controller(request: web.Request) -> web.Response:
    """Turn the role controller on or off while serving (admin key): a switch under way
    finishes; none is started while it is off."""
    require_admin(request)
    proxy = request.app[PROXY]
    asked = await read_admin_body(request, ControllerAsked, "controller setting")
    proxy.controller.enabled = asked.enabled
    proxy.controller.policy.reset()
    return web.json_response(roles_view(proxy)["controller"])


async def list_roles(request: web.Request) -> web.Response:
    return web.json_response(roles_view(request.app[PROXY]))


async def switch_role(request: web.Request) -> web.Response:
    require_admin(request)
    proxy = request.app[PROXY]
    asked = await read_admin_body(request, SwitchAsked, "role switch")
    try:
        switch = proxy.roles.start(request.match_info["name"], asked.role)
    except SwitchRefused as err:
        kind = "invalid_request_error" if err.status < 500 else "service_unavailable"
        raise ProxyError(err.status, err.message, kind, reason=err.reason) from None
    await proxy.roles.wait(switch, asked.wait_s)
    return web.json_response(switch.to_dict(), status=202 if switch.outcome == "draining"
                             else 200)
