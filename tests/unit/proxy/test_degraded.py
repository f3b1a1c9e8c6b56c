"""A deployment that loses a whole stage keeps answering every request type: the stage
plan with a stand-in (pure), and the proxy against fake instances with every P, every D
or every E down: decode computes the prompt itself, prefill decodes, the instance that
computes the prompt encodes; each counted and shown in x-epd-stages; /health degraded."""

from __future__ import annotations

import time

import pytest

from epd_serve.instances.payloads import chat_body
from epd_serve.proxy.config import InstanceEntry
from epd_serve.proxy.routing import StagePlan, down_hops, plan_stages, with_stand_in
from epd_serve.proxy.state import InstanceTable, Roster
from epd_serve.proxy.tenancy import image_key

from tests.waiting import wait_for
from .harness import IMAGE, ascend_deployment, chat, deployment

EPD = Roster(encoders=True, split=True, merged=False)
E_PD = Roster(encoders=True, split=False, merged=True)
P_D = Roster(encoders=False, split=True, merged=False)


# -- the plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("images, roster, down, stand_in, plan", [
    (0, EPD, {"P"}, True, StagePlan(final="D", stand_ins=(("P", "D"),))),
    (0, EPD, {"D"}, True, StagePlan(final="P", stand_ins=(("D", "P"),))),
    (1, EPD, {"P"}, True, StagePlan(encode=(0,), final="D", stand_ins=(("P", "D"),))),
    (1, P_D, {"D"}, True, StagePlan(final="P", pixels_to_prefill=True,
                                    stand_ins=(("D", "P"),))),
    (0, EPD, {"P", "D"}, True, StagePlan(final="P+D")),  # nobody to stand in: refused later
    (0, EPD, {"P"}, False, StagePlan(final="P+D")),  # handoff_fallback: refuse
    (0, EPD, {"E"}, True, StagePlan(final="P+D")),  # E is stood in for when encoding fails
    (0, E_PD, {"PD"}, True, StagePlan(final="PD")),  # a merged instance has no other end
])
def test_plan_stages_with_a_stage_down(images, roster, down, stand_in, plan):
    got = plan_stages(images, [False] * images, False, roster, frozenset(down), stand_in)
    assert got == plan


def test_a_stand_in_plan_runs_on_one_hop_and_is_not_changed_again():
    plan = with_stand_in(StagePlan(encode=(0,), final="P+D"), frozenset({"P"}))
    assert plan.hops == ("E", "D")
    assert with_stand_in(plan, frozenset({"D"})) == plan  # D down too: nothing left to try


def test_down_hops_are_the_rosters_hops_without_a_healthy_instance():
    table = InstanceTable([InstanceEntry(name=n, roles=r, url=f"http://{n}")
                           for n, r in (("e0", "E"), ("p1", "P"), ("d2", "D"), ("d3", "D"))])
    for inst in table.instances:
        inst.healthy = inst.name != "p1"
    assert down_hops(table.instances, table.roster) == {"P"}
    table.get("d2").healthy = False
    assert down_hops(table.instances, table.roster) == {"P"}  # d3 still decodes
    table.get("e0").healthy = False
    assert down_hops(table.instances, table.roster) == {"E", "P"}


# -- every P down: decode computes the prompt ------------------------------------------------
def fallbacks(d, missing: str, standin: str) -> float:
    line = f'epd_proxy_fallbacks_total{{missing="{missing}",standin="{standin}"}} '
    text = d.client.get("/metrics").text
    return next((float(l.split()[-1]) for l in text.splitlines() if l.startswith(line)), 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_with_every_prefill_down_decode_runs_text_and_images_whole(stream):
    with deployment(["E", "P", "D"], dead={"p1"}) as d:
        text = chat(d, "words", max_tokens=4, stream=stream)
        image = chat(d, "look", [IMAGE], max_tokens=4, stream=stream)
        for resp in (text, image):
            assert resp.status_code == 200, resp.text
            stages = resp.headers["x-epd-stages"]
            assert "D=d2" in stages and "P=" not in stages
            assert stages.endswith(";FALLBACK=P>D")
        assert image.headers["x-epd-stages"].startswith("E=e0:")
        plain, pictured = d.seen("d2")
        for request in (plain, pictured):
            # A plain request: no KV hand-off, the client's own length and streaming.
            assert "kv_transfer_params" not in request["body"]
            assert request["body"]["max_tokens"] == 4
            assert bool(request["body"].get("stream")) is stream
        # No MM Store (vLLM's file connector): decode is no EC consumer; it gets the
        # pixels (tagged with their key) and no encoder hand-off.
        (part,) = pictured["body"]["messages"][0]["content"][:1]
        assert part["image_url"]["url"] == IMAGE and part["uuid"] == image_key("fake", IMAGE)
        assert "ec_transfer_params" not in pictured["body"]
        assert fallbacks(d, "P", "D") == 2
        health = d.client.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "degraded", "stages_without_healthy_instance": ["P"],
                                 "stand_ins": ["P>D"]}


def set_url(d, name: str, url: str) -> None:
    """Point the proxy's entry for instance `name` at `url` (in the proxy's own loop)."""
    d.proxy.call(lambda: setattr(d.proxy.proxy.table.get(name).entry, "url", url))


def refuse_connections(d, name: str) -> None:
    """Make instance `name` refuse connections, as right after its process died (the
    proxy still counts it healthy until a probe or a request finds out)."""
    set_url(d, name, "http://127.0.0.1:9")


def test_with_the_mm_store_decode_standing_in_gets_image_references(store_spec):
    with deployment(["E", "P", "D"], dead={"p1"}, mm_store=store_spec.to_json()) as d:
        resp = chat(d, "look", [IMAGE], max_tokens=3)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("IMG=ref;FALLBACK=P>D")
        (request,) = d.seen("d2")
        # Decode instances are EC consumers with the store: they load the feature.
        assert request["body"]["messages"][0]["content"][0] == {
            "type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]},
            "uuid": image_key("fake", IMAGE)}
        assert "kv_transfer_params" not in request["body"]


def test_with_every_prefill_down_and_fallback_refused_requests_get_503():
    with deployment(["P", "D"], dead={"p0"}, routing={"handoff_fallback": "refuse"}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 503 and "stage P" in resp.json()["error"]["message"]
        assert d.seen("d1") == []
        assert d.client.get("/health").status_code == 503


def test_a_prefill_that_dies_under_a_request_is_stood_in_for_by_decode_at_once():
    # p0 still counts as healthy (no probe for a minute) but refuses connections, as
    # right after its process died: the request is planned again with decode alone, and
    # p0 is out for the requests after it.
    with deployment(["P", "D"], health_interval_s=60) as d:
        refuse_connections(d, "p0")
        first = chat(d, "x", max_tokens=3)
        assert first.status_code == 200, first.text
        assert "P=p0!" in first.headers["x-epd-stages"]
        assert first.headers["x-epd-stages"].endswith("FALLBACK=P>D")
        (request,) = d.seen("d1")  # decode had nothing before: prefill never took it
        assert "kv_transfer_params" not in request["body"]
        status = {i["name"]: i for i in d.client.get("/status").json()["instances"]}
        assert not status["p0"]["healthy"] and "ConnectionRefusedError" in status["p0"]["last_error"]
        second = chat(d, "y", max_tokens=3)
        assert second.status_code == 200 and "P=" not in second.headers["x-epd-stages"]
        assert fallbacks(d, "P", "D") == 2


def test_prefill_comes_back_and_the_hand_off_resumes():
    with deployment(["P", "D"]) as d:
        url = d.proxy.proxy.table.get("p0").entry.url
        refuse_connections(d, "p0")
        wait_for(lambda: d.client.get("/health").json()["status"] == "degraded", "P out")
        assert chat(d, "x").headers["x-epd-stages"].endswith("FALLBACK=P>D")
        set_url(d, "p0", url)
        wait_for(lambda: d.client.get("/health").json()["status"] == "ok", "P back")
        resp = chat(d, "y")
        assert resp.status_code == 200
        assert resp.headers["x-epd-stages"].startswith("P=p0:")
        assert "FALLBACK" not in resp.headers["x-epd-stages"]
        assert d.seen("d1")[-1]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
        assert fallbacks(d, "P", "D") == 1


# -- every D down: prefill decodes ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_with_every_decode_down_prefill_runs_text_and_images_whole(stream):
    with deployment(["E", "P", "D"], dead={"d2"}) as d:
        text = chat(d, "words", max_tokens=5, stream=stream)
        image = chat(d, "look", [IMAGE], max_tokens=5, stream=stream)
        for resp in (text, image):
            assert resp.status_code == 200, resp.text
            stages = resp.headers["x-epd-stages"]
            assert "P=p1" in stages and "D=" not in stages and stages.endswith(";FALLBACK=D>P")
        if not stream:
            assert text.json()["usage"]["completion_tokens"] == 5  # it decoded in full
        plain, pictured = d.seen("p1")
        for request in (plain, pictured):
            assert "kv_transfer_params" not in request["body"]  # no do_remote_decode
            assert request["body"]["max_tokens"] == 5
            assert bool(request["body"].get("stream")) is stream
        # Prefill still takes the encoder's hand-off, as it does as prefill.
        assert image_key("fake", IMAGE) in pictured["body"]["ec_transfer_params"]
        assert fallbacks(d, "D", "P") == 2
        assert d.client.get("/health").json() == {
            "status": "degraded", "stages_without_healthy_instance": ["D"], "stand_ins": ["D>P"]}


def test_a_decode_that_dies_under_a_request_is_stood_in_for_by_prefill():
    with deployment(["P", "D"], health_interval_s=60) as d:
        refuse_connections(d, "d1")
        resp = chat(d, "x", max_tokens=3)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert "D=d1!" in stages and stages.endswith("FALLBACK=D>P")
        handed_off, whole = d.seen("p0")  # the hand-off's prefill, then the request whole
        assert handed_off["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert "kv_transfer_params" not in whole["body"] and whole["body"]["max_tokens"] == 3


def test_a_decoder_gone_once_prefill_took_the_request_is_stood_in_for_by_prefill():
    # d1 goes out after the request was planned with it, just as prefill took the
    # request (a probe found it down in between): prefill's hop is ended at once and the
    # request planned again, prefill running it whole; not refused after prefill's end.
    with deployment(["P", "D"], health_interval_s=60) as d:
        upstream = d.proxy.proxy.pipeline.upstream
        choose = upstream.choose

        def decoder_goes_out(hop, trip):
            if hop == "D":
                d.proxy.proxy.table.get("d1").take_out("probe: gone")
            return choose(hop, trip)

        upstream.choose = decoder_goes_out
        d.apps["p0"].state.delay_s = 3.0  # prefill's stream would take 3 s
        started = time.monotonic()
        resp = chat(d, "x", max_tokens=3)
        took = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("FALLBACK=D>P")
        handed_off, whole = d.seen("p0")
        assert handed_off["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert "kv_transfer_params" not in whole["body"]
        assert d.seen("d1") == []
        # Prefill's first hop was closed (its engine would abort it), not waited for:
        # the fake's delay holds every answer, so the whole request took 3 s once, not
        # 3 s of the first hop before it.
        wait_for(lambda: len(d.apps["p0"].state.cancelled) == 1, "prefill's hop closed")
        assert took < 5.5


# -- every E down: the instance computing the prompt encodes ----------------------------------
def test_with_every_encoder_down_images_go_to_prefill_by_default():
    with deployment(["E", "P", "D"], dead={"e0"}) as d:
        resp = chat(d, "look", [IMAGE], max_tokens=2)
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert "E=skipped" in stages and "P=p1" in stages and stages.endswith("FALLBACK=E>P")
        (pre,) = d.seen("p1")
        assert pre["body"]["messages"][0]["content"][0]["image_url"]["url"] == IMAGE
        assert fallbacks(d, "E", "P") == 1
        assert d.client.get("/health").json() == {
            "status": "degraded", "stages_without_healthy_instance": ["E"], "stand_ins": ["E>P"]}


def test_with_encoders_and_prefill_down_decode_does_all_of_it():
    with deployment(["E", "P", "D"], dead={"e0", "p1"}) as d:
        resp = chat(d, "look", [IMAGE], max_tokens=2)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("IMG=pixels;FALLBACK=E>D,P>D")
        (request,) = d.seen("d2")
        assert request["body"]["messages"][0]["content"][0]["image_url"]["url"] == IMAGE
        assert d.client.get("/health").json()["stand_ins"] == ["E>D", "P>D"]


def test_with_both_ends_down_text_is_refused_and_health_says_unavailable():
    with deployment(["P", "D"], dead={"p0", "d1"}) as d:
        resp = chat(d, "x")
        assert resp.status_code == 503 and resp.headers["retry-after"]
        health = d.client.get("/health")
        assert health.status_code == 503
        assert health.json()["stages_without_healthy_instance"] == ["P", "D"]


# -- the other hand-offs take the same stand-ins ------------------------------------------------
def test_ascend_layerwise_with_prefill_down_sends_decode_a_plain_request():
    with ascend_deployment(["P", "D"]) as d:
        refuse_connections(d, "p0")
        wait_for(lambda: d.client.get("/health").json()["status"] == "degraded", "P out")
        resp = d.client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                      "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("FALLBACK=P>D")
        (request,) = d.seen("d1")
        assert "kv_transfer_params" not in request["body"]  # no metaserver round trip


@pytest.mark.parametrize("dead", ["p0", "d1"])
def test_mooncake_hand_off_stands_in_too(dead):
    with deployment(["P", "D"], dead={dead}, protocol="mooncake") as d:
        resp = d.client.post("/v1/chat/completions", json=chat_body("fake", "x", max_tokens=2))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith(
            "FALLBACK=P>D" if dead == "p0" else "FALLBACK=D>P")
