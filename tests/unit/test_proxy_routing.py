"""Routing as pure functions: the stages a request takes, and each policy's choice
(filter -> scorer -> picker) over a hand-built status table."""

from __future__ import annotations

import collections
import time

import pytest

from epd_serve.proxy.config import InstanceEntry, RoutingSettings
from epd_serve.proxy.routing import (
    Roster,
    RouteRequest,
    Router,
    StagePlan,
    eligible,
    plan_stages,
)
from epd_serve.proxy.state import EngineLoad, InstanceState, InstanceTable


def table(*specs: str) -> InstanceTable:
    """'e0:E' 'p1:P' ... every instance healthy."""
    t = InstanceTable([InstanceEntry(name=s.split(":")[0], roles=s.split(":")[1],
                                     url=f"http://{s.split(':')[0]}") for s in specs])
    for inst in t.instances:
        inst.healthy = True
    return t


def router(t: InstanceTable, **policies) -> Router:
    return Router(lambda: t.instances, {"E": "hash-affinity", "P": "least-loaded",
                                        "D": "least-loaded", **policies}, seed=1)


def names(insts: list[InstanceState]) -> list[str]:
    return [i.name for i in insts]


# -- the stage decision ----------------------------------------------------------------
EPD = Roster(encoders=True, split=True, merged=False)
E_PD = Roster(encoders=True, split=False, merged=True)
EP_D = Roster(encoders=False, split=True, merged=False)
TP1 = Roster(encoders=False, split=False, merged=True)


@pytest.mark.parametrize("images, stored, other, roster, plan", [
    (0, [], False, EPD, StagePlan(final="P+D")),  # text: P -> D
    (2, [False, False], False, EPD, StagePlan(encode=(0, 1), final="P+D")),
    (2, [True, False], False, EPD, StagePlan(encode=(1,), stored=(0,), final="P+D")),
    (2, [True, True], False, EPD, StagePlan(stored=(0, 1), final="P+D")),  # E skipped
    (1, [False], False, E_PD, StagePlan(encode=(0,), final="PD")),
    (1, [False], False, EP_D, StagePlan(final="P+D", pixels_to_prefill=True)),  # EP encodes
    (1, [False], False, TP1, StagePlan(final="PD", pixels_to_prefill=True)),
    (0, [], True, EPD, StagePlan(final="P+D", pixels_to_prefill=True)),  # video: E whole
    (0, [], False, TP1, StagePlan(final="PD")),
])
def test_plan_stages(images, stored, other, roster, plan):
    assert plan_stages(images, stored, other, roster) == plan


def test_hops_of_plans():
    assert StagePlan(encode=(0,), final="P+D").hops == ("E", "P", "D")
    assert StagePlan(stored=(0,), final="P+D").hops == ("P", "D")
    assert StagePlan(final="PD").hops == ("PD",)


def test_roster_reads_roles_as_sets_not_substrings():
    assert Roster.of(table("e0:E", "p1:P", "d2:D").instances) == EPD
    assert Roster.of(table("e0:E", "pd1:PD").instances) == E_PD
    assert Roster.of(table("ep0:EP", "d1:D").instances) == EP_D
    assert Roster.of(table("epd0:EPD").instances) == TP1


# -- filter --------------------------------------------------------------------------------
def test_filter_keeps_healthy_undrained_instances_of_the_hop():
    t = table("e0:E", "ep1:EP", "p2:P", "p3:P", "pd4:PD", "d5:D")
    t.get("p3").healthy = False
    assert names(eligible(t.instances, "E")) == ["e0"]  # EP encodes only its own requests
    assert names(eligible(t.instances, "P")) == ["ep1", "p2"]
    assert names(eligible(t.instances, "PD")) == ["pd4"]
    assert names(eligible(t.instances, "D")) == ["d5"]
    t.remove("p2")
    assert names(eligible(t.instances, "P")) == ["ep1"]
    assert names(eligible(t.instances, "P", exclude=[t.get("ep1")])) == []


# -- policies ------------------------------------------------------------------------------
def test_round_robin_cycles_and_lists_the_others_for_failover():
    t = table("p0:P", "p1:P", "p2:P")
    r = router(t, P="round-robin")
    firsts = [names(r.choose("P"))[0] for _ in range(6)]
    assert firsts == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert sorted(names(r.choose("P"))) == ["p0", "p1", "p2"]


def test_least_loaded_counts_in_flight_hops_and_the_engines_own_queue():
    t = table("d0:D", "d1:D", "d2:D")
    r = router(t)
    leases = [t.get("d0").lease("D"), t.get("d0").lease("D"), t.get("d1").lease("D")]
    assert names(r.choose("D")) == ["d2", "d1", "d0"]
    # The engine reports work we did not send (another proxy): it counts.
    t.get("d2").engine = EngineLoad(running=4, waiting=3, kv_cache_usage=0.5,
                                    read_at=time.monotonic())
    assert names(r.choose("D"))[0] == "d1"
    # Numbers the engine stopped reporting expire.
    t.get("d2").engine.read_at -= 60
    assert names(r.choose("D"))[0] == "d2"
    for lease in leases:
        lease.close()
    assert [i.in_flight for i in t.instances] == [0, 0, 0]


def test_least_loaded_breaks_ties_in_turn():
    t = table("d0:D", "d1:D")
    r = router(t)
    assert [names(r.choose("D"))[0] for _ in range(4)] == ["d0", "d1", "d0", "d1"]


def test_size_weighted_prefers_fewer_large_requests_over_many_small():
    t = table("e0:E", "e1:E")
    r = router(t, E="size-weighted")
    big = t.get("e0").lease("E", cost=4096 * 4096)
    small = [t.get("e1").lease("E", cost=64 * 64) for _ in range(3)]
    assert names(r.choose("E", RouteRequest(cost=1000)))[0] == "e1"
    assert names(router(t, E="least-loaded").choose("E", RouteRequest(cost=1000)))[0] == "e0"
    big.close()
    for lease in small:
        lease.close()


def test_power_of_two_never_picks_the_most_loaded_of_three():
    t = table("d0:D", "d1:D", "d2:D")
    for _ in range(5):
        t.get("d2").lease("D")
    t.get("d1").lease("D")
    r = router(t, D="power-of-two")
    firsts = collections.Counter(names(r.choose("D"))[0] for _ in range(300))
    assert firsts["d2"] == 0
    assert firsts["d0"] > firsts["d1"] > 0  # d1 wins only against d2


def test_hash_affinity_is_stable_spreads_and_moves_only_the_removed_encoders_keys():
    t = table("e0:E", "e1:E", "e2:E")
    r = router(t)
    keys = [f"image-{i}" for i in range(300)]
    before = {k: names(r.choose("E", RouteRequest(key=k)))[0] for k in keys}
    assert before == {k: names(r.choose("E", RouteRequest(key=k)))[0] for k in keys}
    share = collections.Counter(before.values())
    assert all(60 < share[e] < 140 for e in ("e0", "e1", "e2")), share
    t.get("e1").healthy = False
    after = {k: names(r.choose("E", RouteRequest(key=k)))[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "e1"}


def test_hash_affinity_without_a_key_falls_back_to_least_loaded():
    t = table("e0:E", "e1:E")
    t.get("e0").lease("E")
    assert names(router(t).choose("E"))[0] == "e1"


def test_merged_instances_follow_the_decode_policy():
    t = table("pd0:PD", "pd1:PD")
    r = router(t, D="round-robin")
    assert r.policy("PD").name == "round-robin"


def test_hash_affinity_is_refused_for_prefill_and_decode():
    with pytest.raises(ValueError, match="only applies to encoders"):
        RoutingSettings(P="hash-affinity")
