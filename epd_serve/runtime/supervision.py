"""What the local and the Ray launcher share: their error, health probing and waiting,
the work directory's layout (logs, the EC folder, the state file, process tags), and
how a process is kept up: its restart back-off and its size-bounded log.

Runs in the launcher's process, and (RestartBackoff, ChildLog) in each Ray host actor.
A "child" here is anything with a name, a health URL, a `healthy` flag, `exit_code()`
(None while it runs or may come back) and `log_tail()`: a local Child, or the Ray
launcher's view of an actor's process. The settings and their defaults are the
deployment file's `supervision` section (epd_serve/deployment/schema.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from epd_serve.deployment.schema import Supervision
from epd_serve.deployment.resolve import ResolvedDeployment
from epd_serve.runtime.log_relay import ChildLog

__all__ = ["ChildLog", "LaunchError", "RestartBackoff"]

logger = logging.getLogger(__name__)

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
    tail = child.log_tail()
    # An engine that fails in its core process says why first; its API server's own
    # traceback ("Engine core initialization failed. See root cause above.") comes last.
    cause = first_traceback(child.log_path)
    cause_text = f"\nits first error:\n{cause}" if cause and cause not in tail else ""
    return LaunchError(f"{child.name} exited with code {child.exit_code()} during start-up; "
                       f"last lines of {child.log_path}:\n{tail}{cause_text}")


def first_traceback(log_path: Path, lines: int = 12) -> str:
    """The end of the first Python traceback in a log, its exception line last ('' if
    there is none). Works on prefixed lines like vLLM's `(EngineCore pid=7) ...`."""
    try:
        text = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    marker = "Traceback (most recent call last):"
    start = next((i for i, line in enumerate(text) if marker in line), None)
    if start is None:
        return ""
    prefix = text[start][:text[start].index(marker)]
    block = [text[start]]
    for line in text[start + 1:]:
        if not line.startswith(prefix):
            continue  # another process's line interleaved
        block.append(line)
        body = line[len(prefix):]
        if body and not body[0].isspace():
            break  # the exception line ends the frames
    return "\n".join(block[-lines:])


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


def report_failed_round(on_event: Callable[[str], None], err: Exception) -> None:
    """Say that a whole supervision round failed (the next one comes as usual). Saying
    so may fail too (stderr gone): that must not end supervision either."""
    try:
        on_event(f"supervision round failed ({type(err).__name__}: {err}); "
                 "trying again at the next check")
    except Exception:  # noqa: BLE001
        logger.error("cannot report a failed supervision round", exc_info=True)


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


class RestartBackoff:
    """How long a process that exited waits before it is started again: at once for the
    first `rapid_restarts` crashes in a row, then backoff_s, doubling up to
    backoff_max_s, for as long as it keeps crashing (no limit: a stage comes back once
    what broke it is fixed). A run of healthy_after_s or more ends the row."""

    def __init__(self, settings: Supervision):
        self.settings = settings
        self.crashes_in_a_row = 0

    def delay_after_exit(self, up_for_s: float) -> float:
        """Count one crash of a process that ran `up_for_s`; returns its wait in seconds."""
        if up_for_s >= self.settings.healthy_after_s:
            self.crashes_in_a_row = 0
        self.crashes_in_a_row += 1
        doublings = self.crashes_in_a_row - self.settings.rapid_restarts - 1
        if doublings < 0:
            return 0.0
        # Bounded exponent: a loop of thousands of crashes must not overflow the float.
        return min(self.settings.backoff_s * 2.0 ** min(doublings, 64),
                   self.settings.backoff_max_s)
