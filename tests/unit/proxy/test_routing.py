"""Routing as pure functions: the stages a request takes, and each policy's choice
(filter -> scorers -> picker) over a hand-built status table: every scorer in [0, 1]
and higher-is-better, the presets ranking as the one-scorer policies did before
scores combined, and weighted policies trading affinity against load."""

from __future__ import annotations

import collections
import random
import time

import pytest
import xxhash

from epd_serve.proxy.config import InstanceEntry, RoutingSettings
from epd_serve.proxy.routing import (
    SCORE,
    Roster,
    Router,
    RouteRequest,
    StagePlan,
    eligible,
    load,
    plan_stages,
    weighted_load,
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


def test_an_engines_count_read_before_our_hop_ended_does_not_keep_it_looking_busy():
    # d0 was read while serving our hop; the hop has ended since: d0 is idle again and
    # takes its turn, while a queue the engine reports beyond ours still counts.
    t = table("d0:D", "d1:D")
    r = router(t)
    lease = t.get("d0").lease("D")
    t.get("d0").read_engine(EngineLoad(running=0, waiting=1, kv_cache_usage=0.0002,
                                       read_at=time.monotonic()))
    assert names(r.choose("D"))[0] == "d1"
    lease.close()
    # Neither its count nor the KV blocks that hop held keep it out of its turn.
    assert sorted(names(r.choose("D"))[0] for _ in range(2)) == ["d0", "d1"]
    t.get("d0").read_engine(EngineLoad(running=3, waiting=0, kv_cache_usage=0.0,
                                       read_at=time.monotonic()))
    t.get("d0").lease("D").close()
    assert [names(r.choose("D"))[0] for _ in range(2)] == ["d1", "d1"]  # 2 still queued


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


# -- scorers: each in [0, 1] over the pool, higher is better -------------------------------
def busy(t: InstanceTable, name: str, hops: int, cost: float = 1.0) -> None:
    for _ in range(hops):
        t.get(name).lease("E", cost)  # never closed: the table is thrown away


def rendezvous_order(pool: list[InstanceState], key: str) -> list[str]:
    """The encoders a key prefers, first to last: the highest hash of key and name."""
    return sorted(names(pool), key=lambda n: -xxhash.xxh3_64_intdigest(f"{key}\0{n}".encode()))


def test_every_scorer_is_in_0_1_and_higher_for_the_better_instance():
    t = table("e0:E", "e1:E", "e2:E", "e3:E")
    busy(t, "e0", 3, cost=100)
    busy(t, "e1", 1, cost=5000)
    busy(t, "e3", 6, cost=10)
    t.get("e2").engine = EngineLoad(running=2, waiting=0, kv_cache_usage=0.5,
                                    read_at=time.monotonic())
    pool = t.instances
    req = RouteRequest(cost=50, key="image-7")
    got = {name: dict(zip(names(pool), score(pool, req))) for name, score in SCORE.items()}
    for name, scores in got.items():
        assert all(0.0 <= s <= 1.0 for s in scores.values()), (name, scores)
    # Requests: e1 1, e2 2.5 (the engine's two and half its KV), e0 3, e3 6.
    least = got["least-loaded"]
    assert least["e1"] == 1.0 and least["e1"] > least["e2"] > least["e0"] > least["e3"] > 0
    assert least["e0"] == pytest.approx((1 + 1) / (3 + 1))  # twice the work, counting this hop
    # Work by size: e2 2 (the engine's requests at size 1), e3 60, e0 300, e1 5000.
    size = got["size-weighted"]
    assert size["e2"] == 1.0 and size["e2"] > size["e3"] > size["e0"] > size["e1"] > 0
    # Affinity: the key's own encoder 1, then halving along its rendezvous order.
    assert [got["hash-affinity"][n] for n in rendezvous_order(pool, "image-7")] == [
        1.0, 0.5, 0.25, 0.125]
    assert set(got["round-robin"].values()) == {1.0}


def test_scorers_are_neutral_without_a_key_or_any_load():
    t = table("e0:E", "e1:E", "e2:E")
    pool = t.instances
    assert SCORE["hash-affinity"](pool, RouteRequest()) == [0.0, 0.0, 0.0]
    assert SCORE["least-loaded"](pool, RouteRequest()) == [1.0, 1.0, 1.0]  # an idle pool
    assert SCORE["size-weighted"](pool, RouteRequest(cost=0.0)) == [1.0, 1.0, 1.0]


# -- presets rank as the one-scorer policies did -------------------------------------------
def old_rank(policy: str, pool: list[InstanceState], req: RouteRequest, turn: int,
             rng: random.Random) -> list[str]:
    """The ranking before scores were normalised and combined: one raw score per
    policy, lower is better, rotated then sorted; hash affinity without a key fell
    back to least-loaded."""
    raw = {"round-robin": lambda i: 0.0, "least-loaded": load, "power-of-two": load,
           "size-weighted": weighted_load,
           "hash-affinity": lambda i: -xxhash.xxh3_64_intdigest(
               f"{req.key}\0{i.name}".encode())}
    if policy == "hash-affinity" and req.key is None:
        policy = "least-loaded"
    score = raw[policy]
    rotated = pool[turn % len(pool):] + pool[:turn % len(pool)]
    if policy == "power-of-two":
        a, b = rng.sample(range(len(pool)), 2)
        first = min((rotated[a], rotated[b]), key=score)
        return names([first, *sorted((i for i in rotated if i is not first), key=score)])
    return names(sorted(rotated, key=score))


@pytest.mark.parametrize("preset", ["round-robin", "least-loaded", "size-weighted",
                                    "power-of-two", "hash-affinity"])
def test_every_preset_ranks_exactly_as_before(preset):
    draw = random.Random(preset)
    for pool_seed in range(20):
        t = table(*(f"e{k}:E" for k in range(draw.randint(2, 5))))
        for inst in t.instances:  # small counts: ties are common, so the rotation shows
            busy(t, inst.name, draw.randint(0, 3), cost=draw.choice([1, 64, 4096]))
            if draw.random() < 0.3:
                inst.engine = EngineLoad(running=draw.randint(0, 5), waiting=0,
                                         kv_cache_usage=draw.choice([0.0, 0.5]),
                                         read_at=time.monotonic())
        r = router(t, E=preset)
        old_rng = random.Random(1)  # the router's seed: power-of-two draws the same pairs
        for turn in range(6):
            req = RouteRequest(cost=draw.choice([1, 500]),
                               key=draw.choice([None, f"image-{turn}"]))
            assert names(r.choose("E", req)) == old_rank(preset, t.instances, req, turn,
                                                         old_rng), (pool_seed, turn)


def test_presets_by_hand():
    t = table("e0:E", "e1:E", "e2:E")
    busy(t, "e0", 1, cost=4096)
    busy(t, "e2", 1)
    least = router(t, E="least-loaded")
    # e1 idle first, then e0 and e2 tied at one request: in turn.
    assert [names(least.choose("E")) for _ in range(3)] == [
        ["e1", "e0", "e2"], ["e1", "e2", "e0"], ["e1", "e2", "e0"]]
    assert names(router(t, E="size-weighted").choose("E")) == ["e1", "e2", "e0"]
    assert [names(router(t, E="round-robin").choose("E"))] == [["e0", "e1", "e2"]]
    assert names(router(t).choose("E", RouteRequest(key="k"))) == rendezvous_order(
        t.instances, "k")


# -- weighted policies -----------------------------------------------------------------------
MIXED = {"hash-affinity": 1, "least-loaded": 1}


def test_affinity_yields_to_an_overloaded_encoder_only_under_a_load_weight():
    t = table("e0:E", "e1:E", "e2:E")
    req = RouteRequest(key="image-1")
    owner, runner_up, last = rendezvous_order(t.instances, req.key)
    for inst in t.instances:
        busy(t, inst.name, 2)
    # Equal loads: the load scores tie and affinity decides.
    assert names(router(t, E=MIXED).choose("E", req))[0] == owner
    # The owner overloaded, the others idle: the idle runner-up takes the image...
    t = table("e0:E", "e1:E", "e2:E")
    busy(t, owner, 8)
    assert names(router(t, E=MIXED).choose("E", req)) == [runner_up, last, owner]
    # ...which pure affinity never does (today's behaviour), nor a load weight of half
    # the affinity's however loaded the owner.
    assert names(router(t).choose("E", req))[0] == owner
    busy(t, owner, 92)
    assert names(router(t, E={"hash-affinity": 1, "least-loaded": 0.5}).choose("E", req))[
        0] == owner


def test_a_weighted_policy_without_a_key_ranks_by_its_other_scorers():
    t = table("e0:E", "e1:E")
    busy(t, "e0", 1)
    r = router(t, E={"hash-affinity": 1, "size-weighted": 0.5})
    assert [names(r.choose("E"))[0] for _ in range(2)] == ["e1", "e1"]


def test_a_weighted_policy_is_built_from_the_deployment_file():
    settings = RoutingSettings(E={"hash-affinity": 1, "least-loaded": 0.5})
    r = Router(lambda: [], {"E": settings.E, "P": settings.P, "D": settings.D})
    assert r.policy("E").name == "{hash-affinity: 1, least-loaded: 0.5}"
    assert r.policy("E").affinity and not r.policy("P").affinity
    assert r.policy("P").name == "least-loaded"


def test_encoder_fan_out_keeps_images_on_their_own_encoders_under_weighted_affinity():
    from types import SimpleNamespace

    from epd_serve.proxy.encoding import Encoder

    t = table("e0:E", "e1:E")
    keys = [k for k in (f"image-{i}" for i in range(40))
            if rendezvous_order(t.instances, k)[0] == "e0"][:4]
    images = SimpleNamespace(keys=keys, sizes=[1.0] * 4, is_chunk=lambda index: False)

    def encoders(policy) -> set[str]:
        batches = Encoder(None, router(t, E=policy), batch=1).assign(images, [0, 1, 2, 3])
        return {order[0].name for order, _ in batches}

    assert encoders(MIXED) == {"e0"}
    assert encoders("least-loaded") == {"e0", "e1"}  # no affinity: spread over both
