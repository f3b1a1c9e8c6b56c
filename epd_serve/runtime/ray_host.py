"""One process of a deployment on a Ray node: the actor that starts it there (an engine
instance, the proxy, or an MM Store server), restarts it when it exits (after its
back-off, never giving up), and keeps its size-bounded log for the launcher to fetch.

Runs inside a Ray worker process on the node, one actor per process; the Ray launcher
(epd_serve/runtime/ray_launcher.py) creates them. Plain Python, so the tests drive it without
Ray; Ray is only asked which devices it assigned and where the actor runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO

from epd_serve.deployment.schema import Supervision
from epd_serve.runtime.child import LEFTOVER_GRACE_S, STOP_GRACE_S, Child, port_in_use
from epd_serve.runtime.plan import fill_run_dir
from epd_serve.runtime.proctree import KILL_WAIT_S, ProcessTree, kill_trees

SUPERVISE_INTERVAL_S = 1.0
LOG_CHUNK_BYTES = 1 << 20

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What to run on the node. `{run_dir}` in the command and in `files` becomes the
    node-local folder of this process (its log, the proxy's config)."""

    name: str
    command: list[str]
    env: dict[str, str]
    tag: str  # the process-tree tag: the same for every incarnation, on any node
    address: str  # the node address it serves on (its ports are checked there)
    supervision: Supervision = dataclasses.field(default_factory=Supervision)
    ports: dict[int, str] = dataclasses.field(default_factory=dict)  # port -> what uses it
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    required_path: str | None = None  # must exist on the node (the model directory)
    device_env: str | None = None  # variable naming the devices the process may see
    ray_resource: str | None = None  # the Ray resource whose assigned ids fill device_env


class ProcessHost:
    """Starts `spec` on construction and keeps it running until `stop()`."""

    def __init__(self, spec: ProcessSpec, run_root: str | None = None):
        self.spec = spec
        root = Path(run_root or Path(tempfile.gettempdir()) / "epd-serve")
        self.run_dir = root / spec.tag
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.error: str | None = None
        self._events: list[str] = []
        self._log_reader: BinaryIO | None = None  # read_log's place in the current log
        self._stopping = threading.Event()
        # An earlier incarnation on this node (the actor restarted with its node) may
        # have left engine processes holding the ports and devices.
        kill_trees([ProcessTree(spec.tag, None)], LEFTOVER_GRACE_S)
        if self._ray_context() is not None and "OMP_NUM_THREADS" not in spec.env:
            # Ray caps its workers' (this actor's) OpenMP threads to their CPU share; the
            # engine is not Ray's worker and runs with the environment the HAL gives it.
            os.environ.pop("OMP_NUM_THREADS", None)
        env = {key: self._fill(value) for key, value in spec.env.items()}
        if spec.device_env and (devices := self._assigned_devices()):
            env[spec.device_env] = ",".join(devices)
        self.child = Child(name=spec.name, command=[self._fill(w) for w in spec.command],
                           env=env, log_path=self.run_dir / "process.log", health_url="",
                           tag=spec.tag, supervision=spec.supervision)
        self.error = self._preflight()
        if self.error is None:
            for name, text in spec.files.items():
                (self.run_dir / name).write_text(self._fill(text))
            self._thread = threading.Thread(target=self._supervise, name="supervise",
                                            daemon=True)
            self._thread.start()

    def _fill(self, text: str) -> str:
        return fill_run_dir(text, str(self.run_dir))

    def _preflight(self) -> str | None:
        if self.spec.required_path and not Path(self.spec.required_path).exists():
            return f"{self.spec.required_path} does not exist on node {self.spec.address}"
        for port, user in sorted(self.spec.ports.items()):
            if port_in_use(self.spec.address, port):
                return f"port {port} ({user}) on {self.spec.address} is in use"
        return None

    def _supervise(self) -> None:
        # The process is started (and restarted) from this thread, which lives as long as
        # the actor: the death signal the child asks for fires when its forking thread
        # ends. So no error may end it: each round's is logged, reported with the
        # events, and the next round comes as usual.
        self._supervise_round()
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            self._supervise_round()

    def _supervise_round(self) -> None:
        try:
            if self.child.process is None and self.child.next_start_at is None:
                # The first start (or a retry of one that raised something unforeseen).
                if event := self.child.try_start():
                    event = f"{self.spec.name}: {event}"
            else:
                event = self.child.revive()
            if event:
                self._events.append(event)
        except Exception as err:  # noqa: BLE001 - see _supervise
            logger.error("supervising %s failed; trying again in %.0f s", self.spec.name,
                         SUPERVISE_INTERVAL_S, exc_info=True)
            self._events.append(f"{self.spec.name}: supervising it failed "
                                f"({type(err).__name__}: {err}); trying again")

    @staticmethod
    def _ray_context():
        import ray

        return ray.get_runtime_context() if ray.is_initialized() else None

    def _assigned_devices(self) -> list[str]:
        """The device ids Ray assigned this actor (GPU, NPU); none on the CPU."""
        context = self._ray_context()
        if context is None or not self.spec.ray_resource:
            return []
        return [str(i) for i in context.get_accelerator_ids().get(self.spec.ray_resource, [])]

    # -- what the launcher asks -----------------------------------------------------
    def status(self) -> dict:
        """Where and how the process runs; events since the last call."""
        events, self._events = self._events, []
        context = self._ray_context()
        return {
            "name": self.spec.name,
            "node_id": context.get_node_id() if context else None,
            "actor_pid": os.getpid(),
            "pid": self.child.process.pid if self.child.process else None,
            "restarts": self.child.restarts,
            "state": self.error or self.child.describe(),
            "gave_up": self.error is not None,  # refused to start it; a crash never gives up
            "exit_code": self.child.exit_code(),
            "error": self.error,
            "events": events,
        }

    def read_log(self, offset: int) -> tuple[bytes, int]:
        """Log bytes from `offset` (at most LOG_CHUNK_BYTES) and the offset after them.
        The file stays open between calls: when the log rolls over, what the old file
        still held is read to its end, then the new file from 0. A log shorter than
        `offset` is a new incarnation's (a new node): read from 0."""
        reader = self._log_reader
        if reader is None or reader.tell() != offset:  # the first call of this actor
            if reader is not None:
                reader.close()
            reader = self._log_reader = self._open_log(offset)
            if reader is None:
                return b"", 0
        rolled_over = self._rolled_over(reader)  # before reading: then EOF is its end
        data = reader.read(LOG_CHUNK_BYTES)
        if not data and rolled_over:
            reader.close()
            reader = self._log_reader = self._open_log(0)
            if reader is None:
                return b"", 0
            data = reader.read(LOG_CHUNK_BYTES)
        return data, reader.tell()

    def _open_log(self, offset: int) -> BinaryIO | None:
        try:
            log = open(self.child.log_path, "rb")
        except FileNotFoundError:
            return None
        log.seek(offset if offset <= os.fstat(log.fileno()).st_size else 0)
        return log

    def _rolled_over(self, reader: BinaryIO) -> bool:
        """Whether the log's name now belongs to a newer file than the one being read."""
        try:
            return os.stat(self.child.log_path).st_ino != os.fstat(reader.fileno()).st_ino
        except FileNotFoundError:  # between the rename and the new file: not yet
            return False

    def stop(self) -> int:
        """Kill the process tree; returns how many processes were killed."""
        self._stopping.set()
        if self.error is None:
            self._thread.join(timeout=SUPERVISE_INTERVAL_S * 5)
        killed = kill_trees([self.child.tree()], STOP_GRACE_S, self.child.shm_segments).killed
        if self.child.process is not None:
            try:
                self.child.process.wait(timeout=KILL_WAIT_S)  # reap it
            except subprocess.TimeoutExpired:
                pass
        self.child.close_log()
        if self._log_reader is not None:
            self._log_reader.close()
        return killed
