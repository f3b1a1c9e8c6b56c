"""Generated videos for requests (client side; numpy + PyAV), as payloads.py makes images.

Used by the tests, the load tool's video workloads and the benchmarks. A video is made
locally from its seed (a gradient that drifts, a square that moves: every frame differs
from the others, and different seeds differ everywhere), so nothing is ever downloaded.
The frames are the same for the same arguments; the file's bytes too with `mpeg4`, and
with H.264 (the default, as most clients send) only for sizes whose lines need no
padding (multiples of 64): x264 reads the padding of its input frames, which is not
cleared. So a caller that needs the same bytes twice keeps them (the load tool does).
"""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import numpy as np

VIDEO_MIME = {"mp4": "video/mp4", "webm": "video/webm", "matroska": "video/x-matroska",
              "avi": "video/x-msvideo"}


def make_frames(frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """`frames` RGB frames (frames, height, width, 3) of uint8."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    speed = rng.integers(1, 6, size=2)
    ys, xs = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    side = max(4, min(width, height) // 4)
    for t in range(frames):
        for c in range(3):
            out[t, :, :, c] = (base[c] + xs * (c + 1) + ys * (3 - c) + 7 * t * (c + 1)) % 256
        top = (speed[0] * 5 * t) % max(1, height - side)
        left = (speed[1] * 5 * t) % max(1, width - side)
        out[t, top:top + side, left:left + side] = 255 - base
    return out


def encode_video(frames: np.ndarray, fps: int = 8, container: str = "mp4",
                 codec: str = "libx264") -> bytes:
    """`frames` (n, h, w, 3 uint8, h and w even) as a video file's bytes."""
    import av  # the load tool and the tests need it; importing it costs ~0.1 s

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"  # MJPEG: full range
        # One thread: PyAV's own thread count overrides the encoder's option otherwise.
        stream.codec_context.thread_count = 1
        stream.codec_context.thread_type = "NONE"
        if codec == "libx264":
            stream.options = {"threads": "1", "preset": "veryfast", "crf": "18"}
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def make_video(frames: int, width: int = 224, height: int = 224, seed: int = 0,
               fps: int = 8, container: str = "mp4", codec: str = "libx264") -> bytes:
    """A generated video file: `frames` frames of width x height at `fps`."""
    return encode_video(make_frames(frames, width, height, seed), fps, container, codec)


def video_data_url(data: bytes, container: str = "mp4") -> str:
    return f"data:{VIDEO_MIME.get(container, 'video/mp4')};base64,{base64.b64encode(data).decode()}"


def video_part(url: str) -> dict:
    """A chat content part holding a video, as OpenAI-compatible servers take it."""
    return {"type": "video_url", "video_url": {"url": url}}
