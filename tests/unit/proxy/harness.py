"""The proxy test harness: the proxy (an aiohttp app) on a background thread, fake
OpenAI-compatible instances behind it (`deployment`, `ascend_deployment`), a chat
request to it (`chat`), and a real (tiny) image, since the proxy's guards refuse
anything undecodable. Each fake and the proxy are real HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import httpx
from aiohttp import web

from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.proxy import ProxyConfig, create_app
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from tests.ports import free_port_block
from tests.waiting import wait_for


def tiny_image(seed: int = 0) -> str:
    return image_data_url(make_image(16, 16, seed=seed), "PNG")


IMAGE = tiny_image()


class ProxyThread:
    """The proxy app served on 127.0.0.1 (a free port unless given) in its own loop."""

    def __init__(self, app: web.Application, port: int = 0):
        self.app = app
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await site.start()
            self.port = self._runner.addresses[0][1]

        self.loop.run_until_complete(start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proxy(self):
        """The running Proxy (its table, router, metrics) for white-box checks."""
        from epd_serve.proxy.app import PROXY
        return self.app[PROXY]

    def call(self, fn, *args):
        """Run `fn(*args)` on the proxy's loop (its state is not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def __enter__(self) -> "ProxyThread":
        self.thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclasses.dataclass
class Deployment:
    client: httpx.Client
    apps: dict
    proxy: ProxyThread

    def seen(self, name: str) -> list[dict]:
        return self.apps[name].state.requests


@contextlib.contextmanager
def deployment(roles: list[str], dead: set[str] = frozenset(), failing: dict | None = None,
               protocol: str = "epd", client_headers: dict | None = None, **settings):
    """Fake instances for `roles` (e.g. ["E", "P", "D"]; "D~": one that may switch role)
    behind a proxy that hands KV off with `protocol`; `settings` are ProxyConfig fields
    (routing, limits, ...)."""
    failing = failing or {}
    with contextlib.ExitStack() as stack:
        entries, apps = [], {}
        for i, written in enumerate(roles):
            role, switchable = written.removesuffix("~"), written.endswith("~")
            name = f"{role.lower()}{i}"
            app = create_fake_app(name, fail_status=failing.get(name))
            apps[name] = app
            if name in dead:
                url = "http://127.0.0.1:9"  # nothing listens: connection refused
            else:
                url = stack.enter_context(ThreadedServer(app)).url
            entry = {"name": name, "roles": role, "url": url, "switchable": switchable}
            if ("P" in role and "D" not in role) or switchable:
                # mooncake: the bootstrap server (the fake answers /query itself);
                # epd: the side channel, which only decode instances talk to (the fakes
                # never do: the address is only handed on, and tests check it was).
                entry["kv_endpoint"] = url if protocol == "mooncake" else f"127.0.0.1:{30100 + i}"
            entries.append(entry)
        # A fake left hanging (a test's stopped process) is let go first, so its server
        # can stop.
        stack.callback(lambda: [setattr(a.state, "hang", False) for a in apps.values()])
        settings.setdefault("health_interval_s", 0.05)
        # These tests read every answer's stages; the default (the operator's only)
        # has tests of its own.
        settings.setdefault("stage_headers", "clients")
        config = ProxyConfig(model="fake", instances=entries, kv_protocol=protocol, **settings)
        proxy = stack.enter_context(ProxyThread(create_app(config)))
        client = stack.enter_context(httpx.Client(base_url=proxy.url, timeout=30,
                                                  headers=client_headers))
        alive = [e["name"] for e in entries if e["name"] not in dead]
        wait_for(lambda: all(i["healthy"] for i in client.get("/status").json()["instances"]
                             if i["name"] in alive), "instances healthy")
        yield Deployment(client, apps, proxy)


@contextlib.contextmanager
def ascend_deployment(roles: list[str], failing: dict | None = None):
    """Fake instances speaking vllm-ascend's layerwise protocol, behind a proxy on a
    known port: decode instances call its /v1/metaserver back."""
    failing = failing or {}
    with contextlib.ExitStack() as stack:
        entries, apps = [], {}
        for i, role in enumerate(roles):
            name = f"{role.lower()}{i}"
            apps[name] = create_fake_app(name, fail_status=failing.get(name))
            url = stack.enter_context(ThreadedServer(apps[name])).url
            entries.append({"name": name, "roles": role, "url": url})
        port = free_port_block(1)
        config = ProxyConfig(model="fake", instances=entries, health_interval_s=0.05,
                             kv_protocol="ascend-layerwise", port=port,
                             stage_headers="clients")
        proxy = stack.enter_context(ProxyThread(create_app(config), port=port))
        client = stack.enter_context(httpx.Client(base_url=proxy.url, timeout=30))
        wait_for(lambda: client.get("/health").status_code == 200, "proxy healthy")
        yield Deployment(client, apps, proxy)


def chat(d: Deployment, *args, headers=None, **kwargs) -> httpx.Response:
    """POST a chat request (`chat_body("fake", *args, **kwargs)`) to the proxy."""
    return d.client.post("/v1/chat/completions", json=chat_body("fake", *args, **kwargs),
                         headers=headers)
