"""One supervised local process: started in its own session and process group,
restarted after its whole tree (leftovers included) is killed, at once or after a
back-off that grows while it keeps crashing (never given up on); its output goes
through a pipe to a log relay (log_relay.py), a process of its own that writes the
log file and rolls it over by size. It does not die with its starter: a supervisor
that is killed, or stopped, costs the children nothing (`epd-serve up` adopts them
again: launcher.py), and the supervisor's own stop kills every tree.

Used by the local launcher (one Child per process of the start-up plan) and by the Ray
host actor (one Child on its node). A child's tag (proctree.TAG_ENV) is inherited by
every process it starts, so `kill_trees` finds them after the leader died.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from epd_serve.deployment.schema import Supervision
from epd_serve.protocols.held_socket import LISTEN_FD_ENV, listening_socket
from epd_serve.runtime.proctree import (TAG_ENV, ProcessTree, Sweep, find_tree_processes,
                                        kill_trees, plural)
from epd_serve.runtime.shm_leftovers import mapped_segments
from epd_serve.runtime.supervision import RestartBackoff

STOP_GRACE_S = 20.0
# A dead child's leftovers are killed before its restart, so the supervisor waits only
# briefly for them to exit on SIGTERM (vLLM's engine core does, within a second).
LEFTOVER_GRACE_S = 2.0
LOG_DRAIN_S = 2.0  # how long a dead child's last output may take to reach its log
PIPE_BYTES = 1 << 20  # Linux's default limit for an unprivileged process


class Adopted:
    """A leader started by an earlier supervisor (killed, or restarted), watched by
    pid: it is not our child, so its exit code is not ours to read (init reaps it)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._process = psutil.Process(pid)

    def poll(self) -> int | None:
        """None while it runs; -1 once it is gone (its code unknown)."""
        try:
            if self._process.is_running() and self._process.status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            pass
        return -1

    def wait(self, timeout: float | None = None) -> int:
        try:
            self._process.wait(timeout)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        return -1


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
    """One supervised process: its output goes to a size-bounded log (ChildLog), and
    after it exits it is started again after its back-off (RestartBackoff), for as long
    as it keeps exiting."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str
    tag: str | None = None  # TAG_ENV's value, the same for every restart of this child
    supervision: Supervision = dataclasses.field(default_factory=Supervision)
    clock: Callable[[], float] = time.monotonic  # tests pass their own
    process: subprocess.Popen | Adopted | None = None
    restarts: int = 0
    started_at: float = 0.0
    healthy: bool = False
    # While it waits out its back-off: when its next start is due (clock time), and why
    # it is down ("exited with code 4", "could not start: ...").
    next_start_at: float | None = None
    down_because: str = ""
    silent_since: float | None = None  # not answering since (runtime/liveness.py)
    # The proxy: (host, port) of the listening socket this supervisor holds for it
    # across its restarts (protocols/held_socket.py); the socket, once bound.
    listen_on: tuple[str, int] | None = None
    listener: socket.socket | None = dataclasses.field(default=None, init=False, repr=False)
    _backoff: RestartBackoff | None = dataclasses.field(default=None, init=False, repr=False)
    _relay: subprocess.Popen | None = dataclasses.field(default=None, init=False, repr=False)
    # Shared-memory segments its processes mapped once serving (shm_leftovers.py), to
    # remove after its tree is killed even if every process that mapped them is gone.
    shm_segments: set[Path] = dataclasses.field(default_factory=set, init=False, repr=False)
    _segments_noted: bool = dataclasses.field(default=False, init=False, repr=False)

    @property
    def backoff(self) -> RestartBackoff:
        if self._backoff is None:
            self._backoff = RestartBackoff(self.supervision)
        return self._backoff

    def start(self) -> None:
        self._wait_log_copied(LOG_DRAIN_S)  # the last incarnation's relay writes its end
        read_end, write_end = os.pipe()
        _widen_pipe(read_end)
        try:
            self._relay = subprocess.Popen(
                [sys.executable, "-m", "epd_serve.runtime.log_relay", str(self.log_path),
                 str(int(self.supervision.log_max_bytes)), str(self.supervision.log_files),
                 "--banner", f"\n==== epd-serve: starting {self.name} at {time.ctime()} ====\n"],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read_end)  # the relay holds the only copy
        env = {**os.environ, **self.env, **({TAG_ENV: self.tag} if self.tag else {})}
        listener = self._listener()
        if listener is not None:
            env[LISTEN_FD_ENV] = str(listener.fileno())
        try:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                stdout=write_end,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=() if listener is None else (listener.fileno(),),
            )
        finally:
            os.close(write_end)  # the child (and what it starts) holds the only copies
        self.started_at = self.clock()
        self.healthy = False
        self._segments_noted = False

    def _listener(self) -> socket.socket | None:
        """The socket to hand this start, bound at the first start that can: one
        after adopting a running proxy cannot (that proxy holds the port), and the
        proxy then binds it itself."""
        if self.listen_on is not None and self.listener is None:
            try:
                self.listener = listening_socket(*self.listen_on)
            except OSError:
                return None
        return self.listener

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def adopt(self, pid: int) -> None:
        """Watch a leader an earlier supervisor started (still running, with this
        child's tag) instead of starting one: its log relay goes on writing its log."""
        self.process = Adopted(pid)
        self.started_at = self.clock()
        self.healthy = False  # until it answers its health URL again

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def tree(self) -> ProcessTree:
        """Every process this child started, in this and in earlier incarnations."""
        return ProcessTree(self.tag, self.process.pid if self.process else None)

    def log_tail(self, lines: int = 15) -> str:
        if self.exit_code() is not None:
            self._wait_log_copied(LOG_DRAIN_S)  # its last words may still be in the pipe
        return log_tail(self.log_path, lines)

    def revive(self) -> str | None:
        """Called at every check. If the process exited: kill what it left running (the
        old engine processes still hold the memory and devices a replacement needs) and
        start it again once its back-off allows. Returns what happened; None when
        nothing did."""
        now = self.clock()
        if self.next_start_at is None:
            code = self.exit_code()
            if code is None:
                if self.healthy and not self._segments_noted:
                    self.note_segments()
                return None
            sweep = self._kill_tree()
            note = f"killed {plural(sweep.killed, 'leftover process')}; " if sweep.killed else ""
            if sweep.survivors:
                note += f"pids {sweep.survivors} survived SIGKILL; "
            if sweep.released:
                note += f"{released_note(sweep)}; "
            self._back_off(now, now - self.started_at, f"exited with code {code}")
            event = f"{self.name} exited with code {code}; {note}"
            if now < self.next_start_at:
                return event + self._waiting(now)
        elif now < self.next_start_at:
            return None
        else:
            event = f"{self.name}: back-off over; "
        return event + (self.try_start(now) or "")

    def kill_hung(self, why: str) -> str:
        """It is there but has not answered for too long (liveness.py): kill its tree
        (SIGKILL reaches a stopped process), for `revive` to restart it as after a
        crash. Returns what happened."""
        sweep = self._kill_tree()
        self.healthy, self.silent_since = False, None
        event = f"{self.name} is hung ({why}): killed {plural(sweep.killed, 'process')}"
        return f"{event}; {released_note(sweep)}" if sweep.released else event

    def note_segments(self) -> None:
        """Remember the shared-memory segments its processes map now (a serving engine's
        rings exist by then): a crash that takes every process mapping them leaves
        nothing to find them by when its tree is swept."""
        self.shm_segments |= mapped_segments(find_tree_processes([self.tree()]))
        self._segments_noted = True

    def _kill_tree(self) -> Sweep:
        sweep = kill_trees([self.tree()], LEFTOVER_GRACE_S, self.shm_segments)
        self.shm_segments = {path for path in self.shm_segments if path.exists()}
        return sweep

    def try_start(self, now: float | None = None) -> str | None:
        """Start it now; a start that fails (no such command, no memory to fork, a
        full disk) waits its back-off as a crash does. Returns what happened; None for
        a first start that succeeded."""
        now = self.clock() if now is None else now
        first = self.process is None and self.next_start_at is None
        try:
            self.start()
        except (OSError, subprocess.SubprocessError) as err:
            self._back_off(now, 0.0, f"could not start: {type(err).__name__}: {err}")
            return f"could not start it ({type(err).__name__}: {err}); {self._waiting(now)}"
        self.next_start_at, self.down_because = None, ""
        if first:
            return None
        self.restarts += 1
        return f"restarting (restart {self.restarts})"

    def _back_off(self, now: float, up_for_s: float, why: str) -> None:
        self.next_start_at = now + self.backoff.delay_after_exit(up_for_s)
        self.down_because = why

    def _waiting(self, now: float) -> str:
        crashes = plural(self.backoff.crashes_in_a_row, "crash")  # failed starts count
        if self.next_start_at <= now:
            return f"{crashes} in a row, trying again at the next check"
        return f"{crashes} in a row, backing off: next try in {self.next_start_at - now:.3g} s"

    def describe(self) -> str:
        """Its state in a few words, for status output."""
        if self.next_start_at is not None:
            due = max(0.0, self.next_start_at - self.clock())
            return f"{self.down_because}; backing off, next try in {due:.3g} s"
        if self.process is None:
            return "not started"
        code = self.exit_code()
        return "running" if code is None else f"exited with code {code}"

    def close_log(self, timeout_s: float = LOG_DRAIN_S) -> None:
        """Once its processes are gone: let the relay write the rest of what they wrote."""
        self._wait_log_copied(timeout_s)

    def _wait_log_copied(self, timeout_s: float) -> None:
        # The relay ends when every process holding the pipe has exited; leftovers of a
        # dead leader may hold it a while longer, so this waits at most timeout_s.
        if self._relay is not None:
            try:
                self._relay.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass


def released_note(sweep: Sweep) -> str:
    """What a sweep removed of the shared memory its tree left."""
    count = len(sweep.released)
    return f"removed {count} shared-memory segment{'s' * (count != 1)} it left"


def _widen_pipe(fd: int) -> None:
    """Let the pipe hold a burst of output while the copying thread waits for the GIL."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):  # above the system's limit, or not Linux
        pass


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file ('' if there is none yet)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
