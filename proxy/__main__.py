"""`python -m epd_serve.proxy --config proxy.json`: run the proxy (aiohttp on uvloop)."""

from __future__ import annotations

import argparse
import gc
import logging

from aiohttp import web

from epd_serve.proxy.admission import descriptor_budget
from epd_serve.proxy.app import create_app
from epd_serve.proxy.config import ProxyConfig
from epd_serve.protocols.held_socket import inherited_socket


def event_loop():
    """uvloop where it is installed: the proxy's per-request cost is mostly the loop's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="epd-serve-proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="proxy JSON written by the launcher")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    config = ProxyConfig.from_file(args.config)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One request log line per request: skip what the format never shows (the caller's
    # frame, thread and process names), as the logging HOWTO's optimisation section says.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # Each request in flight holds sockets: the admission limit is sized to what the
    # process may open (admission.py), after raising that as far as the system allows.
    descriptor_budget()
    app = create_app(config)
    # Everything built so far lives as long as the process: keep it out of the
    # collector's scans, and collect the young generation less often (a request makes
    # a few hundred short-lived objects), so collections stop adding to the tail latency.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    # handler_cancellation: a client that disconnects cancels its request's handler, which
    # closes every hop it has open, so the engines abort the work instead of finishing it.
    # The socket the supervisor holds across our restarts, where it handed us one
    # (protocols/held_socket.py); else our own.
    sock = inherited_socket()
    where = {"sock": sock} if sock is not None else {"host": config.host, "port": config.port}
    web.run_app(app, **where, access_log=None, handler_cancellation=True, print=None,
                loop=event_loop())


if __name__ == "__main__":
    main()
