"""The EC connector's decisions against a real shared-memory store: what the scheduler
side promises (once the feature's bytes are in its own memory), encodes locally or
fails, its loader's prefetch listener, and the worker side's loads. vLLM requests are
stood in for by the few fields the connector reads."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import torch
import zmq

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec import codec
from epd_serve.connectors.epd_ec.codec import HostStaging, to_bytes, to_tensor
from epd_serve.connectors.epd_ec.loader import FeatureLoader
from epd_serve.connectors.epd_ec.scheduler import EPDECScheduler
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.mmstore import FeatureMeta, open_store

from ...ports import free_port_block
from ...waiting import wait_for

GRID = {"image_grid_thw": [1, 4, 4]}


def scheduler(store_spec, producer=False, consumer=True, **settings) -> EPDECScheduler:
    vllm_config = SimpleNamespace(model_config=None)
    sched = EPDECScheduler(vllm_config, Settings(store=store_spec, **settings), producer, consumer)
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


def step(*finished: str):
    """A scheduler output, as far as the connector reads it: the requests finished since
    the previous step."""
    return SimpleNamespace(finished_req_ids=set(finished))


def store_feature(store_spec, key: str) -> None:
    with open_store(store_spec) as store:
        store.put(key, np.arange(64, dtype=np.uint8), FeatureMeta((4, 8), "bfloat16", GRID))


def decided(sched, req, num_computed_tokens: int = 0) -> bool:
    """What the scheduler says once the reads the request waits for are done: True
    (schedule it) or False (it failed)."""
    def settled() -> str | None:
        if sched.ensure_cache_available(req, num_computed_tokens):
            return "scheduled"
        return "failed" if req.request_id in sched._unavailable else None

    return wait_for(settled, "the scheduler deciding on the waiting request") == "scheduled"


def test_a_feature_is_promised_only_once_its_bytes_are_here_and_held_until_the_request_ends(
        store_spec):
    store_feature(store_spec, "held")
    sched = scheduler(store_spec)
    req = request("r1", feature("held"))
    # The first pass starts the read and keeps the request waiting: nothing promised.
    assert sched.ensure_cache_available(req, 0) is False
    assert not sched.has_cache_item("held")
    assert decided(sched, req) is True
    assert sched.has_cache_item("held")
    # The store may now lose it (an eviction, a lapsed lease, a restart): the request
    # holds its own copy.
    with open_store(store_spec) as store:
        assert store.delete("held") is True
    sched.update_state_after_alloc(req, 0)
    step_loads = sched.build_connector_meta(step()).loads
    assert np.array_equal(step_loads["held"].data, np.arange(64, dtype=np.uint8))
    assert step_loads["held"].meta.placeholder == GRID
    assert step_loads["held"].source == "on_demand"
    assert sched.build_connector_meta(step()).loads == {}  # one load per allocation
    assert sched.ensure_cache_available(req, 0) is True  # decided once, not per pass
    sched.request_finished(req)
    assert not sched.has_cache_item("held")
    assert sched.recorder.take()["events"]["loaded"] == 1
    sched.shutdown()


def test_a_scheduler_that_asks_only_as_it_schedules_gets_a_stored_feature_read_at_once(
        store_spec):
    """vllm-ascend's own schedule() copies and its layerwise path ask only
    has_cache_item, as they schedule: a stored feature no hint brought in time is read
    then (within claim_wait_s), not encoded again; a feature the store lacks is encoded
    after no more than the store's answer."""
    store_feature(store_spec, "stored-no-hint")
    sched = scheduler(store_spec)
    try:
        assert sched.has_cache_item("stored-no-hint")  # read now, held for the request
        req = request("r0", feature("stored-no-hint"))
        sched.update_state_after_alloc(req, 0)
        (load,) = sched.build_connector_meta(step()).loads.values()
        assert np.array_equal(load.data, np.arange(64, dtype=np.uint8))
        assert load.source == "on_demand"
        assert not sched.has_cache_item("never-stored")
    finally:
        sched.shutdown()


def test_a_missing_feature_with_the_image_is_encoded_locally(store_spec):
    sched = scheduler(store_spec)
    req = request("r2", feature("absent-with-pixels", pixels=True))
    assert decided(sched, req) is True
    assert not sched.has_cache_item("absent-with-pixels")  # vLLM runs the encoder
    assert sched.take_unavailable_requests() == set()
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    sched.shutdown()


def test_a_missing_feature_without_the_image_fails_the_request_once(store_spec):
    store_feature(store_spec, "present")
    sched = scheduler(store_spec)
    req = request("r3", feature("present"), feature("absent", offset=20))
    assert decided(sched, req) is False
    # Handed to vLLM to fail (before vLLM 0.32, which cannot: it waits to be aborted).
    assert sched.take_unavailable_requests() == ({"r3"} if compat.EC_FAILS_REQUESTS else set())
    assert sched.ensure_cache_available(req, 0) is False  # not scheduled meanwhile
    assert sched.take_unavailable_requests() == set()  # handed to vLLM once
    # The copy held for the feature that was there is given back at once.
    assert not sched.has_cache_item("present")
    sched.request_finished(req)
    assert sched.recorder.take()["events"]["unavailable"] == 1
    sched.shutdown()


def test_features_whose_tokens_are_computed_need_nothing(store_spec):
    sched = scheduler(store_spec)
    # Decode received the prompt's KV: the image's tokens (5..8) are computed.
    req = request("r4", feature("absent-but-covered", offset=5))
    assert sched.ensure_cache_available(req, 100) is True
    assert sched.take_unavailable_requests() == set()
    sched.shutdown()


def test_a_decode_whose_kv_never_came_loads_the_features_it_skipped(store_spec):
    store_feature(store_spec, "needed-later")
    sched = scheduler(store_spec)
    req = request("r5", feature("needed-later", offset=5))
    # Scheduled expecting the prompt's KV: the image's tokens count as computed.
    assert sched.ensure_cache_available(req, 100) is True
    assert not sched.has_cache_item("needed-later")
    # The KV failed to arrive; decode computes the prompt, image included: the feature
    # must come from the MM Store (the request carries only its reference).
    assert decided(sched, req) is True
    assert sched.has_cache_item("needed-later")
    sched.update_state_after_alloc(req, 0)
    assert list(sched.build_connector_meta(step()).loads) == ["needed-later"]
    sched.request_finished(req)
    assert not sched.has_cache_item("needed-later")
    sched.shutdown()


def test_two_requests_share_one_copy_until_the_last_one_ends(store_spec):
    store_feature(store_spec, "shared")
    sched = scheduler(store_spec)
    first, second = request("a", feature("shared")), request("b", feature("shared"))
    assert decided(sched, first) and decided(sched, second)
    sched.request_finished(first)
    assert sched.has_cache_item("shared")  # the second still needs it
    sched.request_finished(second)
    assert not sched.has_cache_item("shared")
    assert sched.recorder.take()["events"]["loaded"] == 1  # read once
    sched.shutdown()


def test_the_producer_publishes_placeholder_metadata(store_spec):
    sched = scheduler(store_spec, producer=True, consumer=False)
    req = request("r5", feature("made"))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.store is None  # an encoder's scheduler side reads nothing
    assert sched.build_connector_meta(step()).publish == {"made": GRID}
    assert not sched.has_cache_item("made")  # an encoder always encodes
    done, params = sched.request_finished(req)
    assert done is False and params == {"made": {"item_indices": [0], "metadata": GRID}}


def test_tensors_round_trip_through_bytes_in_their_dtype():
    tensor = torch.randn(5, 7, dtype=torch.bfloat16)
    data, meta = to_bytes(tensor)
    assert meta == FeatureMeta((5, 7), "bfloat16") and data.nbytes == 70
    data = data.copy()
    loaded = to_tensor(data, meta, "cpu", HostStaging(allocate=unusable))
    assert torch.equal(loaded, tensor)
    assert loaded.data_ptr() == data.ctypes.data  # on the CPU: no copy, no staging


# The staging's device side, faked: this machine has no accelerator. Its buffers are
# plain host memory and its events stand for copies that have not finished until
# waited for. "cpu:0" is not the worker's "cpu", so loads take the device path (the
# copy lands in host memory here, a tensor of its own all the same).
DEVICE = "cpu:0"


def unusable(nbytes: int) -> torch.Tensor:
    raise AssertionError("no staging buffer is needed on the CPU")


class Staging:
    """A HostStaging with fake pinned buffers and events, and what it did with them."""

    def __init__(self, slots: int = 1):
        self.buffers: list[torch.Tensor] = []
        self.events: list[CopyInFlight] = []
        self.staging = HostStaging(slots, allocate=self.allocate, new_event=self.new_event)

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.buffers[-1]

    def new_event(self, device: torch.device) -> CopyInFlight:
        self.events.append(CopyInFlight(self.buffers))
        return self.events[-1]


class CopyInFlight:
    """A device event after a copy out of a staging buffer: not complete until waited
    for. It notes what the buffers held when waited for (still the copy's source?)."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.recorded = False
        self.held_when_waited: list[bytes] | None = None

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded
        self.held_when_waited = [b.numpy().tobytes() for b in self.buffers]


def feature_bytes(seed: int, rows: int = 3) -> tuple[torch.Tensor, np.ndarray, FeatureMeta]:
    tensor = torch.full((rows, 4), float(seed), dtype=torch.bfloat16)
    data, meta = to_bytes(tensor)
    return tensor, data.copy(), meta


def test_a_feature_loads_through_a_staging_buffer_in_its_shape_and_dtype(monkeypatch):
    copies: list[dict] = []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append(kwargs)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    fake = Staging()
    tensor, data, meta = feature_bytes(1)
    loaded = to_tensor(data, meta, DEVICE, fake.staging)
    # The model's thread does not wait for the copy (the stream orders it).
    assert copies == [{"non_blocking": True, "copy": True}]
    assert loaded.dtype == torch.bfloat16 and loaded.shape == (3, 4)
    assert torch.equal(loaded, tensor)
    assert len(fake.buffers) == 1 and fake.events[0].recorded  # staged, copy recorded
    # The result is a copy: neither the store's bytes nor the buffer are kept.
    data[:] = 0
    fake.buffers[0].zero_()
    assert torch.equal(loaded, tensor)


def test_a_buffer_a_copy_may_still_read_is_not_written_until_the_copy_is_done():
    fake = Staging(slots=1)
    first, first_data, meta = feature_bytes(1)
    second, second_data, _ = feature_bytes(2)
    to_tensor(first_data, meta, DEVICE, fake.staging)
    assert fake.events[0].held_when_waited is None  # nothing waits on a load's copy
    loaded = to_tensor(second_data, meta, DEVICE, fake.staging)
    # The second load waited for the first copy while the buffer still held its bytes.
    assert fake.events[0].held_when_waited == [first_data.tobytes()]
    assert torch.equal(loaded, second)


def test_loads_in_a_row_take_turns_over_the_buffers_and_wait_only_when_back_to_one():
    fake = Staging(slots=3)
    features = [feature_bytes(seed) for seed in range(4)]
    for tensor, data, meta in features[:3]:  # one step's three features
        assert torch.equal(to_tensor(data, meta, DEVICE, fake.staging), tensor)
    assert len(fake.buffers) == 3
    assert all(event.held_when_waited is None for event in fake.events)
    tensor, data, meta = features[3]  # next step: back to the first buffer
    assert torch.equal(to_tensor(data, meta, DEVICE, fake.staging), tensor)
    assert fake.events[0].held_when_waited[0] == features[0][1].tobytes()
    assert [e.held_when_waited is None for e in fake.events[1:]] == [True, True, True]
    assert len(fake.buffers) == 3  # reused, not allocated again


def test_a_larger_feature_gets_a_larger_buffer_once_the_old_one_is_free():
    fake = Staging(slots=1)
    _, small_data, small_meta = feature_bytes(1, rows=2)
    big, big_data, big_meta = feature_bytes(2, rows=20)
    to_tensor(small_data, small_meta, DEVICE, fake.staging)
    assert torch.equal(to_tensor(big_data, big_meta, DEVICE, fake.staging), big)
    assert fake.events[0].held_when_waited == [small_data.tobytes()]
    assert [b.numel() for b in fake.buffers] == [small_data.nbytes, big_data.nbytes]


def test_a_device_to_host_copy_waits_for_a_copy_still_reading_the_buffer():
    fake = Staging(slots=1)
    _, loaded_data, meta = feature_bytes(1)
    to_tensor(loaded_data, meta, DEVICE, fake.staging)
    encoded = torch.arange(24, dtype=torch.uint8)
    host = fake.staging.download(encoded)
    assert fake.events[0].held_when_waited == [loaded_data.tobytes()]
    assert host.tobytes() == encoded.numpy().tobytes()


def test_staging_buffers_are_pinned_and_waited_for_without_spinning(monkeypatch):
    asked: list[dict] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        asked.append(dict(kwargs))
        kwargs.pop("pin_memory", None)  # no accelerator here to pin memory for
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    assert codec.pinned_bytes(64).numel() == 64
    assert asked == [{"dtype": torch.uint8, "pin_memory": True}]

    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs))
    codec.copy_done_event(torch.device("cuda", 0))
    assert made == [{"blocking": True}]  # cudaEventBlockingSync: the thread sleeps


def test_the_loader_pulls_hinted_features_and_a_request_finds_them_prefetched(store_spec):
    store_feature(store_spec, "hinted")
    port = free_port_block(1, start=29100)
    with open_store(store_spec) as store:
        loader = FeatureLoader(store, budget_bytes=1 << 20, listen=("127.0.0.1", port))
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        try:
            push.send(b"not msgpack of a list")  # dropped, the listener keeps going
            push.send(msgspec.msgpack.encode(["hinted", "never-stored"]))
            wait_for(lambda: loader.has_copy("hinted"), what="the hinted feature was read")
            item = loader.want("hinted")
            assert item.result[1].placeholder == GRID and item.source == "prefetched"
            assert item.overlap == 1.0  # read before any request needed it
            missing = loader.want("never-stored")
            assert missing.done.wait(5) and missing.result is None and missing.error is None
            assert loader.want("never-stored") is not missing  # a miss is asked again
        finally:
            push.close()
            ctx.term()
            loader.close()


def test_the_loader_keeps_prefetched_copies_within_its_budget_and_held_ones_beyond(store_spec):
    with open_store(store_spec) as store:
        for i in range(4):
            store.put(f"big-{i}", np.zeros(300_000, np.uint8), FeatureMeta((1,), "uint8"))
        loader = FeatureLoader(store, budget_bytes=700_000)
        try:
            held = loader.want("big-0")
            assert held.done.wait(5)
            loader.hold(held)
            loader.hint([f"big-{i}" for i in range(1, 4)])
            wait_for(lambda: all(loader._features[f"big-{i}"].done.is_set()
                                 for i in range(1, 4) if f"big-{i}" in loader._features),
                     what="the hinted reads ended")
            kept = [i for i in range(4) if loader.has_copy(f"big-{i}")]
            # The held copy stays whatever the budget; of the others, the oldest went to
            # keep what nobody holds under 700 kB.
            assert kept == [0, 2, 3]
            # Released by its last request, a copy goes (vLLM's encoder cache has it).
            loader.release(held)
            assert [i for i in range(4) if loader.has_copy(f"big-{i}")] == [2, 3]
        finally:
            loader.close()
