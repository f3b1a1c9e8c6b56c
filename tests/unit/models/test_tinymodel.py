"""The tiny model builder: each family builds offline, deterministically, and its
processor expands an image into the number of tokens its vision tower produces."""

from __future__ import annotations

import json

import pytest

from epd_serve.instances.payloads import make_image
from epd_serve.models.tinymodel import build_tiny_model, is_model_dir

# 448x448 image: (448 / patch)^2 patches, merged 2x2.
IMAGE_TOKENS = {"qwen2_vl": 256, "qwen2_5_vl": 256, "qwen3_vl": 196}


@pytest.mark.parametrize("family", sorted(IMAGE_TOKENS))
def test_family_builds_and_its_processor_expands_images(family, tmp_path):
    from transformers import AutoConfig, AutoProcessor

    out = build_tiny_model(family, tmp_path / family)
    assert is_model_dir(out)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == family
    processor = AutoProcessor.from_pretrained(out)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt
    inputs = processor(text=[prompt], images=[make_image(448, 448)], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(config.image_token_id) == IMAGE_TOKENS[family]


def test_builds_are_deterministic(tmp_path):
    a = build_tiny_model("qwen2_vl", tmp_path / "a", seed=3)
    b = build_tiny_model("qwen2_vl", tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads((b / "tokenizer.json").read_text())


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choose one of qwen2_vl, qwen2_5_vl, qwen3_vl"):
        build_tiny_model("llava", tmp_path)
