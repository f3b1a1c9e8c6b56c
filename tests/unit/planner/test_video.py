"""Videos in the planner: visual tokens of a video, what encoding one costs, its chunks
spread over encoders in the simulator, the planner's stage work, and the latency
prediction script."""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pytest

from epd_serve.bench.timings import SLO
from epd_serve.bench.workloads import ImageRef, RequestSpec, VideoRef
from epd_serve.planner import planner, profile as profiles, simulator
from epd_serve.planner.profile import EncodeItem
from epd_serve.topology import notation

from .conftest import make_profile

REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
SLO_ = SLO(ttft_ms=5000, tpot_ms=100)


def video_request(i: int, frames: int, size: int = 224, max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(i, "which option ?", (), max_tokens, (VideoRef(frames, size, size, i),))


def test_video_tokens_use_the_video_processors_limits():
    cpu = profiles.load("cpu-tiny-qwen2-vl")  # Qwen2-VL's video processor: >= 128 tokens a frame
    assert cpu.image_tokens(224, 224) == 64
    assert cpu.video_tokens(8, 224, 224) == 4 * 144  # 224 -> 336 px: 12 x 12 a temporal patch
    assert cpu.video_tokens(7, 224, 224) == cpu.video_tokens(8, 224, 224)  # ceil(F / 2)
    assert cpu.video_tokens(100, 224, 224) == 32 * 144  # sampled down to 64 frames
    plain = make_profile()  # no video section: the image's limits, two frames a patch
    assert plain.video_tokens(8, 224, 224) == 4 * plain.image_tokens(224, 224) == 256
    assert make_profile(video={"temporal_patch": 4}).video_tokens(8, 224, 224) == 2 * 64


def test_chunks_add_up_to_the_whole_video():
    p = make_profile()
    assert p.video_items(10, 224, 224, 4) == [EncodeItem(128, 4), EncodeItem(128, 4),
                                              EncodeItem(64, 2)]
    assert p.video_items(10, 224, 224) == [EncodeItem(320, 10)]
    assert sum(i.tokens for i in p.video_items(64, 224, 224, 4)) == p.video_tokens(64, 224, 224)
    spec = RequestSpec(0, "q", (ImageRef(224, 224, 1),), 4, (VideoRef(8, 224, 224, 2),))
    assert p.encode_items(spec, 4) == [EncodeItem(64), EncodeItem(128, 4), EncodeItem(128, 4)]
    assert p.request_tokens(spec) == (10 + 1, [64, 256])  # template + one word


def test_encode_cost_per_item_frame_and_token():
    p = make_profile(encoder={"fixed_ms": 5.0, "per_image_ms": 2.0, "per_token_ms": 0.1,
                              "per_frame_ms": 1.5})
    chunk = p.video_items(4, 224, 224, 4)  # one chunk: 4 frames, 128 tokens
    assert p.items_ms(chunk) == pytest.approx(5.0 + 2.0 + 4 * 1.5 + 128 * 0.1)
    assert p.items_ms([EncodeItem(64)]) == p.encode_ms([64]) == pytest.approx(5.0 + 2.0 + 6.4)
    # Without per_frame_ms a frame costs what an image's pre-processing does.
    default = make_profile(encoder={"per_image_ms": 2.0})
    assert default.encoder.frame_ms == 2.0
    assert default.items_ms(chunk) == pytest.approx(5.0 + 2.0 + 4 * 2.0 + 128 * 0.1)


@pytest.mark.parametrize("name", profiles.shipped())
def test_every_shipped_profile_prices_a_frame(name):
    p = profiles.load(name)
    assert p.video is not None and p.video.temporal_patch == 2
    assert p.encoder.per_frame_ms is not None and p.encoder.per_frame_ms > 0


def encoder_bound():
    """Encoding dominates: 1 ms a visual token, every other cost small."""
    return make_profile(encoder={"fixed_ms": 1.0, "per_image_ms": 0.0, "per_token_ms": 1.0,
                                 "per_frame_ms": 0.5},
                        llm={"fixed_ms": 1.0, "per_prefill_token_ms": 0.001,
                             "per_decode_seq_ms": 0.1})


def lone_videos(deployment: str, profile, frames: int, n: int = 3, chunk_frames: int = 4):
    specs = [video_request(i, frames) for i in range(n)]
    offsets = np.arange(n) * 1000.0  # one at a time
    instances = simulator.instances_of(notation.parse(deployment))
    return simulator.simulate(instances, profile, specs, offsets, SLO_, label=deployment,
                              video_chunk_frames=chunk_frames)


def test_two_encoders_split_a_video_and_finish_it_sooner():
    p = encoder_bound()
    one, one_sim = lone_videos("E-P-D", p, 64)
    two, two_sim = lone_videos("2E-1P-1D", p, 64)
    assert all(r.ok for r in one.records + two.records)
    # 16 chunks of 4 frames: all on the one encoder, or half on each of two.
    assert one_sim.instances["e0"]["images"] == 3 * 16
    assert two_sim.instances["e0"]["images"] == two_sim.instances["e1"]["images"] == 3 * 8
    assert all(r.stages_header.startswith("E=e0+e1:") for r in two.records)
    ttft_one = one.summary["ttft_ms"]["avg"]
    ttft_two = two.summary["ttft_ms"]["avg"]
    encode_one = p.items_ms(p.video_items(64, 224, 224, 4))  # the whole video in one pass
    encode_two = p.items_ms(p.video_items(64, 224, 224, 4)[:8])
    assert ttft_one - ttft_two == pytest.approx(encode_one - encode_two, rel=1e-6)
    assert two.summary["e2el_ms"]["avg"] < 0.7 * one.summary["e2el_ms"]["avg"]


def test_prefill_prepares_a_videos_frames_again_when_encoders_computed_them():
    # The proxy sends prefill a video's frames (no reference): its processor prepares
    # them again, as long as per_frame_ms says a frame takes, before the prompt runs.
    cheap, dear = encoder_bound(), encoder_bound()
    dear.encoder.per_frame_ms = cheap.encoder.per_frame_ms + 10.0
    split = [lone_videos("E-P-D", p, 64, n=1)[0].summary["ttft_ms"]["avg"]
             for p in (cheap, dear)]
    whole = [lone_videos("TP1", p, 64, n=1)[0].summary["ttft_ms"]["avg"]
             for p in (cheap, dear)]
    # TP1 prepares the frames once (in its encoder pass); E-P-D on E and again on P.
    assert whole[1] - whole[0] == pytest.approx(64 * 10.0, rel=1e-6)
    assert split[1] - split[0] == pytest.approx(2 * 64 * 10.0, abs=5.0)  # give or take a step


def test_a_monolithic_instance_encodes_a_video_whole():
    p = encoder_bound()
    result, sim = lone_videos("TP1", p, 64, n=1)
    assert sim.instances["epd0"]["images"] == 1
    assert result.records[0].input_tokens == 13 + p.video_tokens(64, 224, 224)  # template + 3 words


def test_chunk_size_sets_the_encoder_items():
    _, sim = lone_videos("E-P-D", encoder_bound(), 64, n=1, chunk_frames=8)
    assert sim.instances["e0"]["images"] == 8
    with pytest.raises(ValueError, match="video_chunk_frames"):
        lone_videos("E-P-D", encoder_bound(), 8, n=1, chunk_frames=0)


def test_simulated_records_carry_the_modality():
    specs = [video_request(0, 8), RequestSpec(1, "hello there", (), 4),
             RequestSpec(2, "see", (ImageRef(224, 224, 1),), 4)]
    run, _ = simulator.simulate(simulator.instances_of(notation.parse("E-P-D")), make_profile(),
                                specs, [0.0, 0.5, 1.0], SLO_)
    assert [r.modality for r in run.records] == ["video", "text", "image"]
    assert list(run.summary["by_modality"]) == ["text", "image", "video"]


def test_planner_counts_a_videos_tokens_as_encoder_work():
    p = make_profile()
    specs = [video_request(i, 8) for i in range(4)]
    work = planner.stage_work(p, specs, SLO_)
    assert work.work["E"] == 4 * p.video_tokens(8, 224, 224)
    assert work.work["P"] == 4 * (13 + p.video_tokens(8, 224, 224))
    result = planner.plan(p, specs, np.arange(4) * 0.5, SLO_, devices=3)
    assert result.best.at_rate.summary["success_requests"] == 4


def video_latency_sim():
    """benchmarks/video_latency_sim.py as a module (benchmarks/ is not a package)."""
    if "video_latency_sim" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "video_latency_sim", REPO / "benchmarks/video_latency_sim.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["video_latency_sim"] = module
        spec.loader.exec_module(module)
    return sys.modules["video_latency_sim"]


SUMMARY = re.compile(r"^summary: profile=(\S+) ratio_8=([\d.]+) ratio_64=([\d.]+) "
                     r"split_gain_64=([\d.]+)$", re.M)


def test_prediction_script_prints_a_summary_per_profile(capsys):
    module = video_latency_sim()
    assert module.main(["--requests", "2"]) == 0
    printed = capsys.readouterr().out
    found = {m[0]: tuple(float(x) for x in m[1:]) for m in SUMMARY.findall(printed)}
    assert set(found) == set(profiles.shipped())
    # Accelerators: a second encoder takes half the chunks of a 64-frame video. On the CPU
    # host two encoders share the same cores (contention 1.0): no gain.
    assert found["atlas-800i-a2-openpangu-7b-vl"][2] > 1.1
    assert found["h800-qwen3-vl-8b"][2] > 1.1
    assert found["cpu-tiny-qwen2-vl"][2] == pytest.approx(1.0, abs=0.05)
    result = module.predict("h800-qwen3-vl-8b", requests=2)
    assert module.summary_line(result) in printed.splitlines()
    r = result["runs"]
    assert r[64]["epd1"]["e2el_mean"] / r[64]["tp1"]["e2el_mean"] == pytest.approx(
        result["ratios"]["ratio_64"])
