"""Who is in the deployment and how each instance is doing: probes, the engines' own
load numbers, and instances joining and leaving at run time.

Runs inside the proxy process as two background tasks (probe, engine metrics) plus
the /instances routes' calls. An instance that refuses connections is out at once
(its process is gone), as is one a request found hung (upstream.py: silent past a
deadline, /health too); one that answers slowly or with an error is out after
`unhealthy_after` probes in a row, since a busy engine can miss one while still
serving; either is back at its first good answer. The roster (instances from the
deployment plus registered ones) is written to `roster_path` on every change and read
back when the proxy restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import aiohttp

from epd_serve.proxy.config import InstanceEntry, ProxyConfig
from epd_serve.proxy.liveness import engine_silent
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.routing import eligible
from epd_serve.proxy.state import HOPS, EngineLoad, InstanceState, InstanceTable, serves
from epd_serve.proxy.upstream import connect_failure

log = logging.getLogger("epd_serve.proxy.membership")

# vLLM's gauges on /metrics (summed over label sets: one per engine/model).
ENGINE_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # before vLLM 0.10
}


def parse_engine_metrics(text: str) -> EngineLoad:
    """The load gauges from an engine's Prometheus text; a scan of the lines we need,
    since vLLM's page is large and read every second."""
    values = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = ENGINE_GAUGES.get(name)
        if field is not None:
            try:
                values[field] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return EngineLoad(read_at=time.monotonic(), **values)


def load_roster(config: ProxyConfig) -> list[tuple[InstanceEntry, str]]:
    """The instances to start with: the kept roster if there is one, else the config's."""
    path = Path(config.roster_path) if config.roster_path else None
    if path is not None and path.is_file():
        try:
            rows = json.loads(path.read_text())
            return [(InstanceEntry.model_validate(r["entry"]), r["source"]) for r in rows]
        except (ValueError, KeyError, TypeError) as err:
            log.warning("roster %s unreadable (%s); starting from the deployment's", path, err)
    return [(entry, "config") for entry in config.instances]


class Membership:
    def __init__(self, table: InstanceTable, session: aiohttp.ClientSession,
                 metrics: ProxyMetrics, config: ProxyConfig):
        self.table = table
        self.session = session
        self.metrics = metrics
        self.config = config
        # Every background task running: the two loops, and one-off probes of instances
        # registered at run time, which leave the set when they end.
        self._tasks: set[asyncio.Task] = set()

    # -- the roster ----------------------------------------------------------------
    def register(self, entry: InstanceEntry) -> InstanceState:
        inst = self.table.add(entry, source="registered")  # KeyError if the name is taken
        self.metrics.set_role(entry.name, entry.roles)
        self.save()
        log.info("instance %s (%s) registered at %s", entry.name, entry.roles, entry.url)
        self.spawn(self.probe(inst))  # routable once it answers
        return inst

    def deregister(self, name: str) -> InstanceState:
        inst = self.table.remove(name)  # KeyError if unknown
        self.metrics.forget(name)
        self.save()
        log.info("instance %s left the roster (%d hops still in flight finish)", name,
                 inst.in_flight)
        return inst

    def save(self) -> None:
        if not self.config.roster_path:
            return
        path = Path(self.config.roster_path)
        rows = [{"entry": e.model_dump(), "source": s} for e, s in self.table.entries()]
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(rows, indent=2))
            os.replace(tmp, path)  # a crash mid-write never leaves half a roster
        except OSError as err:  # the roster still serves; only a restart would forget it
            log.warning("could not keep the roster in %s: %s", path, err)

    # -- background tasks ------------------------------------------------------------
    def start(self) -> None:
        self.spawn(self._every(self.config.health_interval_s, self.probe))
        self.spawn(self._every(self.config.routing.metrics_interval_s, self.read_engine_load))

    def spawn(self, coro) -> None:
        """Run `coro` in the background until it ends or the proxy stops (the role
        controller's loop is one)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # held until it ends: the loop keeps only weak references
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _every(self, interval: float, check) -> None:
        """Run `check` on every instance, every `interval` seconds, for good: an error in
        one round (a bug, something unforeseen from an instance) is logged, and the next
        round runs as usual. Otherwise one such error would stop probing for the
        proxy's lifetime, freezing every instance's health as it was."""
        while True:
            instances = self.table.instances
            results = await asyncio.gather(*(check(i) for i in instances),
                                           return_exceptions=True)
            for inst, result in zip(instances, results):
                if isinstance(result, Exception):
                    log.error("%s of instance %s failed", check.__name__, inst.name,
                              exc_info=result)
            await asyncio.sleep(interval)

    async def probe(self, inst: InstanceState) -> None:
        refused = False
        try:
            async with self.session.get(inst.entry.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                ok = resp.status == 200
                if not ok:
                    inst.last_error = f"health: HTTP {resp.status}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
            failure = connect_failure(err)
            if failure == "local":  # the proxy's own limit: says nothing of the instance
                log.warning("probe of %s not sent: %s", inst.name, err)
                return
            refused = failure == "refused"
            ok = False
            inst.last_error = f"health: {type(err).__name__}"
        if ok and inst.core_hung:
            ok = await self._engine_answers(inst)
        self._note_hung(inst, ok, refused)
        if inst.draining:
            return
        inst.probe_failures = 0 if ok else inst.probe_failures + 1
        healthy = ok or (inst.healthy and not refused
                         and inst.probe_failures < self.config.unhealthy_after)
        if healthy != inst.healthy:
            log.info("instance %s is now %s", inst.name, "healthy" if healthy else "DOWN")
            if healthy:
                inst.incarnation += 1  # it may be a restarted engine: forget what we knew
            else:
                inst.engine = None
        inst.healthy = healthy
        self.metrics.healthy.labels(inst.name).set(int(healthy))

    async def _engine_answers(self, inst: InstanceState) -> bool:
        """An instance whose engine was found hung comes back only once that engine
        answers a one-token request: its /health was green all along."""
        silent = await engine_silent(self.session, inst, self.config.model,
                                     self.config.deadlines.core_timeout_s)
        if silent is not None:
            inst.last_error = silent
            return False
        inst.core_hung = False
        log.info("instance %s: its engine answers again", inst.name)
        return True

    def _note_hung(self, inst: InstanceState, ok: bool, refused: bool) -> None:
        """Since when it has been there but not answering (a refused port is a process
        gone, which the supervisor sees for itself), for /metrics and /status."""
        if ok or refused:
            inst.hung_since = None
        elif inst.hung_since is None:
            inst.hung_since = time.monotonic()
        self.metrics.hung_seconds.labels(inst.name).set(inst.hung_for(time.monotonic()))

    def has_rivals(self, inst: InstanceState) -> bool:
        """Whether routing chooses between this instance and another for a hop it
        serves: only then do the engine's own numbers steer a request."""
        return any(eligible(self.table.instances, hop, exclude=[inst])
                   for hop in HOPS if serves(inst, hop))

    async def read_engine_load(self, inst: InstanceState) -> None:
        """The periodic read, of instances routing chooses among. A stage's only
        instance is not read: vLLM renders its /metrics page (~54 KB, ~3.5 ms of the
        API server's CPU) on the cores the deployment computes on, and on one CPU host
        those reads made E-P-D's median text request 9 ms slower (83 -> 74 ms without
        them). /status reads what it shows on demand (refresh_engine_loads)."""
        if inst.healthy and self.has_rivals(inst):
            await self._read_metrics(inst)

    async def refresh_engine_loads(self) -> None:
        """Read now the healthy instances whose numbers are missing or stale."""
        await asyncio.gather(*(self._read_metrics(i) for i in self.table.instances
                               if i.healthy and i.engine_load() is None))

    async def _read_metrics(self, inst: InstanceState) -> None:
        try:
            async with self.session.get(inst.entry.url + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return  # the probe decides health; stale numbers expire on their own
        inst.read_engine(parse_engine_metrics(text))
