"""Which running children are hung: there, but not answering, for too long.

Runs in the launcher's supervision loop (launcher.py), once per round. A process that
exits is restarted by its Child; one that hangs (stopped, a wedged device, an engine
core stopped under a live API server) does not exit, so it is looked at here:
- an engine instance through the proxy, which sees it best: the proxy publishes how
  long each instance has been there without answering its /health or, /health being
  green while vLLM's engine core is stopped, a one-token request
  (`epd_proxy_instance_hung_seconds`, proxy/liveness.py);
- the proxy and the MM Store server by their own health URL: any answer is alive.
A child counts only once it has answered since its last start (a process starting up
is slow, not hung). One hung for `Supervision.hung_restart_s` is killed (SIGKILL, which
a stopped process takes too), and its Child restarts it as after a crash.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import httpx

HUNG_GAUGE = re.compile(r'^epd_proxy_instance_hung_seconds\{instance="([^"]+)"\} (\S+)$', re.M)
ANSWER_TIMEOUT_S = 5.0


def answers(client: httpx.Client, url: str) -> bool:
    """Whether anything answers at `url` within ANSWER_TIMEOUT_S (any status: a
    server that answers is not hung). A refused connection counts as answered: that
    process is gone, which its exit shows."""
    try:
        client.get(url, timeout=ANSWER_TIMEOUT_S)
        return True
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False


def hung_per_proxy(client: httpx.Client, proxy_url: str) -> dict[str, float] | None:
    """Instance -> seconds the proxy has seen it hung; None if the proxy did not say."""
    try:
        resp = client.get(proxy_url + "/metrics", timeout=ANSWER_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return {name: float(value) for name, value in HUNG_GAUGE.findall(resp.text)}


def hung_children(children: Sequence[Any], engines: set[str], proxy_url: str,
                  client: httpx.Client, limit_s: float, now: float | None = None) -> dict[str, str]:
    """Name -> why, for each healthy running child hung `limit_s` or longer. Children
    that are not engines carry `silent_since` (set and cleared here)."""
    now = time.monotonic() if now is None else now
    found: dict[str, str] = {}
    per_proxy = None
    for child in children:
        if not child.healthy or child.exit_code() is not None:
            child.silent_since = None
            continue
        if child.name in engines:
            if per_proxy is None:
                per_proxy = hung_per_proxy(client, proxy_url) or {}
            seconds = per_proxy.get(child.name, 0.0)
            if seconds >= limit_s:
                found[child.name] = (f"the proxy has seen it hung for {seconds:.0f} s (its "
                                     "/health or its engine not answering)")
            continue
        if answers(client, child.health_url):
            child.silent_since = None
        elif child.silent_since is None:
            child.silent_since = now
        elif now - child.silent_since >= limit_s:
            found[child.name] = f"{child.health_url} has not answered for " \
                                f"{now - child.silent_since:.0f} s"
    return found
