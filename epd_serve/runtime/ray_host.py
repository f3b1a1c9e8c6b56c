"""One process of a deployment on a Ray node: the actor that starts it there (an engine
instance, the proxy, or an MM Store server), restarts it when it exits, and keeps its
log for the launcher to fetch.

Runs inside a Ray worker process on the node, one actor per process; the Ray launcher
(epd_serve/runtime/ray_launcher.py) creates them. Plain Python, so the tests drive it without
Ray; Ray is only asked which devices it assigned and where the actor runs.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from pathlib import Path

from epd_serve.runtime.child import LEFTOVER_GRACE_S, STOP_GRACE_S, Child, port_in_use
from epd_serve.runtime.plan import fill_run_dir
from epd_serve.runtime.proctree import ProcessTree, kill_trees

SUPERVISE_INTERVAL_S = 1.0
LOG_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What to run on the node. `{run_dir}` in the command and in `files` becomes the
    node-local folder of this process (its log, the proxy's config)."""

    name: str
    command: list[str]
    env: dict[str, str]
    tag: str  # the process-tree tag: the same for every incarnation, on any node
    max_restarts: int
    address: str  # the node address it serves on (its ports are checked there)
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
                           tag=spec.tag)
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
        # the actor: the death signal the child asks for fires when its forking thread ends.
        self.child.start()
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            if event := self.child.revive(self.spec.max_restarts):
                self._events.append(event)

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
            "gave_up": self.child.gave_up or self.error is not None,
            "exit_code": self.child.exit_code(),
            "error": self.error,
            "events": events,
        }

    def read_log(self, offset: int) -> tuple[bytes, int]:
        """Log bytes from `offset` (at most LOG_CHUNK_BYTES) and the offset after them. A
        log shorter than `offset` is a new incarnation's (a new node): read from 0."""
        path = self.child.log_path
        if not path.is_file():
            return b"", 0
        size = path.stat().st_size
        if offset > size:
            offset = 0
        with open(path, "rb") as log:
            log.seek(offset)
            data = log.read(LOG_CHUNK_BYTES)
        return data, offset + len(data)

    def stop(self) -> int:
        """Kill the process tree; returns how many processes were killed."""
        self._stopping.set()
        if self.error is None:
            self._thread.join(timeout=SUPERVISE_INTERVAL_S * 5)
        return kill_trees([self.child.tree()], STOP_GRACE_S).killed
