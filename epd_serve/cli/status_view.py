"""The proxy's `/status` answer as a rich table, for `epd-serve status`.

Imported by cli.py. Pure: a JSON dict in, a rich Table out; no network, no console.
The proxy owns the answer's shape, so every field is optional here: unknown fields are
ignored and a missing or malformed one shows as '-', never as an error.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

MISSING = "-"
ERROR_WIDTH = 48  # last errors are whole HTTP bodies; the table shows their start
MIN_ERROR_WIDTH = 12
COLUMNS = (("name", "left"), ("roles", "left"), ("url", "left"), ("source", "left"),
           ("health", "left"), ("in flight", "right"), ("served", "right"),
           ("failures", "right"), ("running", "right"), ("waiting", "right"),
           ("KV %", "right"), ("last error", "left"))


def render(status: dict, width: int | None = None) -> Table:
    """The instance table, titled with the model and the routing policy per stage.

    width: the terminal's. rich shrinks every column alike when a table is too wide,
    which would crop names and counters; instead the last error, the one long free-text
    column, is cut to what the other columns leave of `width`.
    """
    instances = status.get("instances")
    rows = [_row(inst) for inst in (instances if isinstance(instances, list) else [])
            if isinstance(inst, dict)]
    error_width = ERROR_WIDTH
    if width is not None:
        others = sum(max([_cell_len(header), *(_cell_len(row[i]) for row in rows)])
                     for i, (header, _) in enumerate(COLUMNS[:-1]))
        # Each column is padded by one space a side and separated by one more.
        error_width = max(MIN_ERROR_WIDTH, min(ERROR_WIDTH, width - others - 3 * len(COLUMNS) - 1))
    table = Table(title=_title(status), title_justify="left", box=box.SIMPLE_HEAD)
    for header, justify in COLUMNS:
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis")
    for *cells, error in rows:
        table.add_row(*cells, _error(error, error_width))
    return table


def _cell_len(cell: str | Text) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


def _title(status: dict) -> str:
    parts = [f"model {status.get('model') or MISSING}"]
    policies = status.get("policies")
    if isinstance(policies, dict) and policies:
        parts.append("routing " + ", ".join(f"{stage}: {name}" for stage, name in policies.items()))
    return "; ".join(parts)


def _row(inst: dict) -> list:
    """The cells, the last error still raw (render cuts it to the room left)."""
    engine = inst.get("engine")
    engine = engine if isinstance(engine, dict) else {}
    return [
        _text(inst.get("name")), _roles(inst), _text(inst.get("url")),
        _text(inst.get("source")), _health(inst),
        _count(inst.get("in_flight")), _count(inst.get("served")), _count(inst.get("failures")),
        _count(engine.get("running")), _count(engine.get("waiting")),
        _percent(engine.get("kv_cache_usage")), inst.get("last_error"),
    ]


def _roles(inst: dict) -> str:
    """What it serves; for a switchable one "~", the role it started in if a switch
    moved it, and the role it is draining towards: "D~ (was E)", "P~ -> D"."""
    roles = _text(inst.get("roles"))
    if inst.get("switchable") is not True:
        return roles
    target, started = inst.get("switching_to"), inst.get("started_as")
    if target:
        return f"{roles}~ -> {target}"
    return f"{roles}~ (was {started})" if started and started != roles else f"{roles}~"


def _health(inst: dict) -> Text:
    """Draining wins over up/down: an instance being drained takes no new requests
    whatever its probes say."""
    if inst.get("draining") is True:
        return Text("draining", style="yellow")
    healthy = inst.get("healthy")
    if healthy is True:
        return Text("up", style="green")
    if healthy is False:
        return Text("DOWN", style="bold red")
    return Text(MISSING)


def _text(value: Any) -> str:
    return MISSING if value is None or value == "" else str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> str:
    if not _is_number(value):
        return MISSING
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _percent(fraction: Any) -> str:
    return f"{fraction * 100:.0f}%" if _is_number(fraction) else MISSING


def _error(message: Any, width: int) -> Text:
    if not message:
        return Text(MISSING)
    text = " ".join(str(message).split())  # bodies carry newlines; keep one table line
    if len(text) > width:
        text = text[: width - 1] + "…"
    return Text(text, style="red")
