"""The proxy's live status table: every instance, its health, its load, and which hops
its roles serve (the Roster routing decides stages from).

Runs inside the proxy process; pure data, no I/O (probing lives in membership.py).
An instance's load counters have one writer: the `Lease` taken around each hop sent to
it (upstream.py), so in-flight counts cannot drift when a hop fails half-way.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable

from epd_serve.proxy.config import InstanceEntry

# Engine numbers older than this are not trusted for routing (the engine stopped
# answering /metrics); the proxy's own in-flight count still is.
ENGINE_LOAD_TTL_S = 5.0


@dataclasses.dataclass
class EngineLoad:
    """What the engine itself reports on its /metrics."""

    running: float
    waiting: float
    kv_cache_usage: float  # 0..1
    read_at: float  # time.monotonic()


@dataclasses.dataclass(eq=False)
class InstanceState:
    """One row of the status table."""

    entry: InstanceEntry
    source: str = "config"  # or "registered" (POST /instances)
    healthy: bool = False
    draining: bool = False  # removed from the roster; hops already sent finish
    probe_failures: int = 0  # consecutive failed probes
    in_flight: int = 0
    in_flight_cost: float = 0.0  # sum of the sizes of the hops in flight
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    incarnation: int = 0  # +1 each time it comes back after being down (restarted)
    engine: EngineLoad | None = None
    # Our hops on it that ended since `engine` was read: the engine counted them as
    # running or waiting then, and they are gone now.
    ended_since_read: int = 0
    # The stages it serves now: its entry's, until a role switch (roles.py) changes them.
    stages: frozenset[str] = frozenset()
    switching_to: str | None = None  # a switch is draining it: routing skips it
    # Since when (time.monotonic()) it has not answered though its process is there: a
    # hop's deadline or a probe timed out. None while it answers, or its port refuses.
    hung_since: float | None = None
    core_hung: bool = False  # /health answered, a one-token request did not (liveness.py)
    role_since: float = dataclasses.field(default_factory=time.monotonic)
    switches: int = 0

    def __post_init__(self) -> None:
        self.stages = self.stages or self.entry.stages

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def roles(self) -> str:
        """The roles it serves now, in pipeline order."""
        return "".join(s for s in "EPD" if s in self.stages)

    def engine_load(self) -> EngineLoad | None:
        if self.engine is None or time.monotonic() - self.engine.read_at > ENGINE_LOAD_TTL_S:
            return None
        return self.engine

    def read_engine(self, load: EngineLoad) -> None:
        self.engine, self.ended_since_read = load, 0

    def engine_queue(self) -> float | None:
        """Requests the engine holds by its last numbers, less ours that ended since
        they were read (else a request that just finished keeps an idle instance looking
        busy until the next read); None without trusted numbers."""
        engine = self.engine_load()
        if engine is None:
            return None
        return max(0.0, engine.running + engine.waiting - self.ended_since_read)

    def engine_kv_usage(self) -> float:
        """The engine's KV cache use by its last numbers, less the share of the requests
        counted then that have ended since: vLLM frees a finished request's blocks, so a
        read taken while our hop ran would otherwise keep the instance looking fuller
        than an idle rival (seen on vLLM 0.23: a decoder read mid-request lost every tie
        until the next read)."""
        engine = self.engine_load()
        if engine is None:
            return 0.0
        held = engine.running + engine.waiting
        if held <= 0:
            return engine.kv_cache_usage
        return engine.kv_cache_usage * self.engine_queue() / held

    def take_out(self, error: str, hung: bool = False) -> bool:
        """A connection to it was refused (nothing listens: its process is gone), or it
        hung (silent past a deadline, and /health or its engine too): it is out at once,
        as probes would decide later, until it answers a probe again. Returns True if
        it was routable until now."""
        was = self.healthy
        self.healthy = False
        self.engine = None
        self.last_error = error[:300]
        if hung and self.hung_since is None:
            self.hung_since = time.monotonic()
        return was

    def hung_for(self, now: float) -> float:
        """Seconds it has been hung (0 if it is not)."""
        return 0.0 if self.hung_since is None else now - self.hung_since

    def lease(self, hop: str, cost: float = 1.0) -> "Lease":
        return Lease(self, hop, cost)

    def to_dict(self) -> dict:
        engine = self.engine_load()
        return {
            "name": self.name,
            "roles": self.roles,
            "started_as": self.entry.roles,
            "switchable": self.entry.switchable,
            "switching_to": self.switching_to,
            "switches": self.switches,
            "url": self.entry.url,
            "source": self.source,
            "healthy": self.healthy,
            "draining": self.draining,
            "probe_failures": self.probe_failures,
            "in_flight": self.in_flight,
            "in_flight_cost": self.in_flight_cost,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
            "hung_s": round(self.hung_for(time.monotonic()), 1),
            "core_hung": self.core_hung,
            "engine": None if engine is None else {
                "running": engine.running, "waiting": engine.waiting,
                "kv_cache_usage": engine.kv_cache_usage},
        }


class Lease:
    """One hop on one instance: counted in flight from creation until `close`, which
    records how it ended. Closing twice is harmless (streams close on several paths)."""

    def __init__(self, inst: InstanceState, hop: str, cost: float):
        self.inst, self.hop, self.cost = inst, hop, cost
        self.started = time.perf_counter()
        # The request's timeline: the hop's span id, when it was sent (wall clock, ns)
        # and when the instance's answer began.
        self.span_id = ""
        self.sent_ns = time.time_ns()
        self.first_byte_ns = 0
        self.closed = False
        inst.in_flight += 1
        inst.in_flight_cost += cost

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def close(self, error: str | None = None, instance_fault: bool = True) -> bool:
        """End the hop: served if `error` is None, else a failure (counted against the
        instance only when it was the instance's fault, not the client's request).
        Returns False if it was already closed."""
        if self.closed:
            return False
        self.closed = True
        inst = self.inst
        inst.in_flight -= 1
        inst.in_flight_cost -= self.cost
        inst.ended_since_read += 1
        if error is None:
            inst.served += 1
        elif instance_fault:
            inst.failures += 1
            inst.last_error = error[:300]
        return True


# -- what the instances serve --------------------------------------------------------
HOPS = ("E", "P", "D", "PD")


def serves(inst: InstanceState, hop: str) -> bool:
    """Whether an instance's roles now cover a hop."""
    return stages_serve(inst.stages, hop)


def stages_serve(stages: frozenset[str], hop: str) -> bool:
    """Whether an instance with these roles serves a hop. One that prefills and decodes
    is a PD instance, not a hand-off end; encoders are E-only instances (an EP instance
    encodes its own requests' images as part of prefill)."""
    if hop == "E":
        return stages == {"E"}
    if hop == "P":
        return "P" in stages and "D" not in stages
    if hop == "D":
        return "D" in stages and "P" not in stages
    return {"P", "D"} <= stages


@dataclasses.dataclass(frozen=True)
class Roster:
    """What the deployment offers right now, as far as the stage decision cares."""

    encoders: bool  # encoder-only instances are configured (healthy or not)
    split: bool  # prefill-only and decode-only instances: KV is handed off
    merged: bool  # instances that prefill and decode a request themselves

    @classmethod
    def of(cls, instances: Iterable[InstanceState]) -> "Roster":
        """From the roles each instance started with and serves now: a stage a role
        switch emptied is down (its work stood in for), not gone from the deployment."""
        pools = {hop: False for hop in HOPS}
        for inst in instances:
            for hop in HOPS:
                pools[hop] = (pools[hop] or serves(inst, hop)
                              or stages_serve(inst.entry.stages, hop))
        return cls(encoders=pools["E"], split=pools["P"] and pools["D"], merged=pools["PD"])

    @property
    def hops(self) -> tuple[str, ...]:
        """The hops the deployment has (healthy or not)."""
        return tuple(hop for hop, has in (("E", self.encoders), ("P", self.split),
                                          ("D", self.split), ("PD", self.merged)) if has)


class InstanceTable:
    """Every instance by name, in the order they joined."""

    def __init__(self, entries: Iterable[InstanceEntry] = (), source: str = "config"):
        self._by_name: dict[str, InstanceState] = {}
        self._instances: list[InstanceState] = []
        self._roster: Roster | None = None
        # Stage -> requests in flight whose work for it another stage does (stood in).
        self.stood_in: collections.Counter[str] = collections.Counter()
        for entry in entries:
            self.add(entry, source)

    @property
    def instances(self) -> list[InstanceState]:
        """Every instance (read on every request: kept as a list, rebuilt on change)."""
        return self._instances

    @property
    def roster(self) -> Roster:
        """What the deployment offers, from the roles alone."""
        if self._roster is None:
            self._roster = Roster.of(self._instances)
        return self._roster

    def _changed(self) -> None:
        self._instances = list(self._by_name.values())
        self._roster = None

    def set_stages(self, inst: InstanceState, stages: frozenset[str]) -> None:
        """A role switch's last step: the instance serves `stages` from now on."""
        inst.stages = stages
        inst.role_since = time.monotonic()
        self._roster = None

    def get(self, name: str) -> InstanceState | None:
        return self._by_name.get(name)

    def add(self, entry: InstanceEntry, source: str = "config") -> InstanceState:
        if entry.name in self._by_name:
            raise KeyError(entry.name)
        inst = self._by_name[entry.name] = InstanceState(entry, source=source)
        self._changed()
        return inst

    def remove(self, name: str) -> InstanceState:
        inst = self._by_name.pop(name)
        self._changed()
        inst.draining = True  # hops holding it finish; routing no longer sees it
        inst.healthy = False
        return inst

    def entries(self) -> list[tuple[InstanceEntry, str]]:
        return [(i.entry, i.source) for i in self._by_name.values()]

    def to_dict(self) -> list[dict]:
        return [i.to_dict() for i in self._by_name.values()]
