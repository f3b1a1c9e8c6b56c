"""Our EC connector whatever scheduler calls it: through the KV connector's
`get_num_new_matched_tokens` on a prefill instance (feature_gate.py), and through
`has_cache_item` claims where nothing asks `ensure_cache_available` first. vllm-ascend's
real scheduler runs in test_vllm_ascend_scheduler.py; here the calls are made by hand,
in the order each scheduler makes them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import Settings as KVSettings

from ...waiting import wait_for
from .test_epd_ec import feature, request, scheduler, step, store_feature


def kv_scheduler(vllm_config, role: str = "kv_producer") -> EPDKVScheduler:
    vllm_config.cache_config = SimpleNamespace(block_size=16)
    vllm_config.kv_transfer_config = SimpleNamespace(kv_role=role)
    return EPDKVScheduler(vllm_config, KVSettings(role=role))


def test_prefill_keeps_a_request_waiting_through_the_kv_connector_until_its_feature_is_here(
        store_spec):
    store_feature(store_spec, "gated")
    ec = scheduler(store_spec)
    kv = kv_scheduler(ec._vllm_config)
    req = request("g1", feature("gated"))
    req.kv_transfer_params = {"do_remote_decode": True}
    # The read starts on the first ask: the scheduler is told to skip the request (None).
    assert kv.get_num_new_matched_tokens(req, 0) == (None, False)
    wait_for(lambda: kv.get_num_new_matched_tokens(req, 0) == (0, False),
             what="the feature was read")
    assert ec.has_cache_item("gated")  # what _try_schedule_encoder_inputs asks next
    ec.update_state_after_alloc(req, 0)
    assert list(ec.build_connector_meta(step()).loads) == ["gated"]
    ec.shutdown()
    # Its EC connector gone, the KV connector holds nothing up.
    assert kv.get_num_new_matched_tokens(req, 0) == (0, False)


def test_the_gate_serves_only_its_own_engine_and_decode_never_asks(store_spec):
    ec = scheduler(store_spec)
    other_engine = kv_scheduler(SimpleNamespace())
    decode = kv_scheduler(ec._vllm_config, role="kv_consumer")
    req = request("g2", feature("not-stored-anywhere"))
    req.kv_transfer_params = {}
    assert other_engine.get_num_new_matched_tokens(req, 0) == (0, False)
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert ec.loader._features == {}  # neither started a read
    ec.shutdown()


def test_without_an_ask_first_has_cache_item_claims_a_copy_for_the_pass(store_spec):
    store_feature(store_spec, "prefetched")
    ec = scheduler(store_spec)
    ec.loader.hint(["prefetched"])  # the proxy's hint, read before the request arrives
    first, second = request("c1", feature("prefetched")), request("c2", feature("prefetched"))
    # A pass whose request could not be given blocks: claimed, never allocated.
    assert ec.has_cache_item("prefetched")
    assert ec.build_connector_meta(step()).loads == {}
    assert ec.loader.has_copy("prefetched")  # kept for the next pass, not dropped
    # The next pass schedules it: the claim becomes the request's own hold.
    assert ec.has_cache_item("prefetched")
    ec.update_state_after_alloc(first, 0)
    load = ec.build_connector_meta(step()).loads["prefetched"]
    assert load.source == "prefetched" and load.meta.shape == (4, 8)
    # A second request of the same image shares the copy while the first runs.
    assert ec.has_cache_item("prefetched")
    ec.update_state_after_alloc(second, 0)
    ec.build_connector_meta(step("c1"))
    assert ec.has_cache_item("prefetched")
    ec.build_connector_meta(step("c2"))
    assert not ec.loader.has_copy("prefetched")  # the last holder gone, so is the copy
    assert ec.recorder.take()["events"]["loaded"] == 1  # one copy read, shared
    ec.shutdown()


def test_without_an_ask_first_a_feature_the_store_lacks_is_encoded_and_counted(store_spec):
    ec = scheduler(store_spec)
    req = request("c3", feature("never-stored", pixels=True))
    assert not ec.has_cache_item("never-stored")  # asked, not there: vLLM runs the encoder
    ec.update_state_after_alloc(req, 0)
    assert ec.build_connector_meta(step()).loads == {}
    assert ec.recorder.take()["events"]["encoded_locally"] == 1
    assert ec.loader._features == {}  # the failed read forgotten: the next one asks again
    ec.shutdown()


def test_a_claimed_copy_of_another_size_is_reported_not_loaded(store_spec, caplog):
    store_feature(store_spec, "other-size")  # 4 rows
    ec = scheduler(store_spec)
    ec.loader.hint(["other-size"])
    req = request("c4", feature("other-size"))
    req.get_num_encoder_embeds = lambda index: 9
    assert ec.has_cache_item("other-size")
    with caplog.at_level(logging.ERROR, logger="vllm.epd_serve.ec"):
        ec.update_state_after_alloc(req, 0)
    assert ec.build_connector_meta(step()).loads == {}
    assert "disagree on the image's size" in caplog.text
    ec.shutdown()


def test_once_the_scheduler_asks_first_has_cache_item_claims_nothing(store_spec):
    store_feature(store_spec, "decided")
    ec = scheduler(store_spec)
    ec.loader.hint(["decided"])
    # Decode expecting the prompt's KV: asked, nothing needed, nothing decided.
    assert ec.ensure_cache_available(request("d1", feature("decided")), 100)
    assert not ec.has_cache_item("decided")
    ec.shutdown()
