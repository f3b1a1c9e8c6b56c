"""One transfer, one receiving request, one sending request: vLLM's `n` samples of a
prompt on decode share the prompt's one transfer (the first receives, the others wait for
its KV in the prefix cache and answer with its report), and a transfer id named twice,
on either side, costs the second request its transfer and nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epd_serve.connectors.epd_kv.messages import RecvPlan
from epd_serve.connectors.epd_kv.metadata import StepPlan, TransferReport

from ...waiting import wait_for
from .test_compat import scheduled
from .test_epd_kv_both import (  # noqa: F401  (two_workers: a fixture)
    BLOCK_SIZE,
    LAYERS,
    allocated,
    kv_scheduler,
    layer_name,
    request,
    run_step,
    send_chunk,
    to_receive,
    to_send,
    two_workers,
)

DONE = {"transfer_id": "t", "outcome": "done", "bytes": 4096}


def reported(by_request: dict) -> SimpleNamespace:
    return SimpleNamespace(finished_sending=None,
                           kv_connector_worker_meta=TransferReport(by_request))


def test_n_samples_on_decode_receive_their_prompt_once_and_share_it():
    sched = kv_scheduler("kv_consumer")
    first, second = request("0_r", to_receive("t")), request("1_r", to_receive("t"))
    assert sched.get_num_new_matched_tokens(first, 0) == (8, True)
    # The sibling waits (None: vLLM keeps it waiting) while the holder's KV comes.
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
    sched.update_state_after_alloc(first, allocated(5, 6), 8)
    (recv,) = sched.build_connector_meta(scheduled()).recvs
    assert (recv.request_id, recv.transfer_id) == ("0_r", "t")
    sched.update_connector_output(reported({"0_r": dict(DONE)}))
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)  # not cached yet
    # The holder is scheduled: vLLM cached its received blocks just before.
    assert not sched.build_connector_meta(scheduled(new=[("0_r", [5, 6])])).recvs
    assert sched.get_num_new_matched_tokens(second, 4) == (0, False)  # the prefix hit
    assert second.kv_transfer_params["do_remote_prefill"] is False
    sched.update_state_after_alloc(second, allocated(7), 0)
    assert not sched.build_connector_meta(scheduled(new=[("1_r", [5, 7])])).recvs
    # Both answer with the transfer's report; nothing is left behind.
    for req in (first, second):
        assert sched.request_finished(req, [])[1]["epd_kv"]["outcome"] == "done"
    assert not (sched._shared or sched._shares or sched._receiving or sched._reports)


def test_a_sibling_aborted_while_it_waits_leaves_the_holders_transfer_alone():
    sched = kv_scheduler("kv_consumer")
    first, second = request("0_r", to_receive("t")), request("1_r", to_receive("t"))
    sched.get_num_new_matched_tokens(first, 0)
    sched.get_num_new_matched_tokens(second, 0)
    sched.update_state_after_alloc(first, allocated(5, 6), 8)
    second.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(second, []) == (False, None)
    # One reservation (the holder's), no empty one that would cancel the transfer.
    (recv,) = sched.build_connector_meta(scheduled()).recvs
    assert recv.request_id == "0_r" and recv.block_ids == [5, 6]


def test_siblings_go_when_the_holder_finishes_without_running():
    sched = kv_scheduler("kv_consumer")
    first, second = request("0_r", to_receive("t")), request("1_r", to_receive("t"))
    sched.get_num_new_matched_tokens(first, 0)
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
    sched.request_finished(first, [])  # aborted before its KV came
    assert sched.get_num_new_matched_tokens(second, 0) == (0, False)  # computed here


def test_a_second_request_sending_a_transfer_is_refused_and_the_first_sends_alone():
    sched = kv_scheduler("kv_producer")
    first, second = request("0_r", to_send("t")), request("1_r", to_send("t"))
    for req in (first, second):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)
    plan = sched.build_connector_meta(scheduled(new=[("0_r", [1, 2]), ("1_r", [3, 4])],
                                                tokens={"0_r": 8, "1_r": 8}))
    assert [(c.request_id, c.transfer_id) for c in plan.sends] == [("0_r", "t")]
    refused = sched.request_finished(second, [3, 4])
    assert refused[0] is False and "is sent by request 0_r" in \
        refused[1]["epd_kv"]["reason"]
    assert sched.request_finished(first, [1, 2]) == (True, None)
    # Once it finished, the id may be sent again (a retry is refused by the worker's
    # record of ended transfers, not here).
    third = request("2_r", to_send("t"))
    sched.update_state_after_alloc(third, None, 0)
    assert "2_r" in sched._sending


# -- the workers: a transfer id named twice ------------------------------------------
def original(caches: dict, blocks: list[int]) -> list:
    return [part[blocks].clone() for layer in sorted(caches) for part in caches[layer]]


def test_a_transfer_reserved_twice_keeps_the_first_blocks_and_fails_the_second(two_workers):
    (a, a_caches), (b, b_caches) = two_workers
    prompt = 2 * BLOCK_SIZE
    untouched_b, untouched_a = original(b_caches, [12, 13]), original(a_caches, [12, 13])
    # b decodes "first" from a; then b and a itself name the same transfer again.
    b.begin_step(StepPlan(recvs=[RecvPlan("first", "t", "127.0.0.1", a.port, [9, 10], 0,
                                          prompt)]))
    wait_for(lambda: b.receiver._incoming["t"].acked, what="a acknowledged b's reservation")
    b.begin_step(StepPlan(recvs=[RecvPlan("again", "t", "127.0.0.1", a.port, [12, 13], 0,
                                          prompt)]))
    a.begin_step(StepPlan(recvs=[RecvPlan("elsewhere", "t", "127.0.0.1", a.port, [12, 13], 0,
                                          prompt)]))
    failed = {"a": set(), "b": set()}

    def refused() -> bool:
        for name, worker in (("a", a), ("b", b)):
            failed[name] |= worker.transfer_results(set()).failed
        return failed == {"a": {"elsewhere"}, "b": {"again"}}

    wait_for(refused, what="both second reservations failed at once")
    # Prefill writes the transfer once, into the first reservation's blocks only.
    run_step(a, StepPlan(sends=[send_chunk("pre", "t", [1, 2], prompt),
                                send_chunk("other", "t", [3, 4], prompt)],
                         num_tokens=prompt))
    wait_for(lambda: "first" in b.transfer_results(set()).recving, what="first received")
    for layer in range(LAYERS):
        for a_part, b_part in zip(a_caches[layer_name(layer)], b_caches[layer_name(layer)]):
            assert torch.equal(b_part[9:11], a_part[1:3])
    assert all(torch.equal(x, y) for x, y in zip(original(b_caches, [12, 13]), untouched_b))
    assert all(torch.equal(x, y) for x, y in zip(original(a_caches, [12, 13]), untouched_a))
