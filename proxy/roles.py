"""Switching an instance between E, P and D while it serves: stop, drain, flip.

Runs in the proxy process. An instance marked switchable (`~` in the notation) is a
full engine started with both ends of each hand-off (kv_both, ec_both:
backends/hal.py), so its role is an entry of the status table, not a property of its
process, and a switch is a change of routing:
1. checked: refused (`SwitchRefused`, an HTTP status and why) if the instance is
   unknown, not switchable, already switching or already in that role, or if the
   switch would leave a stage with no instance and nothing standing in for it (E:
   `encode_fallback: prefill` lets prefill encode; P or D: `handoff_fallback:
   stand-in` lets the other run requests whole);
2. drained: routing stops sending it work at once (`switching_to` is set, so
   `routing.eligible` skips it and new work of its old role goes to its siblings);
   the hops in flight on it finish;
3. flipped, once the stage it leaves is checked again (its siblings may have died
   during the drain: then the switch is abandoned and it stays): it serves the new
   role. What it holds for other requests (a finished
   prefill's KV waiting for its decode to pull it, features in the MM Store) lives in
   its engine's connectors, which serve them whatever the table says: a KV sender runs
   in every kv_both engine, and the store is its own process.
A switch abandoned (its drain outlasting `role_drain_timeout_s`), cancelled (asked
back to its old role while draining) or failed (an error of ours) leaves the instance
in its old role, routable again. Every switch
is kept with its timings (decision to serving), counted in the metrics and listed on
/status and /roles.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.routing import eligible
from epd_serve.proxy.state import InstanceState, InstanceTable

log = logging.getLogger("epd_serve.proxy.roles")

ROLES = ("E", "P", "D")
DRAIN_POLL_S = 0.005  # how often a drain looks at the hops in flight
KEPT_SWITCHES = 200  # switches listed on /roles, newest last


class SwitchRefused(Exception):
    """A switch that cannot be made: `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


@dataclasses.dataclass
class Switch:
    """One role switch, as /roles and /status list it."""

    instance: str
    source: str
    target: str
    reason: str  # "manual", or the controller's reason
    decided_at: float  # wall clock (time.time())
    in_flight_at_decision: int
    outcome: str = "draining"  # draining | done | abandoned | cancelled | failed
    serving_after_ms: float | None = None  # decision to serving the new role
    _started: float = dataclasses.field(default_factory=time.monotonic, repr=False)
    _task: asyncio.Task | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.name.startswith("_")}


class RoleSwitcher:
    def __init__(self, table: InstanceTable, metrics: ProxyMetrics, config: ProxyConfig):
        self.table = table
        self.metrics = metrics
        self.config = config
        self.history: collections.deque[Switch] = collections.deque(maxlen=KEPT_SWITCHES)
        self.active: dict[str, Switch] = {}
        for inst in table.instances:
            metrics.set_role(inst.name, inst.roles)

    # -- deciding ----------------------------------------------------------------------
    def check(self, name: str, target: str) -> InstanceState:
        """The instance to switch to `target`, or SwitchRefused saying why not."""
        if target not in ROLES:
            raise SwitchRefused(400, f"role must be one of {', '.join(ROLES)}, not {target!r}",
                                "bad_role")
        inst = self.table.get(name)
        if inst is None:
            raise SwitchRefused(404, f"no instance named {name!r}", "unknown_instance")
        if not inst.entry.switchable:
            raise SwitchRefused(409, f"{name} is not switchable: only instances marked '~' in "
                                "the deployment notation (full engines with kv_both and "
                                "ec_both) change role while serving", "not_switchable")
        if inst.switching_to is not None:
            raise SwitchRefused(409, f"{name} is already switching {inst.roles} -> "
                                f"{inst.switching_to}", "switching")
        if inst.roles == target:
            raise SwitchRefused(409, f"{name} already serves {target}", "same_role")
        uncovered = self._left_uncovered(inst)
        if uncovered:
            raise SwitchRefused(409, uncovered, "stage_left_empty")
        return inst

    def _left_uncovered(self, inst: InstanceState) -> str | None:
        """Why taking `inst` out of its stage would leave that stage with no healthy
        instance and nothing standing in; None if it would not."""
        hop = inst.roles
        if [i for i in eligible(self.table.instances, hop) if i is not inst]:
            return None
        routing = self.config.routing
        if hop == "E" and routing.encode_fallback == "prefill":
            return None  # prefill encodes the images itself
        if hop in ("P", "D") and routing.handoff_fallback == "stand-in":
            return None  # the other end runs requests whole
        setting = "encode_fallback: prefill" if hop == "E" else "handoff_fallback: stand-in"
        return (f"{inst.name} is the last healthy {hop} instance and nothing would stand in "
                f"for it (routing.{setting} is off)")

    # -- carrying out ------------------------------------------------------------------
    def start(self, name: str, target: str, reason: str = "manual") -> Switch:
        """Begin switching `name` to `target` (checked first); the drain and the flip
        run in the background. Asking a draining instance back to its role cancels."""
        inst = self.table.get(name)
        if inst is not None and inst.switching_to is not None and inst.roles == target:
            return self._cancel(inst)
        inst = self.check(name, target)
        switch = Switch(name, inst.roles, target, reason, time.time(), inst.in_flight)
        inst.switching_to = target
        self.active[name] = switch
        self.history.append(switch)
        log.info("role switch %s %s -> %s (%s): draining %d hop(s) in flight", name,
                 switch.source, target, reason, inst.in_flight)
        switch._task = asyncio.create_task(self._carry_out(inst, switch))
        return switch

    async def wait(self, switch: Switch, timeout: float | None) -> Switch:
        """`switch`, once it has ended or `timeout` has passed (still draining then)."""
        if switch._task is not None:
            await asyncio.wait([switch._task], timeout=timeout)
        return switch

    async def _carry_out(self, inst: InstanceState, switch: Switch) -> None:
        """The drain and the flip. An error of ours in them must not leave the instance
        out of routing for good: the switch then ends "failed", said in the log, the
        metrics and /roles, and the instance serves whatever role it holds."""
        try:
            await self._drain_and_flip(inst, switch)
        except Exception:  # noqa: BLE001 - reported below; the instance must come back
            log.exception("role switch %s %s -> %s failed; it keeps serving %s", inst.name,
                          switch.source, switch.target, inst.roles)
            if switch.outcome == "draining":
                self._end(inst, switch, "failed")

    def _current(self, switch: Switch) -> bool:
        """Whether `switch` is still the one its instance is making (not cancelled, nor
        replaced by a switch asked for after a cancel)."""
        return self.active.get(switch.instance) is switch

    async def _drain_and_flip(self, inst: InstanceState, switch: Switch) -> None:
        deadline = switch._started + self.config.role_drain_timeout_s
        while inst.in_flight > 0 and self._current(switch):
            if time.monotonic() > deadline:
                self._end(inst, switch, "abandoned")
                log.warning("role switch %s %s -> %s abandoned: %d hop(s) still in flight "
                            "after %.0f s; it keeps serving %s", inst.name, switch.source,
                            switch.target, inst.in_flight, self.config.role_drain_timeout_s,
                            switch.source)
                return
            await asyncio.sleep(DRAIN_POLL_S)
        if not self._current(switch):
            return  # cancelled meanwhile
        uncovered = self._left_uncovered(inst)
        if uncovered:  # its stage lost its other instances while it drained
            self._end(inst, switch, "abandoned")
            log.warning("role switch %s %s -> %s abandoned after its drain: %s; it keeps "
                        "serving %s", inst.name, switch.source, switch.target, uncovered,
                        switch.source)
            return
        self.table.set_stages(inst, frozenset(switch.target))
        inst.switches += 1
        switch.serving_after_ms = (time.monotonic() - switch._started) * 1e3
        self._end(inst, switch, "done")
        self.metrics.set_role(inst.name, inst.roles)
        self.metrics.switch_seconds.observe(switch.serving_after_ms / 1e3)
        log.info("role switch %s %s -> %s done: serving %s after %.1f ms", inst.name,
                 switch.source, switch.target, switch.target, switch.serving_after_ms)

    def _cancel(self, inst: InstanceState) -> Switch:
        switch = self.active[inst.name]
        self._end(inst, switch, "cancelled")
        if switch._task is not None:
            switch._task.cancel()  # a switch asked for next must not meet this one's task
        log.info("role switch %s %s -> %s cancelled: it keeps serving %s", inst.name,
                 switch.source, switch.target, switch.source)
        return switch

    def _end(self, inst: InstanceState, switch: Switch, outcome: str) -> None:
        if not self._current(switch):
            return  # already ended (cancelled); another switch may be under way
        inst.switching_to = None
        switch.outcome = outcome
        del self.active[inst.name]
        self.metrics.child(self.metrics.switches, inst.name, switch.source, switch.target,
                           outcome).inc()

    async def stop(self) -> None:
        tasks = [s._task for s in self.active.values() if s._task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def to_dict(self) -> dict:
        return {"instances": {i.name: {"roles": i.roles, "started_as": i.entry.roles,
                                       "switchable": i.entry.switchable,
                                       "switching_to": i.switching_to}
                              for i in self.table.instances},
                "switches": [s.to_dict() for s in self.history]}
