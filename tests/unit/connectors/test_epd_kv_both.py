"""The epd KV connector as `kv_both`: an instance the proxy may use as prefill or as
decode, switching by routing alone. Its scheduler side takes each request as its own
`kv_transfer_params` ask (sent, received, or computed here); its workers run a sender
and a receiver over one transfer engine. Two kv_both workers move KV to each other, in
both directions in the same steps, over their real side channels (ZeroMQ on 127.0.0.1)
and a stand-in transfer engine that copies the bytes."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from epd_serve.connectors import feature_gate
from epd_serve.connectors.epd_kv import worker as kv_worker
from epd_serve.connectors.epd_kv.connector import EPDKVConnector
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.messages import FinishedSend, RecvPlan, SendChunk, blocks_to_ship
from epd_serve.connectors.epd_kv.metadata import StepPlan, TransferReport
from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.worker import CALIBRATION_BYTES, EPDKVWorker

from ...ports import free_port_block
from ...waiting import wait_for
from .test_compat import compat_role, kv_config, scheduled

BLOCK_SIZE, BLOCKS, LAYERS = 4, 16, 3


# -- scheduler side ------------------------------------------------------------------

def kv_scheduler(role: str = "kv_both", spans_endpoint: str | None = None) -> EPDKVScheduler:
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        kv_transfer_config=SimpleNamespace(kv_role=role),
        observability_config=SimpleNamespace(otlp_traces_endpoint=spans_endpoint))
    return EPDKVScheduler(config, Settings(role=role))


def request(req_id: str, params: dict | None, prompt: int = 8, mm: bool = False):
    """A waiting request as far as the connector reads it; `mm`: it has an image."""
    return SimpleNamespace(
        request_id=req_id, kv_transfer_params=params, prompt_token_ids=list(range(prompt)),
        num_prompt_tokens=prompt, num_computed_tokens=0,
        mm_features=[object()] if mm else [],
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def to_send(transfer: str = "t-send") -> dict:
    return {"do_remote_decode": True, "transfer_id": transfer}


def to_receive(transfer: str = "t-recv", port: int = 9000) -> dict:
    return {"do_remote_prefill": True, "transfer_id": transfer, "remote_host": "127.0.0.1",
            "remote_port": port}


def allocated(*block_ids: int):
    return SimpleNamespace(get_unhashed_block_ids=lambda: list(block_ids))


def test_one_kv_both_instance_sends_one_request_receives_another_and_computes_a_third():
    sched = kv_scheduler()
    sent, received = request("p", to_send()), request("d", to_receive())
    plain = request("l", None)
    # Only the received request's prompt comes from elsewhere (asynchronously).
    assert sched.get_num_new_matched_tokens(received, 0) == (8, True)
    assert sched.get_num_new_matched_tokens(sent, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False)
    sched.update_state_after_alloc(received, allocated(5, 6), 8)
    sched.update_state_after_alloc(sent, None, 0)
    sched.update_state_after_alloc(plain, None, 0)
    # One step: the workers reserve the received one's blocks and write the sent one's.
    plan = sched.build_connector_meta(scheduled(new=[("p", [1, 2]), ("l", [3, 4])],
                                                tokens={"p": 8, "l": 8}))
    (recv,) = plan.recvs
    assert (recv.request_id, recv.transfer_id, recv.prefill_port, recv.block_ids) == \
        ("d", "t-recv", 9000, [5, 6])
    (chunk,) = plan.sends
    assert (chunk.request_id, chunk.transfer_id, chunk.block_ids) == ("p", "t-send", [1, 2])
    assert (chunk.first_block, chunk.end_block) == (0, 2)
    # The workers report the received one's transfer; the sent one finishes first and
    # keeps its blocks until its writes are done, the plain one frees them at once.
    sched.update_connector_output(SimpleNamespace(
        finished_sending=None, kv_connector_worker_meta=TransferReport(
            {"d": {"transfer_id": "t-recv", "outcome": "done", "bytes": 4096}})))
    assert sched.request_finished(sent, [1, 2]) == (True, None)
    assert sched.request_finished(plain, [3, 4]) == (False, None)
    assert sched.request_finished(received, [5, 6]) == (False, {"epd_kv": {
        "epd_v": 1, "transfer_id": "t-recv", "outcome": "done", "bytes": 4096}})
    assert sched.has_pending_push_work()
    (finished,) = sched.build_connector_meta(scheduled()).finished_sends
    assert (finished.request_id, finished.transfer_id, finished.aborted) == ("p", "t-send", False)
    sched.update_connector_output(SimpleNamespace(finished_sending={"p"},
                                                  kv_connector_worker_meta=None))
    assert not sched.has_pending_push_work()
    assert not (sched._sending or sched._block_ids or sched._receiving or sched._reports)


def test_kv_both_gates_what_it_prefills_on_its_features_not_what_it_receives():
    sched = kv_scheduler()
    waiting: list[str] = []

    def features_not_here(req, num_computed_tokens):
        waiting.append(req.request_id)
        return False

    feature_gate.register(sched.vllm_config, features_not_here)
    try:
        assert sched.get_num_new_matched_tokens(request("p", to_send(), mm=True), 0) \
            == (None, False)
        assert sched.get_num_new_matched_tokens(request("l", {}, mm=True), 0) == (None, False)
        # Decode's prompt arrives as KV: its features are not needed here.
        assert sched.get_num_new_matched_tokens(request("d", to_receive(), mm=True), 0) \
            == (8, True)
    finally:
        feature_gate.unregister(sched.vllm_config, features_not_here)
    assert waiting == ["p", "l"]


@pytest.mark.parametrize("params, side, field", [
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1"},
     "decode", "remote_port"),
    ({"do_remote_decode": True}, "prefill", "transfer_id"),
])
def test_kv_both_refuses_parameters_naming_the_field_and_the_side_it_was_asked_for(
        caplog, params, side, field):
    sched = kv_scheduler()
    req = request("r", params)
    with caplog.at_level(logging.ERROR, logger="vllm.epd_serve.kv.scheduler"):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed here
        sched.update_state_after_alloc(req, allocated(1, 2), 0)
    assert f"epd-kv: {side} refuses the KV transfer of request r" in caplog.text
    assert field in caplog.text
    plan = sched.build_connector_meta(scheduled(new=[("r", [1, 2])], tokens={"r": 8}))
    assert plan.sends == [] and plan.recvs == []  # no transfer
    _, report = sched.request_finished(req, [1, 2])
    assert report["epd_kv"]["outcome"] == "refused" and field in report["epd_kv"]["reason"]


def test_kv_both_refuses_a_request_that_asks_to_send_and_to_receive():
    sched = kv_scheduler()
    req = request("r", {**to_send(), **to_receive()})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, allocated(1, 2), 0)
    plan = sched.build_connector_meta(scheduled(new=[("r", [1, 2])], tokens={"r": 8}))
    assert plan.sends == [] and plan.recvs == []
    assert sched.request_finished(req, [1, 2]) == (False, {"epd_kv": {
        "epd_v": 1, "outcome": "refused",
        "reason": "kv_transfer_params: `do_remote_prefill` and `do_remote_decode` are both "
                  "set; a request's KV is either received here or sent from here"}})


@pytest.mark.parametrize("role, sends, receives", [
    ("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)])
def test_each_role_hands_off_only_the_way_it_may(role, sends, receives):
    """kv_producer and kv_consumer read only their own flag, as before kv_both: what
    asks for the other way is computed there, and nothing is refused."""
    sched = kv_scheduler(role)
    sent, received = request("p", to_send()), request("d", to_receive())
    for req in (sent, received):
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, allocated(5, 6), 8)
    plan = sched.build_connector_meta(scheduled(new=[("p", [1, 2])], tokens={"p": 8}))
    assert [c.request_id for c in plan.sends] == (["p"] if sends else [])
    assert [r.request_id for r in plan.recvs] == (["d"] if receives else [])
    assert sched._refused == {}


def test_receiving_spans_exist_wherever_the_instance_receives():
    endpoint = "http://127.0.0.1:9/v1/traces"  # nothing is recorded, nothing sent
    for role, traced in (("kv_producer", False), ("kv_consumer", True), ("kv_both", True)):
        sched = kv_scheduler(role, spans_endpoint=endpoint)
        assert (sched.spans is not None) == traced
        sched.shutdown()


def test_the_connector_runs_as_kv_both_with_piecewise_graphs():
    connector = EPDKVConnector(kv_config("kv_both"), compat_role("SCHEDULER"),
                               SimpleNamespace(kv_cache_groups=[object()]))
    assert connector.scheduler.sends and connector.scheduler.receives
    with pytest.raises(ValueError, match="kv_both"):
        EPDKVConnector(kv_config("kv_other"), compat_role("SCHEDULER"))
    # It may prefill for another instance at any step: its save hooks must run.
    assert EPDKVConnector.requires_piecewise_for_cudagraph({"role": "kv_both"})
    assert not EPDKVConnector.requires_piecewise_for_cudagraph({"role": "kv_both",
                                                                "mode": "whole"})
    assert Settings.from_extra_config({"role": "kv_both"}).role == "kv_both"


# -- worker side ---------------------------------------------------------------------

class CopyingLink:
    """The transfer engine's wrapper: registers nothing, calibrates to a fixed model,
    and writes by copying within this process (both workers live in it)."""

    made: list["CopyingLink"] = []

    def __init__(self, host, protocol, device_name, gid_index):
        self.session_id = f"{host}:{17000 + len(CopyingLink.made)}"
        self.transport = "tcp"
        self.registered: list = []
        CopyingLink.made.append(self)

    def register(self, regions, device_type="cpu"):
        self.registered.append((list(regions), device_type))

    def calibrate(self, address, nbytes):
        return LinkModel(1e-4, 1e9)

    def submit(self, peer, srcs, dsts, lens):
        for src, dst, n in zip(srcs, dsts, lens):
            ctypes.memmove(dst, src, n)
        return SimpleNamespace()

    def done(self, write):
        return True

    def segments_ended(self, write):
        return True


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def kv_both_worker(seed: int) -> tuple[EPDKVWorker, dict]:
    """A kv_both worker over (k, v) caches, as vllm-ascend registers them, filled with
    values of its own; timeouts long enough that a slow machine trips none."""
    config = kv_config("kv_both", heartbeat_s=0.1)
    config.kv_transfer_config.kv_port = free_port_block(1, start=29800 + seed * 50)
    config.kv_transfer_config.engine_id = f"engine-{seed}"
    extra = dict(config.kv_transfer_config.kv_connector_extra_config)
    worker = EPDKVWorker(config, SimpleNamespace(num_blocks=BLOCKS),
                         Settings.from_extra_config(extra))
    generator = torch.Generator().manual_seed(seed)
    caches = {layer_name(i): (torch.rand(BLOCKS, BLOCK_SIZE, 2, 8, generator=generator),
                              torch.rand(BLOCKS, BLOCK_SIZE, 2, 8, generator=generator))
              for i in range(LAYERS)}
    worker.register_kv_caches(caches)
    return worker, caches


def copying_link_workers(monkeypatch) -> None:
    """Workers made after this run as rank 0 over a CopyingLink (both in this process)."""
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(kv_worker, "Link", CopyingLink)
    CopyingLink.made = []


@pytest.fixture
def two_workers(monkeypatch):
    copying_link_workers(monkeypatch)
    made = [kv_both_worker(1), kv_both_worker(2)]
    yield made
    for worker, _ in made:
        worker.shutdown()


def test_a_kv_both_worker_runs_a_sender_and_a_receiver_over_one_link(two_workers):
    (worker, caches), _ = two_workers
    assert worker.sender is not None and worker.receiver is not None
    assert worker.sender.link is worker.link
    assert worker.receiver.te_session == worker.link.session_id  # prefill writes here
    # One transfer engine: every KV tensor registered once, then the sender's
    # calibration buffer.
    (kv, device), (scratch, _) = worker.link.registered
    assert device == "cpu" and len(kv) == 2 * LAYERS
    assert [n for _, n in scratch] == [CALIBRATION_BYTES]


def send_chunk(request_id: str, transfer: str, blocks: list[int], prompt: int) -> SendChunk:
    first, end = blocks_to_ship(prompt, prompt, BLOCK_SIZE, 0)
    return SendChunk(request_id, transfer, blocks, 0, prompt, prompt, first, end, None, None)


def run_step(worker: EPDKVWorker, plan: StepPlan) -> None:
    """One engine step as the model runner drives the connector's worker side."""
    worker.begin_step(plan)
    for layer in range(LAYERS):
        worker.layer_saved(layer_name(layer))
    worker.forward_done()


def test_two_kv_both_workers_prefill_for_each_other_in_the_same_steps(two_workers):
    (a, a_caches), (b, b_caches) = two_workers
    prompt = 2 * BLOCK_SIZE
    # Step 1: each reserves blocks for a request the other prefills.
    b.begin_step(StepPlan(recvs=[RecvPlan("b-decodes", "ab", "127.0.0.1", a.port, [9, 10], 0,
                                          prompt)]))
    a.begin_step(StepPlan(recvs=[RecvPlan("a-decodes", "ba", "127.0.0.1", b.port, [12, 13], 0,
                                          prompt)]))
    wait_for(lambda: all(w.receiver._incoming[t].acked for w, t in ((a, "ba"), (b, "ab"))),
             what="each prefill side acknowledged the other's reservation")
    # Step 2: each prefills its own request and writes it into the other.
    run_step(a, StepPlan(sends=[send_chunk("a-prefills", "ab", [1, 2], prompt)],
                         num_tokens=prompt))
    run_step(b, StepPlan(sends=[send_chunk("b-prefills", "ba", [3, 4], prompt)],
                         num_tokens=prompt))
    got = {"a": set(), "b": set()}

    def received() -> bool:
        for name, worker in (("a", a), ("b", b)):
            results = worker.transfer_results(set())
            assert not results.failed
            got[name] |= results.recving
        return got == {"a": {"a-decodes"}, "b": {"b-decodes"}}

    wait_for(received, what="both transfers landed")
    for layer in range(LAYERS):
        for a_part, b_part in zip(a_caches[layer_name(layer)], b_caches[layer_name(layer)]):
            assert torch.equal(b_part[9:11], a_part[1:3])  # a's blocks 1, 2 -> b's 9, 10
            assert torch.equal(a_part[12:14], b_part[3:5])  # b's blocks 3, 4 -> a's 12, 13
    assert a.take_reports().by_request["a-decodes"]["outcome"] == "done"
    assert b.take_reports().by_request["b-decodes"]["outcome"] == "done"
    # Step 3: the prefilled requests finish; their blocks go once nothing is in flight.
    a.begin_step(StepPlan(finished_sends=[FinishedSend("a-prefills", "ab", False)]))
    b.begin_step(StepPlan(finished_sends=[FinishedSend("b-prefills", "ba", False)]))
    sent = {"a": set(), "b": set()}

    def freed() -> bool:
        for name, worker in (("a", a), ("b", b)):
            sent[name] |= worker.transfer_results(set()).sending
        return sent == {"a": {"a-prefills"}, "b": {"b-prefills"}}

    wait_for(freed, what="both prefill sides freed their blocks")
    stats = a.take_stats().data
    assert stats["received"] == [1] and len(stats["sent_bytes"]) == 1  # both sides' counts


def test_an_empty_step_waits_for_a_transfer_to_end_and_only_then(two_workers):
    """A step that computed nothing, at an engine waiting for KV (decode) or for its
    writes to end (prefill), waits in the worker until a transfer ends rather than come
    back at once and be stepped again (settings.idle_step_wait_ms); a step that computed
    something, or an engine awaiting nothing, never waits."""
    (a, _), (b, _) = two_workers
    for worker in (a, b):  # long enough that only a transfer's end can end the wait
        worker.settings = dataclasses.replace(worker.settings, idle_step_wait_ms=5000)
    start = time.monotonic()
    assert b.transfer_results(set(), idle=True).recving == set()  # nothing awaited
    assert time.monotonic() - start < 2.5
    prompt = 2 * BLOCK_SIZE
    b.begin_step(StepPlan(recvs=[RecvPlan("b-decodes", "ab", "127.0.0.1", a.port, [9, 10], 0,
                                          prompt)]))
    wait_for(lambda: b.receiver._incoming["ab"].acked, what="prefill acknowledged")
    start = time.monotonic()
    assert b.transfer_results(set(), idle=False).recving == set()  # a step that computed
    assert time.monotonic() - start < 2.5

    def prefill_later() -> None:
        time.sleep(0.2)
        run_step(a, StepPlan(sends=[send_chunk("a-prefills", "ab", [1, 2], prompt)],
                             num_tokens=prompt))

    writer = threading.Thread(target=prefill_later)
    writer.start()
    start = time.monotonic()
    results = b.transfer_results(set(), idle=True)
    waited = time.monotonic() - start
    writer.join()
    # One empty step: it waited for the KV (the prefill started 0.2 s later) and came
    # back with it, long before its wait's end.
    assert results.recving == {"b-decodes"} and not results.failed
    assert 0.15 < waited < 2.5
    # Prefill's side: a finished request's blocks are freed once its writes end.
    a.begin_step(StepPlan(finished_sends=[FinishedSend("a-prefills", "ab", False)]))
    start = time.monotonic()
    assert a.transfer_results(set(), idle=True).sending == {"a-prefills"}
    assert time.monotonic() - start < 2.5
