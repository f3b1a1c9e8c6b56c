"""The preflight's unit: one Row per check (ok, warning or error, with the fix), and
the wording the checks share (sizes, port ranges).

Pure; runs wherever the preflight runs: `epd-serve doctor` prints every row, the
launcher refuses to start on the first error of the deployment's. The checks:
preflight_machine.py (CPU, AMX, network namespace, RDMA NICs and GPUDirect),
preflight_stack.py (the installed engine stack) and preflight_deployment.py (model,
ports, /dev/shm and memory, read from the start-up plan; the launcher's refusal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

OK, WARNING, ERROR = "ok", "warning", "error"
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report."""

    level: str  # OK | WARNING | ERROR
    check: str
    found: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def has_error(rows: Sequence[Row]) -> bool:
    return any(r.level == ERROR for r in rows)


def ranges(ports: Iterable[int]) -> str:
    """8000, 8100-8102, 8900 ..."""
    out: list[list[int]] = []
    for port in sorted(set(ports)):
        if out and port == out[-1][1] + 1:
            out[-1][1] = port
        else:
            out.append([port, port])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def mib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


def gib_ceil(nbytes: float) -> int:
    return max(1, -(-int(nbytes) // GIB))
