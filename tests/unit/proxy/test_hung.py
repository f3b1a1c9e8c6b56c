"""An instance that accepts connections and never answers (a stopped process) costs at
most the request it holds, and only for its deadline: past a hop's first-byte deadline
(or a stream's idle deadline) the proxy asks the instance's /health; one that does not
answer is out of routing at once, and its hop goes to another instance, else to a
stand-in, else ends in a clear error. One that answers its /health is slow, not hung,
and is waited for. Fake instances on loopback; each `hang` stands for SIGSTOP."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from pydantic import ValidationError

from epd_serve.instances.payloads import chat_body
from epd_serve.proxy import ProxyConfig
from epd_serve.testing.fake_server import ThreadedServer, create_fake_app

from tests.waiting import wait_for
from .harness import IMAGE, deployment

# Short deadlines, so a test waits a second for what a deployment waits tens of.
FAST = {"first_byte_s": {"E": 0.3, "P": 0.3, "D": 0.3}, "stream_idle_s": 0.3,
        "alive_timeout_s": 0.3, "core_timeout_s": 0.5}
# How long a request on a hung instance may take here: its deadline and the /health
# it is given, and generous slack for a loaded host. Without deadlines it would wait
# request_timeout_s (600 s).
GUARD_S = 15.0


def status(d) -> dict[str, dict]:
    return {i["name"]: i for i in d.client.get("/status").json()["instances"]}


def post(d, body: dict) -> httpx.Response:
    return d.client.post("/v1/chat/completions", json=body, timeout=GUARD_S)


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_decode_is_stood_in_for_and_bypassed_until_a_probe_succeeds(stream):
    with deployment(["P", "D"], deadlines=FAST, health_interval_s=0.1) as d:
        d.apps["d1"].state.hang = True
        first = post(d, chat_body("fake", "x", max_tokens=3, stream=stream))
        assert first.status_code == 200, first.text
        stages = first.headers["x-epd-stages"]
        assert "D=d1!" in stages and stages.endswith("FALLBACK=D>P")  # prefill decoded
        assert not status(d)["d1"]["healthy"]
        assert "hung" in status(d)["d1"]["last_error"].lower()
        assert d.client.get("/health").json() == {
            "status": "degraded", "stages_without_healthy_instance": ["D"],
            "stand_ins": ["D>P"]}
        # The next request does not wait for d1 (nor for three failed probes).
        second = post(d, chat_body("fake", "y", max_tokens=3, stream=stream))
        assert second.status_code == 200 and "D=" not in second.headers["x-epd-stages"]
        assert len(d.seen("d1")) == 1
        # The process resumes: its first good probe brings it back.
        d.apps["d1"].state.hang = False
        wait_for(lambda: status(d)["d1"]["healthy"], "d1 back", timeout=GUARD_S)
        third = post(d, chat_body("fake", "z", max_tokens=3, stream=stream))
        assert third.status_code == 200
        assert "D=d1" in third.headers["x-epd-stages"]
        assert "!" not in third.headers["x-epd-stages"]
        assert "FALLBACK" not in third.headers["x-epd-stages"]


def test_a_hung_prefill_fails_over_to_another_prefill_and_is_bypassed():
    with deployment(["P", "P", "D"], deadlines=FAST, health_interval_s=60,
                    routing={"P": "round-robin"}) as d:
        d.apps["p0"].state.hang = True
        answers = [post(d, chat_body("fake", f"q{i}", max_tokens=2)) for i in range(3)]
        assert [a.status_code for a in answers] == [200] * 3
        stages = [a.headers["x-epd-stages"] for a in answers]
        assert sum("P=p0!" in s for s in stages) == 1  # the one request p0 was given
        assert all("P=p1:" in s and "FALLBACK" not in s for s in stages)
        assert len(d.seen("p0")) == 1  # the others went straight to p1
        assert len(d.seen("d2")) == 3  # decode got each request once, from p1's prefill


def test_a_hung_encoder_is_stood_in_for_by_prefill():
    with deployment(["E", "P", "D"], deadlines=FAST, health_interval_s=60) as d:
        d.apps["e0"].state.hang = True
        resp = post(d, chat_body("fake", "look", [IMAGE], max_tokens=2))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("FALLBACK=E>P")
        assert d.client.get("/health").json()["stand_ins"] == ["E>P"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_held_by_a_hung_decode_goes_to_a_decode_that_came_up_meanwhile(
        stream, monkeypatch):
    """A role switch, a restart or a registration refills decode while a request waits
    on the hung one: at its deadline the stage is not empty, so no stand-in applies,
    and the request is planned again onto the new instance rather than ended with a
    504 (as an E~-P~-D~ soak saw, its encoder switched to decode meanwhile)."""
    monkeypatch.setenv("EPD_ADMIN_KEY", "s3cret")
    slow = {**FAST, "first_byte_s": {"E": 0.3, "P": 0.3, "D": 3.0}}
    late = create_fake_app("d-late")
    with deployment(["P", "D"], deadlines=slow, health_interval_s=0.1) as d, \
            ThreadedServer(late) as server:
        d.apps["d1"].state.hang = True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, d, chat_body("fake", "x", max_tokens=3, stream=stream))
            wait_for(lambda: d.seen("d1"), "the request on d1")
            added = d.client.post("/instances", json={"name": "d9", "roles": "D",
                                                      "url": server.url},
                                  headers={"authorization": "Bearer s3cret"})
            assert added.status_code == 201
            wait_for(lambda: status(d)["d9"]["healthy"], "d9 up", timeout=2.5)
            assert not pending.done()
            resp = pending.result(GUARD_S)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert "D=d1!" in stages and "D=d9" in stages and "FALLBACK" not in stages
        assert late.state.requests


def test_an_image_request_held_by_a_hung_decode_goes_to_its_encoder_switched_to_decode(
        monkeypatch):
    """E~-P~-D~ as a soak ran it: decode hangs, the encoder is switched to decode while
    an image request waits there. Its image is encoded already, so the encoder stage
    now empty does not stop it from being planned again onto the new decode."""
    monkeypatch.setenv("EPD_ADMIN_KEY", "s3cret")
    slow = {**FAST, "first_byte_s": {"E": 0.3, "P": 0.3, "D": 3.0}}
    with deployment(["E~", "P~", "D~"], deadlines=slow, health_interval_s=0.1) as d:
        d.apps["d2"].state.hang = True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, d, chat_body("fake", "look", [IMAGE], max_tokens=3))
            wait_for(lambda: d.seen("d2"), "the request on d2")
            switched = d.client.post("/instances/e0/role", json={"role": "D"},
                                     headers={"authorization": "Bearer s3cret"})
            assert switched.status_code == 200, switched.text
            resp = pending.result(GUARD_S)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert stages.startswith("E=e0:") and "D=d2!" in stages and "D=e0" in stages


def test_a_hung_instance_with_no_stand_in_is_a_clear_error_within_its_deadline():
    with deployment(["PD"], deadlines=FAST, health_interval_s=60) as d:
        d.apps["pd0"].state.hang = True
        resp = post(d, chat_body("fake", "x", max_tokens=2))
        assert resp.status_code == 504  # a gateway timeout, said at the deadline
        message = resp.json()["error"]["message"]
        assert "pd0" in message and "/health did not answer" in message


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_instance_that_answers_its_health_is_waited_for(stream):
    # Held: its engine computes for longer than the deadline (several of them), but its
    # server answers /health: slow, not hung. Not streamed, the wait is for the first
    # byte; streamed, for the events after the headers.
    with deployment(["P", "D"], deadlines=FAST, health_interval_s=60) as d:
        fake = d.apps["d1"].state
        fake.hold = True
        before = fake.health_reads
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, d, chat_body("fake", "x", max_tokens=3, stream=stream))
            # Asked whether it is alive twice: two deadlines have passed.
            wait_for(lambda: fake.health_reads >= before + 2, "liveness checks", timeout=GUARD_S)
            assert not pending.done()
            fake.hold = False
            resp = pending.result(GUARD_S)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert "!" not in stages and "FALLBACK" not in stages and "D=d1" in stages
        assert status(d)["d1"]["healthy"]


def test_a_stream_that_stops_mid_way_ends_with_an_error_and_its_instance_is_out():
    with deployment(["P", "D"], deadlines=FAST, health_interval_s=60) as d:
        d.apps["d1"].state.hang_after_events = 2
        with d.client.stream("POST", "/v1/chat/completions", timeout=GUARD_S,
                             json=chat_body("fake", "x", max_tokens=6, stream=True)) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        # What was relayed stays; an error event says why the rest is missing (as vLLM
        # ends a stream that fails), then [DONE]: a well-formed stream to the end.
        assert '"t0 "' in events[0] and '"t1 "' in events[1] and len(events) == 4
        error = json.loads(events[2].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "d1" in error["message"]
        assert events[3] == "data: [DONE]"
        assert not status(d)["d1"]["healthy"]
        # Nothing already relayed is sent again: the next request is stood in for.
        assert post(d, chat_body("fake", "y")).headers["x-epd-stages"].endswith("FALLBACK=D>P")


def test_deadlines_default_to_first_byte_and_refuse_nonsense():
    config = ProxyConfig(model="m", instances=[],
                         deadlines={"first_byte_s": {"E": 60}})
    assert config.deadlines.first_byte_s.E == 60
    assert config.deadlines.first_byte_s.P == config.deadlines.first_byte_s.D == 10
    assert config.deadlines.stream_idle_s == 5 and config.deadlines.alive_timeout_s == 5
    # 5 + 5: a request a hung core holds is planned again within ~10 s, and served by
    # another instance or a stand-in well within 30 s.
    assert config.deadlines.core_timeout_s == 5
    with pytest.raises(ValidationError, match="first_byte_s.D"):
        ProxyConfig(model="m", instances=[], deadlines={"first_byte_s": {"D": 0}})
    with pytest.raises(ValidationError, match="PD"):
        ProxyConfig(model="m", instances=[], deadlines={"first_byte_s": {"PD": 5}})


def test_a_request_on_a_hung_instance_does_not_hold_up_others():
    # A second PD instance serves while the first holds a request past its deadline.
    with deployment(["PD", "PD"], deadlines=FAST, health_interval_s=60,
                    routing={"D": "round-robin"}) as d:
        d.apps["pd0"].state.hang = True
        answers = [post(d, chat_body("fake", f"q{i}")) for i in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert all("PD=pd1" in a.headers["x-epd-stages"] for a in answers)
        assert len(d.seen("pd0")) <= 1


# -- an engine core that hangs under a live API server ---------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_engine_core_behind_a_green_health_is_found_stood_in_for_and_kept_out(stream):
    """vLLM's /health stays 200 while its engine core is stopped: the one-token request
    after it does not answer, so decode is hung, prefill stands in, and the instance
    stays out (however green its /health) until its engine answers again."""
    with deployment(["P", "D"], deadlines=FAST, health_interval_s=0.1) as d:
        d.apps["d1"].state.core_stopped = True
        first = post(d, chat_body("fake", "x", max_tokens=3, stream=stream))
        assert first.status_code == 200, first.text
        assert first.headers["x-epd-stages"].endswith("FALLBACK=D>P")
        d1 = status(d)["d1"]
        assert not d1["healthy"] and d1["core_hung"]
        assert "one-token request" in d1["last_error"]
        # Probes find /health green, and keep it out while its engine does not answer.
        before = d.apps["d1"].state.health_reads
        wait_for(lambda: d.apps["d1"].state.health_reads >= before + 3, "probes")
        assert not status(d)["d1"]["healthy"] and status(d)["d1"]["hung_s"] > 0
        metrics = d.client.get("/metrics").text
        assert 'epd_proxy_instance_hung_seconds{instance="d1"}' in metrics
        d.apps["d1"].state.core_stopped = False  # restarted, or it resumed
        wait_for(lambda: status(d)["d1"]["healthy"], "d1 back once its engine answers",
                 timeout=GUARD_S)
        assert not status(d)["d1"]["core_hung"] and status(d)["d1"]["hung_s"] == 0
        again = post(d, chat_body("fake", "z", max_tokens=3, stream=stream))
        assert again.status_code == 200 and "FALLBACK" not in again.headers["x-epd-stages"]


def test_a_busy_engine_answers_the_one_token_check_and_is_waited_for():
    """An engine computing a long request still steps: it answers the one-token check,
    so it is slow, not hung (the check is not a request it must finish first)."""
    with deployment(["P", "D"], deadlines=FAST, health_interval_s=60) as d:
        fake = d.apps["d1"].state
        fake.hold = True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, d, chat_body("fake", "x", max_tokens=3))
            wait_for(lambda: sum(r["body"].get("prompt") == "ping" for r in d.seen("d1")) >= 2,
                     "two one-token checks", timeout=GUARD_S)
            assert not pending.done()
            fake.hold = False
            assert pending.result(GUARD_S).status_code == 200
        assert status(d)["d1"]["healthy"] and not status(d)["d1"]["core_hung"]
