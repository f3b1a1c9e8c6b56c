"""The processes that hold a deployment's MM Store, as the launcher and the emitted
shell script start them. Pure: command lines only."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

from epd_serve.mmstore.spec import StoreSpec


@dataclasses.dataclass(frozen=True)
class StoreProcess:
    name: str
    command: list[str]
    health_url: str  # answers 200 once the process serves


def store_processes(spec: StoreSpec) -> list[StoreProcess]:
    """In start order; each must be healthy before the next and before any engine."""
    metrics = f"http://{spec.host}:{spec.metrics_port}/metrics"
    if spec.backend == "shm":
        command = [sys.executable, "-m", "epd_serve.mmstore.shm_server", "--spec",
                   spec.to_json()]
        return [StoreProcess("mmstore", command, metrics)]
    from epd_serve.mmstore.mooncake import holder_command, master_command

    return [StoreProcess("mooncake-master", master_command(spec, _binary("mooncake_master")),
                         metrics),
            StoreProcess("mooncake-holder", holder_command(spec, _binary("mooncake_client")),
                         metrics)]


def _binary(name: str) -> str:
    """Mooncake's programs come with its wheel, beside the interpreter running us (the
    virtualenv's bin/, which need not be on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or name
