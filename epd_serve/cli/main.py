"""The `epd-serve` command line: topology, model, up, down, launch, check-flags, status,
doctor, demo, bench.

Runs in the user's shell. Heavy imports (torch, transformers, matplotlib) happen inside
the subcommand that needs them, so `epd-serve --help` and `topology` stay instant.
Every error a user can cause ends as one line on stderr and exit code 2; a proxy that
`status` cannot reach or read ends the same way with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from epd_serve.cli import role
from epd_serve.cli.role import DEFAULT_PROXY_URL
from epd_serve.cli.bench import add_bench_parser
from epd_serve.cli.doctor import add_doctor_parser
from epd_serve.cli.planner import add_planner_parsers
from epd_serve.deployment.schema import ConfigError
from epd_serve.models.tinymodel import FAMILIES
from epd_serve.topology import notation


def _fail(message: str) -> int:
    print(f"epd-serve: error: {message}", file=sys.stderr)
    return 2


def cmd_topology(args) -> int:
    if args.notation.endswith((".yaml", ".yml")) or Path(args.notation).is_file():
        return _deployment_topology(args)
    plan = notation.parse(args.notation)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(f"{plan.to_notation()}: {len(plan.instances)} instance(s) on {plan.num_devices} device(s)")
    for group in plan.groups():
        names = ", ".join(f"{i.name} [{i.written}]" for i in group)
        devices = ",".join(map(str, group[0].devices))
        shared = " (co-located, separate processes)" if len(group) > 1 else ""
        print(f"  device {devices}: {names}{shared}")
    if any(i.switchable for i in plan.instances):
        print("  ~: may switch between E, P and D while serving (`epd-serve role`); a full "
              "engine whatever it starts as, so an E~ holds the language model and a KV "
              "cache too")
    return 0


def _deployment_topology(args) -> int:
    """A deployment file's instances: on which node, devices and address each runs."""
    from epd_serve.runtime import bringup
    dep = bringup.load(args.notation)
    rows = [{"name": l.name, "roles": l.instance.roles, "node": l.node, "address": l.host,
             "devices": list(l.devices), "url": l.url} for l in dep.launches]
    if args.json:
        print(json.dumps({"notation": dep.plan.to_notation(), "proxy": dep.proxy_url,
                          "instances": rows}, indent=2))
        return 0
    nodes = dep.config.cluster.nodes if dep.config.cluster else []
    where = f"across {len(nodes)} node(s)" if nodes else "on one host"
    print(f"{dep.config.name}: {dep.plan.to_notation()} {where}; proxy {dep.proxy_url}")
    for row in rows:
        print(f"  {row['name']:<6} [{row['roles']}]  node {row['node']} ({row['address']}), "
              f"device(s) {','.join(map(str, row['devices']))}")
    return 0


def cmd_model(args) -> int:
    from epd_serve.models.tinymodel import Shape, build_tiny_model

    shape = Shape(layers=args.layers, hidden=args.hidden, heads=args.heads,
                  kv_heads=args.kv_heads)
    out = build_tiny_model(args.family, args.out, seed=args.seed, shape=shape)
    print(f"built tiny {args.family} model ({shape.layers} layers, hidden {shape.hidden}) in {out}")
    return 0


def cmd_up(args) -> int:
    from epd_serve.runtime import bringup
    launcher = bringup.bring_up(bringup.load(args.config), warmup=not args.no_warmup)

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    print("supervising; Ctrl-C or `epd-serve down` stops everything", file=sys.stderr)
    try:
        launcher.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", file=sys.stderr)
        launcher.stop()
    return 0


def cmd_down(args) -> int:
    from epd_serve.runtime import bringup
    from epd_serve.runtime.launcher import stop_from_state

    dep = bringup.load(args.config)
    stopped = stop_from_state(dep.work_dir / "state.json")
    if not stopped:
        print(f"nothing running for {dep.config.name} (no {dep.work_dir / 'state.json'})")
    else:
        print(f"stopped {', '.join(stopped)}")
    return 0


def cmd_launch(args) -> int:
    from epd_serve.runtime import bringup
    from epd_serve.runtime.shell import emit_shell

    dep = bringup.load(args.config)
    if args.emit_shell:
        script = emit_shell(dep, str(Path(args.config).resolve()))
        if args.output:
            Path(args.output).write_text(script)
            Path(args.output).chmod(0o755)
            print(f"wrote {args.output}", file=sys.stderr)
        else:
            print(script)
        return 0
    for launch in dep.launches:
        print(f"# {launch.name} [{launch.instance.roles}]")
        print(dep.platform.shell_line(launch))
    return 0


STATUS_TIMEOUT_S = 3.0  # a proxy that takes longer is as good as down to someone watching
PIPED_WIDTH = 200


class ProxyUnreachable(Exception):
    """The proxy's /status could not be fetched or read."""


def fetch_status(base_url: str, api_key: str | None = None) -> dict:
    import httpx

    url = base_url.rstrip("/") + "/status"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(url, timeout=STATUS_TIMEOUT_S, headers=headers)
    except httpx.HTTPError as err:
        raise ProxyUnreachable(f"cannot reach the proxy at {url}: "
                               f"{str(err) or type(err).__name__}") from None
    if resp.status_code != 200:
        raise ProxyUnreachable(f"{url} answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        status = resp.json()
    except ValueError:
        raise ProxyUnreachable(f"{url} did not answer JSON: {resp.text[:200]!r}") from None
    if not isinstance(status, dict):
        raise ProxyUnreachable(f"{url} answered {type(status).__name__}, expected an object")
    return status


def _status_target(args) -> tuple[str, str | None]:
    """The proxy's URL, and its client key where the deployment names one."""
    if args.config and args.url:
        raise ValueError("give a deployment file or --url, not both")
    if args.config:
        from epd_serve.runtime import bringup
        dep = bringup.load(args.config)
        from epd_serve.proxy.tenancy import own_key
        return dep.proxy_url, own_key(dep.config.proxy.api_key_env)
    return args.url or DEFAULT_PROXY_URL, os.environ.get("EPD_API_KEY")


def cmd_status(args) -> int:
    import time

    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from epd_serve.cli.status_view import render

    url, api_key = _status_target(args)
    if args.watch is not None and args.watch <= 0:
        raise ValueError("--watch takes a positive number of seconds")
    try:
        status = fetch_status(url, api_key)
    except ProxyUnreachable as err:
        print(f"epd-serve: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=None if args.watch else 2))
        try:
            while args.watch:
                time.sleep(args.watch)
                try:
                    print(json.dumps(fetch_status(url, api_key)), flush=True)
                except ProxyUnreachable as err:
                    print(f"epd-serve: error: {err}", file=sys.stderr)
        except KeyboardInterrupt:
            pass
        return 0
    console = Console()
    if not console.is_terminal:
        # Piped into a file or a pager: no terminal to fit, keep every column whole.
        console = Console(width=PIPED_WIDTH)
    if not args.watch:
        console.print(render(status, console.width))
        return 0

    def view(status: dict, problem: str | None) -> Group:
        # While the proxy is away the last table stays up, marked stale.
        stamp = time.strftime("%H:%M:%S")
        footer = (Text(f"{stamp} {problem}; showing the last answer", style="bold red")
                  if problem else
                  Text(f"{url} at {stamp}, every {args.watch:g} s; Ctrl-C stops", style="dim"))
        return Group(render(status, console.width), footer)

    try:
        with Live(view(status, None), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.watch)
                try:
                    status, problem = fetch_status(url, api_key), None
                except ProxyUnreachable as err:
                    problem = str(err)
                live.update(view(status, problem), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_trace(args) -> int:
    import httpx
    from rich.console import Console

    from epd_serve.bench import waterfall

    url, api_key = _status_target(args)
    admin_env = "EPD_ADMIN_KEY"
    if args.config:
        from epd_serve.runtime import bringup
        admin_env = bringup.load(args.config).config.proxy.admin_key_env or admin_env
    try:
        found = waterfall.fetch(url, args.id, api_key, admin_key=os.environ.get(admin_env))
    except waterfall.TraceNotFound as err:
        return _fail(str(err))
    except httpx.HTTPError as err:
        return _fail(f"cannot read the timeline from {url}: {type(err).__name__}: {err}")
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    console = Console()
    console.print(waterfall.render(found, console.width if console.is_terminal else PIPED_WIDTH))
    if args.png:
        print(f"waterfall: {waterfall.plot(found, Path(args.png))}")
    return 0


def cmd_check_flags(args) -> int:
    from epd_serve.runtime import flagcheck
    try:
        configs = flagcheck.deployment_files([Path(c) for c in args.configs])
        reports = flagcheck.check(configs, python=args.python)
    except (FileNotFoundError, RuntimeError) as err:
        return _fail(str(err))
    print(flagcheck.to_json(reports) if args.json else flagcheck.render(reports))
    return 0 if all(r.ok for r in reports) else 1


def cmd_demo(args) -> int:
    from epd_serve.cli.demo import run_demo

    return run_demo(args.config, load_requests=args.requests, out_dir=args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-serve",
        description="Encode-Prefill-Decode disaggregated serving for multimodal LLMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("topology", help="parse deployment notation and print the plan")
    p.add_argument("notation", help="e.g. E-P-D, (E-P)-D, 2E1P1D, (E-PD)x2, TP2; or a "
                   "deployment file, to show the node and devices of each instance")
    p.add_argument("--json", action="store_true", help="machine-readable plan")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("model", help="build models for testing")
    msub = p.add_subparsers(dest="model_command", required=True)
    t = msub.add_parser("tiny", help="a tiny random-weight Qwen-VL model, built offline")
    t.add_argument("--family", choices=FAMILIES, default=FAMILIES[0])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=2, help="language model layers (Qwen2-VL-7B: 28)")
    t.add_argument("--hidden", type=int, default=256, help="hidden size")
    t.add_argument("--heads", type=int, default=4, help="attention heads")
    t.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    t.add_argument("out", help="output directory")
    t.set_defaults(func=cmd_model)

    _add_running_parsers(sub)
    _add_inspecting_parsers(sub)
    add_doctor_parser(sub)

    p = sub.add_parser("demo", help="bring up E-P-D on the CPU, show each stage, run a short load")
    p.add_argument("--config", required=True,
                   help="a CPU deployment file (scripts/demo.sh gives configs/cpu/e-p-d.yaml)")
    p.add_argument("--requests", type=int, default=24, help="requests in the short load run")
    p.add_argument("--out", default="results/demo", help="where the load report goes")
    p.set_defaults(func=cmd_demo)

    add_bench_parser(sub)
    add_planner_parsers(sub)
    return parser


def _add_running_parsers(sub) -> None:
    """up, down, launch, check-flags: starting, stopping and checking a deployment."""
    p = sub.add_parser("up", help="start a deployment and supervise it until Ctrl-C")
    p.add_argument("config", help="deployment file, e.g. configs/cpu/e-p-d.yaml")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop a deployment started by `up`")
    p.add_argument("config")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("launch", help="print the engine commands, or a shell launcher")
    p.add_argument("config")
    p.add_argument("--emit-shell", action="store_true",
                   help="write a bash script that starts the whole deployment")
    p.add_argument("-o", "--output", help="file for --emit-shell (default: stdout)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("check-flags",
                       help="check every emitted engine command line with the engine's own parser")
    p.add_argument("configs", nargs="+", metavar="FILE_OR_FOLDER",
                   help="deployment files, or folders whose *.yaml files are checked")
    p.add_argument("--python", default=sys.executable,
                   help="the Python of the engine to check against (default: this one)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_check_flags)


def _add_inspecting_parsers(sub) -> None:
    """status, trace: asking a running deployment's proxy."""
    p = sub.add_parser("status", help="the proxy's live instance table")
    p.add_argument("config", nargs="?", help="deployment file; its proxy is asked")
    p.add_argument("--url", help=f"proxy base URL instead of a file (default {DEFAULT_PROXY_URL})")
    p.add_argument("--watch", type=float, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the proxy's raw JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("trace", help="one request's timeline across the proxy and the "
                       "instances, as a waterfall")
    p.add_argument("id", nargs="?", default="last",
                   help="the request's id (x-request-id), or its trace id (x-epd-trace-id); "
                   "default: the last request the proxy served")
    p.add_argument("--config", help="deployment file; its proxy is asked")
    p.add_argument("--url", help=f"proxy base URL instead of a file (default {DEFAULT_PROXY_URL})")
    p.add_argument("--png", metavar="FILE", help="also draw the waterfall into FILE")
    p.add_argument("--json", action="store_true", help="print the timeline's raw JSON")
    p.set_defaults(func=cmd_trace)
    role.add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from epd_serve.runtime.supervision import LaunchError

    try:
        return args.func(args)
    except (notation.NotationError, ConfigError, LaunchError, ValueError) as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
