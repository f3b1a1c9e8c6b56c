"""OpenAI chat request bodies with generated images (client side; numpy + Pillow).

Used by the demo, the warm-up after start-up, the tests and the load tool. Images are
made locally (deterministic noise per seed), so nothing is ever downloaded.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB image; different seeds give different feature hashes."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_data_url(image: Image.Image, fmt: str = "JPEG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt, quality=90) if fmt == "JPEG" else image.save(buf, fmt)
    mime = "image/jpeg" if fmt == "JPEG" else f"image/{fmt.lower()}"
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat_body(model: str, text: str, image_urls: list[str] = (), max_tokens: int = 16,
              stream: bool = False, ignore_eos: bool = True, video_urls: list[str] = ()) -> dict:
    """A chat request: the videos, then the images, then the text."""
    if image_urls or video_urls:
        content: list[dict] | str = [
            {"type": "video_url", "video_url": {"url": url}} for url in video_urls
        ] + [
            {"type": "image_url", "image_url": {"url": url}} for url in image_urls
        ] + [{"type": "text", "text": text}]
    else:
        content = text
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        # Random weights emit EOS at random: fix the output length instead.
        "ignore_eos": ignore_eos,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
