"""Every shipped deployment file serves videos: each instance's command line allows
at least four videos a prompt (an encoder request carries up to four chunks of one
video), keeps every frame the proxy sends (vLLM's video loader keeps only its first 32
otherwise), and has a context long enough for a 64-frame video plus its question at
the platform's frame size. Nothing is started: the flags are read from the start-up
plan's command lines (the engine's own parser checks them: test_flagcheck.py,
`epd-serve check-flags`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from epd_serve.proxy.guards import Limits
from epd_serve.runtime import bringup
from epd_serve.runtime.plan import startup_plan

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted(REPO.glob("configs/*/*.yaml"))

# The vision geometry of each shipped model (by the model folder's name): ViT patch
# side, spatial merge (merge x merge patches make one token), frames per temporal
# patch, and the video processor's per-frame pixel bounds (Qwen2-VL's video processor
# defaults, which both models use: 128 and 768 tokens' worth of 28x28 pixels).
MODELS = {
    "tiny-qwen2-vl": dict(patch=14, merge=2, temporal=2,
                          min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28),
    "Qwen2.5-VL-7B-Instruct": dict(patch=14, merge=2, temporal=2,
                                   min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28),
}
# The frame (width, height) each platform's files are sized for. CPU: the load tool's
# video workloads (224x224, the benchmark shape). GPU and NPU: the largest frame the
# proxy sends (it scales frames down to at most `video_frame_pixels`, 768*28*28), here
# as a 4:3 frame of exactly that many pixels.
FRAME = {"cpu": (224, 224), "cuda": (896, 672), "ascend": (896, 672)}
VIDEO_FRAMES = 64  # the most frames the proxy gives a video (Limits.max_video_frames)
TEXT_TOKENS = 512  # room for the question, the chat template and the answer


def name_of(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def smart_resize(width: int, height: int, geo: dict) -> tuple[int, int]:
    """Qwen2-VL's resize: both sides to multiples of patch*merge, the area into the
    processor's pixel bounds (transformers' smart_resize)."""
    factor = geo["patch"] * geo["merge"]
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > geo["max_pixels"]:
        beta = math.sqrt(height * width / geo["max_pixels"])
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < geo["min_pixels"]:
        beta = math.sqrt(geo["min_pixels"] / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return w, h


def video_tokens(frames: int, width: int, height: int, geo: dict) -> int:
    w, h = smart_resize(width, height, geo)
    per_temporal_patch = (w // geo["patch"]) * (h // geo["patch"]) // geo["merge"] ** 2
    return math.ceil(frames / geo["temporal"]) * per_temporal_patch


def test_token_table_matches_the_known_shapes():
    # 224x224 is upscaled to 336x336 (the 128-token floor): 144 tokens a frame pair.
    assert video_tokens(64, 224, 224, MODELS["tiny-qwen2-vl"]) == 4608
    # The proxy's largest frame: 768 tokens a frame pair.
    assert video_tokens(64, 896, 672, MODELS["Qwen2.5-VL-7B-Instruct"]) == 24576
    # No frame the proxy may send costs more than the table's largest frame.
    limits = Limits()
    assert limits.max_video_frames == VIDEO_FRAMES
    for geo in MODELS.values():
        assert limits.video_frame_pixels <= geo["max_pixels"]
        assert video_tokens(2, 1000, 602, geo) <= 768


def test_token_table_matches_the_video_processor():
    transformers = pytest.importorskip("transformers")
    size = transformers.Qwen2VLVideoProcessor().size
    for geo in MODELS.values():
        assert (size["shortest_edge"], size["longest_edge"]) == (geo["min_pixels"], geo["max_pixels"])


def engine_flags(path: Path, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Instance -> {flag: value} of the flags this test reads, from its command line."""
    dep = bringup.load(path, work_dir=str(tmp_path / "work"))
    wanted = ("--limit-mm-per-prompt", "--media-io-kwargs", "--max-model-len")
    out = {}
    for step in startup_plan(dep):
        if step.launch is None:  # the proxy, the MM Store: no engine
            continue
        argv = list(step.command)
        out[step.name] = {flag: argv[argv.index(flag) + 1] for flag in wanted if flag in argv}
        out[step.name]["platform"] = dep.platform.name
        out[step.name]["model"] = Path(step.launch.model).name
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=name_of)
def test_every_instance_serves_64_frame_videos(path, tmp_path):
    for instance, flags in engine_flags(path, tmp_path).items():
        where = f"{name_of(path)} {instance}"
        assert "--limit-mm-per-prompt" in flags, f"{where}: no --limit-mm-per-prompt"
        limits = json.loads(flags["--limit-mm-per-prompt"])
        video = limits.get("video", 999)
        options = video if isinstance(video, dict) else {"count": video}
        assert options.get("count", 999) >= 4, f"{where}: fewer than 4 videos a prompt"
        assert set(options) <= {"count", "num_frames", "width", "height"}, where
        # CPU profiles small frames (start-up); a device profiles vLLM's largest video,
        # so the memory its encoder reserves covers every video the proxy sends.
        if flags["platform"] == "cpu":
            assert (options.get("width"), options.get("height")) == FRAME["cpu"], where
        else:
            assert not {"num_frames", "width", "height"} & set(options), where

        assert "--media-io-kwargs" in flags, f"{where}: vLLM would keep only 32 frames"
        media = json.loads(flags["--media-io-kwargs"])
        assert media.get("video", {}).get("num_frames") == -1, where

        geo = MODELS[flags["model"]]
        need = video_tokens(VIDEO_FRAMES, *FRAME[flags["platform"]], geo) + TEXT_TOKENS
        assert int(flags["--max-model-len"]) >= need, \
            f"{where}: max_model_len {flags['--max-model-len']} < {need} tokens"


def test_the_shipped_files_cover_every_platform():
    assert {path.parent.name for path in SHIPPED} == {"cpu", "h800", "atlas-800i-a2"}
    assert set(FRAME) == {bringup.load(path).platform.name for path in SHIPPED}
