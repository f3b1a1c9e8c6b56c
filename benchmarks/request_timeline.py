"""The timeline of single requests through a deployment: brings it up, sends a few
unmeasured requests, then one text and one image request (each after a pause, as a
lone request arrives at an idle deployment), and prints each one's waterfall as
`epd-serve trace` shows it; `--png DIR` also draws them.

`--without` switches one of our fixes off, to see what it buys:
  nap   engines' queue readers spin as vLLM's do (EPD_SHM_NAP_MS unset)

    scripts/in-netns.sh .venv/bin/python benchmarks/request_timeline.py \
        [--config configs/cpu/e-p-d.yaml] [--without nap] [--png results/timeline]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
from rich.console import Console

from epd_serve.backends.cpu import idle_wait
from epd_serve.bench import waterfall
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime import bringup

FIXES_OFF = {"nap": {idle_wait.ENV: ""}}  # the deployment's env, layered over the HAL's
PAUSE_S = 3.0  # idle before each measured request: the engines' busy windows have ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/cpu/e-p-d.yaml")
    parser.add_argument("--without", choices=sorted(FIXES_OFF), action="append", default=[])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--png", help="also draw each waterfall into this folder")
    args = parser.parse_args()

    base = bringup.load(args.config)
    env = dict(base.config.env)
    for fix in args.without:
        env.update(FIXES_OFF[fix])
    dep = bringup.load(args.config, env=env) if args.without else base
    console = Console(width=170)
    launcher = bringup.bring_up(dep)
    model = dep.launches[0].served_model_name
    try:
        with httpx.Client(base_url=dep.proxy_url, timeout=300) as client:
            for i in range(4):  # first-use costs out of the way
                images = [image_data_url(make_image(448, 448, seed=700 + i))] if i % 2 else []
                client.post("/v1/chat/completions", json=chat_body(
                    model, "warm up", images, max_tokens=args.max_tokens)).raise_for_status()
            for kind, images in (("text", []),
                                 ("image", [image_data_url(make_image(448, 448, seed=799))])):
                time.sleep(PAUSE_S)
                resp = client.post("/v1/chat/completions", json=chat_body(
                    model, "Describe what you see in detail.", images,
                    max_tokens=args.max_tokens))
                resp.raise_for_status()
                time.sleep(waterfall.SPANS_SETTLE_S)
                found = waterfall.fetch(dep.proxy_url, resp.headers["x-epd-trace-id"])
                without = f" without {', '.join(args.without)}" if args.without else ""
                console.rule(f"{kind} request through {dep.plan.to_notation()}{without}")
                console.print(waterfall.render(found, console.width))
                if args.png:
                    out = Path(args.png)
                    out.mkdir(parents=True, exist_ok=True)
                    name = f"{kind}{'-without-' + '-'.join(args.without) if args.without else ''}"
                    print(f"waterfall: {waterfall.plot(found, out / f'{name}.png')}")
    finally:
        launcher.stop()


if __name__ == "__main__":
    main()
