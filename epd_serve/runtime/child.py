"""One supervised local process: started in its own session and process group, told to
die with its starter, restarted after its whole tree (leftovers included) is killed.

Used by the local launcher (one Child per process of the start-up plan) and by the Ray
host actor (one Child on its node). A child's tag (proctree.TAG_ENV) is inherited by
every process it starts, so `kill_trees` finds them after the leader died.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from epd_serve.runtime.proctree import TAG_ENV, ProcessTree, kill_trees, plural

STOP_GRACE_S = 20.0
# A dead child's leftovers are killed before its restart, so the supervisor waits only
# briefly for them to exit on SIGTERM (vLLM's engine core does, within a second).
LEFTOVER_GRACE_S = 2.0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


@dataclasses.dataclass
class Child:
    """One supervised process."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str
    tag: str | None = None  # TAG_ENV's value, the same for every restart of this child
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    healthy: bool = False
    gave_up: bool = False

    def start(self) -> None:
        log = open(self.log_path, "ab")
        log.write(f"\n==== epd-serve: starting {self.name} at {time.ctime()} ====\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.command,
            env={**os.environ, **self.env, **({TAG_ENV: self.tag} if self.tag else {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        self.started_at = time.monotonic()
        self.healthy = False

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def tree(self) -> ProcessTree:
        """Every process this child started, in this and in earlier incarnations."""
        return ProcessTree(self.tag, self.process.pid if self.process else None)

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)

    def revive(self, max_restarts: int) -> str | None:
        """If the process exited: kill what it left running (the old engine processes
        still hold the memory and devices a replacement needs) and start it again, at
        most max_restarts times. Returns what happened; None while it runs."""
        code = self.exit_code()
        if code is None or self.gave_up:
            return None
        sweep = kill_trees([self.tree()], LEFTOVER_GRACE_S)
        note = f"killed {plural(sweep.killed, 'leftover process')}; " if sweep.killed else ""
        if sweep.survivors:
            note += f"pids {sweep.survivors} survived SIGKILL; "
        if self.restarts >= max_restarts:
            self.gave_up = True
            return (f"{self.name} exited with code {code}; {note}restarted {self.restarts} "
                    f"times already, giving up (log: {self.log_path})")
        self.restarts += 1
        self.start()
        return (f"{self.name} exited with code {code}; {note}restarting "
                f"({self.restarts}/{max_restarts})")


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file ('' if there is none yet)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
