"""Role switching in the simulator: the proxy's role controller, run on simulated engines.

The decision is proxy/role_policy.py's rule itself (RolePolicy), so what the simulator
predicts switching buys is what the proxy would do. This module carries a decision out
as the proxy's controller does:
- every `interval_s` the rule sees each instance as a Member: its load (hops routed to
  it and not finished: queued, running or on their way), the stage it serves, whether
  it may switch, and how long it has served that stage;
- a decision takes the instance out of routing for its old stage at once; it finishes
  what it holds (drain: nothing is handed back or lost), then after `overhead_s` serves
  the new stage, with that stage's budget, and routing picks it for the new hop;
- one switch at a time: the rule is not asked while a switch is in progress, and is
  reset when a switch starts, so the next one waits out its own `sustain_s`.

A switch costs only the drain in this system: a switchable instance is a full engine
with both ends of each hand-off, whatever it serves (notation.py), so P <-> D reuses
the process and its KV cache and E <-> P/D changes only what the proxy routes to it.
`overhead_s` is for what a real switch adds after the drain (paper 003 §3.2.4: under
0.7 s, longest when E is involved; default 0).
"""

from __future__ import annotations

import dataclasses

from epd_serve.proxy.role_policy import Member, RolePolicy, RoleRule


@dataclasses.dataclass(frozen=True)
class RoleControl:
    """The controller's settings: the rule, how often it looks, what a switch adds."""

    rule: RoleRule = RoleRule()
    interval_s: float = 0.5
    overhead_s: float = 0.0  # from the end of the drain to serving the new stage


@dataclasses.dataclass
class Switch:
    """One role switch, with its times in seconds from the run's start."""

    instance: str
    source: str
    target: str
    decided_s: float  # the rule chose it; routing stopped picking it for `source`
    reason: str
    drained_s: float | None = None  # its last `source` work finished
    serving_s: float | None = None  # routing picks it for `target`

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RoleController:
    """Asks the rule at a steady interval and carries its decisions out on `sim`
    (a simulator.Simulation), one at a time."""

    def __init__(self, control: RoleControl, sim):
        self.control = control
        self.sim = sim
        self.policy = RolePolicy(control.rule)
        self.switches: list[Switch] = []
        self._in_progress: Switch | None = None

    def members(self, now: float) -> list[Member]:
        """The instances as the rule sees them (the draining one is not routable)."""
        return [Member(name=e.name, role=e.roles, load=float(e.in_flight),
                       switchable=e.spec.switchable and len(e.roles) == 1,
                       in_role_s=now - e.role_since)
                for e in self.sim.engines if e.draining_to is None]

    def vacant(self) -> dict[str, float]:
        """The encoder stage's work when a switch emptied it: requests whose images
        prefill encodes (queued on it), as the proxy counts those stood in for (the
        proxy holds one until its answer ends, the simulator while its images wait)."""
        if any(e.roles == "E" for e in self.sim.engines) \
                or not any("E" in i.roles for i in self.sim.instances):
            return {}
        waiting = {id(req) for e in self.sim.engines for req, _ in e.encode_queue}
        return {"E": float(len(waiting))}

    def tick(self, now: float) -> None:
        """One look at the queues; the next is scheduled while requests are open."""
        if self._in_progress is None:
            decision = self.policy.observe(self.members(now), now, self.vacant())
            if decision is not None:
                self._start(now, decision)
        if self.sim.open_requests > 0:
            self.sim._push(now + self.control.interval_s, self.tick)

    def _start(self, now: float, decision) -> None:
        switch = Switch(decision.instance, decision.source, decision.target, now,
                        decision.reason)
        self.switches.append(switch)
        self._in_progress = switch
        self.policy.reset()
        engine = next(e for e in self.sim.engines if e.name == decision.instance)
        engine.draining_to = decision.target
        self.sim.refresh_pools()
        self.check_drained(now, engine)

    def check_drained(self, now: float, engine) -> None:
        """Called when the draining instance may have finished its last old work."""
        if self._in_progress.drained_s is not None:
            return
        if engine.in_flight > 0 or engine.has_work() or engine.busy_until is not None:
            return
        self._in_progress.drained_s = now
        self.sim._push(now + self.control.overhead_s, self._serve, engine)

    def _serve(self, now: float, engine) -> None:
        """The instance serves its new stage: its budget, then routing, change."""
        switch = self._in_progress
        engine.roles, engine.draining_to, engine.role_since = engine.draining_to, None, now
        self.sim.set_budget(engine)
        self.sim.refresh_pools()
        switch.serving_s = now
        self._in_progress = None
