"""Starts, watches and stops every process of a deployment: the instances and the proxy.

Runs in the `epd-serve up` process (or a test fixture). Each child gets its own
process group so that stopping it also stops the engine-core and worker processes vLLM
forks; on Linux each child is also told to die with the launcher (PR_SET_PDEATHSIG),
so a killed launcher leaves no orphans. State (pids) goes to <work_dir>/state.json so
`epd-serve down` can stop a deployment started elsewhere.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from epd_serve.config import ConfigError, ResolvedDeployment
from epd_serve.hal import InstanceLaunch, Platform, get_platform
from epd_serve.tinymodel import is_model_dir

STOP_GRACE_S = 20.0


class LaunchError(RuntimeError):
    """The deployment could not be brought up; the message says what to do."""


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


def preflight(dep: ResolvedDeployment, platform: Platform) -> None:
    """Everything that would make start-up fail, checked before anything starts."""
    if not is_model_dir(dep.model_dir):
        raise ConfigError(
            f"model directory {str(dep.model_dir)!r} not found or has no weights; build the "
            f"tiny test model with `epd-serve model tiny --family qwen2_vl {dep.model_dir}` "
            "or point 'model' at a real checkpoint"
        )
    for port, user in sorted(dep.ports().items()):
        if port_in_use(dep.config.host, port):
            raise ConfigError(
                f"port {port} ({user}) on {dep.config.host} is in use; stop what holds it "
                f"(`epd-serve down CONFIG` if it is an earlier deployment) or change "
                "proxy_port/base_port/kv_bootstrap_base_port in the deployment file"
            )
    try:
        platform.check_available()
    except RuntimeError as err:
        raise LaunchError(str(err)) from None


def proxy_config(dep: ResolvedDeployment) -> dict:
    instances = []
    for launch in dep.launches:
        entry = {"name": launch.name, "roles": launch.instance.roles, "url": launch.url}
        if launch.kv_bootstrap_port is not None:
            entry["kv_bootstrap_url"] = f"http://{launch.host}:{launch.kv_bootstrap_port}"
        instances.append(entry)
    return {
        "model": dep.launches[0].served_model_name,
        "host": dep.config.host,
        "port": dep.config.proxy_port,
        "instances": instances,
    }


@dataclasses.dataclass
class Child:
    """One supervised process."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str
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
            env={**os.environ, **self.env},
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

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class Launcher:
    """Brings a resolved deployment up, keeps it up, and brings it down."""

    def __init__(self, dep: ResolvedDeployment, platform: Platform | None = None,
                 on_event: Callable[[str], None] | None = None):
        self.dep = dep
        self.platform = platform or get_platform(dep.config.platform)
        self.on_event = on_event or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.log_dir = dep.work_dir / "logs"
        self.children: list[Child] = []
        self._stopping = False

    @property
    def state_path(self) -> Path:
        return self.dep.work_dir / "state.json"

    def _build_children(self) -> list[Child]:
        children = []
        for launch in self.dep.launches:
            children.append(self._instance_child(launch))
        proxy_json = self.dep.work_dir / "proxy.json"
        proxy_json.write_text(json.dumps(proxy_config(self.dep), indent=2))
        children.append(
            Child(
                name="proxy",
                command=[sys.executable, "-m", "epd_serve.proxy", "--config", str(proxy_json)],
                env={},
                log_path=self.log_dir / "proxy.log",
                health_url=f"{self.dep.proxy_url}/health",
            )
        )
        return children

    def _instance_child(self, launch: InstanceLaunch) -> Child:
        return Child(
            name=launch.name,
            command=self.platform.command(launch),
            env=self.platform.environment(launch),
            log_path=self.log_dir / f"{launch.name}.log",
            health_url=f"{launch.url}/health",
        )

    # -- bring up -----------------------------------------------------------
    def start(self) -> None:
        preflight(self.dep, self.platform)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ec_dir = self.dep.work_dir / "ec_cache"
        shutil.rmtree(ec_dir, ignore_errors=True)  # features of an earlier run are stale
        ec_dir.mkdir(parents=True)
        self.children = self._build_children()
        for child in self.children:
            child.start()
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "config": self.dep.config.name,
            "launcher_pid": os.getpid(),
            "children": {c.name: c.process.pid for c in self.children if c.process},
            "proxy_url": self.dep.proxy_url,
        }
        self.state_path.write_text(json.dumps(state, indent=2))

    def poll_health(self, client: httpx.Client) -> None:
        for child in self.children:
            if child.healthy or child.exit_code() is not None:
                continue
            try:
                child.healthy = client.get(child.health_url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                child.healthy = False

    def wait_healthy(self, progress: Callable[[list[Child], float], None] | None = None) -> float:
        """Block until every process answers /health; returns seconds taken. An
        instance that exits during start-up fails the launch with its log tail."""
        start = time.monotonic()
        deadline = start + self.dep.config.health_timeout_s
        with httpx.Client() as client:
            while True:
                for child in self.children:
                    code = child.exit_code()
                    if code is not None:
                        raise LaunchError(
                            f"{child.name} exited with code {code} during start-up; last lines "
                            f"of {child.log_path}:\n{child.log_tail()}"
                        )
                self.poll_health(client)
                elapsed = time.monotonic() - start
                if progress:
                    progress(self.children, elapsed)
                if all(c.healthy for c in self.children):
                    return elapsed
                if time.monotonic() > deadline:
                    waiting = ", ".join(c.name for c in self.children if not c.healthy)
                    raise LaunchError(
                        f"not healthy after {self.dep.config.health_timeout_s:.0f}s: {waiting}; "
                        f"see logs in {self.log_dir}"
                    )
                time.sleep(1.0)

    # -- keep up ------------------------------------------------------------
    def supervise_once(self) -> list[str]:
        """Restart children that died; returns what happened (one line each)."""
        events = []
        for child in self.children:
            code = child.exit_code()
            if code is None or self._stopping or child.gave_up:
                continue
            if child.restarts >= self.dep.config.max_restarts:
                child.gave_up = True
                events.append(f"{child.name} exited with code {code}; restarted "
                              f"{child.restarts} times already, giving up (log: {child.log_path})")
                continue
            child.restarts += 1
            events.append(f"{child.name} exited with code {code}; restarting "
                          f"({child.restarts}/{self.dep.config.max_restarts})")
            child.start()
        if events:
            self._write_state()
            for event in events:
                self.on_event(event)
        return events

    def run_forever(self, interval: float = 2.0) -> None:
        while not self._stopping:
            self.supervise_once()
            time.sleep(interval)

    # -- bring down ---------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True
        for child in self.children:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group may hold engine processes even after the API server is gone.
            child.signal_group(signal.SIGKILL)
            child.process.wait()
        self.state_path.unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_from_state(state_path: Path, grace_s: float = STOP_GRACE_S) -> list[str]:
    """`epd-serve down`: stop every process group a launcher recorded."""
    if not state_path.is_file():
        return []
    state = json.loads(state_path.read_text())
    launcher_pid = state.get("launcher_pid")
    if launcher_pid and launcher_pid != os.getpid():
        try:
            os.kill(launcher_pid, signal.SIGTERM)  # stops supervision (and restarts) first
        except ProcessLookupError:
            pass
    groups = dict(state.get("children", {}))
    for pgid in groups.values():
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(p) for p in groups.values()):
        time.sleep(0.2)
    for pgid in groups.values():
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    state_path.unlink(missing_ok=True)
    return list(groups)
