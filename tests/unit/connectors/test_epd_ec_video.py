"""Videos stored in chunks: the proxy splits a video into chunks of frames, each encoded
and stored under its own key (`part_key`), and names them, joined, in prefill's
`vllm_xargs`. The keys themselves, the loader joining the chunks, the scheduler reading
and holding them for vLLM's own hash of the video, and an encoder storing a chunk under
the key the proxy named, against a real shared-memory store."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec.codec import to_bytes
from epd_serve.connectors.epd_ec.loader import FeatureLoader
from epd_serve.connectors.epd_ec.scheduler import ECStep
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.connectors.epd_ec.worker import EPDECWorker
from epd_serve.mmstore import FeatureMeta, open_store
from epd_serve.protocols.feature_chunks import (
    MAX_PARTS,
    VIDEO_KEYS_ARG,
    joined_key,
    part_key,
    part_keys,
)

from .test_compat import NEW_API, OLD_API, ec_connector
from .test_epd_ec import GRID, ItemData, decided, feature, scheduler, step, store_feature

HIDDEN = 8
VIDEO_GRID = {"video_grid_thw": [2, 4, 4]}


# -- helpers ------------------------------------------------------------------------------
def chunk(seed: int, rows: int) -> np.ndarray:
    """The float32 feature of one chunk: `rows` embeddings of HIDDEN, distinct per seed."""
    return (np.arange(rows * HIDDEN, dtype=np.float32) + 1000 * seed).reshape(rows, HIDDEN)


def put_chunk(store_spec, key: str, seed: int, rows: int, hidden: int = HIDDEN,
              dtype: str = "float32") -> np.ndarray:
    values = chunk(seed, rows) if hidden == HIDDEN else np.zeros((rows, hidden), np.float32)
    with open_store(store_spec) as store:
        assert store.put(key, values.view(np.uint8).reshape(-1),
                         FeatureMeta((rows, hidden), dtype, VIDEO_GRID))
    return values


def put_video(store_spec, key: str, rows: list[int]) -> tuple[str, np.ndarray]:
    """Chunks of `rows` embeddings stored under `key`'s part keys: their joined key and
    the whole feature they make in order."""
    parts = [part_key(key, i) for i in range(len(rows))]
    whole = [put_chunk(store_spec, p, seed, n) for seed, (p, n) in enumerate(zip(parts, rows))]
    return joined_key(parts), np.concatenate(whole)


def video(identifier: str, offset: int = 5, length: int = 4, pixels: bool = False):
    """vLLM's MultiModalFeatureSpec of a video: its hash, placeholder metadata and,
    when the request carries the video itself, its pixels."""
    data = ItemData(video_grid_thw=torch.tensor([2, 4, 4]))
    if pixels:
        data["pixel_values_videos"] = torch.zeros(16, 8)
    return SimpleNamespace(identifier=identifier, modality="video", data=data,
                           mm_position=SimpleNamespace(offset=offset, length=length,
                                                       get_num_embeds=lambda: length))


def request(req_id: str, *features, keys: list | None = None, embeds: list[int] | None = None):
    """A vLLM request as far as the connector reads it; `keys`: the proxy's
    `vllm_xargs[epd_video_keys]`; `embeds`: each feature's number of embeddings."""
    extra = {VIDEO_KEYS_ARG: keys} if keys is not None else None
    counts = embeds or [4] * len(features)
    return SimpleNamespace(request_id=req_id, mm_features=list(features),
                           sampling_params=SimpleNamespace(extra_args=extra),
                           get_num_encoder_embeds=lambda index: counts[index])


def video_scheduler(store_spec, **kwargs):
    sched = scheduler(store_spec, **kwargs)
    sched.resolver._cache["video"] = {"video_grid_thw"}  # what Qwen2-VL declares
    return sched


def as_floats(data: np.ndarray) -> np.ndarray:
    return data.view(np.float32).reshape(-1, HIDDEN)


# -- keys ---------------------------------------------------------------------------------
def test_part_and_joined_keys_round_trip_and_a_plain_key_has_no_parts():
    parts = [part_key("3f9a", i) for i in range(3)]
    assert parts == ["3f9a.0", "3f9a.1", "3f9a.2"]
    assert part_keys(joined_key(parts)) == parts
    assert joined_key(["3f9a.0"]) == "3f9a.0"  # one part is itself: a plain key
    assert part_keys("3f9a.0") is None
    assert part_keys("3f9a") is None
    assert part_keys(joined_key([f"k.{i}" for i in range(MAX_PARTS)])) is not None


@pytest.mark.parametrize("key", ["a.0,,a.2", ",a.0", "a.0,", ",",
                                 joined_key([f"k.{i}" for i in range(MAX_PARTS + 1)])])
def test_a_malformed_joined_key_is_refused(key):
    with pytest.raises(ValueError):
        part_keys(key)


# -- the loader ---------------------------------------------------------------------------
@pytest.fixture
def loader(store_spec):
    with open_store(store_spec) as store:
        made = FeatureLoader(store, budget_bytes=1 << 20)
        yield made
        made.close()


def test_a_request_reads_a_video_s_chunks_joined_in_order(store_spec, loader):
    key, whole = put_video(store_spec, "want-vid", [3, 2, 4])
    item = loader.want(key)
    assert item.done.wait(5)
    assert item.error is None
    data, meta = item.result
    assert meta.shape == (9, HIDDEN) and meta.dtype == "float32"
    assert np.array_equal(as_floats(data), whole)
    # The chunks' own order, not the store's: the last chunk's rows come last.
    assert np.array_equal(as_floats(data)[-4:], chunk(2, 4))


def test_a_hinted_video_is_joined_in_the_listener_s_thread(store_spec, loader):
    key, whole = put_video(store_spec, "hint-vid", [2, 5])
    loader.hint([key])  # read in the calling thread: done on return
    item = loader.copy_here(key)
    assert item is not None and item.hinted
    assert item.result[1].shape == (7, HIDDEN)
    assert np.array_equal(as_floats(item.result[0]), whole)
    assert loader.want(key) is item and item.source == "prefetched"


def test_a_video_missing_one_chunk_is_a_miss_not_an_error(store_spec, loader):
    put_chunk(store_spec, "holey.0", 0, 3)
    put_chunk(store_spec, "holey.2", 2, 3)  # chunk 1 never stored (or evicted)
    item = loader.want(joined_key(["holey.0", "holey.1", "holey.2"]))
    assert item.done.wait(5)
    assert item.result is None and item.error is None
    loader.hint([joined_key(["holey.0", "holey.1"])])
    assert not loader.has_copy(joined_key(["holey.0", "holey.1"]))


@pytest.mark.parametrize("hidden, dtype", [(HIDDEN * 2, "float32"), (HIDDEN, "bfloat16")],
                         ids=["hidden-size", "dtype"])
def test_chunks_that_disagree_are_an_error_of_the_read_not_a_crash(store_spec, loader,
                                                                    hidden, dtype):
    base = f"odd-{hidden}-{dtype}"
    put_chunk(store_spec, f"{base}.0", 0, 3)
    put_chunk(store_spec, f"{base}.1", 1, 3, hidden=hidden, dtype=dtype)
    item = loader.want(f"{base}.0,{base}.1")
    assert item.done.wait(5)
    assert item.result is None and item.error and "disagree" in item.error
    assert loader._reader.is_alive()  # the reader thread lives on
    assert not loader.has_copy(f"{base}.0,{base}.1")


def test_a_malformed_joined_key_is_an_error_of_its_read(loader):
    item = loader.want("bad.0,,bad.2")
    assert item.done.wait(5)
    assert item.result is None and item.error
    loader.hint(["bad.0,"])  # the listener's thread survives it too
    assert not loader.has_copy("bad.0,")


def test_a_video_whose_chunks_disagree_does_not_stop_reads_of_other_features(
        store_spec, loader):
    """One bad video is not the store failing: the next read of another feature, moments
    later, must still go to the store."""
    put_chunk(store_spec, "bad-vid.0", 0, 3)
    put_chunk(store_spec, "bad-vid.1", 1, 3, hidden=HIDDEN * 2)
    store_feature(store_spec, "fine-image")
    bad = loader.want("bad-vid.0,bad-vid.1")
    assert bad.done.wait(5) and bad.error
    fine = loader.want("fine-image")
    assert fine.done.wait(5)
    assert fine.error is None and fine.result is not None


# -- the scheduler, consumer --------------------------------------------------------------
def test_a_video_is_read_under_its_chunks_and_loaded_under_vllm_s_hash(store_spec):
    key, whole = put_video(store_spec, "sched-vid", [3, 3])
    sched = video_scheduler(store_spec)
    req = request("v1", video("vllm-hash-1"), keys=[key], embeds=[6])
    assert sched.ensure_cache_available(req, 0) is False  # the read starts: it waits
    assert not sched.has_cache_item("vllm-hash-1")
    assert decided(sched, req) is True
    assert sched.has_cache_item("vllm-hash-1")
    assert sched.loader.copy_here("vllm-hash-1") is None  # nothing read under the hash
    sched.update_state_after_alloc(req, 0)
    loads = sched.build_connector_meta(step()).loads
    assert list(loads) == ["vllm-hash-1"]  # vLLM's encoder cache knows its own hash
    assert loads["vllm-hash-1"].meta.shape == (6, HIDDEN)
    assert np.array_equal(as_floats(loads["vllm-hash-1"].data), whole)
    sched.request_finished(req)
    assert not sched.has_cache_item("vllm-hash-1")
    assert not sched.loader.has_copy(key)  # given back with the request
    assert sched.recorder.take()["events"]["loaded"] == 1
    sched.shutdown()


def test_a_video_of_another_length_than_the_request_s_is_encoded_here(store_spec):
    key, _ = put_video(store_spec, "short-vid", [3, 2])  # 5 embeddings in all
    sched = video_scheduler(store_spec)
    req = request("v2", video("vllm-hash-2", pixels=True), keys=[key], embeds=[6])
    assert decided(sched, req) is True
    assert not sched.has_cache_item("vllm-hash-2")  # vLLM runs the encoder on it
    sched.update_state_after_alloc(req, 0)
    assert sched.build_connector_meta(step()).loads == {}
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    reference_only = request("v3", video("vllm-hash-2"), keys=[key], embeds=[6])
    assert decided(sched, reference_only) is False
    assert sched.take_unavailable_requests() == ({"v3"} if compat.EC_FAILS_REQUESTS else set())
    sched.shutdown()


def test_a_video_missing_a_chunk_is_encoded_here(store_spec):
    put_chunk(store_spec, "gap-vid.0", 0, 3)
    sched = video_scheduler(store_spec)
    req = request("v4", video("vllm-hash-4", pixels=True), keys=["gap-vid.0,gap-vid.1"],
                  embeds=[6])
    assert decided(sched, req) is True
    assert not sched.has_cache_item("vllm-hash-4")
    assert sched.recorder.take()["events"]["encoded_locally"] == 1
    sched.shutdown()


def test_without_named_keys_a_video_is_read_under_vllm_s_hash(store_spec):
    put_chunk(store_spec, "whole-video-hash", 0, 4)
    sched = video_scheduler(store_spec)
    for req_id, extra in (("v5", None), ("v6", []), ("v7", [""]), ("v8", "not-a-list")):
        req = request(req_id, video("whole-video-hash"), keys=extra)
        assert decided(sched, req) is True, extra
        assert sched.has_cache_item("whole-video-hash")
        sched.update_state_after_alloc(req, 0)
        load = sched.build_connector_meta(step()).loads["whole-video-hash"]
        assert np.array_equal(as_floats(load.data), chunk(0, 4))
        sched.request_finished(req)
    no_extra = SimpleNamespace(request_id="v9", mm_features=[video("whole-video-hash")],
                               get_num_encoder_embeds=lambda index: 4)  # no sampling_params
    assert decided(sched, no_extra) is True and sched.has_cache_item("whole-video-hash")
    sched.request_finished(no_extra)
    sched.shutdown()


def test_videos_take_their_named_keys_in_order_and_images_ignore_them(store_spec):
    first, first_whole = put_video(store_spec, "first-vid", [2, 2])
    second, second_whole = put_video(store_spec, "second-vid", [3])
    store_feature(store_spec, "image-hash")  # an image: stored under vLLM's hash
    sched = video_scheduler(store_spec)
    req = request("v10", video("hash-a", offset=5), feature("image-hash", offset=20),
                  video("hash-b", offset=40, length=3), keys=[first, second],
                  embeds=[4, 4, 3])
    assert decided(sched, req) is True
    assert all(sched.has_cache_item(h) for h in ("hash-a", "image-hash", "hash-b"))
    for index in range(3):
        sched.update_state_after_alloc(req, index)
    loads = sched.build_connector_meta(step()).loads
    assert set(loads) == {"hash-a", "image-hash", "hash-b"}
    assert np.array_equal(as_floats(loads["hash-a"].data), first_whole)
    assert np.array_equal(as_floats(loads["hash-b"].data), second_whole)
    assert loads["image-hash"].meta.placeholder == GRID
    sched.request_finished(req)
    assert not any(sched.has_cache_item(h) for h in ("hash-a", "image-hash", "hash-b"))
    sched.shutdown()


def test_a_second_video_the_proxy_named_no_key_for_is_read_under_its_hash(store_spec):
    first, _ = put_video(store_spec, "only-named", [2, 2])
    put_chunk(store_spec, "hash-unnamed", 5, 4)
    sched = video_scheduler(store_spec)
    req = request("v11", video("hash-named"), video("hash-unnamed", offset=30),
                  keys=[first])
    assert decided(sched, req) is True
    for index in range(2):
        sched.update_state_after_alloc(req, index)
    loads = sched.build_connector_meta(step()).loads
    assert np.array_equal(as_floats(loads["hash-unnamed"].data), chunk(5, 4))
    sched.request_finished(req)
    sched.shutdown()


def test_a_request_still_waiting_for_its_video_survives_another_request_ending(store_spec):
    """Another request's end drops aliases of copies nobody holds: the waiting request's
    alias must be there when its read is done and vLLM asks for vLLM's hash."""
    key, _ = put_video(store_spec, "late-vid", [2, 2])
    store_feature(store_spec, "other-image")
    sched = video_scheduler(store_spec)
    waiting = request("v12", video("late-hash"), keys=[key])
    other = request("v13", feature("other-image"))
    assert decided(sched, other) is True
    sched.ensure_cache_available(waiting, 0)
    sched.request_finished(other)
    assert decided(sched, waiting) is True
    assert sched.has_cache_item("late-hash")
    sched.request_finished(waiting)
    sched.shutdown()


# -- the scheduler, producer, and the worker ---------------------------------------------
def test_an_encoder_names_the_chunk_key_to_store_each_video_under(store_spec):
    sched = video_scheduler(store_spec, producer=True, consumer=False)
    req = request("e1", video("chunk-hash", pixels=True), feature("img-hash", offset=20),
                  keys=[part_key("enc-vid", 3)])
    assert sched.ensure_cache_available(req, 0) is True
    plan = sched.build_connector_meta(step())
    assert plan.store_as == {"chunk-hash": "enc-vid.3"}  # the image keeps its hash
    assert plan.publish == {"chunk-hash": VIDEO_GRID, "img-hash": GRID}
    assert sched.build_connector_meta(step()).store_as == {}  # said once
    plain = request("e2", video("plain-hash", pixels=True))
    assert sched.ensure_cache_available(plain, 0) is True
    assert sched.build_connector_meta(step()).store_as == {}


def test_an_instance_that_prefills_a_chunked_video_never_stores_it_whole(store_spec):
    # ec_both: a producer and a consumer. A video it prefills is named by its chunks
    # joined; encoded here, it must not be stored under that key, which no one reads.
    sched = video_scheduler(store_spec, producer=True, consumer=True)
    req = request("b1", video("whole-hash", pixels=True),
                  keys=[joined_key([part_key("gone", 0), part_key("gone", 1)])])
    sched.ensure_cache_available(req, 0)
    assert sched.build_connector_meta(step()).store_as == {}
    sched.request_finished(req)
    sched.shutdown()


@pytest.fixture
def encoder(store_spec):
    made = EPDECWorker(Settings(store=store_spec), producer=True, consumer=False)
    yield made
    made.shutdown()


def stored(store_spec, key: str):
    with open_store(store_spec) as store:
        return store.get(key)


def encoded(seed: float) -> torch.Tensor:
    return torch.full((4, HIDDEN), seed, dtype=torch.float32)


def test_a_worker_saves_a_chunk_under_the_key_its_step_named(store_spec, encoder):
    sched = video_scheduler(store_spec, producer=True, consumer=False)
    req = request("e3", video("enc-hash-0", pixels=True), keys=[part_key("saved-vid", 0)])
    assert sched.ensure_cache_available(req, 0)
    cache: dict[str, torch.Tensor] = {}
    encoder.start_save_caches(sched.build_connector_meta(step()), cache)
    cache["enc-hash-0"] = encoded(7.0)  # the encoder ran
    encoder.save(cache, "enc-hash-0")
    found = stored(store_spec, "saved-vid.0")
    assert found is not None
    assert found[1].shape == (4, HIDDEN) and found[1].placeholder == VIDEO_GRID
    assert np.array_equal(found[0], to_bytes(encoded(7.0))[0])
    assert stored(store_spec, "enc-hash-0") is None


def test_a_chunk_encoded_steps_after_its_request_came_is_saved_under_its_key(
        store_spec, encoder):
    cache: dict[str, torch.Tensor] = {}
    encoder.start_save_caches(ECStep(publish={"slow-hash": VIDEO_GRID},
                                     store_as={"slow-hash": "slow-vid.1"}), cache)
    encoder.start_save_caches(ECStep(), cache)  # the encoder budget was spent elsewhere
    encoder.start_save_caches(ECStep(publish={"other": GRID}), cache)
    cache["slow-hash"] = encoded(2.0)
    encoder.save(cache, "slow-hash")
    found = stored(store_spec, "slow-vid.1")
    assert found is not None and found[1].placeholder == VIDEO_GRID
    assert np.array_equal(found[0], to_bytes(encoded(2.0))[0])
    assert stored(store_spec, "slow-hash") is None


def test_a_chunk_already_in_the_encoder_cache_is_stored_under_its_key(store_spec, encoder):
    """vLLM runs no encoder for a chunk it holds already (no save_caches): the step
    stores it from the encoder cache, under the key the proxy named."""
    cache = {"cached-hash": encoded(4.0)}
    encoder.start_save_caches(ECStep(publish={"cached-hash": VIDEO_GRID},
                                     store_as={"cached-hash": "cached-vid.2"}), cache)
    found = stored(store_spec, "cached-vid.2")
    assert found is not None and np.array_equal(found[0], to_bytes(encoded(4.0))[0])
    assert stored(store_spec, "cached-hash") is None


@pytest.mark.parametrize("starts_saves", [NEW_API, OLD_API])
def test_the_connector_saves_a_chunk_a_step_after_the_step_that_named_its_key(
        store_spec, monkeypatch, starts_saves):
    monkeypatch.setattr(compat, "EC_START_SAVE_CACHES", starts_saves)
    connector = ec_connector(store_spec, "WORKER", producer=True, consumer=False)
    mm_hash, key = f"conn-hash-{starts_saves}", f"conn-vid-{starts_saves}.0"
    cache: dict[str, torch.Tensor] = {}

    def run_step(plan: ECStep, encodes: str | None = None) -> None:
        connector.bind_connector_metadata(plan)
        if starts_saves:
            connector.start_save_caches(encoder_cache=cache)
        if encodes is not None:
            cache[encodes] = encoded(9.0)
            connector.save_caches(cache, encodes)
        connector.get_finished(set())
        connector.clear_connector_metadata()

    try:
        run_step(ECStep(publish={mm_hash: VIDEO_GRID}, store_as={mm_hash: key}))
        run_step(ECStep(), encodes=mm_hash)
        found = stored(store_spec, key)
        assert found is not None and found[1].placeholder == VIDEO_GRID
        assert np.array_equal(found[0], to_bytes(encoded(9.0))[0])
        assert stored(store_spec, mm_hash) is None
    finally:
        connector.shutdown()
