"""Videos in the proxy: what is accepted and refused before a frame is decoded, the
frames every stage is sent, and a video's trip through fake E, P and D with a real
shared-memory store (chunks encoded apart, named to prefill joined, skipped when
stored)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from PIL import Image

from epd_serve.instances.payloads import chat_body
from epd_serve.instances.videos import encode_video, make_frames, make_video, video_data_url
from epd_serve.mmstore import FeatureMeta, open_store
from epd_serve.protocols.feature_chunks import VIDEO_KEYS_ARG, joined_key
from epd_serve.proxy.encoding import Encoder
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import CHAT_PATH, Limits
from epd_serve.proxy.request import parse_request
from epd_serve.proxy.tenancy import video_chunk_keys
from epd_serve.proxy import video as video_module
from epd_serve.proxy.video import (
    VideoPreparer,
    decode_video,
    frame_list_url,
    sample_indices,
    split_chunks,
)

from .test_features import deployment, parts
from .test_routing import MIXED, router, table

LIMITS = Limits()


def refused(url: str, limits: Limits = LIMITS) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        decode_video(url, limits)
    return caught.value


def frames_of(url: str) -> list[np.ndarray]:
    payload = url.split(",", 1)[1]
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for f in payload.split(",")]


# -- decoding --------------------------------------------------------------------------
@pytest.mark.parametrize("container,codec", [("mp4", "libx264"), ("mp4", "mpeg4"),
                                             ("webm", "libvpx-vp9"), ("avi", "mjpeg")])
def test_a_video_becomes_its_frames_as_jpeg_whatever_its_container(container, codec):
    source = make_frames(6, 64, 48, seed=1)
    video = decode_video(video_data_url(encode_video(source, container=container,
                                                     codec=codec), container), LIMITS)
    assert (len(video.frames), video.width, video.height, video.source_frames) == \
        (6, 64, 48, 6)
    assert video.url.startswith("data:video/jpeg;base64,")
    decoded = frames_of(video.url)
    assert [f.shape for f in decoded] == [(48, 64, 3)] * 6
    # The frames in order: each is closest to its own source frame.
    for i, frame in enumerate(decoded):
        errors = [np.abs(frame.astype(int) - s.astype(int)).mean() for s in source]
        assert int(np.argmin(errors)) == i


def test_a_long_video_is_sampled_evenly_down_to_the_limit():
    video = decode_video(video_data_url(make_video(40, 32, 32, codec="mpeg4")),
                         Limits(max_video_frames=8))
    assert len(video.frames) == 8 and video.source_frames == 40
    assert sample_indices(40, 8) == [0, 6, 11, 17, 22, 28, 33, 39]
    assert sample_indices(5, 8) == [0, 1, 2, 3, 4]


def test_the_same_video_gives_the_same_frames_every_time():
    url = video_data_url(make_video(8, 64, 64, seed=3))
    assert decode_video(url, LIMITS).url == decode_video(url, LIMITS).url


def test_large_frames_are_shrunk_before_they_are_sent():
    video = decode_video(video_data_url(make_video(2, 256, 128, codec="mpeg4")),
                         Limits(video_frame_pixels=64 * 32))
    assert (video.width, video.height) == (64, 32)
    assert frames_of(video.url)[0].shape == (32, 64, 3)


def test_a_clients_frame_list_is_checked_and_sent_as_ours():
    frames = make_frames(3, 32, 32, seed=4)
    jpegs = []
    for pixels in frames:
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG")
        jpegs.append(base64.b64encode(buf.getvalue()).decode())
    video = decode_video(frame_list_url(jpegs), LIMITS)
    assert len(video.frames) == 3 and video.frames != jpegs  # re-encoded as JPEG
    err = refused(frame_list_url([jpegs[0], "bm90IGFuIGltYWdl"]))
    assert (err.status, err.reason) == (400, "undecodable_image")


@pytest.mark.parametrize("data,limits,status,reason,words", [
    (b"\x89PNG\r\n\x1a\n" + bytes(64), LIMITS, 400, "unsupported_video", "not a video"),
    (b"\x00\x00\x00\x18ftypmp42" + os.urandom(2048), LIMITS, 400, "undecodable_video",
     "not a readable video"),
    ("too many", Limits(max_video_source_frames=10), 413, "too_many_frames", "more than 10"),
    ("too many", Limits(max_video_seconds=1), 413, "video_too_long", "lasts 2 s"),
    ("too many", Limits(max_video_frame_pixels=100), 413, "video_too_large", "16x16"),
    ("too many", Limits(video_decode_timeout_s=1e-9), 400, "video_decode_timeout", "longer"),
])
def test_a_video_that_is_not_one_or_too_large_is_refused_with_the_reason(
        data, limits, status, reason, words):
    if data == "too many":
        data = make_video(16, 16, 16, fps=8, codec="mpeg4")  # 2 s
    err = refused(video_data_url(data), limits)
    assert (err.status, err.reason) == (status, reason), err.message
    assert words in err.message, err.message


def test_a_video_over_the_byte_limit_is_refused_as_a_video():
    err = refused(video_data_url(make_video(8, 64, 64)), Limits(max_media_bytes=100))
    assert (err.status, err.reason) == (413, "video_too_large")
    assert "the video is" in err.message and "bytes per video" in err.message


def test_a_codec_outside_the_list_is_refused_by_name():
    data = encode_video(make_frames(2, 16, 16), container="matroska", codec="ffv1")
    err = refused(video_data_url(data, "matroska"))
    assert (err.status, err.reason) == (400, "unsupported_video")
    assert "'ffv1'" in err.message


def test_chunks_cover_the_frames_in_order():
    assert split_chunks(9, 4) == ((0, 4), (4, 8), (8, 9))
    assert split_chunks(4, 4) == ((0, 4),)


# -- the request ----------------------------------------------------------------------
def video_request(url: str, **extra) -> dict:
    body = chat_body("fake", "what happens", max_tokens=2)
    body["messages"][0]["content"] = [{"type": "video_url", "video_url": {"url": url}},
                                      {"type": "text", "text": "what happens"}]
    return {**body, **extra}


def test_a_client_may_not_name_the_keys_prefill_reads_a_video_under():
    body = video_request("data:video/mp4;base64,AAAA", vllm_xargs={VIDEO_KEYS_ARG: ["x.0"]})
    with pytest.raises(ProxyError) as caught:
        parse_request(msgspec.json.encode(body), CHAT_PATH, LIMITS)
    assert caught.value.status == 400 and VIDEO_KEYS_ARG in caught.value.message


def test_a_videos_chunks_are_spread_over_the_encoders_even_under_affinity():
    t = table("e0:E", "e1:E")
    work = SimpleNamespace(keys=[f"v.{i}" for i in range(8)], sizes=[1.0] * 8,
                           is_chunk=lambda index: True)
    batches = Encoder(None, router(t, E=MIXED), batch=2).assign(work, list(range(8)))
    per_encoder = {}
    for order, items in batches:
        per_encoder.setdefault(order[0].name, []).extend(items)
    assert sorted(len(items) for items in per_encoder.values()) == [4, 4]


# -- through fake stages ---------------------------------------------------------------
def test_a_video_is_encoded_in_chunks_and_prefill_gets_a_reference_to_them_joined(
        store_spec):
    url = video_data_url(make_video(10, 32, 32, seed=5))
    sent = decode_video(url, LIMITS).url
    chunks = video_chunk_keys("fake", sent)
    assert len(chunks) == 3  # 10 frames: 4 + 4 + 2
    with deployment(store_spec) as (client, apps, hints):
        resp = client.post("/v1/chat/completions", json=video_request(url))
        assert resp.status_code == 200, resp.text
        stages = resp.headers["x-epd-stages"]
        assert stages.startswith("E=e0:") and stages.endswith("IMG=ref"), stages
        encoded = apps["e0"].state.requests
        seen = [(p["uuid"], len(p["video_url"]["url"].split(",")) - 1)
                for r in encoded for p in parts(r)]
        assert sorted(seen) == sorted(zip(chunks, (4, 4, 2)))
        for r in encoded:  # each encoder request names the key to store each chunk under
            assert r["body"]["vllm_xargs"][VIDEO_KEYS_ARG] == [p["uuid"] for p in parts(r)]
        for stage in ("p1", "d2"):
            (request,) = apps[stage].state.requests
            # No frames: the video's grid (2 + 2 + 1 temporal patches, as each chunk's
            # encoder published them) under its chunks' joined key.
            assert parts(request)[0] == {"type": "video_embeds", "uuid": joined_key(chunks),
                                         "video_embeds": {"video_grid_thw": [5, 4, 4]}}
            assert request["body"]["vllm_xargs"][VIDEO_KEYS_ARG] == [joined_key(chunks)]
        assert hints.poll(2000)
        assert msgspec.msgpack.decode(hints.recv()) == [joined_key(chunks)]


def store_chunks(store_spec, chunks: list[str]) -> None:
    """Each chunk's feature in the store, with no placeholder metadata."""
    with open_store(store_spec) as store:
        for key in chunks:
            store.put(key, np.zeros(64, np.uint8), FeatureMeta((4, 8), "bfloat16"))


def test_a_video_whose_chunks_published_no_grid_goes_to_prefill_as_frames(store_spec):
    """Chunks stored without placeholder metadata (an encoder that published none):
    nothing to make a reference of, so prefill gets the frames with the chunks' keys."""
    url = video_data_url(make_video(6, 32, 32, seed=8))
    sent = decode_video(url, LIMITS).url
    chunks = video_chunk_keys("fake", sent)
    store_chunks(store_spec, chunks)
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=video_request(url))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].endswith("IMG=keyed")
        (request,) = apps["p1"].state.requests
        assert parts(request)[0]["video_url"]["url"] == sent
        assert request["body"]["vllm_xargs"][VIDEO_KEYS_ARG] == [joined_key(chunks)]


def test_a_video_whose_chunks_the_store_holds_skips_the_encoder(store_spec):
    url = video_data_url(make_video(6, 32, 32, seed=6))
    chunks = video_chunk_keys("fake", decode_video(url, LIMITS).url)
    store_chunks(store_spec, chunks)
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=video_request(url))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-epd-stages"].startswith("E=store:")
        assert apps["e0"].state.requests == []


def test_a_video_with_one_chunk_stored_sends_only_the_others(store_spec):
    url = video_data_url(make_video(8, 32, 32, seed=7))
    chunks = video_chunk_keys("fake", decode_video(url, LIMITS).url)
    with open_store(store_spec) as store:
        store.put(chunks[0], np.zeros(64, np.uint8), FeatureMeta((4, 8), "bfloat16"))
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=video_request(url))
        assert resp.status_code == 200, resp.text
        (encoded,) = apps["e0"].state.requests
        assert [p["uuid"] for p in parts(encoded)] == chunks[1:]


def test_a_bad_video_never_reaches_a_stage(store_spec):
    with deployment(store_spec) as (client, apps, _):
        resp = client.post("/v1/chat/completions", json=video_request(
            "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()))
        assert resp.status_code == 400, resp.text
        assert "not a video" in resp.json()["error"]["message"]
        assert all(app.state.requests == [] for app in apps.values())


# -- decodes that outlive their request; the queue ------------------------------------
def test_a_stopped_decode_ends_at_its_next_frame_with_its_reason():
    stop = threading.Event()
    stop.set()
    with pytest.raises(ProxyError) as caught:
        decode_video(video_data_url(make_video(8, 64, 64, seed=3)), LIMITS, "video", stop)
    assert caught.value.status == 499 and "decode stopped" in caught.value.message


class SlowDecodes:
    """decode_video stood in for by one that runs until told to stop (or released)."""

    def __init__(self):
        self.started, self.stopped, self.release = [], [], threading.Event()

    def __call__(self, url, limits, where, stop):
        self.started.append(url)
        while not (stop.is_set() or self.release.is_set()):
            time.sleep(0.005)
        if stop.is_set():
            self.stopped.append(url)
            raise ProxyError(499, "stopped")
        return SimpleNamespace(url=url, frames=["f"], width=8, height=8)


def test_a_request_that_ends_stops_its_decode_and_frees_the_slot_only_after(monkeypatch):
    slow = SlowDecodes()
    monkeypatch.setattr(video_module, "decode_video", slow)

    async def run():
        preparer = VideoPreparer(Limits(max_video_decodes=1), 4)
        first = asyncio.ensure_future(preparer.prepare([video_item("a")]))
        while not slow.started:
            await asyncio.sleep(0.005)
        first.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await first
        # The slot is the stopped thread's until it returns: the next decode starts
        # after that, never beside it.
        second = asyncio.ensure_future(preparer.prepare([video_item("b")]))
        while len(slow.started) < 2:
            await asyncio.sleep(0.005)
        assert slow.stopped == ["a"]
        slow.release.set()
        await second
        preparer.close()

    asyncio.run(run())


def test_past_the_queue_a_video_is_refused_with_503_not_queued(monkeypatch):
    slow = SlowDecodes()
    monkeypatch.setattr(video_module, "decode_video", slow)

    async def run():
        preparer = VideoPreparer(Limits(max_video_decodes=1, max_video_queue=1), 4)
        running = asyncio.ensure_future(preparer.prepare([video_item("a")]))
        waiting = asyncio.ensure_future(preparer.prepare([video_item("b")]))
        while not slow.started:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)  # "b" is waiting for the slot now
        with pytest.raises(ProxyError) as caught:
            await preparer.prepare([video_item("c")])
        assert caught.value.status == 503 and "waiting to be decoded" in caught.value.message
        slow.release.set()
        await asyncio.gather(running, waiting)
        assert slow.started == ["a", "b"]
        preparer.close()

    asyncio.run(run())


def test_one_client_holds_only_its_share_of_the_slots_and_waits_within_a_deadline(
        monkeypatch):
    """Two slots: one client's two videos decode one after the other, so another
    client's video takes the second slot at once; a wait past `video_wait_s` is a 503,
    never a request held without end."""
    slow = SlowDecodes()
    monkeypatch.setattr(video_module, "decode_video", slow)

    async def run():
        preparer = VideoPreparer(Limits(max_video_decodes=2, video_wait_s=0.2), 4)
        hog = asyncio.ensure_future(preparer.prepare([video_item("a1"), video_item("a2")],
                                                     "10.0.0.1"))
        while not slow.started:
            await asyncio.sleep(0.005)
        other = asyncio.ensure_future(preparer.prepare([video_item("b")], "10.0.0.2"))
        while len(slow.started) < 2:
            await asyncio.sleep(0.005)
        assert sorted(slow.started) == ["a1", "b"]  # a2 waits for a1, not for b
        # a2 waited past its deadline: the hog's request ends with a 503.
        with pytest.raises(ProxyError) as caught:
            await hog
        assert caught.value.status == 503 and "video_wait_s" in caught.value.message
        slow.release.set()
        await other
        while preparer._clients:  # the stopped decode returns: nothing is left held
            await asyncio.sleep(0.005)
        preparer.close()

    asyncio.run(run())


def video_item(url: str) -> SimpleNamespace:
    return SimpleNamespace(url=url, where="video")
