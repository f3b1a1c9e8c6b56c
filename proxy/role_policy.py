"""When an instance should change role: the role controller's decision, as a pure rule.

Used by the proxy's controller (role_control.py) on the live table and by the planner's
simulator (planner/simulator.py) on simulated instances, so what the simulator predicts
switching would buy is what this rule would do. No I/O, no clock: the caller passes
`now`.

The rule, after paper 003 §3.2.4 ("monitors the system's queuing statistics across all
stages and reallocates workers to stages experiencing higher demand"):
- a stage's pressure is the work queued on it per instance serving it (hops in flight,
  or what the engine says it holds if more: routing.load); a stage a switch emptied
  (E) has as pressure the work its stand-in does for it (requests whose images prefill
  is encoding), as if it had one instance, and comes first when that reaches
  `high_load`, so it is given an instance back;
- the hottest stage, at `high_load` or more, takes an instance from the coolest stage
  whose pressure is at most 1/`ratio` of it, when that stage can spare one: it keeps an
  instance, or (E only) the degraded path covers it (prefill encodes) and it is idle
  (`low_load` or less); the donor's switchable instance with the least work (it drains
  first) that has held its role `min_dwell_s` goes;
- the same (from, to) pressure must hold `sustain_s` before it is acted on (hysteresis:
  a burst does not move an instance, and the ratio keeps the reverse switch from
  following at once).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

STAGES = ("E", "P", "D")
# A stage the degraded path covers when it has no instance: prefill encodes the images.
# Prefill and decode are never emptied by the controller (their stand-ins run requests
# whole, a failure mode, not a plan).
VACATABLE = frozenset({"E"})


@dataclasses.dataclass(frozen=True)
class RoleRule:
    """The rule's thresholds (the deployment's `proxy.role_control`, less its switches)."""

    high_load: float = 2.0  # a stage is under pressure at this much queued work per instance
    ratio: float = 3.0  # ... and this many times the donor's
    low_load: float = 0.5  # a stage may be left empty only this idle (E: prefill encodes)
    sustain_s: float = 3.0  # the pressure must hold this long before a switch
    min_dwell_s: float = 10.0  # an instance stays in a role at least this long

    @classmethod
    def of(cls, settings) -> "RoleRule":
        """The rule from an object with the same field names (proxy/config.RoleControl)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Member:
    """One routable instance as the rule sees it."""

    name: str
    role: str  # the stage it serves now: E, P or D
    load: float  # work queued on it
    switchable: bool
    in_role_s: float = math.inf  # time since it last switched (inf: never)


@dataclasses.dataclass(frozen=True)
class Decision:
    instance: str
    source: str
    target: str
    reason: str


def pressures(members: Iterable[Member],
              vacant: Mapping[str, float] | None = None) -> dict[str, float]:
    """Stage -> queued work per instance serving it, for stages with an instance, and
    for each stage in `vacant` (no instance; its work stood in for) that work."""
    load: dict[str, float] = {}
    count: dict[str, int] = {}
    for m in members:
        load[m.role] = load.get(m.role, 0.0) + m.load
        count[m.role] = count.get(m.role, 0) + 1
    found = {stage: load[stage] / count[stage] for stage in load}
    for stage, work in (vacant or {}).items():
        found.setdefault(stage, work)
    return found


class RolePolicy:
    """The rule with its memory: since when each (from, to) pressure has held."""

    def __init__(self, rule: RoleRule, vacatable: frozenset[str] = VACATABLE):
        self.rule = rule
        self.vacatable = vacatable
        self._held_since: dict[tuple[str, str], float] = {}

    def observe(self, members: list[Member], now: float,
                vacant: Mapping[str, float] | None = None) -> Decision | None:
        """The switch to make now, if any. `vacant`: stages with no instance -> the work
        their stand-ins do for them. Call it at a steady interval; call `reset` after
        acting, so the next switch waits out its own `sustain_s`."""
        candidate = self._candidate(members, vacant)
        if candidate is None:
            self._held_since.clear()
            return None
        key = (candidate.source, candidate.target)
        self._held_since = {key: self._held_since.get(key, now)}
        if now - self._held_since[key] < self.rule.sustain_s:
            return None
        return candidate

    def reset(self) -> None:
        self._held_since.clear()

    def _candidate(self, members: list[Member],
                   vacant: Mapping[str, float] | None) -> Decision | None:
        rule = self.rule
        stage_load = pressures((m for m in members if m.role in STAGES), vacant)
        if not stage_load:
            return None
        # An emptied stage under pressure comes first: its stand-in (prefill encoding
        # images) is busier by that work, so giving it back its instance relieves both.
        hot = next((s for s in sorted(vacant or {}) if stage_load[s] >= rule.high_load),
                   max(stage_load, key=stage_load.__getitem__))
        if stage_load[hot] < rule.high_load:
            return None
        serving = _by_stage(members)
        for donor in sorted(stage_load, key=stage_load.__getitem__):
            if donor == hot or not serving[donor] \
                    or stage_load[donor] * rule.ratio > stage_load[hot]:
                continue
            if len(serving[donor]) == 1 and not (donor in self.vacatable
                                                 and stage_load[donor] <= rule.low_load):
                continue
            movable = [m for m in serving[donor]
                       if m.switchable and m.in_role_s >= rule.min_dwell_s]
            if not movable:
                continue
            chosen = min(movable, key=lambda m: (m.load, m.name))
            return Decision(chosen.name, donor, hot, _reason(hot, donor, stage_load, rule))
        return None


def _by_stage(members: Iterable[Member]) -> Mapping[str, list[Member]]:
    serving: dict[str, list[Member]] = {stage: [] for stage in STAGES}
    for m in members:
        if m.role in serving:
            serving[m.role].append(m)
    return serving


def _reason(hot: str, donor: str, stage_load: Mapping[str, float], rule: RoleRule) -> str:
    return (f"{hot} queue {stage_load[hot]:.1f} per instance (>= {rule.high_load:g}) vs "
            f"{donor} {stage_load[donor]:.1f} (<= 1/{rule.ratio:g} of it) for "
            f"{rule.sustain_s:g} s")
