"""`python -m epd_serve.proxy --config proxy.json`: run the proxy with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from epd_serve.proxy.app import create_app
from epd_serve.proxy.state import ProxyConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="epd-serve-proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="proxy JSON written by the launcher")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    config = ProxyConfig.from_file(args.config)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
