"""A hand-off field renamed on one side is refused at the boundary, naming it, never
read as absent: the proxy (against fake engines that speak the protocol through the same
structs) answers the client a 502; the epd KV connector's decode scheduler refuses the
transfer, logs an ERROR and reports the refusal for the proxy to turn into that 502."""

from __future__ import annotations

import logging
import types

import msgspec
import pytest

from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.protocols import epd_push
from epd_serve.proxy.handoff import epd_push as proxy_epd_push
from tests.unit.proxy.harness import chat, deployment


def renamed(kind: type, field: str, new_name: str) -> type:
    """`kind` as a sender or reader would have it after renaming one of its keys."""
    spec = [(f.name, f.type, msgspec.field(default=f.default, default_factory=f.default_factory,
                                          name=new_name if f.name == field else f.encode_name))
            for f in msgspec.structs.fields(kind)]
    config = kind.__struct_config__
    return msgspec.defstruct(kind.__name__, spec, kw_only=True,
                             forbid_unknown_fields=config.forbid_unknown_fields)


def test_the_proxy_renaming_what_it_sends_decode_gets_a_502_naming_the_field(monkeypatch):
    monkeypatch.setattr(proxy_epd_push, "DecodeParams",
                        renamed(epd_push.DecodeParams, "remote_port", "remote_prt"))
    with deployment(["P", "D"]) as d:
        resp = chat(d, "x")
        assert resp.status_code == 502, resp.text
        assert "remote_prt" in resp.json()["error"]["message"]
        assert "refused" in resp.json()["error"]["message"]


def test_the_proxy_renaming_what_it_reads_of_decodes_report_answers_502_naming_it(monkeypatch):
    monkeypatch.setattr(proxy_epd_push, "TransferReport",
                        renamed(epd_push.TransferReport, "outcome", "result"))
    with deployment(["P", "D"]) as d:
        resp = chat(d, "x")
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        # The reader names the key it does not know: the one the sender still writes.
        assert "kv_transfer_params.epd_kv" in message and "`outcome`" in message


def test_a_streamed_request_whose_decode_params_are_renamed_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(proxy_epd_push, "DecodeParams",
                        renamed(epd_push.DecodeParams, "transfer_id", "transfer"))
    with deployment(["P", "D"]) as d:
        resp = chat(d, "x", stream=True)
        assert resp.status_code >= 400 and "transfer" in resp.text


def decode_scheduler() -> EPDKVScheduler:
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=4),
                                   kv_transfer_config=types.SimpleNamespace(kv_role="kv_consumer"),
                                   observability_config=types.SimpleNamespace(
                                       otlp_traces_endpoint=None))
    return EPDKVScheduler(config, Settings())


@pytest.mark.parametrize("params, field", [
    ({"remote_prt": 9000}, "remote_prt"),  # renamed by the sender
    ({}, "remote_port"),  # left out
    ({"remote_port": 9000, "epd_v": 2}, "epd_v"),  # a version this connector does not know
])
def test_the_decode_scheduler_refuses_renamed_params_naming_the_field(params, field, caplog):
    scheduler = decode_scheduler()
    sent = {"epd_v": 1, "do_remote_prefill": True, "do_remote_decode": False,
            "transfer_id": "t", "remote_host": "127.0.0.1", **params}
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=list(range(8)),
                                    kv_transfer_params=sent,
                                    status=types.SimpleNamespace(name="FINISHED_STOPPED"))
    with caplog.at_level(logging.ERROR, logger="vllm.epd_serve.kv.scheduler"):
        # No transfer: nothing to load remotely, nothing reserved with prefill.
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert field in record.getMessage()
    scheduler.update_state_after_alloc(request, types.SimpleNamespace(
        get_unhashed_block_ids=lambda: [1, 2]), 0)
    assert scheduler.build_connector_meta(types.SimpleNamespace(
        total_num_scheduled_tokens=0, num_scheduled_tokens={}, preempted_req_ids=set(),
        scheduled_new_reqs=[], scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set()))).recvs == []
    # The refusal goes back to the proxy in the request's report, naming the field.
    _, report = scheduler.request_finished(request, [1, 2])
    refused = msgspec.convert(report[epd_push.REPORT_KEY], epd_push.TransferReport)
    assert refused.outcome == "refused" and field in refused.reason
    assert sent["do_remote_prefill"] is False  # kept on vLLM's dict: one try per request


def test_the_decode_scheduler_takes_well_formed_params_and_reserves():
    scheduler = decode_scheduler()
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=list(range(8)),
                                    kv_transfer_params=msgspec.to_builtins(
                                        epd_push.DecodeParams(transfer_id="t",
                                                              remote_host="127.0.0.1",
                                                              remote_port=9000)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (8, True)
    scheduler.update_state_after_alloc(request, types.SimpleNamespace(
        get_unhashed_block_ids=lambda: [1, 2]), 8)
    (recv,) = scheduler._recvs
    assert (recv.transfer_id, recv.prefill_host, recv.prefill_port) == ("t", "127.0.0.1", 9000)
