"""Client videos made into what every stage is sent: checked, decoded, sampled, re-encoded.

Runs inside the proxy process; the decoding runs on worker threads of its own (PyAV,
which releases the GIL while FFmpeg works), at most `max_video_decodes` at once, never
on the event loop, at most `max_video_decodes_per_client` of them one client address's;
at most `max_video_queue` more wait, each for `video_wait_s` at most (503 past either),
so one client cannot hold every slot and keep the others waiting. A request that
ends (its client left) stops its decode at the next frame, and its slot is free again
once the thread has stopped, not before. The proxy is the only decoder of a client's video: it sends the encoders,
prefill and decode the same frames, as vLLM's frame-list data URL
(`data:video/jpeg;base64,<frame>,<frame>,...`). So every stage sees identical pixels
whatever decoder or sampling its engine would have used, a video's features can be
split into chunks of frames (encoded on several encoders, stored per chunk, stitched by
prefill) and match the whole video's, and a deployment of any shape answers a video the
same way.

What is accepted, checked before a frame is decoded:
- containers by their first bytes (MP4/QuickTime, Matroska/WebM, AVI), opened with that
  demuxer only: no playlist or network demuxer ever sees a client's bytes;
- codecs H.264, HEVC, VP8, VP9, AV1, MPEG-4 Part 2 and Motion JPEG;
- the frame size from the stream header (`max_video_frame_pixels`, and again on every
  decoded frame: a stream may change size), the duration (`max_video_seconds`) and the
  frame count, counted from the container's packets (`max_video_source_frames`): a few
  KB of identical frames cannot make the proxy decode for minutes;
- a client's own frame list (`video/jpeg`): every frame an image `inspect_image` accepts.

Then `max_video_frames` frames are sampled uniformly (as vLLM samples), decoded only
up to the last one kept, shrunk to at most `video_frame_pixels` and saved as JPEG.
Every refusal is a ProxyError: 400, or 413 for a size over a limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import threading
import time

import numpy as np
from PIL import Image

from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.guards import Limits, decode_data_url, inspect_image

try:
    from pybase64 import b64encode
except ImportError:  # pragma: no cover - the same output, slower
    from base64 import b64encode

__all__ = ["CODECS", "VideoFrames", "VideoPreparer", "decode_video", "frame_list_url",
           "split_chunks"]

# First bytes -> the FFmpeg demuxer that reads them (and nothing else).
_CONTAINERS = (
    (lambda raw: raw[4:8] == b"ftyp", "mov"),  # MP4, QuickTime, 3GP
    (lambda raw: raw[:4] == b"\x1a\x45\xdf\xa3", "matroska"),  # MKV, WebM
    (lambda raw: raw[:4] == b"RIFF" and raw[8:12] == b"AVI ", "avi"),
)
CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
FRAME_LIST_MIME = "video/jpeg"  # vLLM's name for a list of base64 image frames
JPEG_QUALITY = 95


@dataclasses.dataclass(frozen=True)
class VideoFrames:
    """A video as the stages get it."""

    frames: list[str]  # base64 JPEG, in order
    width: int
    height: int
    source_frames: int  # frames the client's video held

    @property
    def url(self) -> str:
        return frame_list_url(self.frames)


def frame_list_url(frames: list[str]) -> str:
    return f"data:{FRAME_LIST_MIME};base64," + ",".join(frames)


def split_chunks(frames: int, chunk_frames: int) -> tuple[tuple[int, int], ...]:
    """[start, end) frame ranges of `chunk_frames` each (the last may be shorter)."""
    return tuple((start, min(start + chunk_frames, frames))
                 for start in range(0, frames, chunk_frames))


@dataclasses.dataclass
class _ClientShare:
    """One client address's part of the decode slots."""

    slots: asyncio.Semaphore
    decodes: int = 0  # waiting or running: the share is forgotten at none


class VideoPreparer:
    """Decodes the videos of requests, a bounded number at once, off the event loop."""

    def __init__(self, limits: Limits, chunk_frames: int):
        self.limits = limits
        self.chunk_frames = chunk_frames
        self._slots = asyncio.Semaphore(limits.max_video_decodes)
        self._waiting = 0
        self._clients: dict[str, _ClientShare] = {}  # by address
        self._threads = concurrent.futures.ThreadPoolExecutor(
            limits.max_video_decodes, thread_name_prefix="epd-video")

    async def prepare(self, items, client: str = "unknown") -> None:
        """Make each video item's URL the frame list its stages get; set its frames,
        chunks and pixels (what its tokens are estimated from). `client`: the address
        the request came from, whose decodes share its slots."""
        tasks = [asyncio.ensure_future(self._prepare(item, client)) for item in items]
        try:
            await asyncio.gather(*tasks)
        finally:  # one refused, or the request cancelled: the others stop too
            for task in tasks:
                task.cancel()

    async def _prepare(self, item, client: str) -> None:
        video = await self._decode(item.url, item.where, client)
        item.url = video.url
        item.frames = video.frames
        n = len(video.frames)
        item.chunks = split_chunks(n, self.chunk_frames)
        # Two frames make one temporal patch: tokens ~ pixels / (28 * 28) as for images.
        item.pixels = video.width * video.height * ((n + 1) // 2)


    async def _decode(self, url: str, where: str, client: str) -> VideoFrames:
        """`decode_video` on a slot's thread. Cancelled (the request ended), the thread
        is told to stop and the slot stays taken until it has."""
        if self._slots.locked() and self._waiting >= self.limits.max_video_queue:
            raise ProxyError(503, f"{where}: {self._waiting} videos are waiting to be decoded "
                             "already; try again shortly", "service_unavailable",
                             reason="video_queue_full")
        share = self._clients.get(client)
        if share is None:
            share = self._clients[client] = _ClientShare(
                asyncio.Semaphore(self.limits.max_video_decodes_per_client))
        share.decodes += 1
        self._waiting += 1
        try:
            # The client's own share first: past it, its videos wait for each other,
            # never taking a slot another client's video could use.
            async with asyncio.timeout(self.limits.video_wait_s):
                await share.slots.acquire()
                try:
                    await self._slots.acquire()
                except BaseException:
                    share.slots.release()
                    raise
        except TimeoutError:
            self._forget(client, share)
            raise ProxyError(503, f"{where}: waited {self.limits.video_wait_s:g} s for a "
                             "video decode slot (limits.video_wait_s); try again shortly",
                             "service_unavailable", reason="video_wait") from None
        except BaseException:
            self._forget(client, share)
            raise
        finally:
            self._waiting -= 1
        stop = threading.Event()
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._threads, decode_video, url, self.limits, where, stop)
        except BaseException:
            self._release(client, share)
            raise
        future.add_done_callback(lambda done: self._freed(done, client, share))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            stop.set()
            raise

    def _release(self, client: str, share: _ClientShare) -> None:
        self._slots.release()
        share.slots.release()
        self._forget(client, share)

    def _forget(self, client: str, share: _ClientShare) -> None:
        """One decode of `client` fewer; a client with none left is forgotten, so the
        table holds only addresses with work here."""
        share.decodes -= 1
        if not share.decodes and self._clients.get(client) is share:
            del self._clients[client]

    def _freed(self, future: asyncio.Future, client: str, share: _ClientShare) -> None:
        """A decode thread has returned: its slot is free. (Its outcome is read here, so
        one nobody waits for any more, stopped or refused, is not reported as lost.)"""
        self._release(client, share)
        if not future.cancelled():
            future.exception()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------
# Decoding (worker threads)
# ----------------------------------------------------------------------------------

def decode_video(url: str, limits: Limits, where: str = "video",
                 stop: threading.Event | None = None) -> VideoFrames:
    """The frames the stages get from a client's video data: URL. `stop` set (the
    request ended) ends the decode at the next frame."""
    deadline = Deadline(time.monotonic() + limits.video_decode_timeout_s, limits, where,
                        stop or threading.Event())
    if url[5:5 + len(FRAME_LIST_MIME)].lower() == FRAME_LIST_MIME:
        return _from_frame_list(url, limits, where, deadline)
    raw = decode_data_url(url, where, limits.max_media_bytes, "video")
    demuxer = next((name for sniff, name in _CONTAINERS if sniff(raw)), None)
    if demuxer is None:
        raise bad_request(f"{where}: not a video this deployment reads (MP4/QuickTime, "
                          "Matroska/WebM or AVI, or a video/jpeg frame list)",
                          "unsupported_video")
    import av  # PyAV: imported on first use (the proxy without videos never needs it)

    try:
        with av.open(io.BytesIO(raw), format=demuxer, options={"enable_drefs": "0"}) as box:
            return _decode(box, limits, where, deadline)
    except ProxyError:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as err:
        raise bad_request(f"{where}: the data is not a readable video ({err})",
                          "undecodable_video") from None


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When a decode must end: its time limit, or its request ending (`stop`)."""

    at: float  # time.monotonic()
    limits: Limits
    where: str
    stop: threading.Event

    def check(self) -> None:
        if self.stop.is_set():
            raise ProxyError(499, f"{self.where}: the request ended; its decode stopped",
                             reason="video_decode_stopped")
        if time.monotonic() > self.at:
            raise bad_request(f"{self.where}: decoding the video took longer than "
                              f"{self.limits.video_decode_timeout_s:g} s",
                              "video_decode_timeout")


def _decode(box, limits: Limits, where: str, deadline: Deadline) -> VideoFrames:
    if not box.streams.video:
        raise bad_request(f"{where}: the file holds no video stream", "undecodable_video")
    stream = box.streams.video[0]
    codec = stream.codec_context.name
    if codec not in CODECS:
        raise bad_request(f"{where}: video codec {codec!r} is not accepted; this deployment "
                          f"reads {', '.join(sorted(CODECS))}", "unsupported_video")
    _check_frame_size(stream.codec_context.width, stream.codec_context.height, limits, where)
    seconds = _declared_seconds(box, stream)
    if seconds > limits.max_video_seconds:
        raise _too_large(where, f"the video lasts {seconds:.0f} s; this deployment accepts "
                         f"at most {limits.max_video_seconds:g} s", "video_too_long")
    count = _count_frames(box, stream, limits, where, deadline)
    keep = sample_indices(count, limits.max_video_frames)
    box.seek(0)
    stream.thread_type = "AUTO"
    frames: list[np.ndarray] = []
    wanted, size = 0, None
    for index, frame in enumerate(box.decode(stream)):
        deadline.check()
        if index != keep[wanted]:
            continue
        _check_frame_size(frame.width, frame.height, limits, where)
        size = size or _sent_size(frame.width, frame.height, limits.video_frame_pixels)
        frames.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
        wanted += 1
        if wanted == len(keep):
            break
    if not frames:
        raise bad_request(f"{where}: no frame of the video could be decoded",
                          "undecodable_video")
    return VideoFrames(_jpegs(frames, deadline), size[0], size[1], count)


def _declared_seconds(box, stream) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return box.duration / 1e6 if box.duration else 0.0


def _count_frames(box, stream, limits: Limits, where: str, deadline: Deadline) -> int:
    """Frames of the stream, counted from its packets (no decoding)."""
    count = 0
    for packet in box.demux(stream):
        if packet.size:
            count += 1
            if count > limits.max_video_source_frames:
                raise _too_large(where, f"the video has more than "
                                 f"{limits.max_video_source_frames} frames; this deployment "
                                 "accepts at most that many", "too_many_frames")
            if count % 256 == 0:
                deadline.check()
    if count == 0:
        raise bad_request(f"{where}: the video stream holds no frames", "undecodable_video")
    return count


def sample_indices(count: int, most: int) -> list[int]:
    """`most` frame indices spread evenly over `count` frames (all of them if fewer)."""
    if count <= most:
        return list(range(count))
    return np.linspace(0, count - 1, most).round().astype(int).tolist()


def _from_frame_list(url: str, limits: Limits, where: str, deadline: Deadline) -> VideoFrames:
    """A client's own list of base64 frames (vLLM's video/jpeg form)."""
    start = url.find(",") + 1
    texts = url[start:].split(",")
    if len(texts) > limits.max_video_source_frames:
        raise _too_large(where, f"the frame list has {len(texts)} frames; this deployment "
                         f"accepts at most {limits.max_video_source_frames}", "too_many_frames")
    keep = sample_indices(len(texts), limits.max_video_frames)
    frames, size = [], None
    for index in keep:
        deadline.check()
        frame_where = f"{where} frame {index}"
        raw = decode_data_url(f"data:image/jpeg;base64,{texts[index]}", frame_where,
                              limits.max_image_bytes)
        inspect_image(raw, limits, frame_where)
        with Image.open(io.BytesIO(raw)) as image:
            _check_frame_size(image.width, image.height, limits, frame_where)
            size = size or _sent_size(image.width, image.height, limits.video_frame_pixels)
            frames.append(np.asarray(image.convert("RGB").resize(size, Image.BICUBIC)))
    return VideoFrames(_jpegs(frames, deadline), size[0], size[1], len(texts))


def _sent_size(width: int, height: int, most: int) -> tuple[int, int]:
    """The frame size sent: shrunk (aspect kept) to at most `most` pixels."""
    if width * height <= most:
        return width, height
    scale = (most / (width * height)) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def _jpegs(frames: list[np.ndarray], deadline: Deadline) -> list[str]:
    out = []
    for frame in frames:
        deadline.check()
        out.append(_jpeg(frame))
    return out


def _jpeg(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=JPEG_QUALITY)
    return b64encode(buf.getvalue()).decode("ascii")


def _check_frame_size(width: int, height: int, limits: Limits, where: str) -> None:
    if width <= 0 or height <= 0:
        raise bad_request(f"{where}: the video declares no frame size", "undecodable_video")
    if width * height > limits.max_video_frame_pixels:
        raise _too_large(where, f"the video's frames are {width}x{height} = "
                         f"{width * height} pixels; this deployment accepts at most "
                         f"{limits.max_video_frame_pixels}", "video_too_large")


def _too_large(where: str, message: str, reason: str) -> ProxyError:
    return bad_request(f"{where}: {message}", reason, status=413)
