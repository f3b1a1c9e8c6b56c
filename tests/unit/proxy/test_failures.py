"""Failures the proxy must report, never hide: a client that leaves while a KV hand-off
is cleaning up still ends its handler; one client's request id never steers another's
request; requests past the proxy's limits get a 503, and the ones already accepted are
served; background loops outlive an unexpected error; the MM Store client opens once,
off the event loop, and a store that cannot be opened is tried again only after a pause
while requests go on without it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time

import pytest

from epd_serve.proxy import ProxyConfig
from epd_serve.proxy.config import InstanceEntry
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import Limits
from epd_serve.proxy.handoff.ascend_layerwise import AscendLayerwise
from epd_serve.proxy.handoff.epd_push import EPDPush
from epd_serve.proxy.membership import Membership
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.routing import RouteRequest
from epd_serve.proxy.state import InstanceState, InstanceTable
from epd_serve.proxy.trip import Trip

from tests.waiting import wait_for
from .harness import ascend_deployment, chat, deployment


# -- cancellation: the handler's own CancelledError is never swallowed -------------------
class SlowToCancel:
    """A decode hop that, once cancelled, takes a while to close (it waits for
    `release`), so the hand-off is still waiting on it when the client leaves."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cleaning_up = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self):
        self.started.set()
        try:
            await asyncio.Event().wait()  # an engine decoding
        except asyncio.CancelledError:
            self.cleaning_up.set()
            await self.release.wait()
            raise


class FakeUpstream:
    """Just enough of upstream.Upstream for a hand-off: decode is `SlowToCancel`,
    prefill fails after it took the request."""

    def __init__(self, decode: SlowToCancel):
        self.decode = decode

    def note_retry(self, hop, trip):
        pass

    def choose(self, hop, trip):
        return ["d1"]

    async def open_stream(self, hop, path, body, trip, candidates=None):
        assert hop == "P"
        decode = self.decode

        class FailingPrefill:
            async def finish(self):
                await decode.started.wait()  # decode has the request, then prefill breaks
                raise ProxyError(502, "prefill broke", "upstream_error")

            async def close(self):
                pass

        return FailingPrefill()

    async def post(self, hop, path, body, trip, candidates=None):
        if hop == "D":
            return await self.decode.run()
        raise ProxyError(502, "prefill failed", "upstream_error")


def prefill_instance():
    table = InstanceTable([InstanceEntry(name="p0", roles="P", url="http://p0",
                                         kv_endpoint="127.0.0.1:30100")])
    return table.get("p0")


async def leave_while_decode_is_cleaning_up(run, decode: SlowToCancel) -> asyncio.Task:
    """Run the hand-off as a handler would; once prefill has failed and the hand-off is
    waiting for decode to close, cancel the handler (the client left)."""
    handler = asyncio.create_task(run())
    await asyncio.wait_for(decode.cleaning_up.wait(), 5)
    handler.cancel()
    decode.release.set()
    await asyncio.wait({handler}, timeout=5)
    assert handler.done()
    return handler


def test_epd_handoff_lets_the_handlers_own_cancellation_through():
    async def scenario():
        decode = SlowToCancel()
        handoff = EPDPush(FakeUpstream(decode), ProxyConfig(model="m", instances=[]))
        trip = Trip("r1", False, RouteRequest())
        return await leave_while_decode_is_cleaning_up(
            lambda: handoff.complete("/v1/completions", {"prompt": "x"}, trip,
                                     [prefill_instance()]), decode)

    handler = asyncio.run(scenario())
    # Not "prefill broke" (the cancellation swallowed, the request carried on): cancelled.
    assert handler.cancelled(), handler.exception()


def test_ascend_handoff_lets_the_handlers_own_cancellation_through():
    async def scenario():
        decode = SlowToCancel()
        handoff = AscendLayerwise(FakeUpstream(decode),
                                  ProxyConfig(model="m", instances=[], host="127.0.0.1"))
        trip = Trip("r1", False, RouteRequest())

        async def run():
            return await handoff.complete("/v1/completions", {"prompt": "x"}, trip,
                                          [prefill_instance()])

        async def prefill_fails_once_decode_reported():
            await decode.started.wait()
            (token,) = handoff._pending  # the URL decode was given
            with pytest.raises(ProxyError):
                await handoff.metaserver(token, {"request_id": "cmpl-r1-0"})

        reporter = asyncio.create_task(prefill_fails_once_decode_reported())
        handler = await leave_while_decode_is_cleaning_up(run, decode)
        await reporter
        return handler

    handler = asyncio.run(scenario())
    assert handler.cancelled(), handler.exception()


def test_a_cancelled_hop_that_failed_is_dropped_but_our_cancellation_is_not():
    from epd_serve.proxy.handoff.base import cancel_and_wait

    async def scenario():
        async def fails():
            raise ProxyError(502, "decode failed")

        failed = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(failed)  # its failure is not ours to raise

        decode = SlowToCancel()
        slow = asyncio.create_task(decode.run())
        await decode.started.wait()
        waiter = asyncio.create_task(cancel_and_wait(slow))
        await decode.cleaning_up.wait()
        waiter.cancel()
        decode.release.set()
        await asyncio.wait({waiter})
        return waiter

    assert asyncio.run(scenario()).cancelled()


# -- request ids: the client's is echoed, the engines get one of our own --------------------
def test_a_client_request_id_reused_by_two_requests_reaches_engines_as_two_ids():
    with deployment(["P", "D"]) as d:
        for _ in range(2):
            resp = chat(d, "x", headers={"x-request-id": "client-7"})
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "client-7"
        first, second = ([r["request_id"] for r in d.seen(name)] for name in ("p0", "d1"))
        # Each request's prefill and decode share one id, unique to that request, that
        # still says which client request it was.
        assert first == second
        assert first[0] != first[1]
        assert all(rid.startswith("client-7-") for rid in first)


def test_concurrent_ascend_requests_with_one_client_id_each_get_their_own_prefill():
    with ascend_deployment(["P", "D"]) as d:
        d.apps["p0"].state.hold = True
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(chat, d, "x", headers={"x-request-id": "same"})
                       for _ in range(2)]
            # Both requests are in the hand-off at once, each waiting on its prefill.
            wait_for(lambda: len(d.seen("p0")) == 2, "both prefills at the instance")
            d.apps["p0"].state.hold = False
            answers = [f.result(timeout=30) for f in futures]
        assert [a.status_code for a in answers] == [200, 200]
        prefills = [r["request_id"] for r in d.seen("p0")]
        decodes = [r["request_id"] for r in d.seen("d1")]
        # Each decode's blocks went to a prefill run of its own request, none was lost.
        assert len(set(prefills)) == 2 and sorted(prefills) == sorted(decodes)


def test_the_request_log_keeps_the_clients_id_and_the_engines(caplog):
    with deployment(["P", "D"]) as d:
        with caplog.at_level(logging.INFO, logger="epd_serve.proxy.requests"):
            assert chat(d, "x", headers={"x-request-id": "client-9"}).status_code == 200
            wait_for(lambda: any("client-9" in r.getMessage() for r in caplog.records),
                     "the request logged")
        (line,) = [r.getMessage() for r in caplog.records if "client-9" in r.getMessage()]
        logged = json.loads(line)
        assert logged["request_id"] == "client-9"
        assert logged["engine_request_id"] == d.seen("d1")[0]["request_id"] != "client-9"


# -- limits: refused with 503 past them, accepted requests served ----------------------------
def test_requests_past_the_in_flight_limit_get_503_and_the_accepted_one_is_served():
    with deployment(["PD"], limits={"max_requests_in_flight": 1}) as d:
        d.apps["pd0"].state.hold = True  # a busy engine: answers when the test says
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            accepted = pool.submit(chat, d, "first")
            wait_for(lambda: len(d.seen("pd0")) == 1, "the first request at the instance")
            refused = chat(d, "second")
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert "max_requests_in_flight" in refused.json()["error"]["message"]
            d.apps["pd0"].state.hold = False
            assert accepted.result(timeout=30).status_code == 200
        assert len(d.seen("pd0")) == 1  # the refused one never reached an engine
        assert chat(d, "third").status_code == 200  # room again
        text = d.client.get("/metrics").text
        assert 'epd_proxy_refused_total{limit="max_requests_in_flight"} 1.0' in text


def test_metrics_show_what_is_in_flight_when_scraped():
    with deployment(["P", "D"]) as d:
        d.apps["d1"].state.hold = True  # decode answers when the test says
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, d, "held")
            wait_for(lambda: len(d.seen("d1")) == 1, "the request at decode")
            text = d.client.get("/metrics").text
            assert 'epd_proxy_instance_in_flight{instance="d1"} 1.0' in text
            assert "epd_proxy_requests_in_flight 1.0" in text
            d.apps["d1"].state.hold = False
            assert held.result(timeout=30).status_code == 200
        text = d.client.get("/metrics").text
        for line in ('epd_proxy_instance_in_flight{instance="d1"} 0.0',
                     'epd_proxy_instance_in_flight{instance="p0"} 0.0',
                     "epd_proxy_requests_in_flight 0.0", "epd_proxy_body_bytes_in_flight 0.0"):
            assert line in text


def test_bodies_past_the_in_flight_byte_limit_get_503():
    limits = {"max_body_bytes": 4096, "max_body_bytes_in_flight": 6000}
    with deployment(["PD"], limits=limits) as d:
        d.apps["pd0"].state.hold = True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            accepted = pool.submit(chat, d, "a" * 3000)
            wait_for(lambda: len(d.seen("pd0")) == 1, "the first request at the instance")
            refused = chat(d, "b" * 3000)  # 3 kB more than the 6 kB allowed in flight
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert "max_body_bytes_in_flight" in refused.json()["error"]["message"]
            d.apps["pd0"].state.hold = False
            assert accepted.result(timeout=30).status_code == 200
        assert chat(d, "b" * 3000).status_code == 200
        text = d.client.get("/metrics").text
        assert 'epd_proxy_refused_total{limit="max_body_bytes_in_flight"}' in text


def test_a_byte_limit_below_one_body_is_refused_at_start():
    with pytest.raises(ValueError, match="is below max_body_bytes"):
        Limits(max_body_bytes=1 << 20, max_body_bytes_in_flight=1 << 10)


# -- background loops and tasks ----------------------------------------------------------
def membership_of(**settings) -> tuple[Membership, InstanceTable]:
    table = InstanceTable([InstanceEntry(name="d0", roles="D", url="http://d0")])
    config = ProxyConfig(model="m", instances=[], **settings)
    return Membership(table, session=None, metrics=ProxyMetrics(), config=config), table


def test_an_unexpected_error_in_a_probe_round_is_logged_and_probing_goes_on(caplog):
    async def scenario():
        membership, _ = membership_of(health_interval_s=0.01,
                                      routing={"metrics_interval_s": 0.01})
        rounds = {"probe": 0, "load": 0}
        again = asyncio.Event()

        def flaky(kind):
            async def check(inst):
                rounds[kind] += 1
                if rounds[kind] == 1:
                    raise RuntimeError(f"unexpected {kind} error")
                if min(rounds.values()) >= 3:
                    again.set()
            return check

        membership.probe = flaky("probe")
        membership.read_engine_load = flaky("load")
        membership.start()
        try:
            await asyncio.wait_for(again.wait(), 5)
        finally:
            await membership.stop()

    with caplog.at_level(logging.ERROR, logger="epd_serve.proxy.membership"):
        asyncio.run(scenario())
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert "unexpected probe error" in logged and "unexpected load error" in logged


def test_one_off_probes_of_registered_instances_are_not_kept():
    async def scenario():
        membership, table = membership_of(health_interval_s=60)
        probed = []

        async def probe(inst):
            probed.append(inst.name)

        membership.probe = probe
        membership.read_engine_load = probe
        membership.start()
        try:
            for i in range(5):
                membership.register(InstanceEntry(name=f"r{i}", roles="D", url=f"http://r{i}"))
            deadline = time.monotonic() + 5
            while len(membership._tasks) > 2:  # the two loops
                assert time.monotonic() < deadline, f"{len(membership._tasks)} tasks kept"
                await asyncio.sleep(0.01)
            assert {f"r{i}" for i in range(5)} <= set(probed)
        finally:
            await membership.stop()

    asyncio.run(scenario())


# -- the MM Store client opens once, whichever thread asks first ---------------------------
def test_the_feature_store_is_opened_once_by_concurrent_first_users(monkeypatch):
    from epd_serve.mmstore import StoreSpec
    from epd_serve.proxy import features

    opened = []

    def slow_open(spec):
        opened.append(threading.get_ident())
        time.sleep(0.1)  # a store client connecting: long enough for a second caller
        return object()

    monkeypatch.setattr(features, "open_store", slow_open)
    directory = features.FeatureDirectory(StoreSpec(backend="shm"), [])
    try:
        start = threading.Barrier(2)

        def first_use():
            start.wait()
            return directory._client()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            clients = list(pool.map(lambda _: first_use(), range(2)))
        assert len(opened) == 1 and clients[0] is clients[1]
    finally:
        directory._store = None  # not a real store: nothing to close
        directory.close()


# -- an MM Store that cannot be opened holds up no request -----------------------------------
def store_down(monkeypatch, opened):
    """The proxy's MM Store client made by `opened(spec)` (a stand-in for open_store);
    the deployment's store is a shared-memory one whose server does not run."""
    from epd_serve.mmstore import StoreSpec
    from epd_serve.proxy import features

    monkeypatch.setattr(features, "open_store", opened)
    return StoreSpec(backend="shm", port=9).to_json()


def test_an_image_request_opening_the_store_holds_up_no_other_request(monkeypatch):
    from epd_serve.mmstore import StoreError

    from .harness import IMAGE

    opening, answer = threading.Event(), threading.Event()

    def unanswered_open(spec):
        # A store server that does not answer: its client waits out its deadline.
        opening.set()
        answer.wait(30)
        raise StoreError("MM Store did not answer in 2000 ms; is the store server running?")

    spec = store_down(monkeypatch, unanswered_open)
    with deployment(["E", "P", "D"], mm_store=spec) as d, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            image = pool.submit(chat, d, "look", [IMAGE], max_tokens=2)
            assert opening.wait(10), "the image request never opened the store"
            # Meanwhile the proxy serves: the store is opened off its event loop.
            text = d.client.post("/v1/chat/completions", timeout=10,
                                 json={"model": "fake", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "x"}]})
            assert text.status_code == 200
            assert not image.done()
        finally:
            answer.set()
        resp = image.result(30)
        # Without the store, the image is encoded as if nothing were stored.
        assert resp.status_code == 200 and resp.headers["x-epd-stages"].startswith("E=e0:")


def test_a_store_that_cannot_be_opened_is_tried_again_only_after_a_pause(monkeypatch):
    from epd_serve.mmstore import StoreError

    from .harness import IMAGE

    attempts = []

    def failing_open(spec):
        attempts.append(time.monotonic())
        raise StoreError("MM Store did not answer in 2000 ms; is the store server running?")

    spec = store_down(monkeypatch, failing_open)
    with deployment(["E", "P", "D"], mm_store=spec) as d:
        for i in range(3):
            resp = chat(d, f"look {i}", [IMAGE], max_tokens=2)
            assert resp.status_code == 200 and resp.headers["x-epd-stages"].startswith("E=e0:")
        assert len(attempts) == 1  # not once per request
        # The pause over, the next request tries again (without waiting for it).
        d.proxy.call(lambda: setattr(d.proxy.proxy.pipeline.features, "_reopen_at", 0.0))
        assert chat(d, "look again", [IMAGE], max_tokens=2).status_code == 200
        wait_for(lambda: len(attempts) == 2, "a second attempt")


def test_refused_requests_never_reach_an_engine_even_in_a_burst():
    with deployment(["PD"], limits={"max_requests_in_flight": 2}) as d:
        d.apps["pd0"].state.hold = True
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(chat, d, f"burst {i}") for i in range(8)]
            wait_for(lambda: sum(f.done() for f in futures) == 6, "six refusals")
            wait_for(lambda: len(d.seen("pd0")) == 2, "the two accepted at the engine")
            d.apps["pd0"].state.hold = False
            statuses = sorted(f.result(timeout=30).status_code for f in futures)
        assert statuses == [200, 200] + [503] * 6
        assert len(d.seen("pd0")) == 2



class PrefillAnswersThenHangs:
    """Prefill answers its one token, then stops before its writes (a chaos soak's
    `stop prefill mid-write`): decode waits for KV that the fence holds back."""

    def __init__(self, prefill: InstanceState):
        self.prefill = prefill
        self.decode_closed = asyncio.Event()

    def note_retry(self, hop, trip):
        pass

    def choose(self, hop, trip):
        return ["d1"]

    async def open_stream(self, hop, path, body, trip, candidates=None):
        class Answered:
            async def finish(self):
                return None

            async def close(self):
                pass

        return Answered()

    async def post(self, hop, path, body, trip, candidates=None):
        assert hop == "D"
        await asyncio.sleep(0.2)
        self.prefill.take_out("hung: silent past a deadline", hung=True)  # found by others
        try:
            await asyncio.sleep(60)  # the fence: until the prefill says its writes ended
        except asyncio.CancelledError:
            self.decode_closed.set()
            raise


def test_a_decode_waiting_on_a_prefill_found_hung_is_ended_to_be_planned_again():
    async def scenario():
        prefill = prefill_instance()
        upstream = PrefillAnswersThenHangs(prefill)
        handoff = EPDPush(upstream, ProxyConfig(model="m", instances=[]))
        trip = Trip("r1", False, RouteRequest())
        started = time.monotonic()
        with pytest.raises(ProxyError) as err:
            await handoff.complete("/v1/completions", {"prompt": "x"}, trip, [prefill])
        return err.value, upstream.decode_closed.is_set(), time.monotonic() - started

    err, closed, took = asyncio.run(scenario())
    # Unreachable: the pipeline plans it again, with a stand-in for the hung prefill.
    assert err.unreachable and err.reason == "instance_hung" and closed and took < 5


class NoDecoderLeft:
    """Prefill takes the request and would compute it for 30 s; the last decoder went
    out after the request was planned (router: none healthy for D)."""

    def __init__(self):
        self.prefill_closed = asyncio.Event()
        self.decode_sent = False

    def note_retry(self, hop, trip):
        pass

    def choose(self, hop, trip):
        return []

    async def open_stream(self, hop, path, body, trip, candidates=None):
        upstream = self

        class LongPrefill:
            async def finish(self):
                await asyncio.sleep(30)

            async def close(self):
                upstream.prefill_closed.set()

        if hop == "D":
            self.decode_sent = True
        return LongPrefill()

    async def post(self, hop, path, body, trip, candidates=None):
        self.decode_sent = True
        raise AssertionError("decode was sent a request with no decoder chosen")


@pytest.mark.parametrize("stream", [False, True])
def test_with_no_decoder_left_at_the_hand_off_prefill_is_stopped_at_once(stream):
    async def scenario():
        upstream = NoDecoderLeft()
        handoff = EPDPush(upstream, ProxyConfig(model="m", instances=[]))
        trip = Trip("r1", False, RouteRequest())
        run = handoff.stream if stream else handoff.complete
        started = time.monotonic()
        with pytest.raises(ProxyError) as err:
            await run("/v1/completions", {"prompt": "x"}, trip, [prefill_instance()])
        return err.value, upstream, time.monotonic() - started

    err, upstream, took = asyncio.run(scenario())
    # Not held for prefill's 30 s, then refused: prefill closed (its engine aborts the
    # request), and unreachable, so the pipeline plans it again with prefill standing in.
    assert took < 5 and upstream.prefill_closed.is_set() and not upstream.decode_sent
    assert err.status == 503 and err.unreachable and err.reason == "no_D"
