"""Starts, watches and stops every process of a deployment: the instances and the proxy.

Runs in the `epd-serve up` process (or a test fixture); `stop_from_state` runs in
`epd-serve down`. Each child gets its own process group, is told to die with the
launcher (PR_SET_PDEATHSIG) and carries a tag that all its descendants inherit; a dead
child's whole tree is killed before it is restarted, and every tree on stop
(epd_serve/proctree.py). State (pids and tags) goes to <work_dir>/state.json so
`epd-serve down` can do the same for a deployment started elsewhere.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import secrets
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
from epd_serve.kv_protocols import get_protocol
from epd_serve.mmstore.service import store_processes
from epd_serve.proctree import KILL_WAIT_S, TAG_ENV, ProcessTree, kill_trees, plural
from epd_serve.proxy.config import InstanceEntry, ProxyConfig
from epd_serve.tinymodel import is_model_dir

STOP_GRACE_S = 20.0
# A dead child's leftovers are killed before its restart, so the supervisor waits only
# briefly for them to exit on SIGTERM (vLLM's engine core does, within a second).
LEFTOVER_GRACE_S = 2.0


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
                "proxy_port/base_port/kv_base_port in the deployment file"
            )
    try:
        platform.check_available()
    except RuntimeError as err:
        raise LaunchError(str(err)) from None


def roster_path(dep: ResolvedDeployment) -> Path:
    """Where the proxy keeps its live roster: across its own restarts, not across `up`."""
    return dep.work_dir / "proxy-roster.json"


def proxy_config(dep: ResolvedDeployment) -> ProxyConfig:
    """The proxy's typed view of the deployment, KV hand-off and MM Store included."""
    instances = []
    for launch in dep.launches:
        endpoint = None
        if launch.kv_role is not None:
            endpoint = get_protocol(launch.kv_protocol).proxy_endpoint(launch)
        prefetch = None
        if launch.prefetch_port is not None:
            prefetch = f"{launch.host}:{launch.prefetch_port}"
        instances.append(InstanceEntry(name=launch.name, roles=launch.instance.roles,
                                       url=launch.url, kv_endpoint=endpoint,
                                       prefetch_endpoint=prefetch))
    store = dep.mm_store
    return ProxyConfig(
        **dep.config.proxy.model_dump(),
        roster_path=str(roster_path(dep)),
        model=dep.launches[0].served_model_name,
        host=dep.proxy_host,
        port=dep.config.proxy_port,
        kv_protocol=dep.launches[0].kv_protocol,
        mm_store=store.to_json() if store is not None else None,
        fault_injection=dep.config.fault_injection,
        instances=instances,
    )


# -- children -----------------------------------------------------------------------
@dataclasses.dataclass
class Child:
    """One supervised process."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str
    tag: str | None = None  # TAG_ENV's value, the same for every restart of this child
    needed_by_engines: bool = False  # started and serving before any engine starts
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
        # Tells this launcher's processes apart from those of another launcher of the
        # same deployment (say a test and a developer's `epd-serve up`).
        self._token = secrets.token_hex(6)

    @property
    def state_path(self) -> Path:
        return self.dep.work_dir / "state.json"

    def _tag(self, child_name: str) -> str:
        return f"{self.dep.config.name}/{child_name}/{self._token}"

    def _build_children(self) -> list[Child]:
        """The MM Store's processes first (engines connect to it as they start), then
        the instances and the proxy."""
        children = []
        if (store := self.dep.mm_store) is not None:
            for proc in store_processes(store):
                children.append(Child(name=proc.name, command=proc.command, env={},
                                      log_path=self.log_dir / f"{proc.name}.log",
                                      health_url=proc.health_url, tag=self._tag(proc.name),
                                      needed_by_engines=True))
        for launch in self.dep.launches:
            children.append(self._instance_child(launch))
        proxy_json = self.dep.work_dir / "proxy.json"
        roster_path(self.dep).unlink(missing_ok=True)  # a new deployment: the file's roster
        proxy_json.write_text(proxy_config(self.dep).model_dump_json(indent=2))
        children.append(
            Child(
                name="proxy",
                command=[sys.executable, "-m", "epd_serve.proxy", "--config", str(proxy_json)],
                env={},
                log_path=self.log_dir / "proxy.log",
                # Ready, not only up: every instance has answered the proxy's own probe
                # (else the first image may find no encoder the proxy knows is healthy).
                health_url=f"{self.dep.proxy_url}/ready",
                tag=self._tag("proxy"),
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
            tag=self._tag(launch.name),
        )

    # -- bring up -----------------------------------------------------------
    def start(self) -> None:
        preflight(self.dep, self.platform)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.prepare_ec_dir()
        self.children = self._build_children()
        for child in self.children:
            child.start()
            self._write_state()
            if child.needed_by_engines:
                self._wait_serving(child)

    def prepare_ec_dir(self) -> None:
        """An empty folder for vLLM's file EC connector: features of an earlier run are stale."""
        ec_dir = self.dep.work_dir / "ec_cache"
        shutil.rmtree(ec_dir, ignore_errors=True)
        ec_dir.mkdir(parents=True)

    def _wait_serving(self, child: Child, timeout_s: float = 60.0) -> None:
        """Block until a process the engines connect to at start-up answers."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while True:
                if (code := child.exit_code()) is not None:
                    raise LaunchError(f"{child.name} exited with code {code} during start-up; "
                                      f"last lines of {child.log_path}:\n{child.log_tail()}")
                self.poll_health(client)
                if child.healthy:
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(f"{child.name} did not start in {timeout_s:.0f}s; see "
                                      f"{child.log_path}")
                time.sleep(0.2)

    def _write_state(self) -> None:
        state = {
            "config": self.dep.config.name,
            "launcher_pid": os.getpid(),
            "children": {c.name: c.process.pid for c in self.children if c.process},
            "process_tags": {c.name: c.tag for c in self.children if c.tag},
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
            if not self._stopping and (event := child.revive(self.dep.config.max_restarts)):
                events.append(event)
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
        """Kill every child's whole tree, leftovers of earlier incarnations included."""
        self._stopping = True
        kill_trees([child.tree() for child in self.children], STOP_GRACE_S)
        for child in self.children:
            if child.process is not None:
                try:
                    child.process.wait(timeout=KILL_WAIT_S)  # reap the leader
                except subprocess.TimeoutExpired:
                    pass
        self.state_path.unlink(missing_ok=True)


def trees_from_state(state: dict) -> list[ProcessTree]:
    tags = state.get("process_tags", {})
    trees = [ProcessTree(tags.get(name), pid) for name, pid in state.get("children", {}).items()]
    # A child may be missing from "children" (never started) yet have left tagged processes.
    trees += [ProcessTree(tag, None) for name, tag in tags.items()
              if name not in state.get("children", {})]
    return trees


def stop_from_state(state_path: Path, grace_s: float = STOP_GRACE_S) -> list[str]:
    """`epd-serve down`: kill every process tree a launcher recorded."""
    if not state_path.is_file():
        return []
    state = json.loads(state_path.read_text())
    launcher_pid = state.get("launcher_pid")
    if launcher_pid and launcher_pid != os.getpid():
        try:
            os.kill(launcher_pid, signal.SIGTERM)  # stops supervision (and restarts) first
        except ProcessLookupError:
            pass
    kill_trees(trees_from_state(state), grace_s)
    state_path.unlink(missing_ok=True)
    return list(state.get("children", {}))
