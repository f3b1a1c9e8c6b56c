"""The EC connector's decisions against a real shared-memory store: what the scheduler
side pins, encodes locally or fails, and the worker side's prefetch listener and loads.
vLLM requests are stood in for by the few fields the connector reads."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import zmq

from epd_serve.connectors.epd_ec.prefetch import Prefetcher
from epd_serve.connectors.epd_ec.scheduler import EPDECScheduler
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.codec import to_bytes, to_tensor
from epd_serve.mmstore import FeatureMeta, open_store

from ...ports import free_port_block
from ...stores import started_shm_store
from ...waiting import wait_for

GRID = {"image_grid_thw": [1, 4, 4]}


@pytest.fixture(scope="module")
def spec():
    with started_shm_store("ec-unit", 8 << 20, port_start=29000) as spec:
        yield spec


def scheduler(spec, producer=False, consumer=True) -> EPDECScheduler:
    vllm_config = SimpleNamespace(model_config=None)
    sched = EPDECScheduler(vllm_config, Settings(store=spec), producer, consumer)
    # What Qwen2-VL declares as placeholder metadata (vLLM reads it from the model).
    sched.resolver._cache["image"] = {"image_grid_thw"}
    return sched


class ItemData(dict):
    """vLLM's MultiModalKwargsItem: processed inputs of one image, by key."""

    def get_data(self) -> dict:
        return dict(self)


def feature(key: str, offset: int = 5, pixels: bool = False):
    data = ItemData(image_grid_thw=torch.tensor([1, 4, 4]))
    if pixels:
        data["pixel_values"] = torch.zeros(16, 8)
    return SimpleNamespace(identifier=key, modality="image", data=data,
                           mm_position=SimpleNamespace(offset=offset, length=4,
                                                       get_num_embeds=lambda: 4))


def request(req_id: str, *features):
    return SimpleNamespace(request_id=req_id, mm_features=list(features),
                           get_num_encoder_embeds=lambda index: 4)


def store_feature(spec, key: str) -> None:
    with open_store(spec) as store:
        store.put(key, np.arange(64, dtype=np.uint8), FeatureMeta((4, 8), "bfloat16", GRID))


def handled(store) -> None:
    """Return once the store server has handled everything `store` sent so far: pins
    and unpins go without an answer, but the server handles one connection's messages
    in order, so the answer to a round trip on it (deleting a key nobody stored) comes
    after theirs."""
    assert store.delete("never-stored") is False


def test_a_stored_feature_is_pinned_until_the_request_finishes(spec):
    store_feature(spec, "held")
    sched = scheduler(spec)
    req = request("r1", feature("held"))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("held")
    sched.update_state_after_alloc(req, 0)
    assert sched.build_connector_meta(None).loads == {"held": 4}
    assert sched.build_connector_meta(None).loads == {}  # one load per allocation
    handled(sched.store)  # the scheduler's hold is not acknowledged
    with open_store(spec) as store:
        assert store.delete("held") is False  # pinned by the scheduler
        sched.request_finished(req)
        handled(sched.store)  # nor is its unpin
        assert store.delete("held") is True
    assert not sched.has_cache_item("held")


def test_a_missing_feature_with_the_image_is_encoded_locally(spec):
    sched = scheduler(spec)
    req = request("r2", feature("absent-with-pixels", pixels=True))
    assert sched.ensure_cache_available(req, 0) is True
    assert not sched.has_cache_item("absent-with-pixels")  # vLLM runs the encoder
    assert sched.take_unavailable_requests() == set()
    assert sched.recorder.take()["events"]["encoded_locally"] == 1


def test_a_missing_feature_without_the_image_fails_the_request_once(spec):
    store_feature(spec, "present")
    sched = scheduler(spec)
    req = request("r3", feature("present"), feature("absent", offset=20))
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == {"r3"}
    assert sched.ensure_cache_available(req, 0) is False  # not scheduled meanwhile
    assert sched.take_unavailable_requests() == set()  # handed to vLLM once
    # The pin taken on the feature that was there is given back at once.
    assert not sched.has_cache_item("present")
    sched.request_finished(req)
    assert sched.recorder.take()["events"]["unavailable"] == 1


def test_features_whose_tokens_are_computed_need_nothing(spec):
    sched = scheduler(spec)
    # Decode received the prompt's KV: the image's tokens (5..8) are computed.
    req = request("r4", feature("absent-but-covered", offset=5))
    assert sched.ensure_cache_available(req, 100) is True
    assert sched.take_unavailable_requests() == set()


def test_a_decode_whose_kv_never_came_loads_the_features_it_skipped(spec):
    store_feature(spec, "needed-later")
    sched = scheduler(spec)
    req = request("r5", feature("needed-later", offset=5))
    # Scheduled expecting the prompt's KV: the image's tokens count as computed.
    assert sched.ensure_cache_available(req, 100) is True
    assert not sched.has_cache_item("needed-later")
    # The KV failed to arrive; decode computes the prompt, image included: the feature
    # must come from the MM Store (the request carries only its reference).
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("needed-later")
    sched.update_state_after_alloc(req, 0)
    assert sched.build_connector_meta(None).loads == {"needed-later": 4}
    assert sched.ensure_cache_available(req, 0) is True  # pinned once, not per pass
    sched.request_finished(req)
    assert not sched.has_cache_item("needed-later")


def test_the_producer_publishes_placeholder_metadata(spec):
    sched = scheduler(spec, producer=True, consumer=False)
    req = request("r5", feature("made"))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.build_connector_meta(None).publish == {"made": GRID}
    assert not sched.has_cache_item("made")  # an encoder always encodes
    done, params = sched.request_finished(req)
    assert done is False and params == {"made": {"item_indices": [0], "metadata": GRID}}


def test_tensors_round_trip_through_bytes_in_their_dtype():
    tensor = torch.randn(5, 7, dtype=torch.bfloat16)
    data, meta = to_bytes(tensor)
    assert meta == FeatureMeta((5, 7), "bfloat16") and data.nbytes == 70
    assert torch.equal(to_tensor(data.copy(), meta, "cpu"), tensor)


def test_the_prefetcher_pulls_hinted_features_and_hands_each_over_once(spec):
    store_feature(spec, "hinted")
    port = free_port_block(1, start=29100)
    with open_store(spec) as store:
        prefetcher = Prefetcher(store, "127.0.0.1", port, budget_bytes=1 << 20)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        try:
            push.send(b"not msgpack of a list")  # dropped, the listener keeps going
            push.send(msgspec.msgpack.encode(["hinted", "never-stored"]))
            item = wait_for(lambda: prefetcher.claim("hinted"), what="the hint arrived")
            assert item.done.wait(5) and item.result is not None
            assert item.result[1].placeholder == GRID and item.ready_at >= item.hinted_at
            assert prefetcher.claim("hinted") is None  # handed over once
            missing = prefetcher.claim("never-stored")
            assert missing is not None and missing.done.wait(5) and missing.result is None
            assert prefetcher.claim("not-hinted") is None
        finally:
            push.close()
            ctx.term()
            prefetcher.close()


def test_the_prefetcher_keeps_unclaimed_features_within_its_budget(spec):
    with open_store(spec) as store:
        for i in range(4):
            store.put(f"big-{i}", np.zeros(300_000, np.uint8), FeatureMeta((1,), "uint8"))
        prefetcher = Prefetcher(store, "127.0.0.1", free_port_block(1, start=29200),
                                budget_bytes=700_000)
        try:
            prefetcher.hint([f"big-{i}" for i in range(4)])
            held = [k for k in (f"big-{i}" for i in range(4))
                    if (item := prefetcher.claim(k)) is not None and item.result is not None]
            assert len(held) == 2  # the oldest were dropped to stay under 700 kB
        finally:
            prefetcher.close()
