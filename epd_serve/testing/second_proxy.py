"""A second proxy process in front of a running deployment's instances (and MM Store),
configured as the deployment's own with some settings changed: what tests and
benchmarks use to try a proxy setting without starting the engines again."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx

from epd_serve.proxy.config import ProxyConfig
from epd_serve.runtime.plan import proxy_config
from epd_serve.runtime.supervision import log_dir


@contextlib.contextmanager
def second_proxy(dep, name: str, port_offset: int, env: dict | None = None, **settings):
    """Yields the URL of a proxy with the deployment's config and `settings` (ProxyConfig
    fields) on top, on the deployment's proxy port + `port_offset`; its log is
    logs/proxy-<name>.log, its environment this one's and `env`."""
    base = proxy_config(dep).model_dump()
    config = ProxyConfig.model_validate({**base, "port": base["port"] + port_offset,
                                         "roster_path": None, **settings})
    path = dep.work_dir / f"proxy-{name}.json"
    path.write_text(config.model_dump_json())
    url = f"http://{config.host}:{config.port}"
    with open(log_dir(dep) / f"proxy-{name}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "epd_serve.proxy", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
