"""The role controller's rule (proxy/role_policy.py), on made-up queues."""

from __future__ import annotations

import math

from epd_serve.proxy.role_policy import Member, RolePolicy, RoleRule, pressures

RULE = RoleRule(high_load=2.0, ratio=3.0, low_load=0.5, sustain_s=1.0, min_dwell_s=5.0)


def member(name, role, load, switchable=True, in_role_s=math.inf) -> Member:
    return Member(name, role, load, switchable, in_role_s)


def test_pressure_is_queued_work_per_instance_of_each_stage():
    assert pressures([member("e0", "E", 1), member("e1", "E", 0), member("d0", "D", 6)]) \
        == {"E": 0.5, "D": 6.0}


def test_a_backed_up_stage_takes_the_idlest_switchable_instance_of_a_cool_one_once_sustained():
    policy = RolePolicy(RULE)
    members = [member("e0", "E", 1), member("e1", "E", 0), member("p0", "P", 1, False),
               member("d0", "D", 6, False)]
    assert policy.observe(members, now=0.0) is None  # not sustained yet
    assert policy.observe(members, now=0.5) is None
    decision = policy.observe(members, now=1.0)
    assert (decision.instance, decision.source, decision.target) == ("e1", "E", "D")
    assert "D queue 6.0 per instance" in decision.reason


def test_a_burst_that_ends_before_sustain_s_moves_nothing():
    policy = RolePolicy(RULE)
    hot = [member("e0", "E", 0), member("e1", "E", 0), member("d0", "D", 6)]
    calm = [member("e0", "E", 0), member("e1", "E", 0), member("d0", "D", 1)]
    assert policy.observe(hot, 0.0) is None
    assert policy.observe(calm, 0.6) is None
    assert policy.observe(hot, 1.2) is None  # the clock started again


def test_no_switch_when_the_stages_are_balanced_or_not_under_pressure():
    policy = RolePolicy(RULE)
    balanced = [member("e0", "E", 3), member("e1", "E", 3), member("d0", "D", 6)]
    light = [member("e0", "E", 0), member("e1", "E", 0), member("d0", "D", 1.5)]
    for now in (0.0, 2.0, 4.0):
        assert policy.observe(balanced, now) is None
        assert policy.observe(light, now + 1) is None


def test_an_instance_keeps_its_role_min_dwell_s_and_fixed_instances_never_move():
    policy = RolePolicy(RULE)
    members = [member("e0", "E", 0, in_role_s=2.0), member("e1", "E", 0, switchable=False),
               member("d0", "D", 6)]
    assert policy.observe(members, 0.0) is None
    assert policy.observe(members, 5.0) is None


def test_prefill_and_decode_are_never_emptied_but_an_idle_encoder_stage_may_be():
    policy = RolePolicy(RULE)
    only_p = [member("p0", "P", 0), member("d0", "D", 6)]
    assert policy.observe(only_p, 0.0) is None and policy.observe(only_p, 9.0) is None
    busy_e = [member("e0", "E", 1.0), member("d0", "D", 6)]
    assert policy.observe(busy_e, 0.0) is None and policy.observe(busy_e, 9.0) is None
    idle_e = [member("e0", "E", 0.2), member("d0", "D", 6)]
    policy.observe(idle_e, 0.0)
    decision = policy.observe(idle_e, 1.0)
    assert (decision.instance, decision.target) == ("e0", "D")


def test_reset_makes_the_next_switch_wait_its_own_sustain_s():
    policy = RolePolicy(RULE)
    members = [member("e0", "E", 0), member("e1", "E", 0), member("d0", "D", 6)]
    policy.observe(members, 0.0)
    assert policy.observe(members, 1.0) is not None
    policy.reset()
    assert policy.observe(members, 1.1) is None


def test_an_emptied_encoder_stage_weighs_the_work_prefill_does_for_it_and_gets_one_back():
    policy = RolePolicy(RULE)
    members = [member("p0", "P", 1, False), member("d0", "D", 0), member("d1", "D", 0.2)]
    assert pressures(members, {"E": 5}) == {"P": 1.0, "D": 0.1, "E": 5.0}
    policy.observe(members, 0.0, vacant={"E": 5})
    decision = policy.observe(members, 1.0, vacant={"E": 5})
    assert (decision.instance, decision.source, decision.target) == ("d0", "D", "E")
    # A vacant stage gives nothing up, and nothing is asked of it when idle.
    assert RolePolicy(RULE).observe(members, 0.0, vacant={"E": 0}) is None


def test_one_key_turns_the_controller_on_with_the_rules_defaults():
    from epd_serve.proxy.config import ProxySettings

    settings = ProxySettings.model_validate({"role_control": True})
    assert settings.role_control.enabled
    assert RoleRule.of(settings.role_control) == RoleRule()  # the rule's own defaults
    assert not ProxySettings().role_control.enabled  # off unless asked
