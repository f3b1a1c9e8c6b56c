"""Builds a tiny random-weight Qwen-VL-family model, tokenizer and processor offline.

Runs in the CLI process; needs torch and transformers (the [cpu] extra), imported
inside the builder so that `epd-serve --help` stays light. No model hub is contacted:
the tokenizer is a byte-level BPE trained here on a built-in corpus.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# Qwen's special tokens, in Qwen's order; vLLM's Qwen-VL processors look them up by text.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

HIDDEN = 256
HEADS = 4
KV_HEADS = 2
TEXT_LAYERS = 2
VISION_DEPTH = 2
VISION_EMBED = 128
BPE_VOCAB = 2000
# Weights of the language model are drawn with this standard deviation, and its output
# projection is its own matrix, not the input embedding. With transformers' defaults
# (0.02, tied) every layer adds little to the residual stream, so the last position's
# logits are its own token's embedding against every other: the greedy answer repeats
# the prompt's last token ("\n" after the chat template) whatever came before, and no
# check that compares answers can see a wrong feature or KV block. At 0.1, untied,
# answers follow the prompt and the pixels (tests/unit/models/test_tinymodel.py).
TEXT_INIT_STD = 0.1
# Written into epd_tiny_model.json: a model directory built by an older builder is
# built again by the launcher (2: answers that follow their input; 3: a chat template
# that renders tools).
BUILDER_VERSION = 3

# Qwen2-VL's chat template, reduced to what the serving paths use: system/user/assistant
# turns whose content is a string or a list of text / image / video parts, and tools as
# Qwen2.5 renders them (hermes style: the functions in <tools></tools> in the system
# turn, calls in <tool_call></tool_call>, results in <tool_response></tool_response>),
# so that vLLM's hermes tool parser serves this model as it serves Qwen's.
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\n<tools>")
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% macro render(content) %}{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
    "{% if tools or messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{% if tools %}" + TOOLS_PREAMBLE +
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}" + TOOLS_POSTAMBLE +
    "{% endif %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ render(message['content']) }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "\n<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    words = (
        "the a an image picture photo shows describe what is in this of and to with on "
        "cat dog person car tree house sky blue red green small large left right top bottom "
        "please answer question explain why how many count color shape text read chart table "
        "system user assistant you are helpful model vision language encode prefill decode"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 13)))
    lines.extend(str(n) for n in range(1000))
    return lines


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.save_pretrained(out)
    return fast


@dataclasses.dataclass(frozen=True)
class Shape:
    """Size of the language model: deep enough to matter for per-layer KV transfer
    (Qwen2-VL-7B has 28 layers), narrow enough for a 2-core machine."""

    layers: int = TEXT_LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS

    def __post_init__(self):
        if min(self.layers, self.hidden, self.heads, self.kv_heads) < 1:
            raise ValueError("layers, hidden, heads and kv_heads must be positive")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads}), and heads of kv_heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 16:
            raise ValueError(f"head size hidden/heads = {self.hidden // self.heads} must be "
                             "a multiple of 16 (rotary sections, CPU attention kernels)")


def _config(family: str, tok, shape: Shape) -> object:
    import transformers

    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    vocab = ((len(tok) + 63) // 64) * 64  # pad like Qwen does, to a multiple of 64
    text = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.hidden * 2,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        initializer_range=TEXT_INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    head_dim = shape.hidden // shape.heads
    # mrope splits half the head dim over (temporal, height, width).
    mrope = [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": mrope}
        vision = dict(depth=VISION_DEPTH, embed_dim=VISION_EMBED, hidden_size=shape.hidden,
                      num_heads=HEADS, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    if family == "qwen2_5_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": mrope}
        vision = dict(depth=VISION_DEPTH, hidden_size=VISION_EMBED, out_hidden_size=shape.hidden,
                      intermediate_size=VISION_EMBED * 2, num_heads=HEADS, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[VISION_DEPTH - 1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    if family == "qwen3_vl":
        text["head_dim"] = head_dim
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": mrope,
                                "mrope_interleaved": True}
        vision = dict(depth=VISION_DEPTH, hidden_size=VISION_EMBED, out_hidden_size=shape.hidden,
                      intermediate_size=VISION_EMBED * 2, num_heads=HEADS, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=2304, deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **common)
    raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def _processor(family: str, tok):
    import transformers

    if family == "qwen3_vl":
        image = transformers.Qwen2VLImageProcessor(patch_size=16, merge_size=2)
        video = transformers.Qwen3VLVideoProcessor(patch_size=16, merge_size=2)
        return transformers.Qwen3VLProcessor(image_processor=image, tokenizer=tok,
                                             video_processor=video, chat_template=CHAT_TEMPLATE)
    image = transformers.Qwen2VLImageProcessor()
    video = transformers.Qwen2VLVideoProcessor()
    cls = transformers.Qwen2VLProcessor if family == "qwen2_vl" else transformers.Qwen2_5_VLProcessor
    return cls(image_processor=image, tokenizer=tok, video_processor=video,
               chat_template=CHAT_TEMPLATE)


def build_tiny_model(family: str, out: str | Path, seed: int = 0, shape: Shape = Shape()) -> Path:
    """Write a deterministic random-weight model directory that vLLM can serve."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    config = _config(family, tok, shape)
    torch.manual_seed(seed)
    model_cls = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }[family]
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out)
    _processor(family, tok).save_pretrained(out)
    (out / "epd_tiny_model.json").write_text(
        json.dumps({"family": family, "seed": seed, "builder": BUILDER_VERSION,
                    **dataclasses.asdict(shape)}))
    return out


def is_model_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_current_tiny_model(path: str | Path) -> bool:
    """Whether `path` holds a tiny model this builder would write (not one of an older
    builder's, whose answers ignore their input)."""
    try:
        built = json.loads((Path(path) / "epd_tiny_model.json").read_text())
    except (OSError, ValueError):
        return False
    return is_model_dir(path) and built.get("builder") == BUILDER_VERSION
