"""Brings a multi-node deployment up on Ray, keeps it up and brings it down: one actor
per process (epd_serve/runtime/ray_host.py), placed on its node and devices by placement
groups; the proxy and the MM Store's servers on the head node.

Runs in the `epd-serve up` process (or a test fixture), which is the Ray driver. Only
deployments with a `cluster:` section import it; Ray comes with `epd-serve[cluster]`.
It carries out the same start-up plan as the local launcher (epd_serve/runtime/plan.py)
and probes health over HTTP from here the same way (epd_serve/runtime/supervision.py);
each actor restarts its own process, and Ray restarts an actor whose node died once a
node with the same label is back.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import os
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from epd_serve.deployment.resolve import ResolvedDeployment
from epd_serve.runtime.child import STOP_GRACE_S, log_tail
from epd_serve.runtime.plan import Step, carry_out, startup_plan, with_internal_token
from epd_serve.runtime.ray_host import ProcessHost, ProcessSpec
from epd_serve.runtime.supervision import (
    ChildLog,
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
from epd_serve.topology.placement import NODE_LABEL, ClusterSpec, NodeSpec, ray_resource_args

_HostActor = ray.remote(ProcessHost)
STATUS_TIMEOUT_S = 3.0
LOG_SYNC_INTERVAL_S = 0.5
LOCAL_OBJECT_STORE_BYTES = 100 << 20  # nothing of ours goes through Ray's object store

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RayChild:
    """One process as the driver sees it: the same surface as child.Child (name,
    health, exit code, log) for the start-up progress and the health wait."""

    name: str
    node: str
    health_url: str
    log_path: Path
    actor: Any = None
    healthy: bool = False
    restarts: int = 0
    state: str = ""  # as its actor last said: running, backing off ...
    gave_up: bool = False  # its actor refused to start it (`error` says why)
    code: int | None = None
    error: str | None = None
    lost: bool = False  # its actor does not answer: the node died or restarts
    node_id: str | None = None
    log_offset: int = 0
    log: ChildLog | None = None  # the copy of its log here, rolled over as the actor's
    log_decoder: codecs.IncrementalDecoder = dataclasses.field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def exit_code(self) -> int | None:
        return (self.code if self.code is not None else -1) if self.gave_up else None

    def log_tail(self, lines: int = 15) -> str:
        if self.error:
            return f"{self.error} (its actor did not start it)"
        return log_tail(self.log_path, lines)


def node_problems(cluster: ClusterSpec, ray_nodes: list[dict], resource: str) -> list[str]:
    """What keeps the live Ray nodes (`ray.nodes()`) from hosting the file's nodes."""
    alive = [n for n in ray_nodes if n.get("Alive")]
    problems = []
    for spec in cluster.nodes:
        found = [n for n in alive if n.get("Labels", {}).get(NODE_LABEL) == spec.name]
        if not found:
            problems.append(f"no live Ray node is labelled {NODE_LABEL}={spec.name} (start "
                            f"it with `ray start ... --labels {NODE_LABEL}={spec.name}`)")
            continue
        node = found[0]
        if node["NodeManagerAddress"] != spec.address:
            problems.append(f"{spec.name} is at {node['NodeManagerAddress']} in Ray but at "
                            f"{spec.address} in the file")
        offered = node.get("Resources", {}).get(resource, 0)
        if offered < len(spec.devices):
            problems.append(f"{spec.name} offers {offered:g} {resource} to Ray, the file "
                            f"lists {len(spec.devices)} device(s)")
    return problems


def resource_options(resource: str, amount: float) -> dict[str, Any]:
    """Ray actor options that take `amount` of a device resource, and no CPU beside it."""
    return {"num_cpus": 0, **ray_resource_args(resource, round(amount, 4))}  # Ray's precision


def local_node_args(node: NodeSpec, resource: str) -> dict[str, Any]:
    """`ray.cluster_utils.Cluster.add_node` arguments for one node of the file on this
    machine: its address, label and devices as Ray resources."""
    return {"node_ip_address": node.address, "labels": {NODE_LABEL: node.name},
            "object_store_memory": LOCAL_OBJECT_STORE_BYTES, "include_dashboard": False,
            "num_cpus": 1, **ray_resource_args(resource, len(node.devices))}


class RayLauncher:
    """Launcher for deployments with a `cluster:` section: the same surface as the local
    Launcher (start, wait_healthy, supervise_once, run_forever, stop, children)."""

    def __init__(self, dep: ResolvedDeployment,
                 on_event: Callable[[str], None] | None = None):
        assert dep.config.cluster is not None
        self.dep = dep
        self.on_event = on_event or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.log_dir = log_dir(dep)
        self.state_path = state_path(dep)
        self.children: list[RayChild] = []
        self._stopping = False
        self._token = secrets.token_hex(6)  # as the local launcher's: tags its processes
        self._internal_token = secrets.token_hex(16)  # plan.INTERNAL_TOKEN, this bring-up's
        self.cluster: ClusterSpec = dep.config.cluster
        self.resource = dep.platform.ray_resource
        self.local_cluster = None  # ray.cluster_utils.Cluster when cluster.address is 'local'
        self._local_nodes: dict[str, Any] = {}
        self._placement_groups: list[PlacementGroup] = []
        # instance -> (its device group, its share of the group's devices), reserved
        # just before the first instance starts
        self._device_groups: dict[str, tuple[PlacementGroup, float]] | None = None
        self._log_thread: threading.Thread | None = None
        self._logs_done = threading.Event()

    # -- connect ------------------------------------------------------------
    def _connect(self) -> None:
        address = self.cluster.address
        if address == "local":
            address = self._start_local_cluster()
        elif address != "auto" and ":" not in address:
            address = f"{address}:{self.cluster.head_port}"
        try:
            ray.init(address=address, namespace="epd-serve", log_to_driver=False,
                     logging_level="WARNING")
        except ConnectionError as err:
            raise LaunchError(f"cannot join the Ray cluster at {address}: {err}") from None
        if problems := node_problems(self.cluster, ray.nodes(), self.resource):
            raise LaunchError(f"the Ray cluster does not have the nodes {self.dep.config.name} "
                              f"places instances on: {'; '.join(problems)}")

    def _start_local_cluster(self) -> str:
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray's sockets live under its temp dir, whose path must stay short.
        if "RAY_TMPDIR" not in os.environ:
            os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="epd-ray-")
        self.local_cluster = Cluster()
        head = self.cluster.head_node
        for node in [head, *(n for n in self.cluster.nodes if n is not head)]:
            self.add_local_node(node.name)
        return self.local_cluster.address

    def add_local_node(self, name: str) -> None:
        """Start (again) the local Ray node of the file's node `name`."""
        node = self.cluster.node(name)
        self._local_nodes[name] = self.local_cluster.add_node(
            **local_node_args(node, self.resource))

    def kill_local_node(self, name: str) -> None:
        """Kill a local Ray node at once, as a machine that fails would go."""
        self.local_cluster.remove_node(self._local_nodes.pop(name), allow_graceful=False)

    # -- bring up -----------------------------------------------------------
    @property
    def internal_token(self) -> str:
        """This bring-up's internal token: what the proxy takes from the engines' span
        exports and from the deployment's own tools (the warm-up reads the stages)."""
        return self._internal_token

    def start(self) -> None:
        """Start every step of the plan in order, each once the steps it waits on serve
        (saying why through on_event); the devices are reserved (placement groups)
        before the first instance."""
        prepare_work_dir(self.dep)
        self._connect()
        self.children = []
        self._log_thread = threading.Thread(target=self._forward_logs, name="logs", daemon=True)
        self._log_thread.start()
        carry_out(startup_plan(self.dep), self._start_step, self._wait_serving, self.on_event)
        self._write_state()

    def _wait_serving(self, step: Step) -> None:
        wait_serving(self._child_named(step.name), self.poll_health, step.start_timeout_s)

    def _start_step(self, step: Step) -> None:
        if step.launch is None:
            self._start_on_head(step)
            return
        if self._device_groups is None:
            self._device_groups = self._reserve_devices()
        self._start_instance(step, *self._device_groups[step.name])

    def _spec(self, step: Step, **extra) -> ProcessSpec:
        return ProcessSpec(name=step.name, command=list(step.command),
                           env=with_internal_token(step.env, self._internal_token),
                           tag=process_tag(self.dep, step.name, self._token),
                           supervision=self.dep.config.supervision, address=step.address,
                           ports=step.ports, files=step.files, **extra)

    def _child_named(self, name: str) -> RayChild:
        return next(child for child in self.children if child.name == name)

    def _reserve_devices(self) -> dict[str, tuple[PlacementGroup, float]]:
        """One placement group per device group of the plan, on its node. Returns
        instance name -> (its group, how much of the group's devices it takes)."""
        by_name = {launch.name: launch for launch in self.dep.launches}
        shares: dict[str, tuple[PlacementGroup, float]] = {}
        pending = {}
        for group in self.dep.plan.groups():
            launches = [by_name[inst.name] for inst in group]
            devices = len({d for launch in launches for d in launch.devices})
            pg = placement_group([{self.resource: devices}], strategy="STRICT_PACK",
                                 bundle_label_selector=[{NODE_LABEL: launches[0].node}])
            self._placement_groups.append(pg)
            pending[pg.ready()] = (f"{devices} {self.resource} on node {launches[0].node} "
                                   f"for {', '.join(l.name for l in launches)}")
            for launch in launches:
                shares[launch.name] = (pg, launch.instance.tensor_parallel / len(launches))
        ready, waiting = ray.wait(list(pending), num_returns=len(pending),
                                  timeout=self.cluster.placement_timeout_s)
        if waiting:
            raise LaunchError(f"Ray did not reserve {'; '.join(pending[r] for r in waiting)} "
                              f"within {self.cluster.placement_timeout_s:.0f}s (`ray status` "
                              "shows what each node has free)")
        return shares

    def _start_instance(self, step: Step, group: PlacementGroup, share: float) -> None:
        spec = self._spec(step, required_path=step.launch.model,
                          device_env=self.dep.platform.device_visibility_env,
                          ray_resource=self.resource)
        options = resource_options(self.resource, share)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, 0)
        self._add_child(spec, step.node, step.health_url, options)

    def _start_on_head(self, step: Step) -> RayChild:
        """The proxy and the MM Store's servers: no devices, on the head node."""
        options = {"num_cpus": 0, "label_selector": {NODE_LABEL: step.node}}
        return self._add_child(self._spec(step), step.node, step.health_url, options)

    def _add_child(self, spec: ProcessSpec, node: str, health_url: str,
                   options: dict[str, Any]) -> RayChild:
        # max_restarts=-1: an actor whose node died comes back when the node does (its
        # placement group waits for a node with the same label).
        actor = _HostActor.options(max_restarts=-1, max_task_retries=0, **options).remote(spec)
        child = RayChild(name=spec.name, node=node, health_url=health_url,
                         log_path=self.log_dir / f"{spec.name}.log", actor=actor)
        self.children.append(child)
        return child

    # -- keep up ------------------------------------------------------------
    def poll_health(self, client) -> None:
        self._refresh()
        probe(self.children, client)

    def wait_healthy(self, progress: Callable[[list[RayChild], float], None] | None = None) -> float:
        return wait_healthy(self.children, self.poll_health, self.dep.config.health_timeout_s,
                            self.log_dir, progress)

    def supervise_once(self) -> list[str]:
        events = self._refresh()
        if events:
            try:
                self._write_state()
            except OSError as err:  # a full disk: `epd-serve down` reads the last one
                self.on_event(f"cannot write {self.state_path} ({err}); it may be stale")
        return events

    def run_forever(self, interval: float = 2.0) -> None:
        """Supervise until stopped; a round that fails is reported, the next comes as
        usual (the actors restart their processes meanwhile)."""
        while not self._stopping:
            try:
                self.supervise_once()
            except Exception as err:  # noqa: BLE001 - never stop the deployment for it
                logger.error("a supervision round failed", exc_info=True)
                report_failed_round(self.on_event, err)
            time.sleep(interval)

    def _ask(self, children: list[RayChild], call) -> dict[str, Any]:
        """`call(child)` (a method call on its actor) for every child at once. Returns
        name -> the answer, or the exception standing for none (a dead or restarting
        actor, or no answer within STATUS_TIMEOUT_S)."""
        refs = {child.name: call(child) for child in children}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATUS_TIMEOUT_S)
        answers: dict[str, Any] = {}
        for name, ref in refs.items():
            try:
                answers[name] = ray.get(ref) if ref in ready else TimeoutError()
            except ray.exceptions.RayError as err:
                answers[name] = err
        return answers

    def _refresh(self) -> list[str]:
        """Ask every actor how its process is; report what changed."""
        answers = self._ask(self.children, lambda child: child.actor.status.remote())
        events = []
        for child in self.children:
            status = answers[child.name]
            if isinstance(status, Exception):
                if not child.lost:
                    events.append(f"{child.name}: its actor on node {child.node} does not "
                                  "answer (node lost?); Ray restarts it when the node is back")
                child.lost, child.healthy = True, False
                continue
            if child.lost:
                events.append(f"{child.name}: back on node {child.node}")
            child.lost = False
            events += status["events"]
            if status["error"] and status["error"] != child.error:
                events.append(f"{child.name}: {status['error']}")
            child.restarts, child.gave_up = status["restarts"], status["gave_up"]
            child.state = status.get("state", "")  # an actor of an older release has none
            child.code, child.error = status["exit_code"], status["error"]
            child.node_id = status["node_id"]
        for event in events:
            self.on_event(event)
        return events

    def _forward_logs(self) -> None:
        """Append what each actor's process logged to <work_dir>/logs/<name>.log here."""
        while not self._logs_done.wait(LOG_SYNC_INTERVAL_S):
            try:
                self.sync_logs()
            except Exception:  # noqa: BLE001 - the copies lag; they must not stop
                logger.error("copying the processes' logs failed; trying again",
                             exc_info=True)

    def sync_logs(self) -> None:
        children = list(self.children)  # start() may be adding to it
        answers = self._ask(children, lambda child: child.actor.read_log.remote(child.log_offset))
        for child in children:
            if isinstance(answer := answers[child.name], Exception):
                continue
            data, child.log_offset = answer
            if data:
                if child.log is None:
                    child.log = ChildLog(child.log_path, self.dep.config.supervision)
                child.log.write(child.log_decoder.decode(data))

    def _write_state(self) -> None:
        state = {
            "config": self.dep.config.name,
            "launcher_pid": os.getpid(),
            "children": {},  # no local processes: they stop with this launcher's Ray job
            "ray_address": self.cluster.address,
            "nodes": {child.name: child.node for child in self.children},
            "proxy_url": self.dep.proxy_url,
            # As its actors last said (rewritten whenever a process exits or restarts).
            "supervision": {child.name: {"state": "actor lost" if child.lost else child.state,
                                         "restarts": child.restarts}
                            for child in self.children},
        }
        self.state_path.write_text(json.dumps(state, indent=2))

    # -- bring down ---------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True
        self._logs_done.set()
        if self._log_thread is not None:
            self._log_thread.join()
        if ray.is_initialized():
            refs = [child.actor.stop.remote() for child in self.children]
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)
            self.sync_logs()
            for child in self.children:
                ray.kill(child.actor, no_restart=True)
                if child.log is not None:
                    child.log.close()
            for pg in self._placement_groups:
                remove_placement_group(pg)
            ray.shutdown()
        if self.local_cluster is not None:
            self.local_cluster.shutdown()
        self.state_path.unlink(missing_ok=True)
