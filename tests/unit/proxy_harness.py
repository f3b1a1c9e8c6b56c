"""Run the proxy (an aiohttp app) on a background thread for tests, and a chat body
with a real (tiny) image, since the proxy's guards refuse anything undecodable."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from epd_serve.engines.payloads import image_data_url, make_image


def tiny_image(seed: int = 0) -> str:
    return image_data_url(make_image(16, 16, seed=seed), "PNG")


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
