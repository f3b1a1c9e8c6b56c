"""Where a request goes: which stages it takes (a pure decision returning a StagePlan)
and which instance runs each hop (filter -> scorers -> picker, one policy per stage).

Runs inside the proxy process, on every request: no I/O, no awaits. The load numbers
it reads (in-flight hops, the engine's own running/waiting/KV use) are kept current by
state.Lease and membership.py. Each scorer gives every candidate a score in [0, 1],
higher better, relative to the others in this decision; a policy is a weighted sum of
scorers (a preset name, or weights from the deployment file), its best total first,
ties going round in turn. A new scorer is a line in SCORE here and its name in
proxy/scores.py, which holds the names, presets and formulas (config.py checks the
deployment file against them without importing this module).

Hops are named by what the instance does for the request: "E" (encode), "P" (prefill
whose KV is handed to decode), "D" (decode with that KV) and "PD" (an instance that
prefills and decodes the request itself). When every instance of one end of the KV
hand-off is down, the plan's final hop is the other end alone ("D" or "P"), which then
runs the request whole (`with_stand_in`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence

import xxhash

from epd_serve.proxy.scores import AFFINITY, KEYLESS, by_rank, describe, relative, resolve
from epd_serve.proxy.state import HOPS, InstanceState, Roster, serves


# -- which stages -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The hops one request takes, in order."""

    encode: tuple[int, ...] = ()  # indices of the images an encoder computes
    stored: tuple[int, ...] = ()  # images whose features the MM Store already holds
    pixels_to_prefill: bool = False  # prefill gets the pixels (no encoder hop for them)
    # "P+D": prefill, KV hand-off, decode; otherwise the one hop that runs the request
    # whole: "PD" (a merged instance), or "D" / "P" standing in for a missing P / D.
    final: str = "PD"
    stand_ins: tuple[tuple[str, str], ...] = ()  # (missing stage, the stage doing its work)

    @property
    def hops(self) -> tuple[str, ...]:
        head = ("E",) if self.encode else ()
        return head + (("P", "D") if self.final == "P+D" else (self.final,))


def plan_stages(images: int, stored: Sequence[bool], other_media: bool, roster: Roster,
                down: frozenset[str] = frozenset(), stand_in: bool = False) -> StagePlan:
    """The stages of a request with `images` items the encoders compute (images and
    chunks of videos; `stored[i]`: the MM Store holds item i) and `other_media` (audio,
    which encoders take whole), given the hops of the roster that have no healthy
    instance now (`down`).

    Text goes P -> D. Images and videos go E -> P -> D when the deployment has
    encoders, skipping E for the items the store holds; without encoders (EP-D, TP1)
    prefill encodes.
    With `stand_in`, a hand-off missing one end runs whole on the other (`with_stand_in`).
    """
    final = "P+D" if roster.split else "PD"
    if not roster.encoders or not (images or other_media):
        plan = StagePlan(final=final, pixels_to_prefill=bool(images or other_media))
    elif other_media:  # encoders take the whole request; prefill gets it with pixels
        plan = StagePlan(encode=tuple(range(images)), final=final, pixels_to_prefill=True)
    else:
        plan = StagePlan(encode=tuple(i for i in range(images) if not stored[i]),
                         stored=tuple(i for i in range(images) if stored[i]), final=final)
    return with_stand_in(plan, down) if stand_in else plan


def with_stand_in(plan: StagePlan, down: frozenset[str]) -> StagePlan:
    """`plan` with a KV hand-off that lost one end run whole by the other: prefill and
    decode instances are both full engines. Every P down: a decode instance computes
    the prompt itself (as when a KV transfer fails); every D down: a prefill instance
    decodes. Any other plan (or both ends down) is returned as it is."""
    if plan.final != "P+D":
        return plan
    if "P" in down and "D" not in down:
        return dataclasses.replace(plan, final="D", stand_ins=(("P", "D"),))
    if "D" in down and "P" not in down:
        return dataclasses.replace(plan, final="P", stand_ins=(("D", "P"),))
    return plan


def computing_hop(plan: StagePlan) -> str:
    """The hop that computes the prompt, and so encodes images when no encoder does."""
    return "P" if plan.final == "P+D" else plan.final


# -- which instance: filter ---------------------------------------------------------
def eligible(instances: Iterable[InstanceState], hop: str,
             exclude: Iterable[InstanceState] = ()) -> list[InstanceState]:
    excluded = set(map(id, exclude))
    return [i for i in instances
            if serves(i, hop) and i.healthy and not i.draining and i.switching_to is None
            and id(i) not in excluded]


def down_hops(instances: Sequence[InstanceState], roster: Roster) -> frozenset[str]:
    """The roster's hops that no healthy instance serves right now."""
    return frozenset(hop for hop in roster.hops if not eligible(instances, hop))


# -- which instance: scorers (each in [0, 1] over the pool, higher is better) ------
@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about the hop: its size and, for images, its content."""

    cost: float = 1.0  # prompt tokens (estimated), or image pixels for an encoder
    key: str | None = None  # content key of the image(s) for hash affinity


def load(inst: InstanceState) -> float:
    """Requests on the instance: what we sent it, or what the engine says it holds if
    more (other proxies, or requests we already gave up on), with KV use breaking ties
    (a nearly full KV cache is about to queue)."""
    engine_queue = inst.engine_queue()
    queued = inst.in_flight if engine_queue is None else max(inst.in_flight, engine_queue)
    return queued + inst.engine_kv_usage()


def weighted_load(inst: InstanceState) -> float:
    """The size of the work in flight on the instance; requests the engine reports
    beyond ours count at the mean size of ours."""
    engine_queue = inst.engine_queue()
    cost = inst.in_flight_cost
    if engine_queue is not None and engine_queue > inst.in_flight:
        mean = cost / inst.in_flight if inst.in_flight else 1.0
        cost += (engine_queue - inst.in_flight) * mean
    return cost


def rendezvous(inst: InstanceState, key: str) -> int:
    """Rendezvous hashing: each key ranks every instance the same way on every proxy,
    and removing an instance moves only the keys it held."""
    return xxhash.xxh3_64_intdigest(f"{key}\0{inst.name}".encode())


Scorer = Callable[[Sequence[InstanceState], RouteRequest], list[float]]

# By name, as proxy/scores.py lists them (the formulas are explained there).
SCORE: dict[str, Scorer] = {
    "least-loaded": lambda pool, req: relative([load(i) for i in pool], 1.0),
    "size-weighted": lambda pool, req: relative([weighted_load(i) for i in pool], req.cost),
    "hash-affinity": lambda pool, req: (
        [0.0] * len(pool) if req.key is None  # nothing to be affine to: neutral
        else by_rank([rendezvous(i, req.key) for i in pool])),
    "round-robin": lambda pool, req: [1.0] * len(pool),
}


# -- which instance: policy (weighted scorers) and picker ---------------------------
@dataclasses.dataclass(frozen=True)
class Policy:
    name: str  # the preset, or the weights as the deployment file writes them
    weights: Mapping[str, float]  # the scorers that count (weight > 0)
    keyless: Mapping[str, float]  # those that count for a request without an image key
    two_choices: bool = False  # pick the better of two at random, then the rest

    @classmethod
    def of(cls, spec: str | Mapping[str, float]) -> "Policy":
        """A preset name or `{scorer: weight}` (config.py has checked it). The weights
        are settled here, once, not on every request."""
        preset = resolve(spec)
        name = spec if isinstance(spec, str) else describe(preset.weights)
        weights = {scorer: w for scorer, w in preset.weights.items() if w > 0}
        # Affinity alone and no key: least-loaded decides, not the rotation (as before).
        keyless = {scorer: w for scorer, w in weights.items() if scorer != AFFINITY} or KEYLESS
        return cls(name, weights, keyless, preset.two_choices)

    @property
    def affinity(self) -> bool:
        """Whether the image key weighs in (the encoder stage then keeps a request's
        images on their own encoders instead of spreading them)."""
        return AFFINITY in self.weights

    def totals(self, pool: Sequence[InstanceState], req: RouteRequest) -> list[float]:
        """Each instance's weighted sum of scores."""
        totals = [0.0] * len(pool)
        for name, weight in (self.keyless if req.key is None else self.weights).items():
            for k, score in enumerate(SCORE[name](pool, req)):
                totals[k] += weight * score
        return totals

    def rank(self, pool: list[InstanceState], req: RouteRequest, turn: int,
             rng: random.Random) -> list[InstanceState]:
        """`pool` best first; the rest follow so a failed hop can go on to the next."""
        n = len(pool)
        if n <= 1:
            return pool
        # Rotating the pool before a stable sort spreads ties evenly.
        start = turn % n
        rotated = pool[start:] + pool[:start]
        totals = self.totals(rotated, req)
        order = sorted(range(n), key=lambda k: -totals[k])
        if self.two_choices:
            a, b = rng.sample(range(n), 2)
            first = a if totals[a] >= totals[b] else b
            order.remove(first)
            order.insert(0, first)
        return [rotated[k] for k in order]


class Router:
    """Picks instances for hops from the live table, with one policy per hop."""

    def __init__(self, instances: Callable[[], Iterable[InstanceState]],
                 policies: Mapping[str, str | Mapping[str, float]], seed: int | None = None):
        self._instances = instances
        self.policies = {hop: Policy.of(spec) for hop, spec in policies.items()}
        self._turns = {hop: itertools.count() for hop in HOPS}
        self._rng = random.Random(seed)

    def policy(self, hop: str) -> Policy:
        # A merged instance decodes: it follows the decode policy.
        return self.policies["D" if hop == "PD" else hop]

    def choose(self, hop: str, req: RouteRequest = RouteRequest(),
               exclude: Iterable[InstanceState] = ()) -> list[InstanceState]:
        """Healthy instances for `hop`, best first; empty if none."""
        pool = eligible(self._instances(), hop, exclude)
        return self.policy(hop).rank(pool, req, next(self._turns[hop]), self._rng)
