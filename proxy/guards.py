"""Request guards: the proxy's limits and the checks it makes on a request's bytes.

`Limits` is the `proxy: {limits: ...}` section of a deployment file: how large, how
many, how fast, and which media sources are accepted. The checks here look at bytes,
not at the request's shape (request.py parses that, once): an inline image is decoded
far enough to read its header (`inspect_image`), a data: URL must be base64, and a
media URL must be inline data, or http(s) when the deployment turns remote URLs on
(then remote_media.py downloads it). They are synchronous and do no I/O (no DNS, no
sockets, no files).

Every refusal is a `ProxyError` (400, or 413 for a size over a limit) with a short
`reason` label for the failures-by-reason metric; nothing here lets a 5xx or a hang
through for bad client input.
"""

from __future__ import annotations

import binascii
import io
from urllib.parse import urlsplit

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

from epd_serve.proxy.errors import ProxyError, bad_request

try:
    # vLLM's own decoder, so installed beside every engine: about 20x faster than the
    # standard library's (3 ms instead of 65 ms for a 20 MiB image), and as strict.
    from pybase64 import b64decode
except ImportError:  # pragma: no cover - the standard library accepts the same input
    from base64 import b64decode

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "Limits",
    "check_image_bytes",
    "check_media_url",
    "decode_data_url",
    "inspect_image",
]

MiB = 1 << 20

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# Longest "<mime>;<params>;base64" part of a data: URL looked at for its comma.
_MAX_DATA_URL_HEADER = 1024


class Limits(BaseModel):
    """Per-request limits; the `proxy: {limits: ...}` section of a deployment file."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        64 * MiB, gt=0,
        description="Largest request body the server accepts, in bytes (a larger "
                    "Content-Length is refused unread, 413).")
    max_messages: int = Field(
        2048, gt=0,
        description="Most chat messages in one request.")
    max_images: int = Field(
        32, gt=0,
        description="Most images (image_url, input_image, image parts) in one request.")
    max_media_parts: int = Field(
        32, gt=0,
        description="Most media parts of any kind (images, video, audio, embeddings) in "
                    "one request; counted before anything is decoded or downloaded.")
    # Qwen2-VL's processor resizes every image to at most 16384 * 28 * 28 = 12.8M pixels,
    # so a larger image gains the model nothing. 36M (6000 x 6000) leaves room for large
    # photos; far beyond that an image is a decompression bomb or a mistake, and decoding
    # it would cost the encoder hundreds of MB of memory for nothing.
    max_image_pixels: int = Field(
        36_000_000, gt=0,
        description="Most pixels (width x height) of one image, read from its header "
                    "before any pixel is decoded.")
    # The same cap per image as OpenAI's API, so clients written for it fit.
    max_image_bytes: int = Field(
        20 * MiB, gt=0,
        description="Largest encoded image, in bytes, inline (after base64 decoding) or "
                    "downloaded.")
    max_media_bytes: int = Field(
        64 * MiB, gt=0,
        description="Largest downloaded video or audio file, in bytes (inline ones are "
                    "bounded by max_body_bytes).")
    # Videos (proxy/video.py). The proxy decodes each video itself and sends every
    # stage the same sampled frames, so these bound the proxy's own work too.
    max_videos: int = Field(
        4, gt=0,
        description="Most videos (video_url parts) in one request.")
    max_sequences: int = Field(
        256, gt=0,
        description="Most sequences one request asks for: its prompts (a completion's list) "
                    "times `n`. Each prompt is its own trip through the stages.")
    max_video_frames: int = Field(
        64, gt=0,
        description="Most frames of one video the model is given (Video-MME's 64); a "
                    "longer video is sampled uniformly down to this many.")
    max_video_source_frames: int = Field(
        3600, gt=0,
        description="Most frames a video may hold (2 minutes at 30 fps); counted from "
                    "the container's packets before any frame is decoded (413 past it).")
    max_video_seconds: float = Field(
        600.0, gt=0,
        description="Longest video accepted, as its container declares (413 past it).")
    max_video_frame_pixels: int = Field(
        3840 * 2160, gt=0,
        description="Most pixels of one video frame (4K UHD), read from the stream's "
                    "header and checked on every decoded frame (413 past it).")
    # Qwen2-VL's video processor shrinks frames to at most 768 * 28 * 28 pixels; larger
    # frames are shrunk here first, so no stage receives pixels the model drops.
    video_frame_pixels: int = Field(
        768 * 28 * 28, gt=0,
        description="Frames larger than this many pixels are scaled down (aspect kept) "
                    "before they are sent to the stages.")
    video_decode_timeout_s: float = Field(
        30.0, gt=0,
        description="Time the proxy may spend decoding one video (400 past it).")
    max_video_decodes: int = Field(
        2, gt=0,
        description="Videos decoded at once in the whole proxy (each on a worker thread, "
                    "off the event loop); more wait their turn.")
    max_video_decodes_per_client: int = Field(
        1, gt=0,
        description="Of those, most decoding one client address's videos at once; its "
                    "other videos wait their turn without holding a slot.")
    video_wait_s: float = Field(
        30.0, gt=0,
        description="Longest wait for a decode slot (503 past it, retry later).")
    max_video_queue: int = Field(
        16, ge=0,
        description="Videos that may wait for a decode slot; one more is refused (503, "
                    "retry later) instead of queueing without bound.")
    allow_remote_urls: bool = Field(
        False,
        description="Accept http(s) media URLs; the proxy then downloads them itself, "
                    "from public internet addresses only, and sends the instances the "
                    "bytes.")
    fetch_timeout_s: float = Field(
        5.0, gt=0,
        description="Time allowed to download one remote media URL, redirects included.")
    max_fetches_in_flight: int = Field(
        16, gt=0,
        description="Remote media downloads running at once in the whole proxy; more "
                    "wait their turn (within fetch_timeout_s).")
    max_fetched_bytes_per_request: int = Field(
        128 * MiB, gt=0,
        description="Most bytes downloaded for one request, all its remote media "
                    "together (413 past it). Downloads also count against "
                    "max_body_bytes_in_flight while the request is served.")
    allow_client_embeddings: bool = Field(
        False,
        description="Accept image_embeds, video_embeds, audio_embeds and prompt_embeds "
                    "parts (tensors a client computed) instead of refusing them (400). "
                    "Each is then keyed by a hash of its content; a metadata-only "
                    "reference to a stored feature is refused either way.")
    # What the proxy holds at once (proxy/admission.py). Past either, a new request gets
    # 503 with Retry-After and never reaches an engine; requests already taken on finish.
    # 4096: engines queue beyond what they run (vLLM's max_num_seqs is 256 an instance),
    # and the proxy's own cost is a few kB a request; 1 GiB: sixteen bodies of the
    # largest size, each held two or three times over while it is parsed and rewritten.
    max_requests_in_flight: int = Field(
        4096, gt=0,
        description="Most client requests served at once (lowered at start to what the "
                    "process's file descriptors allow); past it, new requests get 503 "
                    "with Retry-After (those already accepted are served).")
    max_requests_per_client: int = Field(
        1024, gt=0,
        description="Most requests in flight from one client address (its body still "
                    "arriving, or its answer still being computed or read); more get 429 "
                    "(a client behind a shared gateway counts as one).")
    tenant_weights: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Weight of each tenant (by its name in the request log, key-<8 hex>) "
                    "in the fair share of max_requests_in_flight; unnamed tenants weigh 1.")
    fair_share_above: float = Field(
        0.75, gt=0, le=1,
        description="Once this fraction of max_requests_in_flight is taken, a tenant "
                    "past its weighted share gets 503: the rest is kept for tenants "
                    "within theirs. 1: shares never apply.")
    max_body_bytes_in_flight: int = Field(
        1 << 30, gt=0,
        description="Most bytes of request bodies (and remote media downloads) held at "
                    "once, counted as they arrive; a request that would pass it gets 503 "
                    "with Retry-After. At least max_body_bytes.")
    # A slow upload holds a connection and what it has sent; it must keep up a rate
    # that any real client exceeds (64 KiB/s: a 20 MiB image in about 5 minutes at
    # worst), or it is cut off with 408 and its bytes are given back.
    upload_grace_s: float = Field(
        10.0, gt=0,
        description="Time a request body may take before min_upload_bytes_per_s applies "
                    "(also the longest wait for the first byte).")
    min_upload_bytes_per_s: int = Field(
        64 * 1024, gt=0,
        description="Slowest upload accepted: after upload_grace_s, a body must average at "
                    "least this many bytes a second, or the request ends with 408.")
    client_write_timeout_s: float = Field(
        30.0, gt=0,
        description="Longest a streamed answer may wait for its client to take the next "
                    "bytes; past it the connection is closed and the request cancelled "
                    "on the instances (a client that stops reading holds nothing).")
    max_uploads_per_client: int = Field(
        64, gt=0,
        description="Request bodies received at once from one client address; more get "
                    "429 (a client behind a shared gateway counts as one).")
    max_trace_body_bytes: int = Field(
        4 * MiB, gt=0,
        description="Largest span export (POST /v1/traces) an engine may send.")

    @model_validator(mode="after")
    def _one_body_fits(self) -> "Limits":
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) is below "
                f"max_body_bytes ({self.max_body_bytes}): a request of the largest size "
                "would be refused forever")
        return self


def _malformed(message: str) -> ProxyError:
    return bad_request(message, "malformed")


def check_media_url(url: str, where: str, limits: Limits) -> bool:
    """Apply the URL policy to one media URL; True when it must be downloaded (an
    http(s) URL in a deployment that allows them), False for inline data."""
    if url[:5].lower() == "data:":
        base64_start(url, where)
        return False
    host = http_host(url, where)
    if not limits.allow_remote_urls:
        raise bad_request(
            f"{where}: remote media URLs (http/https, here {host}) are turned off in "
            "this deployment; send the media inline as a data: URL "
            "(data:<mime>;base64,...), or have the operator enable remote URLs in the "
            "deployment file with `proxy: {limits: {allow_remote_urls: true}}`",
            "remote_url_disabled")
    return True


def http_host(url: str, where: str) -> str:
    """The host of an http(s) URL; any other scheme (file:, ftp:, none) is refused."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port  # .port raises for a bad port
    except ValueError:
        raise _malformed(f"{where}: the media URL is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        shown = f"'{scheme}:'" if scheme else "scheme-less"
        raise bad_request(f"{where}: {shown} media URLs are not accepted; send the media "
                          "inline as a data: URL (data:<mime>;base64,...)",
                          "forbidden_url")
    if not host or port == 0:
        raise _malformed(f"{where}: the media URL has no host or port to fetch from")
    return host


def base64_start(url: str, where: str) -> int:
    """Where the base64 text of a data: URL starts. Only base64 data URLs, as vLLM
    reads them (RFC 2397: data:[<mediatype>][;<param>=<value>]*;base64,<data>)."""
    # Found by position rather than split: the payload can be tens of MB, and every
    # slice of it is a copy.
    comma = url.find(",", 5, 5 + _MAX_DATA_URL_HEADER)
    if comma < 0 or url[5:comma].rpartition(";")[2] != "base64":
        raise bad_request(f"{where}: data URLs must be base64 "
                          "(data:<mime>;base64,<data>)", "bad_base64")
    return comma + 1


def decode_data_url(url: str, where: str, max_bytes: int, kind: str = "image") -> bytes:
    """The bytes of a base64 data: URL, refused (413) past `max_bytes` before decoding;
    `kind`: what the refusal calls the media (image, video)."""
    payload = url[base64_start(url, where):]
    # The decoded size follows from the text's length: refuse before decoding anything.
    decoded_size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if decoded_size > max_bytes:
        raise _bytes_too_large(where, decoded_size, max_bytes, kind)
    try:
        # Strict, like vLLM's own decoding: no whitespace, no URL-safe alphabet, so
        # what passes here also decodes on the instances.
        return b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise bad_request(f"{where}: the data URL is not valid base64 ({err})",
                          "bad_base64") from None


def _bytes_too_large(where: str, size: int, max_bytes: int, kind: str = "image") -> ProxyError:
    return bad_request(f"{where}: the {kind} is {size} bytes; this deployment accepts at "
                       f"most {max_bytes} bytes per {kind}", f"{kind}_too_large", status=413)


def check_image_bytes(raw: bytes, limits: Limits, where: str = "image") -> str:
    """Check an encoded image without decoding its pixels; return its MIME type."""
    return inspect_image(raw, limits, where)[0]


def inspect_image(raw: bytes, limits: Limits, where: str = "image") -> tuple[str, int]:
    """Check an encoded image without decoding its pixels; its MIME type and pixels.

    Reads the header for the size (refusing more than `max_image_pixels`, which stops
    decompression bombs: a tiny file declaring 30000 x 30000), then `verify()` walks
    the file's structure (every chunk and checksum of a PNG) to catch corrupt data.
    """
    if len(raw) > limits.max_image_bytes:
        raise _bytes_too_large(where, len(raw), limits.max_image_bytes)
    try:
        # Image.open reads only the header. Pillow itself raises DecompressionBombError
        # above 2 x Image.MAX_IMAGE_PIXELS (and warns above 1 x, a warning that turns
        # into an exception where warnings are errors); both mean "too large" here.
        image = Image.open(io.BytesIO(raw))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise bad_request(f"{where}: the image declares more pixels than the decoder "
                          f"accepts (this deployment: at most {limits.max_image_pixels})",
                          "image_too_large", status=413) from None
    except Exception as err:  # any parser failure means the client's bytes are bad
        raise _undecodable(where, err) from None
    with image:
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise bad_request(f"{where}: the image is {width}x{height} = {width * height} "
                              f"pixels; this deployment accepts at most "
                              f"{limits.max_image_pixels}", "image_too_large", status=413)
        mime = image.get_format_mimetype() or f"image/{(image.format or 'unknown').lower()}"
        try:
            image.verify()
        except Exception as err:
            raise _undecodable(where, err) from None
    return mime, width * height


def _undecodable(where: str, err: Exception) -> ProxyError:
    detail = str(err) or type(err).__name__
    return bad_request(f"{where}: the data is not a readable image ({detail})",
                       "undecodable_image")
