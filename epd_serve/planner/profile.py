"""A profile: what each stage of one model costs on one kind of device, read from a
YAML file that `epd-serve profile` writes (measured) or that ships with the package
(derived from published numbers, epd_serve/planner/profiles/).

Pure pydantic and arithmetic; the simulator, the budget search and the planner read
it. Times are milliseconds. A cost is linear in what an iteration holds, which is
what the papers' batch-latency curves show at the batch sizes serving uses (paper 001,
Figure 3): an encoder pass costs per item (an image, or a chunk of a video's frames),
per video frame and per visual token, a language-model iteration per prefill token,
per decoding sequence and per token of their contexts.

A video of F frames (at most `video.max_frames`, sampled as the proxy samples) becomes
ceil(F / temporal_patch) temporal patches, each with the visual tokens of one frame
resized as an image is (within the video processor's pixel limits). Sent through
encoders, the proxy splits it into chunks of `chunk_frames` frames, each encoded as an
item of its own; a monolithic or prefill instance encodes it whole.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from epd_serve.backends import PLATFORMS
from epd_serve.bench.workloads import RequestSpec
from epd_serve.planner.machine import Machine

PROFILES_DIR = Path(__file__).parent / "profiles"
# Where `epd-serve profile --quick` saves this machine's profiles, found by name before
# the shipped ones (relative to the working directory, like .epd/models).
LOCAL_PROFILES_ENV = "EPD_PROFILE_DIR"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageTokens(_Strict):
    """How an image becomes visual tokens (Qwen-VL's smart resize): each side rounded
    to `unit_px` (patch size x spatial merge), the area kept in [min, max] pixels."""

    unit_px: int = Field(28, description="Pixels per visual token side (14 x 2 for Qwen2-VL).")
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280


class VideoTokens(ImageTokens):
    """How a video's frames become visual tokens (Qwen-VL's video processor): each
    frame resized as an image is, within these limits (the model's video processor may
    have its own: Qwen2-VL's takes 128 to 768 tokens' worth of pixels per frame), and
    `temporal_patch` frames merged into one temporal patch."""

    temporal_patch: int = Field(2, ge=1, description="Frames per temporal patch (Qwen2-VL: 2).")
    max_frames: int = Field(64, ge=1, description="Frames kept of a longer video (the "
                            "proxy samples at most 64 uniformly).")


class EncodeItem(NamedTuple):
    """One item an encoder is given: an image (no frames), a video or a chunk of one."""

    tokens: int
    frames: int = 0


class EncoderCost(_Strict):
    """One encoder pass over a batch of items (images, videos, chunks of videos)."""

    fixed_ms: float = Field(description="Per pass (launch, scheduling).")
    per_image_ms: float = Field(description="Per item (pre-processing, per-item kernels).")
    per_token_ms: float = Field(description="Per visual token after merging.")
    per_frame_ms: float | None = Field(None, description="Per video frame, beyond its "
                                       "tokens: turning a decoded frame into the encoder's "
                                       "input (decode, resize, normalise, patchify), paid "
                                       "before the item's tokens. Default: per_image_ms, a "
                                       "frame costing what an image's pre-processing does.")

    @property
    def frame_ms(self) -> float:
        return self.per_image_ms if self.per_frame_ms is None else self.per_frame_ms


class LLMCost(_Strict):
    """One language-model iteration (chunked prefill and decode in one batch)."""

    fixed_ms: float = Field(description="Per iteration (scheduling, launch, sampling).")
    per_prefill_token_ms: float
    per_decode_seq_ms: float = Field(description="Per sequence decoding one token.")
    per_context_token_ms: float = Field(0.0, description="Per token of the decoding "
                                        "sequences' contexts (reading their KV).")
    mm_decode_once_ms: float = Field(0.0, description="Extra once per request with images, "
                                     "in the iterations after its first token (measured: "
                                     "~30 ms on the CPU backend while vLLM's attention split "
                                     "the KV over threads, its first ~8 steps slow; 0 since).")
    consumer_step_ms: float = Field(0.0, description="Extra per iteration of a decode "
                                    "instance that receives KV (its connector's work each "
                                    "step); measured by the hand-off run.")


class Transfers(_Strict):
    """What a request pays between stages and at the proxy."""

    hop_ms: float = Field(description="Proxy -> instance and back, per stage visit, with "
                          "the engine's API server's work on the request (chat template, "
                          "tokenising).")
    feature_fixed_ms: float = Field(0.0, description="E -> P per request (store put/get).")
    feature_bytes_per_token: float = Field(0.0, description="Encoder output bytes per visual token.")
    feature_gbps: float = Field(10.0, description="E -> P bandwidth, GB/s.")
    feature_hidden: float = Field(1.0, description="Share of the E -> P copy hidden by "
                                  "prefetching before prefill schedules the request.")
    kv_fixed_ms: float = Field(0.0, description="P -> D per request (handshake, commit).")
    kv_bytes_per_token: float = Field(0.0, description="KV bytes per prompt token, all layers.")
    kv_gbps: float = Field(10.0, description="P -> D bandwidth, GB/s.")
    kv_hidden: float = Field(0.0, description="Share of the KV copy overlapped with prefill "
                             "(layer-grouped transfer); the rest delays decode.")
    kv_samples_ms: list[float] = Field(default_factory=list, description="Measured P -> D "
                                       "costs per request (quantiles); when given, each "
                                       "request draws one instead of the formula.")
    feature_samples_ms: list[float] = Field(default_factory=list, description="The same "
                                            "for E -> P.")
    blocking: bool = Field(False, description="Whether a hand-off's cost occupies the "
                           "receiving engine (its iteration takes that much longer, for its "
                           "whole batch) instead of only delaying the request: true on a "
                           "CPU host, where the copy and its bookkeeping compete for the "
                           "cores; false where a DMA engine overlaps it with compute.")

    def feature_ms(self, visual_tokens: int, draw: float | None = None) -> float:
        """E -> P cost of a request; `draw` in [0, 1) picks from the measured samples."""
        if self.feature_samples_ms and draw is not None:
            return _quantile(self.feature_samples_ms, draw)
        copy = visual_tokens * self.feature_bytes_per_token / (self.feature_gbps * 1e6)
        return self.feature_fixed_ms + (1.0 - self.feature_hidden) * copy

    def kv_ms(self, prompt_tokens: int, draw: float | None = None) -> float:
        """P -> D cost of a request; `draw` in [0, 1) picks from the measured samples."""
        if self.kv_samples_ms and draw is not None:
            return _quantile(self.kv_samples_ms, draw)
        copy = prompt_tokens * self.kv_bytes_per_token / (self.kv_gbps * 1e6)
        return self.kv_fixed_ms + (1.0 - self.kv_hidden) * copy

    def kv_bytes(self, prompt_tokens: int) -> int:
        return int(prompt_tokens * self.kv_bytes_per_token)


class Sharing(_Strict):
    """How instances slow each other down. `device`: only instances co-located on one
    device contend (accelerators); `host`: every instance of the deployment shares the
    host's cores (the CPU backend). A busy instance's iteration takes
    (1 + contention x other busy instances sharing with it) times its cost."""

    scope: Literal["device", "host"] = "device"
    contention: float = Field(0.3, ge=0.0, description="Slowdown per busy sharer.")
    pairs: dict[str, float] = Field(default_factory=dict, description="Slowdown of one "
                                    "instance's iterations per busy sharer, by their roles: "
                                    "'D+E': 0.8 slows decode while an encoder works beside "
                                    "it; the reverse pair is separate (co-location need not "
                                    "hurt both alike). Others take `contention`.")

    def between(self, roles: str, other: str) -> float:
        """The slowdown of `roles`'s iterations per busy `other`."""
        return self.pairs.get(f"{roles}+{other}", self.contention)


class Memory(_Strict):
    kv_capacity_tokens: int = Field(description="KV cache tokens one whole device holds "
                                    "after weights; co-located instances split it.")


class Profile(_Strict):
    name: str
    platform: Literal[PLATFORMS]
    model: str
    source: str = Field(description="Where the numbers come from: measured how, or which "
                        "published tables and figures.")
    tokens_per_word: float = Field(1.0, description="Text tokens per word of a prompt.")
    template_tokens: int = Field(20, description="Chat-template tokens around a prompt.")
    image: ImageTokens = Field(default_factory=ImageTokens)
    video: VideoTokens | None = Field(None, description="A video frame's pixel limits and "
                                      "the temporal merge; default: the image's limits, "
                                      "temporal patch 2.")
    encoder: EncoderCost
    llm: LLMCost
    transfers: Transfers
    sharing: Sharing = Field(default_factory=Sharing)
    memory: Memory
    alpha: float = Field(0.5, description="Share of the TTFT SLO one E, EP or P iteration "
                         "may take (paper 001: a request needs an encode and a prefill "
                         "iteration before its first token).")
    beta: float = Field(0.5, description="The same for prefill in the planner's throughput "
                        "estimate (paper 001, Algorithm 2).")
    machine: Machine | None = Field(None, description="The machine the numbers describe: "
                                    "measured on, or published about.")
    measured: dict | None = Field(None, description="Raw probe results, when measured.")
    _origin: str = PrivateAttr("")

    @property
    def origin(self) -> str:
        """Where it was read from: 'shipped', or its file."""
        return self._origin

    # -- what a request asks of each stage ------------------------------------------
    def image_tokens(self, width: int, height: int) -> int:
        """Visual tokens of a width x height image after Qwen-VL's smart resize."""
        return _resized_tokens(width, height, self.image)

    @property
    def video_limits(self) -> VideoTokens:
        return self.video or VideoTokens(**self.image.model_dump())

    def video_frames(self, frames: int) -> int:
        """Frames of a video that are encoded (the proxy samples the longer ones)."""
        return min(frames, self.video_limits.max_frames)

    def video_tokens(self, frames: int, width: int, height: int) -> int:
        """Visual tokens of a video: a frame's tokens per temporal patch."""
        limits = self.video_limits
        patches = math.ceil(self.video_frames(frames) / limits.temporal_patch)
        return patches * _resized_tokens(width, height, limits)

    def video_items(self, frames: int, width: int, height: int,
                    chunk_frames: int | None = None) -> list[EncodeItem]:
        """A video as encoder items: whole, or in chunks of `chunk_frames` frames (the
        last may be shorter) as the proxy splits it over encoders."""
        kept = self.video_frames(frames)
        step = chunk_frames or kept
        return [EncodeItem(self.video_tokens(min(step, kept - start), width, height),
                           min(step, kept - start)) for start in range(0, kept, step)]

    def request_tokens(self, spec: RequestSpec) -> tuple[int, list[int]]:
        """(text tokens incl. the chat template, visual tokens per image and per video)."""
        text = self.template_tokens + math.ceil(len(spec.text.split()) * self.tokens_per_word)
        videos = [self.video_tokens(v.frames, v.width, v.height) for v in spec.videos]
        return text, [self.image_tokens(*_size(ref)) for ref in spec.images] + videos

    def encode_items(self, spec: RequestSpec, chunk_frames: int | None = None) -> list[EncodeItem]:
        """What encoding a request's media takes: one item per image, and each video
        whole or in chunks of `chunk_frames` frames."""
        images = [EncodeItem(self.image_tokens(*_size(ref))) for ref in spec.images]
        return images + [item for v in spec.videos
                         for item in self.video_items(v.frames, v.width, v.height, chunk_frames)]

    # -- what an iteration costs ------------------------------------------------------
    def encode_ms(self, visual_tokens: list[int], frames: int = 0) -> float:
        """One encoder pass over items of these visual tokens holding `frames` video
        frames in all."""
        if not visual_tokens:
            return 0.0
        e = self.encoder
        return (e.fixed_ms + e.per_image_ms * len(visual_tokens) + e.frame_ms * frames
                + e.per_token_ms * sum(visual_tokens))

    def items_ms(self, items: list[EncodeItem]) -> float:
        """One encoder pass over these items."""
        return self.encode_ms([i.tokens for i in items], sum(i.frames for i in items))

    def iteration_ms(self, prefill_tokens: int, decode_seqs: int, context_tokens: int = 0) -> float:
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return 0.0
        m = self.llm
        return (m.fixed_ms + m.per_prefill_token_ms * prefill_tokens
                + m.per_decode_seq_ms * decode_seqs + m.per_context_token_ms * context_tokens)


def _resized_tokens(width: int, height: int, limits: ImageTokens) -> int:
    """Visual tokens of a width x height picture after Qwen-VL's smart resize: each side
    rounded to the unit, the area brought within the limits."""
    unit = limits.unit_px
    h = max(unit, round(height / unit) * unit)
    w = max(unit, round(width / unit) * unit)
    if h * w > limits.max_pixels:
        scale = math.sqrt(height * width / limits.max_pixels)
        h = max(unit, math.floor(height / scale / unit) * unit)
        w = max(unit, math.floor(width / scale / unit) * unit)
    elif h * w < limits.min_pixels:
        scale = math.sqrt(limits.min_pixels / (height * width))
        h = math.ceil(height * scale / unit) * unit
        w = math.ceil(width * scale / unit) * unit
    return (h // unit) * (w // unit)


def _quantile(sorted_samples: list[float], u: float) -> float:
    """Inverse of the empirical distribution the samples (quantiles) describe."""
    return float(np.interp(u, np.linspace(0.0, 1.0, len(sorted_samples)), sorted_samples))


def _size(ref) -> tuple[int, int]:
    if ref.path:
        from PIL import Image

        with Image.open(ref.path) as image:  # reads the header only
            return image.size
    return ref.width, ref.height


def local_dir() -> Path:
    return Path(os.environ.get(LOCAL_PROFILES_ENV) or ".epd/profiles")


def load(name_or_path: str | Path) -> Profile:
    """A profile file, or a profile's name: this machine's (local_dir(), where
    `epd-serve profile --quick` saves) before the shipped one (see `shipped()`)."""
    path = Path(name_or_path)
    origin = str(path)
    if not path.is_file():
        local = local_dir() / f"{name_or_path}.yaml"
        candidate = PROFILES_DIR / f"{name_or_path}.yaml"
        if local.is_file():
            path, origin = local, str(local)
        elif candidate.is_file():
            path, origin = candidate, "shipped"
        else:
            raise ValueError(f"no profile {name_or_path!r}: not a file, not in {local_dir()}, "
                             f"and the shipped ones are {', '.join(shipped())}")
    try:
        profile = Profile.model_validate(yaml.safe_load(path.read_text()))
    except (ValueError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: not a valid profile: {err}") from None
    profile._origin = origin
    return profile


def save(profile: Profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return path


def shipped() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def machine_note(profile: Profile) -> tuple[bool, str]:
    """(whether `profile` describes another machine than this one, the line saying
    which machine it describes)."""
    import datetime as dt

    from epd_serve.planner import machine

    return machine.profile_note(profile.name, profile.origin or "in memory", profile.machine,
                                machine.this_machine(profile.platform),
                                dt.datetime.now(dt.timezone.utc))
