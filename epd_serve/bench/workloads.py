"""What each request of a load run asks: text, images, videos, output length.

Synthetic mixes shaped like the papers' datasets and like video question answering
(NextQA, Video-MME), and file datasets (AISBench multimodal JSONL, ShareGPT JSON, a
folder of images). Images and videos are generated (deterministic per seed) or read
from local files; nothing is downloaded. Bodies are built before the run starts so that sending
costs no encoding time.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import mimetypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.instances.videos import make_video, video_data_url

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}

# Words for synthetic prompts; about one token each for Qwen-family tokenizers.
_WORDS = ("describe the image in detail what is shown here and why does it matter please "
          "explain each part of the picture count objects read any visible text compare "
          "colors shapes people animals buildings sky road water").split()


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """A generated image (width x height, seed) or a file on disk."""

    width: int = 0
    height: int = 0
    seed: int = 0
    path: str | None = None

    def data_url(self) -> str:
        if self.path:
            data = Path(self.path).read_bytes()
            mime = mimetypes.guess_type(self.path)[0] or "image/png"
            return f"data:{mime};base64,{base64.b64encode(data).decode()}"
        return image_data_url(make_image(self.width, self.height, self.seed))


@dataclasses.dataclass(frozen=True)
class VideoRef:
    """A generated video: `frames` frames of width x height (H.264 mp4), from its seed."""

    frames: int
    width: int = 224
    height: int = 224
    seed: int = 0

    def data_url(self) -> str:
        return _video_url(self)


@functools.lru_cache(maxsize=512)
def _video_url(ref: VideoRef) -> str:
    # A 64-frame 224x224 video takes ~0.2 s to make: the bodies built again for the next
    # deployment of a comparison reuse it. 512 of them hold ~70 MB.
    return video_data_url(make_video(ref.frames, ref.width, ref.height, ref.seed))


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    index: int
    text: str
    images: tuple[ImageRef, ...]
    max_tokens: int
    videos: tuple[VideoRef, ...] = ()

    @property
    def multimodal(self) -> bool:
        return bool(self.images or self.videos)

    @property
    def modality(self) -> str:
        """"text", "image", "video" or "image+video": what the report groups by."""
        kinds = [kind for kind, items in (("image", self.images), ("video", self.videos))
                 if items]
        return "+".join(kinds) or "text"


@dataclasses.dataclass(frozen=True)
class SyntheticWorkload:
    """Requests drawn from distributions (all seeded).

    text_tokens: mean words of the question (Poisson distributed, at least 1).
    image_fraction: share of requests that carry images.
    images_per_request: (min, max) image count of a multimodal request, uniform.
    resolution: mean (width, height); resolution_std: per-axis std (0 = fixed size).
    """

    name: str
    text_tokens: float
    image_fraction: float
    resolution: tuple[int, int]
    resolution_std: tuple[float, float] = (0.0, 0.0)
    images_per_request: tuple[int, int] = (1, 1)
    output_tokens: int = 64

    def requests(self, n: int, seed: int = 0) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            words = max(1, int(rng.poisson(self.text_tokens)))
            text = " ".join(rng.choice(_WORDS, size=words))
            images: tuple[ImageRef, ...] = ()
            if rng.random() < self.image_fraction:
                count = int(rng.integers(self.images_per_request[0], self.images_per_request[1] + 1))
                refs = []
                for j in range(count):
                    w = int(np.clip(rng.normal(self.resolution[0], self.resolution_std[0]), 28, 4096))
                    h = int(np.clip(rng.normal(self.resolution[1], self.resolution_std[1]), 28, 4096))
                    refs.append(ImageRef(w, h, seed=seed * 1_000_003 + i * 101 + j))
                images = tuple(refs)
            out.append(RequestSpec(i, text, images, self.output_tokens))
        return out


# Video question answering: what is asked about a clip, and the options of a
# multiple-choice question (about one token a word).
_VIDEO_WORDS = ("what why how does the person man woman child dog do after before while "
                "holding the ball cup door picks up walks toward turns around looks at "
                "sits down on the chair table floor at the end beginning of video").split()
_OPTION_WORDS = ("a red car the kitchen two people running outside nothing happens "
                 "he laughs she waves a cat jumps rain falls they leave").split()


@dataclasses.dataclass(frozen=True)
class VideoQAWorkload:
    """Video question answering, every request one generated video and a question.

    frames: frames per video; resolution: (width, height) of every frame.
    question_words: mean words of the question (Poisson, at least 3).
    choices: options listed after the question (0: an open question), lettered A, B, ...
    questions_per_video: requests that ask about the same video (1: every request its
    own video, as the image workloads give every request its own image).
    """

    name: str
    frames: int
    question_words: float
    output_tokens: int
    choices: int = 0
    resolution: tuple[int, int] = (224, 224)
    questions_per_video: int = 1

    def requests(self, n: int, seed: int = 0) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            video = VideoRef(self.frames, *self.resolution,
                             seed=seed * 1_000_003 + i // self.questions_per_video)
            out.append(RequestSpec(i, self._question(rng), (), self.output_tokens, (video,)))
        return out

    def _question(self, rng: np.random.Generator) -> str:
        words = max(3, int(rng.poisson(self.question_words)))
        text = " ".join(rng.choice(_VIDEO_WORDS, size=words)) + " ?"
        if not self.choices:
            return text
        options = [f"{chr(ord('A') + k)}. " + " ".join(rng.choice(_OPTION_WORDS, size=3))
                   for k in range(self.choices)]
        return ("Question: " + text + "\nOptions:\n" + "\n".join(options)
                + "\nAnswer with the option's letter from the given choices directly.")


PRESETS: dict[str, SyntheticWorkload | VideoQAWorkload] = {
    # ShareGPT-4o as the papers sample it: every request one image, mean 802x652, ~9.6
    # text tokens, 64 output tokens.
    "sharegpt4o": SyntheticWorkload("sharegpt4o", 9.6, 1.0, (802, 652), (160.0, 130.0)),
    # VisualWebInstruct: half text-only, images 1280x720, ~63 text tokens.
    "visualwebinstruct": SyntheticWorkload("visualwebinstruct", 63.1, 0.5, (1280, 720)),
    "text": SyntheticWorkload("text", 32.0, 0.0, (0, 0)),
    # Small images for quick runs on CPU machines.
    "tiny-mm": SyntheticWorkload("tiny-mm", 8.0, 0.5, (224, 224), output_tokens=16),
    # NextQA-like: 8 frames a clip, a short open question (~12 words), answers of ~8
    # tokens ("the boy picks up the ball").
    "video-nextqa": VideoQAWorkload("video-nextqa", frames=8, question_words=12.0,
                                    output_tokens=8),
    # Video-MME-like: 64 frames a video, a multiple-choice question with options A-D in
    # the text, answers of a few tokens ("B." or "B. a cat").
    "video-mme": VideoQAWorkload("video-mme", frames=64, question_words=14.0,
                                 output_tokens=4, choices=4),
}


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line of a JSONL file."""
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err})") from None


def aisbench_jsonl(path: str | Path, output_tokens: int) -> list[RequestSpec]:
    """AISBench's multimodal custom dataset: one JSON object per line,
    {"type": "image", "path": [...], "question": ..., "answer": ...}."""
    path = Path(path)
    out = []
    for lineno, row in _jsonl_rows(path):
        paths = row.get("path") or []
        if isinstance(paths, str):
            paths = [paths]
        images = tuple(ImageRef(path=str((path.parent / p).resolve())) for p in paths)
        for ref in images:
            if not Path(ref.path).is_file():
                raise ValueError(f"{path}:{lineno}: image {ref.path} not found")
        question = row.get("question") or row.get("prompt")
        if not question:
            raise ValueError(f"{path}:{lineno}: no 'question'")
        out.append(RequestSpec(len(out), question, images, output_tokens))
    return out


def request_trace(path: str | Path, output_tokens: int | None) -> list[RequestSpec]:
    """A request trace (what `epd-serve plan --trace` reads, and what the load tool
    replays with `--process trace --trace` on the same file): JSONL, one request per
    line, {"timestamp": s, "text": ... or "prompt_words": n, "images": [[w, h], ...],
    "videos": [[frames, w, h], ...], "output_tokens": n}. Images and videos are generated
    at the recorded sizes."""
    path = Path(path)
    out = []
    for lineno, row in _jsonl_rows(path):
        try:
            text = row.get("text") or " ".join(
                _WORDS[(lineno + k) % len(_WORDS)] for k in range(int(row.get("prompt_words", 8))))
            images = tuple(ImageRef(int(w), int(h), seed=lineno * 101 + j)
                           for j, (w, h) in enumerate(row.get("images") or []))
            videos = tuple(VideoRef(int(f), int(w), int(h), seed=lineno * 101 + j)
                           for j, (f, w, h) in enumerate(row.get("videos") or []))
            n_out = output_tokens or int(row.get("output_tokens", 64))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}:{lineno}: not a trace row ({err})") from None
        out.append(RequestSpec(len(out), text, images, n_out, videos))
    return out


def is_request_trace(path: Path) -> bool:
    """A JSONL whose rows say what each request asks, not only when it comes."""
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    first = next((line for line in path.read_text().splitlines() if line.strip()), "")
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return (isinstance(row, dict) and "timestamp" in row
            and any(k in row for k in ("text", "prompt_words", "images", "videos",
                                       "output_tokens")))


def sharegpt_json(path: str | Path, output_tokens: int | None, image_root: str | None = None) -> list[RequestSpec]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}], "image": optional path}]. Without output_tokens the
    answer's length (in words) sets the output length."""
    path = Path(path)
    rows = json.loads(path.read_text())
    root = Path(image_root) if image_root else path.parent
    out = []
    for row in rows:
        turns = row.get("conversations") or []
        if len(turns) < 1:
            continue
        question = turns[0].get("value", "").replace("<image>", "").strip()
        answer = turns[1].get("value", "") if len(turns) > 1 else ""
        n_out = output_tokens or max(1, len(answer.split()))
        images: tuple[ImageRef, ...] = ()
        if row.get("image"):
            image_path = root / row["image"]
            if image_path.is_file():
                images = (ImageRef(path=str(image_path)),)
        if question:
            out.append(RequestSpec(len(out), question, images, n_out))
    return out


def image_folder(path: str | Path, output_tokens: int, question: str = "Describe the image.") -> list[RequestSpec]:
    files = sorted(p for p in Path(path).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {path}")
    return [RequestSpec(i, question, (ImageRef(path=str(f)),), output_tokens)
            for i, f in enumerate(files)]


def load_workload(name_or_path: str, n: int, output_tokens: int | None, seed: int = 0) -> list[RequestSpec]:
    """A preset name, or a dataset file/folder; the list is cycled to `n` requests."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        if output_tokens:
            preset = dataclasses.replace(preset, output_tokens=output_tokens)
        return preset.requests(n, seed)
    path = Path(name_or_path)
    if path.is_dir():
        base = image_folder(path, output_tokens or 64)
    elif is_request_trace(path):
        base = request_trace(path, output_tokens)
    elif path.suffix == ".jsonl":
        base = aisbench_jsonl(path, output_tokens or 64)
    elif path.suffix == ".json":
        base = sharegpt_json(path, output_tokens)
    else:
        raise ValueError(f"unknown workload {name_or_path!r}: use a preset "
                         f"({', '.join(PRESETS)}), a .jsonl (AISBench, or a request trace), a .json "
                         "(ShareGPT) "
                         "or a folder of images")
    if not base:
        raise ValueError(f"workload {name_or_path} holds no requests")
    return [dataclasses.replace(base[i % len(base)], index=i) for i in range(n)]


def build_bodies(specs: list[RequestSpec], model: str, ignore_eos: bool = True,
                 progress=None) -> Iterator[bytes]:
    """Serialise every request (streaming, with usage) to JSON bytes; images and videos
    made once each. Media parts come before the text: videos, then images."""
    cache: dict[ImageRef | VideoRef, str] = {}
    for spec in specs:
        urls = []
        for ref in (*spec.videos, *spec.images):
            if ref not in cache:
                cache[ref] = ref.data_url()
            urls.append(cache[ref])
        videos, images = urls[:len(spec.videos)], urls[len(spec.videos):]
        body = chat_body(model, spec.text, images, max_tokens=spec.max_tokens, stream=True,
                         ignore_eos=ignore_eos, video_urls=videos)
        if progress:
            progress()
        yield json.dumps(body).encode()
