"""What the local and the Ray launcher share: their error, health probing and waiting,
and the work directory's layout (logs, the EC folder, the state file, process tags).

Runs in the launcher's process. A "child" here is anything with a name, a health URL,
a `healthy` flag, `exit_code()` (None while it runs or may come back) and `log_tail()`:
a local Child, or the Ray launcher's view of an actor's process.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from epd_serve.deployment.resolve import ResolvedDeployment

Refresh = Callable[[httpx.Client], None]  # brings every child's `healthy` up to date


class LaunchError(RuntimeError):
    """The deployment could not be brought up; the message says what to do."""


def probe(children: Sequence[Any], client: httpx.Client) -> None:
    """Ask every running child that is not known healthy yet for its health URL."""
    for child in children:
        if child.healthy or child.exit_code() is not None:
            continue
        try:
            child.healthy = client.get(child.health_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            child.healthy = False


def exited_during_start_up(child: Any) -> LaunchError:
    return LaunchError(f"{child.name} exited with code {child.exit_code()} during start-up; "
                       f"last lines of {child.log_path}:\n{child.log_tail()}")


def wait_serving(child: Any, refresh: Refresh, timeout_s: float = 60.0) -> None:
    """Block until a child that later ones connect to at start-up answers."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while True:
            if child.exit_code() is not None:
                raise exited_during_start_up(child)
            refresh(client)
            if child.healthy:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name} did not start in {timeout_s:.0f}s; see "
                                  f"{child.log_path}")
            time.sleep(0.2)


def wait_healthy(children: Sequence[Any], refresh: Refresh, timeout_s: float, log_dir: Path,
                 progress: Callable[[list[Any], float], None] | None = None) -> float:
    """Block until every child is healthy; returns seconds taken. A child that exits
    during start-up fails the launch with its log tail."""
    start = time.monotonic()
    deadline = start + timeout_s
    with httpx.Client() as client:
        while True:
            for child in children:
                if child.exit_code() is not None:
                    raise exited_during_start_up(child)
            refresh(client)
            elapsed = time.monotonic() - start
            if progress:
                progress(list(children), elapsed)
            if all(c.healthy for c in children):
                return elapsed
            if time.monotonic() > deadline:
                waiting = ", ".join(c.name for c in children if not c.healthy)
                raise LaunchError(f"not healthy after {timeout_s:.0f}s: {waiting}; "
                                  f"see logs in {log_dir}")
            time.sleep(1.0)


def state_path(dep: ResolvedDeployment) -> Path:
    """Where a launcher records what it started, for `epd-serve down`."""
    return dep.work_dir / "state.json"


def log_dir(dep: ResolvedDeployment) -> Path:
    """Where every process's log is kept (<name>.log)."""
    return dep.work_dir / "logs"


def prepare_work_dir(dep: ResolvedDeployment) -> None:
    """The log folder, and an empty folder for vLLM's file EC connector (features of an
    earlier run are stale)."""
    log_dir(dep).mkdir(parents=True, exist_ok=True)
    ec_dir = dep.work_dir / "ec_cache"
    shutil.rmtree(ec_dir, ignore_errors=True)
    ec_dir.mkdir(parents=True)


def process_tag(dep: ResolvedDeployment, name: str, token: str) -> str:
    """The tag every process of child `name` carries (proctree.TAG_ENV): `token` tells
    this launcher's processes apart from another launcher's of the same deployment."""
    return f"{dep.config.name}/{name}/{token}"
