"""`epd-serve doctor`: what a newcomer runs when something is off.

Runs in the CLI process (and in the demo's first lines). Runs the preflight
(epd_serve/runtime/preflight_*.py): always this machine's checks (and, on a GPU node, its
RDMA NICs and GPUDirect); given a deployment file, also that deployment's, read from
its start-up plan, the same checks the launcher refuses to start on. Prints them as a
table (or JSON) and says, by its exit code, whether any is an error. Without a file
only the machine is checked. Never imports torch or vLLM (finding them is enough).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING, Row, has_error

__all__ = ["add_doctor_parser", "collect", "has_error", "render", "run_doctor", "to_json"]

STYLE = {OK: "green", WARNING: "yellow", ERROR: "bold red"}
# Piped into a log or a note: its cells wrap, so a readable width will do.
PIPED_WIDTH = 120


def collect(config_path: str | None) -> list[Row]:
    """Every row: the machine's, then the deployment's (skipped without a file)."""
    # Imported here, not above: `epd-serve --help` builds this command's parser.
    from epd_serve.connectors.epd_kv import fabric
    from epd_serve.runtime.preflight_deployment import (deployment_rows, engine_env,
                                                        is_local_host, kv_step)
    from epd_serve.runtime.preflight_machine import kv_fabric, machine_rows, rdma_rows

    if config_path is None:
        return [*machine_rows(engine_on_cpu=True), *rdma_rows(os.environ, None),
                Row(WARNING, "deployment", "no deployment file given: only this machine was "
                                           "checked; engine stack, model, ports, /dev/shm "
                                           "and memory not checked",
                    "name one: epd-serve doctor DEPLOYMENT.yaml")]
    from epd_serve.deployment.schema import ConfigError
    from epd_serve.runtime import bringup
    from epd_serve.runtime.plan import startup_plan

    try:
        dep = bringup.load(config_path)
        steps = startup_plan(dep)
    except (ConfigError, ValueError, OSError) as err:
        return [*machine_rows(engine_on_cpu=True), *rdma_rows(os.environ, None),
                Row(ERROR, "deployment", f"{config_path} cannot be loaded: {err}",
                    "fix the file; docs/deployments.md lists its keys")]
    rows = machine_rows(engine_on_cpu=dep.config.platform == "cpu")
    if dep.config.platform == "cuda":
        # The NICs and GPUDirect as the engine here sees them: in its own environment,
        # needed where its KV goes over RDMA.
        step = kv_step(steps, is_local_host)
        needed = step is not None and \
            kv_fabric(dep.platform, step.launch)[0] == fabric.RDMA
        rows += rdma_rows(engine_env(step), needed)
    rows.append(Row(OK, "deployment", f"{config_path}: {dep.config.name}, "
                                      f"{dep.plan.to_notation()} on {dep.config.platform}"))
    return rows + deployment_rows(dep, steps, config_path)


def to_json(rows: Sequence[Row], config_path: str | None) -> str:
    return json.dumps({"config": config_path, "ok": not has_error(rows),
                       "checks": [r.to_dict() for r in rows]}, indent=2)


def render(rows: Sequence[Row]):
    """A rich table: level, check, what was found with the fix under it."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="epd-serve doctor", title_justify="left", show_lines=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("found / fix")
    for row in rows:
        cell = Text(row.found)
        if row.fix:
            cell.append(f"\nfix: {row.fix}", style=STYLE[row.level])
        table.add_row(Text(row.level, style=STYLE[row.level]), row.check, cell)
    counts = {level: sum(r.level == level for r in rows) for level in (OK, WARNING, ERROR)}
    table.caption = (f"{counts[OK]} ok, {counts[WARNING]} warning(s), "
                     f"{counts[ERROR]} error(s)")
    table.caption_justify = "left"
    return table


def run_doctor(config_path: str | None, console) -> bool:
    """Check, print the table on `console`; True when nothing is an error."""
    rows = collect(config_path)
    console.print(render(rows))
    return not has_error(rows)


def cmd_doctor(args) -> int:
    """0 when no row is an error, else 1."""
    from rich.console import Console

    if args.json:
        rows = collect(args.config)
        print(to_json(rows, args.config))
        return 1 if has_error(rows) else 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=PIPED_WIDTH)
    return 0 if run_doctor(args.config, console) else 1


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine (and a deployment file) for what "
                       "would stop a deployment, with the fix for each problem")
    p.add_argument("config", nargs="?",
                   help="deployment file: also checks what it needs here (engine stack, "
                   "model, ports, /dev/shm, memory), as `up` will; without one only this "
                   "machine is checked")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_doctor)
