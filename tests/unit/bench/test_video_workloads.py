"""The video workloads: what their requests ask, the bodies they become (a real mp4 of
the right frame count before the text), determinism, and each request's modality."""

from __future__ import annotations

import base64
import io
import json

import pytest

from epd_serve.bench import workloads
from epd_serve.bench.workloads import ImageRef, RequestSpec, VideoRef


def decoded_frames(url: str) -> tuple[int, tuple[int, int]]:
    """(frames, (width, height)) of a data:video/mp4 URL, decoded with PyAV."""
    import av

    head, data = url.split(",", 1)
    assert head == "data:video/mp4;base64"
    with av.open(io.BytesIO(base64.b64decode(data))) as box:
        frames = list(box.decode(video=0))
    return len(frames), (frames[0].width, frames[0].height)


def test_nextqa_shape_open_question_short_answers():
    specs = workloads.PRESETS["video-nextqa"].requests(50, seed=2)
    assert all(len(s.videos) == 1 and not s.images for s in specs)
    assert {(v.frames, v.width, v.height) for s in specs for v in s.videos} == {(8, 224, 224)}
    assert {s.max_tokens for s in specs} == {8}
    assert not any("A." in s.text for s in specs)
    assert len({s.videos[0] for s in specs}) == 50  # every request its own video


def test_videomme_shape_four_lettered_options():
    specs = workloads.PRESETS["video-mme"].requests(20, seed=2)
    assert {v.frames for s in specs for v in s.videos} == {64}
    assert all(s.max_tokens <= 8 for s in specs)
    for s in specs:
        assert all(f"\n{letter}. " in s.text for letter in "ABCD")
        assert "\nE. " not in s.text


def test_requests_are_deterministic_per_seed():
    preset = workloads.PRESETS["video-mme"]
    assert preset.requests(10, seed=5) == preset.requests(10, seed=5)
    first, other = preset.requests(10, seed=5), preset.requests(10, seed=6)
    assert {s.videos[0] for s in other}.isdisjoint({s.videos[0] for s in first})
    assert [s.text for s in other] != [s.text for s in first]


def test_questions_per_video_repeats_a_video():
    import dataclasses

    preset = dataclasses.replace(workloads.PRESETS["video-nextqa"], questions_per_video=3)
    videos = [s.videos[0] for s in preset.requests(9)]
    assert len(set(videos)) == 3 and videos[0] == videos[2] != videos[3]


def test_modality_of_each_kind_of_request():
    image, video = ImageRef(32, 32, 1), VideoRef(2, 32, 32, 1)
    assert RequestSpec(0, "x", (), 4).modality == "text"
    assert RequestSpec(0, "x", (image,), 4).modality == "image"
    assert RequestSpec(0, "x", (), 4, (video,)).modality == "video"
    both = RequestSpec(0, "x", (image,), 4, (video,))
    assert both.modality == "image+video" and both.multimodal
    assert not RequestSpec(0, "x", (), 4).multimodal


def test_video_body_holds_a_decodable_mp4_before_the_text():
    specs = workloads.PRESETS["video-nextqa"].requests(2, seed=1)
    bodies = [json.loads(b) for b in workloads.build_bodies(specs, "m")]
    for body, spec in zip(bodies, specs):
        content = body["messages"][0]["content"]
        assert [part["type"] for part in content] == ["video_url", "text"]
        assert content[1]["text"] == spec.text
        assert decoded_frames(content[0]["video_url"]["url"]) == (8, (224, 224))
        assert body["stream"] and body["max_tokens"] == 8
    assert bodies[0]["messages"][0]["content"][0] != bodies[1]["messages"][0]["content"][0]


def test_videomme_body_has_64_frames():
    (spec,) = workloads.PRESETS["video-mme"].requests(1, seed=3)
    (body,) = workloads.build_bodies([spec], "m")
    url = json.loads(body)["messages"][0]["content"][0]["video_url"]["url"]
    assert decoded_frames(url)[0] == 64


def test_media_order_video_then_image_then_text():
    spec = RequestSpec(0, "what?", (ImageRef(32, 32, 1),), 4, (VideoRef(2, 32, 32, 1),))
    (body,) = workloads.build_bodies([spec], "m")
    content = json.loads(body)["messages"][0]["content"]
    assert [p["type"] for p in content] == ["video_url", "image_url", "text"]


def test_a_video_is_made_once_however_many_requests_share_it(monkeypatch):
    made = []
    real = workloads.make_video
    monkeypatch.setattr(workloads, "make_video", lambda *a: made.append(a) or real(*a))
    workloads._video_url.cache_clear()
    ref = VideoRef(2, 32, 32, seed=12345)
    specs = [RequestSpec(i, "q", (), 4, (ref,)) for i in range(5)]
    bodies = list(workloads.build_bodies(specs, "m"))
    list(workloads.build_bodies(specs, "m"))  # built again: the next deployment's run
    assert made == [(2, 32, 32, 12345)]
    assert len(set(bodies)) == 1


def test_request_trace_rows_with_videos(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0.0, "prompt_words": 4,
                                 "videos": [[16, 320, 240]], "output_tokens": 5}) + "\n")
    assert workloads.is_request_trace(trace)
    (spec,) = workloads.request_trace(trace, None)
    assert spec.modality == "video" and spec.max_tokens == 5
    assert (spec.videos[0].frames, spec.videos[0].width, spec.videos[0].height) == (16, 320, 240)


@pytest.mark.parametrize("name", ["video-nextqa", "video-mme"])
def test_load_workload_keeps_the_presets_answer_length_without_an_override(name):
    specs = workloads.load_workload(name, 3, None)
    assert {s.max_tokens for s in specs} == {workloads.PRESETS[name].output_tokens}
    assert {s.max_tokens for s in workloads.load_workload(name, 3, 32)} == {32}
