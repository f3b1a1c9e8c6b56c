"""Starts, watches and stops every process of a deployment on one host: the start-up
plan (epd_serve/runtime/plan.py) carried out with local processes.

Runs in the `epd-serve up` process (or a test fixture); `stop_from_state` runs in
`epd-serve down`. Each child gets its own process group and carries a tag that all its
descendants inherit; a dead child's whole tree is killed before it is restarted, and
every tree on stop (epd_serve/runtime/proctree.py). State (pids and tags) goes to
<work_dir>/state.json so `epd-serve down` can do the same for a deployment started
elsewhere.

The launcher is not a single point of failure: its children do not die with it and
write their logs through relays of their own (child.py), so a launcher killed or stopped
leaves the deployment serving. `epd-serve up` started again (by hand, or by the shipped
systemd unit, scripts/systemd/epd-serve@.service) adopts the running processes recorded
in state.json instead of starting a second deployment (`adopt`), and supervises them
from then on. Ctrl-C or SIGTERM to `up`, or `epd-serve down`, still stops everything.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from epd_serve.deployment.resolve import ResolvedDeployment
from epd_serve.backends.hal import Platform
from epd_serve.mmstore import StoreSpec
from epd_serve.mmstore.service import remove_store_files
from epd_serve.proxy.tenancy import INTERNAL_TOKEN_ENV
from epd_serve.runtime.child import STOP_GRACE_S, Child
from epd_serve.runtime.liveness import hung_children
from epd_serve.runtime.plan import (
    ROSTER_FILE,
    Step,
    carry_out,
    fill_run_dir,
    startup_plan,
    with_internal_token,
)
from epd_serve.runtime.preflight_deployment import refuse_to_start
from epd_serve.runtime.proctree import KILL_WAIT_S, TAG_ENV, ProcessTree, kill_trees
from epd_serve.runtime.supervision import (
    LaunchError,
    log_dir,
    prepare_work_dir,
    probe,
    process_tag,
    report_failed_round,
    state_path,
    wait_healthy,
    wait_serving,
)

logger = logging.getLogger(__name__)


def preflight(dep: ResolvedDeployment) -> None:
    """Refuse to start what would fail: the preflight's checks of the start-up plan
    (epd_serve/runtime/preflight_deployment.py), as `epd-serve doctor` words them."""
    refuse_to_start(dep, startup_plan(dep))


class Launcher:
    """Brings a resolved deployment up on this host, keeps it up, and brings it down.
    `platform` replaces the deployment's own HAL (tests start fake engines with it)."""

    def __init__(self, dep: ResolvedDeployment, platform: Platform | None = None,
                 on_event: Callable[[str], None] | None = None):
        self.dep = dep if platform is None else dataclasses.replace(dep, platform=platform)
        self.on_event = on_event or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.log_dir = log_dir(dep)
        self.state_path = state_path(dep)
        self.children: list[Child] = []
        self._stopping = False
        # What the supervision rounds probe the children with, kept for the launcher's
        # life: a new httpx client costs ~50 ms of CPU (it loads the CA bundle into a TLS
        # context), which every 2 s round made 2-3% of a core on an idle deployment. It
        # keeps no connection between requests, as a client per round did not: a server
        # closing an idle one just as a probe reuses it would read as a failed probe.
        self._probe_client: httpx.Client | None = None
        # Tells this launcher's processes apart from those of another launcher of the
        # same deployment (say a test and a developer's `epd-serve up`).
        self._token = secrets.token_hex(6)
        # What the proxy takes span exports with (plan.INTERNAL_TOKEN): one per bring-up.
        self._internal_token = secrets.token_hex(16)

    # -- bring up -----------------------------------------------------------
    @property
    def internal_token(self) -> str:
        """This bring-up's internal token: what the proxy takes from the engines' span
        exports and from the deployment's own tools (the warm-up reads the stages)."""
        return self._internal_token

    def start(self) -> None:
        """Start every step of the plan in order, each once the steps it waits on serve
        (saying why through on_event)."""
        preflight(self.dep)
        prepare_work_dir(self.dep)
        (self.dep.work_dir / ROSTER_FILE).unlink(missing_ok=True)  # a new deployment
        self.children = []
        carry_out(startup_plan(self.dep), self._start_step, self._wait_serving, self.on_event)

    def adopt(self) -> bool:
        """Take over the processes an earlier launcher of this deployment started and
        recorded, if that launcher is gone and they run (with their tags): True then,
        and a child no longer running is started again. A launcher still running is
        refused (LaunchError): there is one supervisor per deployment."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return False
        if state.get("config") != self.dep.config.name:
            return False
        other = state.get("launcher_pid")
        if other and other != os.getpid() and _running(other):
            raise LaunchError(f"{self.dep.config.name} is already supervised by `epd-serve "
                              f"up` (pid {other}); `epd-serve down` stops it")
        running = _running_leaders(state)
        if not running:
            return False
        self._token = next(iter(running.values()))[1].rsplit("/", 1)[-1]
        self._internal_token = _internal_token_of(running) or self._internal_token
        for step in startup_plan(self.dep):
            child = self._child_for(step)
            self.children.append(child)
            if step.name in running:
                child.adopt(running[step.name][0])
            elif event := child.try_start():
                self.on_event(f"{step.name}: {event}")
        self._write_state()
        again = [c.name for c in self.children if c.name not in running]
        self.on_event(f"adopted {', '.join(sorted(running))} (started by pid {other}); "
                      f"started again: {', '.join(again) or 'nothing'}")
        return True

    def _wait_serving(self, step: Step) -> None:
        wait_serving(self._child_named(step.name), self.poll_health, step.start_timeout_s)

    def _start_step(self, step: Step) -> None:
        child = self._child_for(step)
        self.children.append(child)
        child.start()
        self._write_state()

    def _child_for(self, step: Step) -> Child:
        run_dir = str(self.dep.work_dir)
        for file_name, text in step.files.items():
            (self.dep.work_dir / file_name).write_text(fill_run_dir(text, run_dir))
        return Child(name=step.name, command=[fill_run_dir(w, run_dir) for w in step.command],
                     env=with_internal_token(step.env, self._internal_token),
                     log_path=self.log_dir / f"{step.name}.log",
                     health_url=step.health_url,
                     tag=process_tag(self.dep, step.name, self._token),
                     supervision=self.dep.config.supervision,
                     # Clients wait, not refused, while the proxy restarts
                     # (protocols/held_socket.py).
                     listen_on=(step.address, next(iter(step.ports)))
                     if step.kind == "proxy" else None)

    def _child_named(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    def _write_state(self) -> None:
        state = {
            "config": self.dep.config.name,
            "launcher_pid": os.getpid(),
            "children": {c.name: c.process.pid for c in self.children if c.process},
            "process_tags": {c.name: c.tag for c in self.children if c.tag},
            "proxy_url": self.dep.proxy_url,
            # What `down` removes once the processes are gone (the shm store's arena).
            "mm_store": self.dep.mm_store.to_json() if self.dep.mm_store else None,
            # As of this write (it is rewritten whenever a child exits or restarts).
            "supervision": {c.name: {"state": c.describe(), "restarts": c.restarts,
                                     "crashes_in_a_row": c.backoff.crashes_in_a_row}
                            for c in self.children},
        }
        self.state_path.write_text(json.dumps(state, indent=2))

    def poll_health(self, client: httpx.Client) -> None:
        probe(self.children, client)

    def wait_healthy(self, progress: Callable[[list[Child], float], None] | None = None) -> float:
        """Block until every process answers its health URL; returns seconds taken. An
        instance that exits during start-up fails the launch with its log tail."""
        elapsed = wait_healthy(self.children, self.poll_health,
                               self.dep.config.health_timeout_s, self.log_dir, progress)
        for child in self.children:
            child.note_segments()  # a crash before the first supervision round leaks none
        return elapsed

    # -- keep up ------------------------------------------------------------
    def supervise_once(self) -> list[str]:
        """Kill children hung too long, restart children that died (each once its
        back-off allows); returns what happened (one line each). A failure while looking
        after one child is reported and tried again at the next check; it does not stop
        the others."""
        events = self._kill_hung()
        for child in self.children:
            if self._stopping:
                break
            try:
                if event := child.revive():
                    events.append(event)
            except Exception as err:  # noqa: BLE001 - whatever it is, the rest go on
                logger.error("supervising %s failed", child.name, exc_info=True)
                events.append(f"{child.name}: supervising it failed ({type(err).__name__}: "
                              f"{err}); trying again at the next check")
        if events:
            try:
                self._write_state()
            except OSError as err:  # a full disk: `epd-serve down` reads the last one
                events.append(f"cannot write {self.state_path} ({err}); it may be stale")
            for event in events:
                self.on_event(event)
        return events

    def _kill_hung(self) -> list[str]:
        """Children there but silent for `hung_restart_s` (runtime/liveness.py),
        killed for the next step to restart them."""
        try:
            if self._probe_client is None:
                self._probe_client = httpx.Client(
                    limits=httpx.Limits(max_keepalive_connections=0))
            client = self._probe_client
            probe(self.children, client)  # which ones have answered since their start
            hung = hung_children(self.children, {l.name for l in self.dep.launches},
                                 self.dep.proxy_url, client,
                                 self.dep.config.supervision.hung_restart_s)
        except Exception as err:  # noqa: BLE001 - restarts of exited children go on
            logger.error("looking for hung children failed", exc_info=True)
            return [f"looking for hung children failed ({type(err).__name__}: {err})"]
        return [self._child_named(name).kill_hung(why) for name, why in hung.items()]

    def run_forever(self, interval: float = 2.0) -> None:
        """Supervise until stopped. A round that fails is reported and the next comes as
        usual: the deployment is never stopped because its supervisor stumbled."""
        while not self._stopping:
            try:
                self.supervise_once()
            except Exception as err:  # noqa: BLE001 - see above
                logger.error("a supervision round failed", exc_info=True)
                report_failed_round(self.on_event, err)
            time.sleep(interval)

    # -- bring down ---------------------------------------------------------
    def stop(self) -> None:
        """Kill every child's whole tree, leftovers of earlier incarnations included."""
        self._stopping = True
        kill_trees([child.tree() for child in self.children], STOP_GRACE_S,
                   set().union(*(child.shm_segments for child in self.children)))
        for child in self.children:
            if child.process is not None:
                try:
                    child.process.wait(timeout=KILL_WAIT_S)  # reap the leader
                except subprocess.TimeoutExpired:
                    pass
            child.close_log()
            child.close_listener()
        if self.dep.mm_store is not None:
            remove_store_files(self.dep.mm_store)
        self.state_path.unlink(missing_ok=True)
        if self._probe_client is not None:
            self._probe_client.close()
            self._probe_client = None


def _running(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _running_leaders(state: dict) -> dict[str, tuple[int, str]]:
    """Child name -> (pid, tag) of each recorded leader still running with its tag (a
    pid reused by another process does not carry it)."""
    found = {}
    tags = state.get("process_tags", {})
    for name, pid in state.get("children", {}).items():
        tag = tags.get(name)
        try:
            carries = tag and psutil.Process(pid).environ().get(TAG_ENV) == tag
        except psutil.Error:
            carries = False
        if carries and _running(pid):
            found[name] = (pid, tag)
    return found


def _internal_token_of(running: dict[str, tuple[int, str]]) -> str | None:
    """The span token the running processes were started with (never written to a file:
    read back from their environment)."""
    for pid, _ in running.values():
        try:
            token = psutil.Process(pid).environ().get(INTERNAL_TOKEN_ENV)
        except psutil.Error:
            continue
        if token:
            return token
    return None


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
    if state.get("mm_store"):
        remove_store_files(StoreSpec.from_json(state["mm_store"]))
    state_path.unlink(missing_ok=True)
    return list(state.get("children", {}))
