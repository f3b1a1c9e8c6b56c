"""The membership routes: the roster listed, and instances registered and removed while
the proxy runs.

Runs in the proxy process. Listing takes an API key like any client route; registering
and removing take the admin key (`require_admin`), and are refused outright when the
deployment set none. Handlers reach the running Proxy as `request.app[PROXY]`.
"""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from epd_serve.proxy.config import InstanceEntry
from epd_serve.proxy.context import PROXY
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.tenancy import is_admin

M = TypeVar("M", bound=BaseModel)


def require_admin(request: web.Request) -> None:
    proxy = request.app[PROXY]
    if proxy.admin_key is None:
        raise ProxyError(403, f"instance registration and role switches are off: set "
                         f"{proxy.config.admin_key_env} in the proxy's environment to "
                         "enable it", "permission_error", reason="admin_disabled")
    if not is_admin(request, proxy.admin_key):
        raise ProxyError(401, "missing or wrong admin key", "authentication_error",
                         reason="unauthorized")


async def list_instances(request: web.Request) -> web.Response:
    return web.json_response(request.app[PROXY].table.to_dict())


async def read_admin_body(request: web.Request, model: type[M], what: str) -> M:
    """An admin route's JSON body as `model`; a 400 naming the first field wrong."""
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise bad_request(f"invalid {what}: {where}: {first['msg']}", "malformed") from None


async def add_instance(request: web.Request) -> web.Response:
    require_admin(request)
    entry = await read_admin_body(request, InstanceEntry, "instance")
    try:
        inst = request.app[PROXY].membership.register(entry)
    except KeyError:
        raise ProxyError(409, f"an instance named {entry.name!r} is already registered",
                         "invalid_request_error", reason="duplicate") from None
    return web.json_response(inst.to_dict(), status=201)


async def remove_instance(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    try:
        inst = request.app[PROXY].membership.deregister(name)
    except KeyError:
        raise ProxyError(404, f"no instance named {name!r}", "invalid_request_error",
                         reason="unknown_instance") from None
    return web.json_response(inst.to_dict())
