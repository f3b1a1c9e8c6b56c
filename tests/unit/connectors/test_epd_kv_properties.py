"""Properties of the epd KV connector under any sequence of engine events (hypothesis):
requests arriving to send, receive or compute under a few shared, repeated or unknown
transfer ids, steps scheduling some of them, workers reporting transfers, requests
finishing or aborted at any point, preemptions, and bugs of ours. Whatever the sequence:
no exception leaves the connector into vLLM's step, a transfer id is never sent by two
requests at once nor received by two (its siblings share it), no write is planned for a
request that has finished, and no reservation of a finished request is sent; the
sender's step hooks, driven by the same kind of sequences, never raise either.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_serve.connectors.epd_kv import sender_steps
from epd_serve.connectors.epd_kv.connector import EPDKVConnector
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.layout import LayerLayout, Region
from epd_serve.connectors.epd_kv.messages import FinishedSend, SendChunk
from epd_serve.connectors.epd_kv.metadata import StepPlan, TransferReport
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.stats import EPDKVStats
from epd_serve.connectors.epd_kv.sender_table import TransferTable

from .test_compat import scheduled
from .test_epd_kv_both import allocated, kv_scheduler

REQUESTS = [f"r{i}" for i in range(5)]
TRANSFERS = ["t0", "t1", "t2"]

arrive = st.tuples(st.just("arrive"), st.sampled_from(REQUESTS),
                   st.sampled_from(["send", "receive", "plain", "both", "garbled"]),
                   st.sampled_from(TRANSFERS), st.integers(1, 20))
schedule = st.tuples(st.just("schedule"), st.lists(st.sampled_from(REQUESTS), max_size=3))
report = st.tuples(st.just("report"), st.sampled_from(REQUESTS),
                   st.sampled_from(["done", "failed"]))
finish = st.tuples(st.just("finish"), st.sampled_from(REQUESTS), st.booleans())
preempt = st.tuples(st.just("preempt"), st.sampled_from(REQUESTS))
bug = st.tuples(st.just("bug"), st.sampled_from(["get_num_new_matched_tokens",
                                                 "update_state_after_alloc",
                                                 "build_connector_meta", "request_finished"]))
events = st.lists(st.one_of(arrive, schedule, report, finish, preempt, bug), max_size=40)


def params(kind: str, transfer: str) -> dict | None:
    if kind == "send":
        return {"do_remote_decode": True, "transfer_id": transfer}
    if kind == "receive":
        return {"do_remote_prefill": True, "transfer_id": transfer,
                "remote_host": "127.0.0.1", "remote_port": 9000}
    if kind == "both":
        return {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": transfer}
    if kind == "garbled":
        return {"do_remote_prefill": True, "transfer_id": 7}
    return None


def blocks_of(rid: str) -> list[int]:
    return list(range(10 * int(rid[1:]), 10 * int(rid[1:]) + 5))


class Engine:
    """vLLM's scheduler as far as the connector sees it, and the checks."""

    def __init__(self):
        self.connector = object.__new__(EPDKVConnector)  # the facade, no vLLM config
        self.connector.scheduler = kv_scheduler("kv_both")
        self.connector.worker = None
        self.live: dict[str, SimpleNamespace] = {}  # arrived, not finished
        self.allocated: set[str] = set()
        self.sending: dict[str, str] = {}  # transfer id -> request id, from the plans
        self.finished: set[str] = set()
        self.last_plan: StepPlan | None = None

    def run(self, event) -> None:
        getattr(self, event[0])(*event[1:])

    def arrive(self, rid, kind, transfer, prompt) -> None:
        if rid in self.live:
            return
        self.finished.discard(rid)
        self.live[rid] = SimpleNamespace(
            request_id=rid, kv_transfer_params=params(kind, transfer),
            prompt_token_ids=list(range(prompt)), num_prompt_tokens=prompt,
            num_computed_tokens=0, mm_features=[],
            status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
        self.schedule([])

    def schedule(self, rids) -> None:
        """One scheduling pass, as vLLM's: every waiting request is asked for again
        (None keeps it waiting) and allocated, `rids` run, then the step is planned."""
        for rid, req in self.live.items():
            if rid in self.allocated:
                continue
            tokens, _ = self.connector.get_num_new_matched_tokens(req, 0)
            if tokens is not None:
                self.connector.update_state_after_alloc(req, allocated(*blocks_of(rid)), tokens)
                self.allocated.add(rid)
        new = [(r, blocks_of(r)) for r in dict.fromkeys(rids)
               if r in self.allocated and r in self.live]
        plan = self.connector.build_connector_meta(scheduled(
            new=new, tokens={r: self.live[r].num_prompt_tokens for r, _ in new}))
        self.check(plan)
        self.last_plan = plan
        for rid, _ in new:
            self.live[rid].num_computed_tokens = self.live[rid].num_prompt_tokens

    def check(self, plan: StepPlan) -> None:
        for chunk in plan.sends:
            assert chunk.request_id in self.live, f"a write planned for finished {chunk.request_id}"
            owner = self.sending.setdefault(chunk.transfer_id, chunk.request_id)
            assert owner == chunk.request_id, f"{chunk.transfer_id} sent by {owner} and " \
                f"{chunk.request_id}"
        reserved = [r for r in plan.recvs if r.block_ids and not r.error]
        assert len({r.transfer_id for r in reserved}) == len(reserved), \
            "one transfer reserved twice in a step"
        for recv in reserved:
            assert recv.request_id in self.live, f"a reservation for finished {recv.request_id}"

    def report(self, rid, outcome) -> None:
        self.connector.update_connector_output(SimpleNamespace(
            finished_sending={rid} if rid in self.finished else None,
            kv_connector_worker_meta=TransferReport({rid: {"transfer_id": "t0",
                                                           "outcome": outcome}})))

    def finish(self, rid, aborted) -> None:
        req = self.live.pop(rid, None)
        if req is None:
            return
        req.status = SimpleNamespace(name="FINISHED_ABORTED" if aborted else "FINISHED_STOPPED")
        self.connector.request_finished(req, [])
        self.allocated.discard(rid)
        self.finished.add(rid)
        self.sending = {t: r for t, r in self.sending.items() if r != rid}

    def preempt(self, rid) -> None:
        if rid in self.live:
            self.check(self.connector.build_connector_meta(scheduled(preempted=[rid])))
            self.live[rid].num_computed_tokens = 0

    def bug(self, method) -> None:
        """The next call of `method` raises, as a bug of ours would."""
        scheduler = self.connector.scheduler
        real = getattr(scheduler, method)

        def broken(*args, **kwargs):
            setattr(scheduler, method, real)
            raise RuntimeError(f"a bug in {method}")

        setattr(scheduler, method, broken)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_no_sequence_of_engine_events_raises_or_plans_a_write_for_a_finished_request(events):
    engine = Engine()
    for event in events:
        engine.run(event)  # raises on any exception the connector lets through
    engine.schedule(list(engine.live))
    for rid in list(engine.live):
        engine.finish(rid, aborted=True)
    final = engine.connector.build_connector_meta(scheduled())
    engine.check(final)


def test_a_bug_of_ours_costs_its_request_and_is_counted_in_the_next_step():
    engine = Engine()
    engine.bug("update_state_after_alloc")
    engine.arrive("r1", "receive", "t0", 8)  # allocated, and its step planned
    plan = engine.last_plan
    (failed,) = plan.recvs
    assert failed.request_id == "r1" and "a bug in update_state_after_alloc" in failed.error
    assert failed.block_ids and plan.internal_errors == 1
    # A step whose planning fails: its reservations fail at once, nothing is lost.
    engine.bug("build_connector_meta")
    engine.arrive("r2", "receive", "t1", 8)
    plan = engine.last_plan
    (failed,) = plan.recvs
    assert failed.request_id == "r2" and "could not be planned" in failed.error
    assert plan.internal_errors == 1
    engine.schedule([])
    assert engine.last_plan.internal_errors == 0 and not engine.last_plan.recvs


# -- the sender's step hooks ------------------------------------------------------------
LAYERS = 3


def hooks(mode: str) -> sender_steps.StepHooks:
    table = TransferTable(Settings(role="kv_producer", mode=mode), EPDKVStats(),
                          LinkModel(1e-4, 1e9))
    layout = LayerLayout(regions=(Region(0, 64, 64),))
    return sender_steps.StepHooks(table, [layout] * LAYERS)


chunk = st.builds(lambda rid, tid, start, last: SendChunk(
    rid, tid, list(range(6)), start, start + 4, 24 if not last else start + 4,
    start // 4, start // 4 + 1, None, None),
    st.sampled_from(REQUESTS), st.sampled_from(TRANSFERS), st.sampled_from([0, 4, 8, 20]),
    st.booleans())
step = st.builds(lambda sends, finished, preempted: StepPlan(
    sends=sends, finished_sends=[FinishedSend(r, t, a) for r, t, a in finished],
    preempted=preempted, num_tokens=4 * len(sends)),
    st.lists(chunk, max_size=3),
    st.lists(st.tuples(st.sampled_from(REQUESTS), st.sampled_from(TRANSFERS), st.booleans()),
             max_size=2),
    st.lists(st.sampled_from(REQUESTS), max_size=1))


@pytest.mark.parametrize("mode", ["layer", "group", "whole"])
@settings(max_examples=100, deadline=None)
@given(steps=st.lists(step, max_size=12))
def test_the_senders_step_hooks_take_any_sequence_of_steps(mode, steps):
    """Duplicate, unknown, late and repeated transfer ids, chunks of finished requests,
    preemptions: each step's hooks run without raising (the jobs they queue are for the
    submit thread, not running here)."""
    steps_hooks = hooks(mode)
    for plan in steps:
        steps_hooks.begin_step(plan)
        for layer in range(LAYERS):
            steps_hooks.layer_saved(layer)
        steps_hooks.forward_done()
        owners = {}
        for job in list(steps_hooks.table.jobs.queue):
            out = steps_hooks.table.transfers.get(job.transfer_id)
            if out is not None:
                owners.setdefault(job.transfer_id, out.request_id)
                assert owners[job.transfer_id] == out.request_id
