"""The EC connector as `ec_both`: an instance the proxy switches between encoder and
prefill (or decode) by routing alone. It publishes what it encodes for others (the E
hop: the image, one output token, `ec_transfer_params` read from the answer) and takes
from the MM Store what it prefills (prefetch listener, feature gate), against a real
shared-memory store; its worker side stores and loads, driven in the order each vLLM
drives it."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from epd_serve.connectors import compat, feature_gate
from epd_serve.connectors.epd_ec.codec import to_bytes
from epd_serve.connectors.epd_ec.scheduler import ECStep, Load
from epd_serve.mmstore import open_store

from ...ports import free_port_block
from ...waiting import wait_for
from .test_compat import NEW_API, OLD_API, ec_connector
from .test_epd_ec import GRID, decided, feature, request, scheduler, step, store_feature
from .test_feature_gate import kv_scheduler


def both(store_spec, **settings):
    return scheduler(store_spec, producer=True, consumer=True, **settings)


def test_an_encoder_hop_of_a_feature_the_store_lacks_is_encoded_here_and_published(store_spec):
    sched = both(store_spec)
    req = request("e1", feature("fresh", pixels=True))
    assert decided(sched, req)  # looked for in the store first: not there
    assert not sched.has_cache_item("fresh")  # so vLLM runs the encoder ...
    plan = sched.build_connector_meta(step())
    assert plan.publish == {"fresh": GRID} and plan.loads == {}  # ... and the worker stores it
    # What the proxy reads from the answer to build prefill's image reference.
    assert sched.request_finished(req) == (False, {"fresh": {"item_indices": [0],
                                                             "metadata": GRID}})
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    sched.shutdown()


def test_an_encoder_hop_of_a_stored_feature_loads_it_and_publishes_it_all_the_same(store_spec):
    store_feature(store_spec, "seen-before")
    sched = both(store_spec)
    req = request("e2", feature("seen-before", pixels=True))
    assert decided(sched, req)
    assert sched.has_cache_item("seen-before")  # not encoded again
    sched.update_state_after_alloc(req, 0)
    plan = sched.build_connector_meta(step())
    assert list(plan.loads) == ["seen-before"] and plan.publish == {"seen-before": GRID}
    assert sched.request_finished(req)[1] == {"seen-before": {"item_indices": [0],
                                                               "metadata": GRID}}
    sched.shutdown()


def test_a_prefill_hop_takes_its_hinted_feature_from_the_store_through_the_kv_gate(store_spec):
    store_feature(store_spec, "for-prefill")
    port = free_port_block(1, start=29150)
    sched = both(store_spec, prefetch_port=port)
    kv = kv_scheduler(sched._vllm_config, role="kv_both")  # the same engine's KV side
    req = request("p1", feature("for-prefill"))  # a reference: no pixels
    req.kv_transfer_params = {"do_remote_decode": True, "transfer_id": "t"}
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        push.send(msgspec.msgpack.encode(["for-prefill"]))  # the proxy's hint
        wait_for(lambda: sched.loader.has_copy("for-prefill"), what="the hint was read")
        # kv_both prefills it for a decode instance: the feature gate lets it through.
        assert kv.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.has_cache_item("for-prefill")
        sched.update_state_after_alloc(req, 0)
        load = sched.build_connector_meta(step()).loads["for-prefill"]
        assert load.source == "prefetched" and load.meta.placeholder == GRID
    finally:
        push.close()
        ctx.term()
        sched.shutdown()
    # Shut down, its EC side holds nothing up any more.
    assert feature_gate.features_ready(sched._vllm_config,
                                       request("p2", feature("never-stored")), 0)


@pytest.mark.parametrize("starts_saves", [NEW_API, OLD_API])
def test_an_ec_both_worker_stores_what_it_encodes_and_loads_what_it_was_given(
        store_spec, monkeypatch, starts_saves):
    monkeypatch.setattr(compat, "EC_START_SAVE_CACHES", starts_saves)
    connector = ec_connector(store_spec, "WORKER", producer=True, consumer=True)
    encoded, loaded = f"encoded-{starts_saves}", f"loaded-{starts_saves}"
    data, meta = to_bytes(torch.full((4, 8), 3.0))
    encoder_cache: dict[str, torch.Tensor] = {}
    try:
        # One step as the model runner drives it: saves started, loads, the encoder.
        connector.bind_connector_metadata(ECStep(
            loads={loaded: Load(data.copy(), meta, "on_demand", {"needed": 0.0})},
            publish={encoded: GRID, loaded: GRID}))
        if starts_saves:
            connector.start_save_caches(encoder_cache=encoder_cache)
        connector.start_load_caches(encoder_cache)
        encoder_cache[encoded] = torch.ones(4, 8)  # the encoder ran on this one only
        connector.save_caches(encoder_cache, encoded)
        connector.get_finished(set())
        connector.clear_connector_metadata()
        assert torch.equal(encoder_cache[loaded], torch.full((4, 8), 3.0))
        with open_store(store_spec) as store:
            assert store.lookup(encoded).placeholder == GRID
            assert store.lookup(loaded) is None  # loaded here: not stored again
    finally:
        connector.shutdown()


@pytest.mark.parametrize("starts_saves", [NEW_API, OLD_API])
def test_an_encoder_hop_for_a_feature_it_loaded_earlier_stores_it_from_the_encoder_cache(
        store_spec, monkeypatch, starts_saves):
    """vLLM finds the image in its encoder cache (loaded for a prefill) and runs no
    encoder, so no save_caches comes: the E hop's step stores it from that cache, even
    on an instance that never encoded anything."""
    monkeypatch.setattr(compat, "EC_START_SAVE_CACHES", starts_saves)
    connector = ec_connector(store_spec, "WORKER", producer=True, consumer=True)
    key = f"loaded-then-asked-{starts_saves}"
    data, meta = to_bytes(torch.full((4, 8), 5.0))
    encoder_cache: dict[str, torch.Tensor] = {}

    def run_step(plan: ECStep) -> None:
        connector.bind_connector_metadata(plan)
        if starts_saves:
            connector.start_save_caches(encoder_cache=encoder_cache)
        connector.start_load_caches(encoder_cache)
        connector.get_finished(set())
        connector.clear_connector_metadata()

    try:
        run_step(ECStep(loads={key: Load(data.copy(), meta, "on_demand", {"needed": 0.0})}))
        run_step(ECStep(publish={key: GRID}))  # the E hop: nothing encoded, nothing loaded
        with open_store(store_spec) as store:
            stored = store.lookup(key)
        assert stored is not None and stored.placeholder == GRID
    finally:
        connector.shutdown()
