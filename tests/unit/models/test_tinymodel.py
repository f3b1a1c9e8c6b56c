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


# -- answers that follow their input -------------------------------------------------------
TOPICS = ("cats dogs rain trains music chess ocean bread rockets gardens winter maps clocks "
          "bees glass rivers").split()
ANSWER_TOKENS = 16
PATCH = 16  # pixels: one square of an image changed between the two of a pair


def _image(seed: int, changed_patch: int | None = None):
    """A 224x224 noise image; with `changed_patch`, the same image with one 16x16 square
    (placed and filled by that seed) replaced."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    if changed_patch is not None:
        rng = np.random.default_rng(changed_patch)
        y, x = rng.integers(0, 224 - PATCH, size=2)
        pixels[y:y + PATCH, x:x + PATCH] = rng.integers(0, 256, (PATCH, PATCH, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


class GreedyAnswers:
    """The model's 16-token greedy answers, computed by transformers (vLLM runs the same
    weights; the e2e tests count distinct answers there too)."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)

    def __call__(self, text: str, image=None) -> tuple[int, ...]:
        content = [{"type": "text", "text": text}]
        if image is not None:
            content.insert(0, {"type": "image"})
        prompt = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[prompt], images=None if image is None else [image],
                                return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=ANSWER_TOKENS, do_sample=False)
        return tuple(out[0, inputs["input_ids"].shape[1]:].tolist())


@pytest.mark.parametrize("family", sorted(IMAGE_TOKENS))
def test_greedy_answers_follow_the_prompt_and_the_pixels(family, tmp_path):
    """64 distinct requests (32 texts, 32 images) get at least 60 distinct greedy
    answers, and two images that differ in one 16x16 square get different answers in at
    least 80% of pairs: a check that compares answers can see a wrong feature or KV."""
    answer = GreedyAnswers(build_tiny_model(family, tmp_path / family))
    texts = [answer(f"Tell me about {TOPICS[i % 16]}, number {i}.") for i in range(32)]
    images = [answer("Describe this.", _image(500 + i)) for i in range(32)]
    distinct = len(set(texts + images))
    pairs = 20
    differ = sum(answer("Describe this.", _image(900 + i))
                 != answer("Describe this.", _image(900 + i, changed_patch=77 + i))
                 for i in range(pairs))
    print(f"{family}: {distinct} distinct answers of 64; one changed {PATCH}x{PATCH} square "
          f"changed the answer in {differ} of {pairs} pairs")
    assert distinct >= 60
    assert differ >= 0.8 * pairs
