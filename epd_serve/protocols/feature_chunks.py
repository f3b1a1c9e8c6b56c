"""Keys of a feature stored in chunks: a video whose frames were encoded in parts.

The proxy splits a video into chunks of frames (proxy/video.py); each is encoded on any
encoder and stored in the MM Store under its own key (`part_key`: the video's content
key and the chunk's index, which is the chunk's uuid and, without processor or media
kwargs, the feature hash vLLM stores it under). Prefill is sent the whole video and
asks its EC connector for one feature, under a hash vLLM computes (on vLLM 0.32 the
engine's `media_io_kwargs` are hashed in, so the proxy cannot know it). So the proxy
names, per video in prompt order, the store keys of its chunks, joined
(`joined_key`), in the request's `vllm_xargs[VIDEO_KEYS_ARG]`; the connector reads
those chunks and joins their features in order (connectors/epd_ec/loader.py). For
Qwen2-VL-family encoders this is exact: their vision attention never crosses a temporal
patch (two frames), and chunks hold whole patches.

Feature keys are hex hashes, which never hold the separator. No vLLM import.
"""

from __future__ import annotations

__all__ = ["MAX_PARTS", "VIDEO_KEYS_ARG", "joined_key", "part_key", "part_keys"]

VIDEO_KEYS_ARG = "epd_video_keys"  # vllm_xargs: one joined key per video, prompt order
_JOIN = ","
MAX_PARTS = 4096  # far beyond any video the proxy accepts: a bound on what a key can ask


def part_key(key: str, index: int) -> str:
    """The key of chunk `index` of the video whose content key is `key`."""
    return f"{key}.{index}"


def joined_key(parts: list[str]) -> str:
    """One key naming a feature stored as `parts` (in order); a single part is itself."""
    return _JOIN.join(parts)


def part_keys(key: str) -> list[str] | None:
    """The parts of a joined key, in order; None for a key of one piece."""
    if _JOIN not in key:
        return None
    parts = key.split(_JOIN)
    if len(parts) > MAX_PARTS or not all(parts):
        raise ValueError(f"not a joined feature key: {len(parts)} parts, empty ones "
                         f"{sum(1 for p in parts if not p)}")
    return parts
