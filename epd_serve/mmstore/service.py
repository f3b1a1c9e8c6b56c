"""The processes that hold a deployment's MM Store: their command lines, as the
launcher and the emitted shell script start them, and `StartedStore` for tests and
benchmarks that start them directly."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time
import urllib.request
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


def remove_store_files(spec: StoreSpec) -> None:
    """What the store leaves when its processes stop, removed once the deployment
    stops: the shm arena (kept across a server's restarts: shm_server.py)."""
    if spec.backend == "shm":
        from epd_serve.mmstore.shm_server import remove_arena

        remove_arena(spec)


def _binary(name: str) -> str:
    """Mooncake's programs come with its wheel, beside the interpreter running us (the
    virtualenv's bin/, which need not be on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or name


class StartedStore:
    """The store's processes started right here, one after another, each serving before
    the next (tests and benchmarks; the launcher supervises its own children).
    `log_dir`: where their output goes; None leaves it on this process's."""

    def __init__(self, spec: StoreSpec, log_dir: Path | None = None, timeout_s: float = 30.0):
        self.spec = spec
        self.processes: list[subprocess.Popen] = []
        try:
            for proc in store_processes(spec):
                log = None
                if log_dir is not None:
                    log_dir.mkdir(parents=True, exist_ok=True)
                    log = open(log_dir / f"{proc.name}.log", "wb")
                self.processes.append(subprocess.Popen(proc.command, stdout=log,
                                                       stderr=subprocess.STDOUT if log else None))
                if log is not None:
                    log.close()
                self._wait_serving(proc, self.processes[-1], timeout_s)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait_serving(proc: StoreProcess, process: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(proc.health_url, timeout=1).read()
                return
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not start serving {proc.health_url}")
                time.sleep(0.1)

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            process.wait(timeout=30)
        remove_store_files(self.spec)

    def __enter__(self) -> StartedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
