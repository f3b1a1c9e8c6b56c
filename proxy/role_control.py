"""The role controller: every `interval_s`, the stages' queues as the proxy sees them,
the rule's decision (role_policy.py), and the switch carried out (roles.py).

Runs in the proxy process as one background task, when the deployment turns it on
(`proxy.role_control: true`). Coverage comes first: prefill or decode left with no
healthy instance (they crashed) is given an idle switchable instance from a stage that
keeps one, at once, whatever else is under way. Then the load rule (role_policy.py), one move per stage at a time: while a switch
drains, a decision that would touch its stages waits (the queues it leaves behind are
not yet the ones to judge), others do not. Each decision is logged with its reason and
kept for /roles.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time

from epd_serve.proxy.config import RoleControl
from epd_serve.proxy.role_policy import (
    STAGES,
    VACATABLE,
    Decision,
    Member,
    RolePolicy,
    RoleRule,
)
from epd_serve.proxy.roles import RoleSwitcher, SwitchRefused
from epd_serve.proxy.routing import down_hops, load
from epd_serve.proxy.state import InstanceState, InstanceTable

log = logging.getLogger("epd_serve.proxy.role_control")

KEPT_DECISIONS = 200


def member_of(inst: InstanceState, now: float) -> Member:
    """How the rule sees an instance: its stage, its queue, whether it may move and
    how long it has held its role (forever, if it never switched)."""
    in_role = now - inst.role_since if inst.switches else math.inf
    return Member(inst.name, inst.roles, load(inst), inst.entry.switchable, in_role)


def members_of(table: InstanceTable, now: float, decode_starts_with_prefill: bool) -> list[Member]:
    """The routable single-stage instances (a merged PD instance is no stage's).

    With `decode_starts_with_prefill` (the epd hand-off sends decode its hop when
    prefill starts), each request prefilling also has a decode hop in flight, waiting:
    that is prefill's queue, not decode's, so decode's loads are scaled down to the
    hops beyond prefill's (else decode always looks at least as busy as prefill)."""
    members = [member_of(i, now) for i in table.instances
               if i.healthy and not i.draining and i.switching_to is None and i.roles in STAGES]
    if not decode_starts_with_prefill:
        return members
    prefilling = sum(m.load for m in members if m.role == "P")
    decoding = sum(m.load for m in members if m.role == "D")
    share = max(0.0, decoding - prefilling) / decoding if decoding else 1.0
    return [dataclasses.replace(m, load=m.load * share) if m.role == "D" else m
            for m in members]


class RoleController:
    def __init__(self, table: InstanceTable, switcher: RoleSwitcher, settings: RoleControl,
                 decode_starts_with_prefill: bool = False):
        self.table = table
        self.switcher = switcher
        self.settings = settings
        self.decode_starts_with_prefill = decode_starts_with_prefill
        self.enabled = settings.enabled  # turned on and off at run time: POST /roles/controller
        self.policy = RolePolicy(RoleRule.of(settings))
        self.decisions: collections.deque[dict] = collections.deque(maxlen=KEPT_DECISIONS)

    async def run(self) -> None:
        """Decide every interval, for good: an unforeseen error in one round is logged
        and the next round runs (a controller that died would leave roles frozen)."""
        while True:
            try:
                await self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - logged; the loop must outlive one bad round
                log.exception("role controller round failed")
            await asyncio.sleep(self.settings.interval_s)

    async def step(self, now: float) -> Decision | None:
        """One round: the switch started, if any."""
        if not self.enabled:
            self.policy.reset()
            return None
        members = members_of(self.table, now, self.decode_starts_with_prefill)
        decision = self._refill(members)
        if decision is None:
            decision = self._by_load(members, now)
        if decision is None:
            return None
        self.policy.reset()
        return self._carry_out(decision)

    def _refill(self, members: list[Member]) -> Decision | None:
        """Prefill or decode lost (no healthy instance, each of its instances up before:
        `_lost`), none being switched to it: the idlest switchable instance of a stage
        that keeps another (or of E, which prefill covers) moves there now. (An empty E
        is the load rule's: it comes back when prefill's encoding for it is work
        enough.)"""
        arriving = {s.target for s in self.switcher.active.values()}
        empty = [stage for stage in ("P", "D")
                 if stage in down_hops(self.table.instances, self.table.roster)
                 and stage not in arriving and self._lost(stage)]
        if not empty:
            return None
        serving = collections.Counter(m.role for m in members)
        donors = [m for m in members if m.switchable and m.role not in empty
                  and (serving[m.role] > 1 or m.role in VACATABLE)]
        if not donors:
            return None
        # From a stage that keeps an instance first, else an encoder (prefill encodes).
        chosen = min(donors, key=lambda m: (serving[m.role] == 1, m.load, m.name))
        return Decision(chosen.name, chosen.role, empty[0],
                        f"{empty[0]} has no healthy instance: refilled from {chosen.role}")

    def _lost(self, stage: str) -> bool:
        """Whether `stage` was emptied by failures: each instance that serves it has
        been healthy before. One that has not is still starting (a deployment coming
        up): moving an idle instance there would empty the stage it came from."""
        serving = [inst for inst in self.table.instances if stage in inst.stages]
        return bool(serving) and all(inst.incarnation > 0 for inst in serving)

    def _by_load(self, members: list[Member], now: float) -> Decision | None:
        """The load rule's decision, unless it would touch a stage a switch is moving
        an instance out of or into (its queues are not yet the ones to judge)."""
        busy = {stage for s in self.switcher.active.values() for stage in (s.source, s.target)}
        serving = {m.role for m in members} | {s.target for s in self.switcher.active.values()}
        # A stage a switch emptied weighs what its stand-in does for it.
        vacant = {stage: float(self.table.stood_in[stage]) for stage in sorted(VACATABLE)
                  if stage in self.table.roster.hops and stage not in serving}
        decision = self.policy.observe(members, now, vacant)
        if decision is not None and {decision.source, decision.target} & busy:
            return None
        return decision

    def _carry_out(self, decision: Decision) -> Decision:
        record = {"at": time.time(), "instance": decision.instance, "source": decision.source,
                  "target": decision.target, "reason": decision.reason}
        try:
            self.switcher.start(decision.instance, decision.target, reason=decision.reason)
            record["started"] = True
            log.info("role controller: switch %s %s -> %s: %s", decision.instance,
                     decision.source, decision.target, decision.reason)
        except SwitchRefused as err:
            record.update(started=False, refused=err.message)
            log.warning("role controller: switch %s %s -> %s refused: %s", decision.instance,
                        decision.source, decision.target, err.message)
        self.decisions.append(record)
        return decision
