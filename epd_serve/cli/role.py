"""`epd-serve role INSTANCE E|P|D`: switch a switchable instance's role by hand.

Asks the running proxy (POST /instances/{name}/role, with the deployment's admin key)
and follows the switch on /roles until the instance serves its new role, printing the
drain as it goes; exits non-zero if the proxy refuses it, or it is abandoned or
cancelled.
"""

from __future__ import annotations

import os
import time

import httpx

DEFAULT_PROXY_URL = "http://127.0.0.1:8000"  # where `epd-serve up` puts the proxy
POLL_S = 0.5
ASK_WAIT_S = 5.0  # the first answer comes once the switch is done or this has passed


def _admin_target(args) -> tuple[str, str | None, str | None]:
    """The proxy's URL, its admin key and its client key (for /roles)."""
    if args.config:
        from epd_serve.proxy.tenancy import own_key
        from epd_serve.runtime import bringup

        dep = bringup.load(args.config)
        proxy = dep.config.proxy
        return (dep.proxy_url, os.environ.get(proxy.admin_key_env),
                own_key(proxy.api_key_env))
    return (args.url or DEFAULT_PROXY_URL, os.environ.get("EPD_ADMIN_KEY"),
            os.environ.get("EPD_API_KEY"))


def _error_of(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def cmd_role(args) -> int:
    url, admin_key, client_key = _admin_target(args)
    if not admin_key:
        print("error: role switches take the proxy's admin key: set EPD_ADMIN_KEY (or the "
              "deployment's proxy.admin_key_env) in this shell")
        return 2
    base = url.rstrip("/")
    try:
        resp = httpx.post(f"{base}/instances/{args.instance}/role",
                          json={"role": args.role, "wait_s": ASK_WAIT_S},
                          headers={"authorization": f"Bearer {admin_key}"},
                          timeout=ASK_WAIT_S + 10)
    except httpx.HTTPError as err:
        print(f"error: cannot reach the proxy at {base}: {err or type(err).__name__}")
        return 1
    if resp.status_code not in (200, 202):
        print(f"error: HTTP {resp.status_code}: {_error_of(resp)}")
        return 1
    switch = resp.json()
    if resp.status_code == 202:
        switch = _follow(base, switch, client_key, args.timeout)
    return _report(switch)


def _follow(base: str, switch: dict, client_key: str | None, timeout: float) -> dict:
    """Poll /roles until the switch has ended (or `timeout`), showing the drain."""
    headers = {"authorization": f"Bearer {client_key}"} if client_key else None
    deadline = time.monotonic() + timeout
    while switch["outcome"] == "draining" and time.monotonic() < deadline:
        status = httpx.get(f"{base}/status", headers=headers, timeout=10).json()
        in_flight = next((i["in_flight"] for i in status["instances"]
                          if i["name"] == switch["instance"]), "?")
        print(f"draining {switch['instance']} ({switch['source']} -> {switch['target']}): "
              f"{in_flight} hop(s) in flight", flush=True)
        time.sleep(POLL_S)
        mine = [s for s in status["roles"]["switches"]
                if s["instance"] == switch["instance"] and s["decided_at"] == switch["decided_at"]]
        switch = mine[-1] if mine else switch
    return switch


def _report(switch: dict) -> int:
    name, move = switch["instance"], f"{switch['source']} -> {switch['target']}"
    if switch["outcome"] == "done":
        print(f"{name}: {move}, serving {switch['target']} "
              f"{switch['serving_after_ms']:.0f} ms after the decision")
        return 0
    if switch["outcome"] == "draining":
        print(f"{name}: {move} still draining; follow it with `epd-serve status`")
        return 1
    print(f"{name}: {move} {switch['outcome']}; it keeps serving {switch['source']}")
    # Cancelled: asked back to the role it was leaving, which it now serves.
    return 0 if switch["outcome"] == "cancelled" else 1


def add_parser(sub) -> None:
    p = sub.add_parser("role", help="switch a switchable (~) instance between E, P and D "
                       "while it serves")
    p.add_argument("instance", help="the instance's name, e.g. d0")
    p.add_argument("role", choices=("E", "P", "D"))
    p.add_argument("--config", help="deployment file; its proxy is asked")
    p.add_argument("--url", help="proxy base URL instead of a file")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="how long to follow the drain (seconds)")
    p.set_defaults(func=cmd_role)
