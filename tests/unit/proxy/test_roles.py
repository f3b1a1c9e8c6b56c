"""Role switching in the proxy against fake instances: a switch by hand drains, flips and
is shown; refusals say why; the controller moves an instance to the stage whose queue
grows and back."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import pytest

from epd_serve.instances.payloads import chat_body

from tests.unit.proxy.harness import IMAGE, deployment
from tests.waiting import wait_for

ADMIN = {"authorization": "Bearer s3cret"}


@pytest.fixture(autouse=True)
def admin_key(monkeypatch):
    monkeypatch.setenv("EPD_ADMIN_KEY", "s3cret")


def body(*args, **kwargs) -> dict:
    return chat_body("fake", *args, **kwargs)


def roles_of(d) -> dict[str, str]:
    return {i["name"]: i["roles"] for i in d.client.get("/status").json()["instances"]}


def switch(d, name: str, role: str, wait_s: float = 10.0):
    return d.client.post(f"/instances/{name}/role", json={"role": role, "wait_s": wait_s},
                         headers=ADMIN)


@contextlib.contextmanager
def answered(d, payloads: list[dict]):
    """The requests sent at once; on leaving, every one must have been answered 200."""
    with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
        sent = [pool.submit(d.client.post, "/v1/chat/completions", json=p) for p in payloads]
        yield sent
        assert all(f.result().status_code == 200 for f in sent)


def served_by(response) -> str:
    return response.headers["x-epd-stages"]


def test_a_switch_by_hand_flips_the_role_and_routing_follows():
    with deployment(["E", "P~", "P", "D"]) as d:
        answer = switch(d, "p1", "D")
        assert answer.status_code == 200, answer.text
        done = answer.json()
        assert (done["source"], done["target"], done["outcome"]) == ("P", "D", "done")
        assert done["serving_after_ms"] >= 0
        assert roles_of(d) == {"e0": "E", "p1": "D", "p2": "P", "d3": "D"}
        d.apps["d3"].state.fail_status = 500  # only the switched instance can decode now
        for _ in range(4):
            r = d.client.post("/v1/chat/completions", json=body("hi"))
            assert r.status_code == 200, r.text
            assert "P=p2" in served_by(r) and "D=p1" in served_by(r)
            assert "SWITCHED=p1:P>D" in served_by(r)
        listed = d.client.get("/roles").json()
        assert listed["instances"]["p1"] == {"roles": "D", "started_as": "P",
                                             "switchable": True, "switching_to": None}
        assert [s["outcome"] for s in listed["switches"]] == ["done"]
        metrics = d.client.get("/metrics").text
        assert ('epd_proxy_role_switches_total{instance="p1",outcome="done",source="P",'
                'target="D"} 1.0') in metrics
        assert 'epd_proxy_instance_role{instance="p1",role="D"} 1.0' in metrics
        assert 'epd_proxy_instance_role{instance="p1",role="P"} 0.0' in metrics


def test_a_switch_waits_for_the_hops_in_flight_and_sends_no_new_work_meanwhile():
    with deployment(["P~", "P", "D"]) as d:
        d.apps["p0"].state.delay_s = 1.0
        d.apps["p1"].state.delay_s = 1.0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = [pool.submit(d.client.post, "/v1/chat/completions", json=body(f"q{i}"))
                     for i in range(2)]  # least-loaded: one on each prefill
            wait_for(lambda: d.proxy.proxy.table.get("p0").in_flight == 1, "p0 busy")
            answer = switch(d, "p0", "D", wait_s=0)
            assert answer.status_code == 202 and answer.json()["outcome"] == "draining"
            assert answer.json()["in_flight_at_decision"] == 1
            d.apps["p0"].state.delay_s = 0.0
            later = [pool.submit(d.client.post, "/v1/chat/completions", json=body(f"r{i}"))
                     for i in range(3)]
            results = [f.result() for f in first + later]
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        # Sent while it drained: none of the later prefills went to it.
        assert all("P=p1" in served_by(r) for r in results[2:])
        wait_for(lambda: roles_of(d)["p0"] == "D", "p0 serving decode")
        done = d.client.get("/roles").json()["switches"][-1]
        assert done["outcome"] == "done" and done["serving_after_ms"] >= 500


def test_switching_the_last_prefill_leaves_decode_standing_in_and_back():
    with deployment(["P~", "D"]) as d:
        assert switch(d, "p0", "D").status_code == 200
        r = d.client.post("/v1/chat/completions", json=body("hi"))
        assert r.status_code == 200 and "FALLBACK=P>D" in served_by(r)
        assert switch(d, "p0", "P").status_code == 200
        r = d.client.post("/v1/chat/completions", json=body("hi"))
        assert r.status_code == 200 and "P=p0" in served_by(r) and "FALLBACK" not in served_by(r)
        assert d.client.get("/roles").json()["instances"]["p0"]["roles"] == "P"


def test_a_switch_asked_back_while_draining_is_cancelled():
    with deployment(["P~", "P", "D"]) as d:
        d.apps["p0"].state.delay_s = 1.0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(d.client.post, "/v1/chat/completions", json=body(f"q{i}"))
                    for i in range(2)]
            wait_for(lambda: d.proxy.proxy.table.get("p0").in_flight == 1, "p0 busy")
            assert switch(d, "p0", "D", wait_s=0).status_code == 202
            back = switch(d, "p0", "P", wait_s=0)
            assert back.status_code == 200 and back.json()["outcome"] == "cancelled"
            assert all(f.result().status_code == 200 for f in held)
        assert roles_of(d)["p0"] == "P"
        r = d.client.post("/instances/p0/role", json={"role": "P"}, headers=ADMIN)
        assert r.status_code == 409 and "already serves P" in r.json()["error"]["message"]


@pytest.mark.parametrize("name, role, body_status, says", [
    ("p1", "D", 409, "not switchable"),
    ("x9", "D", 404, "no instance named"),
    ("p0", "X", 400, "role must be one of E, P, D"),
    ("d2", "P", 409, "last healthy D instance"),
])
def test_switches_that_cannot_be_made_are_refused_saying_why(name, role, body_status, says):
    with deployment(["P~", "P", "D~"], routing={"handoff_fallback": "refuse"}) as d:
        r = switch(d, name, role)
        assert r.status_code == body_status and says in r.json()["error"]["message"], r.text
        assert roles_of(d) == {"p0": "P", "p1": "P", "d2": "D"}


def test_switching_takes_the_admin_key_and_a_well_formed_body():
    with deployment(["P~", "D"]) as d:
        assert d.client.post("/instances/p0/role", json={"role": "D"}).status_code == 401
        r = d.client.post("/instances/p0/role", json={"role": "D", "x": 1}, headers=ADMIN)
        assert r.status_code == 400 and "x" in r.json()["error"]["message"]
        assert roles_of(d)["p0"] == "P"


def test_the_controller_moves_an_encoder_to_a_backed_up_decode_stage_and_back():
    control = {"enabled": True, "interval_s": 0.05, "high_load": 2.0, "ratio": 2.0,
               "sustain_s": 0.2, "min_dwell_s": 0.5}
    with deployment(["E~", "P", "D"], role_control=control) as d:
        d.apps["d2"].state.delay_s = 1.5  # long answers: decode's queue grows
        with answered(d, [body(f"q{i}") for i in range(6)]):
            wait_for(lambda: roles_of(d)["e0"] == "D", "e0 moved to decode", timeout=10)
        decision = d.client.get("/roles").json()["controller"]["decisions"][0]
        assert (decision["instance"], decision["source"], decision["target"]) == ("e0", "E", "D")
        assert "D queue" in decision["reason"] and decision["started"]
        # The shift back: decode is quick again and images arrive, which prefill (slow)
        # encodes itself while no instance is an encoder: that work is the empty E
        # stage's pressure, and an instance goes back to E (by way of P, if prefill's
        # own queue is the longer one first).
        d.apps["d2"].state.delay_s = 0.0
        d.apps["p1"].state.delay_s = 1.0

        def moves():
            return [(s["source"], s["target"]) for s in d.client.get("/roles").json()["switches"]]

        with answered(d, [body("what is this?", [IMAGE]) for _ in range(6)]):
            wait_for(lambda: "E" in roles_of(d).values(), "an encoder again", timeout=10)
        assert moves()[0] == ("E", "D") and ("D", "E") in moves()


def test_with_the_controller_off_nothing_switches_under_the_same_load():
    with deployment(["E~", "P", "D"]) as d:
        d.apps["d2"].state.delay_s = 0.5
        with answered(d, [body(f"q{i}") for i in range(6)]):
            pass
        roles = d.client.get("/roles").json()
        assert roles["controller"] == {"enabled": False, "decisions": []}
        assert roles["switches"] == [] and roles_of(d)["e0"] == "E"


def test_the_controller_is_turned_on_and_off_while_serving_with_the_admin_key():
    control = {"enabled": False, "interval_s": 0.05, "sustain_s": 0.2, "min_dwell_s": 0.5}
    with deployment(["E~", "P", "D"], role_control=control) as d:
        assert d.client.post("/roles/controller", json={"enabled": True}).status_code == 401
        on = d.client.post("/roles/controller", json={"enabled": True}, headers=ADMIN)
        assert on.status_code == 200 and on.json()["enabled"] is True
        d.apps["d2"].state.delay_s = 1.5
        with answered(d, [body(f"q{i}") for i in range(6)]):
            wait_for(lambda: roles_of(d)["e0"] == "D", "e0 moved to decode", timeout=10)
        off = d.client.post("/roles/controller", json={"enabled": False}, headers=ADMIN)
        assert off.json()["enabled"] is False


def test_a_switch_that_fails_on_an_error_of_ours_leaves_the_instance_routable():
    with deployment(["P~", "P", "D"]) as d:
        table = d.proxy.proxy.table

        def broken(inst, stages):
            raise RuntimeError("a bug in the flip")

        table.set_stages = broken
        answer = switch(d, "p0", "D")
        assert answer.status_code == 200 and answer.json()["outcome"] == "failed"
        assert roles_of(d)["p0"] == "P"
        assert d.client.get("/roles").json()["instances"]["p0"]["switching_to"] is None
        d.apps["p1"].state.fail_status = 500  # only p0 can prefill now
        r = d.client.post("/v1/chat/completions", json=body("hi"))
        assert r.status_code == 200 and "P=p0" in served_by(r)
        assert ('epd_proxy_role_switches_total{instance="p0",outcome="failed",source="P",'
                'target="D"} 1.0') in d.client.get("/metrics").text


# -- every hang healed: stages refilled, coverage re-checked, no freeze, no race -------
def stop(d, name: str) -> None:
    """The instance hangs (as a stopped process: its /health too) and is out now."""
    d.apps[name].state.hang = True
    d.proxy.call(d.proxy.proxy.table.get(name).take_out, "stopped")


CONTROL = {"enabled": True, "interval_s": 0.05, "high_load": 2.0, "ratio": 2.0,
           "sustain_s": 0.2, "min_dwell_s": 0.5}


def test_a_decode_stage_emptied_by_a_crash_is_refilled_from_an_idle_switchable_instance():
    with deployment(["E~", "P", "D"], role_control=CONTROL,
                    routing={"handoff_fallback": "refuse"}) as d:
        stop(d, "d2")  # the only decoder hangs
        wait_for(lambda: roles_of(d)["e0"] == "D", "e0 moved to the empty decode stage",
                 timeout=10)
        decision = d.client.get("/roles").json()["controller"]["decisions"][0]
        assert "D has no healthy instance" in decision["reason"]
        r = d.client.post("/v1/chat/completions", json=body("hi"))
        assert r.status_code == 200 and "D=e0" in served_by(r)


def test_a_stage_still_starting_is_not_refilled():
    # Found on a real E~-P~-D~ coming up: its decoder was not healthy yet, the controller
    # moved the encoder there, and the deployment's warm-up found no E.
    with deployment(["E~", "P", "D"], dead={"d2"}, role_control=CONTROL,
                    routing={"handoff_fallback": "refuse"}) as d:
        time.sleep(20 * CONTROL["interval_s"])  # twenty rounds of the controller
        assert roles_of(d)["e0"] == "E"
        assert d.client.get("/roles").json()["controller"]["decisions"] == []


def test_a_switch_whose_stage_lost_its_sibling_while_it_drained_is_abandoned():
    with deployment(["P~", "P", "D"], routing={"handoff_fallback": "refuse"}) as d:
        # p0's drain outlasts the switch call and p1's loss by seconds, also on a busy
        # host (at 1 s the drain once ended first there: the switch was then done).
        d.apps["p0"].state.delay_s = 3.0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(d.client.post, "/v1/chat/completions", json=body("q"))
            wait_for(lambda: d.proxy.proxy.table.get("p0").in_flight == 1, "p0 busy")
            assert switch(d, "p0", "D", wait_s=0).status_code == 202
            stop(d, "p1")
            assert held.result().status_code == 200
        wait_for(lambda: d.client.get("/roles").json()["switches"][-1]["outcome"]
                 == "abandoned", "the switch abandoned after its drain")
        assert roles_of(d)["p0"] == "P"


def test_the_controller_refills_a_lost_stage_while_a_long_drain_runs():
    with deployment(["E~", "P~", "P", "D"], role_control=CONTROL,
                    routing={"handoff_fallback": "refuse"}) as d:
        d.apps["p1"].state.delay_s = 3.0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(d.client.post, "/v1/chat/completions", json=body("long"))
            wait_for(lambda: d.proxy.proxy.table.get("p1").in_flight == 1, "p1 busy")
            assert switch(d, "p1", "E", wait_s=0).status_code == 202  # drains for 3 s
            stop(d, "d3")  # the only decoder hangs
            wait_for(lambda: roles_of(d)["e0"] == "D", "decode refilled during p1's drain",
                     timeout=10)
            assert not held.done()  # p1's long hop is still running
            # Its decode hop picks an instance once p1's answer has begun: d3 (which then
            # hangs: 502 or 504), e0 (200), or, on a loaded host where p1 answered only
            # after d3 was out and before e0 served D, none (503: no decode instance).
            assert held.result().status_code in (200, 502, 503, 504)


def test_a_switch_cancelled_and_asked_again_is_not_ended_by_the_first_ones_task():
    with deployment(["P~", "P", "D"]) as d:
        d.apps["p0"].state.delay_s = 0.5
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(d.client.post, "/v1/chat/completions", json=body("q"))
            wait_for(lambda: d.proxy.proxy.table.get("p0").in_flight == 1, "p0 busy")
            assert switch(d, "p0", "D", wait_s=0).status_code == 202
            assert switch(d, "p0", "P", wait_s=0).json()["outcome"] == "cancelled"
            again = switch(d, "p0", "D", wait_s=10)
            assert held.result().status_code == 200
        assert again.status_code == 200 and again.json()["outcome"] == "done"
        outcomes = [s["outcome"] for s in d.client.get("/roles").json()["switches"]]
        assert outcomes == ["cancelled", "done"] and roles_of(d)["p0"] == "D"
