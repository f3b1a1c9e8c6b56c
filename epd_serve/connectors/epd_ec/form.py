"""What a feature this engine can be fed looks like, and why a stored one cannot.

Runs in the engine-core process (the EC connector's scheduler side), on every feature
read from the MM Store before it is promised to vLLM: a feature whose bytes, shape or
dtype the model cannot take would make the worker or the model raise inside the step
(the engine stops), so it is refused here instead, and the request encodes the image
itself or fails alone (scheduler.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from epd_serve.mmstore import FeatureMeta


def encoder_output_width(hf_config) -> int | None:
    """The width of the vision encoder's output for Qwen-VL-family configs: the
    language model's hidden size, or the merger's `out_hidden_size`, times the layers a
    DeepStack model (Qwen3-VL) packs into each feature; None for a model without a
    vision config (nothing to check against)."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    text = getattr(hf_config, "text_config", hf_config)
    width = getattr(vision, "out_hidden_size", None) or getattr(text, "hidden_size", None)
    if not width:
        return None
    return int(width) * (1 + len(getattr(vision, "deepstack_visual_indexes", None) or ()))


@dataclasses.dataclass(frozen=True)
class FeatureForm:
    width: int | None  # the encoder's output width; None: not checked

    @classmethod
    def of(cls, model_config) -> FeatureForm:
        return cls(encoder_output_width(getattr(model_config, "hf_config", None)))

    def mismatch(self, meta: FeatureMeta, nbytes: int, rows: int) -> str | None:
        """Why a feature stored as `meta` with `nbytes` bytes cannot stand for one of
        `rows` embeddings here; None if it can."""
        shape = tuple(meta.shape)
        if len(shape) != 2 or shape[0] != rows or (self.width and shape[1] != self.width):
            return (f"has shape {shape} in the MM Store, the request needs "
                    f"({rows}, {self.width or 'any'}) embeddings")
        # Any floating dtype: vLLM casts features to the model's when it merges them.
        dtype = getattr(torch, meta.dtype, None) if isinstance(meta.dtype, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            return f"has dtype {meta.dtype!r} in the MM Store, which is no floating dtype"
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            return f"has {nbytes} bytes in the MM Store, its shape and dtype need {expected}"
        return None
