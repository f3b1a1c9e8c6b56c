"""Request guards: what the proxy checks before any engine sees a request.

The proxy's app calls `check_request` once per request, before routing it. It checks
the OpenAI body shape, counts the images, decodes each inline (data:) image far enough
to read its header, and applies the URL policy: inline data is accepted, local files
and unknown schemes never are, and http(s) media only when the deployment turns remote
URLs on. It must stay synchronous and cheap: it does no I/O (no DNS, no sockets, no
files), and a text-only request costs a few dict lookups.

Remote media it accepts come back as `RemoteMedia` items, for remote_media.py to
download once and inline; the instances never fetch anything themselves.

Every refusal is a `ProxyError` (400, or 413 for a size over a limit) with a short
`reason` label for the failures-by-reason metric; nothing here lets a 5xx or a hang
through for bad client input.
"""

from __future__ import annotations

import binascii
import dataclasses
import io
from urllib.parse import urlsplit

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    "RemoteMedia",
    "check_image_bytes",
    "check_request",
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
        description="Largest request body the server accepts, in bytes (enforced by the "
                    "server layer before the body is parsed).")
    max_messages: int = Field(
        2048, gt=0,
        description="Most chat messages in one request.")
    max_images: int = Field(
        32, gt=0,
        description="Most images (image_url, input_image, image parts) in one request.")
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
    allow_remote_urls: bool = Field(
        False,
        description="Accept http(s) media URLs; the proxy then downloads them itself, "
                    "from public internet addresses only, and sends the instances the "
                    "bytes.")
    fetch_timeout_s: float = Field(
        5.0, gt=0,
        description="Time allowed to download one remote media URL, redirects included.")
    # What the proxy holds at once (proxy/admission.py). Past either, a new request gets
    # 503 with Retry-After and never reaches an engine; requests already taken on finish.
    # 4096: engines queue beyond what they run (vLLM's max_num_seqs is 256 an instance),
    # and the proxy's own cost is a few kB a request; 1 GiB: sixteen bodies of the
    # largest size, each held two or three times over while it is parsed and rewritten.
    max_requests_in_flight: int = Field(
        4096, gt=0,
        description="Most client requests served at once; past it, new requests get 503 "
                    "with Retry-After (those already accepted are served).")
    max_body_bytes_in_flight: int = Field(
        1 << 30, gt=0,
        description="Most bytes of request bodies held at once (each counted at its "
                    "Content-Length, or at max_body_bytes without one); past it, new "
                    "requests get 503 with Retry-After. At least max_body_bytes.")

    @model_validator(mode="after")
    def _one_body_fits(self) -> "Limits":
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) is below "
                f"max_body_bytes ({self.max_body_bytes}): a request of the largest size "
                "would be refused forever")
        return self


@dataclasses.dataclass(eq=False)
class RemoteMedia:
    """One http(s) media URL of a request, to be downloaded by a RemoteFetcher, which
    rewrites `holder[key]` (the url inside the client's body) to a data: URL."""

    modality: str  # "image", "video" or "audio"
    url: str
    holder: dict
    key: str
    where: str  # where in the body, for error messages: "messages[0].content[1]"


# Part type -> (modality, the field holding its URL). The field holds an object
# {"url": ...} or the URL itself: both are in use (OpenAI's Responses API sends
# input_image's image_url as a plain string).
_URL_PARTS = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "image": ("image", "image"),
    "video_url": ("video", "video_url"),
    "audio_url": ("audio", "audio_url"),
}


def _malformed(message: str) -> ProxyError:
    return bad_request(message, "malformed")


# ----------------------------------------------------------------------------------
# check_request: shape, counts, inline images, URL policy (synchronous, no I/O)
# ----------------------------------------------------------------------------------

def check_request(body: object, path: str, limits: Limits,
                  image_pixels: dict[str, int] | None = None) -> list[RemoteMedia]:
    """Check one request for `path` before any instance sees it.

    Raises ProxyError (400, or 413 for a size over a limit) for bad input. Returns the
    http(s) media URLs the caller must have a RemoteFetcher inline (always empty unless
    `limits.allow_remote_urls`). Paths other than the chat and completions routes only
    get the check that the body is a JSON object. If given, `image_pixels` is filled
    with the size (width x height) of each inline image, by URL, for routing by size.
    """
    if not isinstance(body, dict):
        raise _malformed("the request body must be a JSON object")
    if path == COMPLETIONS_PATH:
        _check_prompt(body)
        return []
    if path != CHAT_PATH:
        return []
    media = _chat_media(body, limits)
    if not media:
        return []
    _check_image_count(media, limits)
    remote = []
    for item in media:
        if _check_media_url(item, limits, image_pixels):
            remote.append(item)
    return remote


def _chat_media(body: dict, limits: Limits) -> list[RemoteMedia]:
    """Check the messages' shape; return every media part's URL, inline or remote."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _malformed("'messages' must be a non-empty list")
    if len(messages) > limits.max_messages:
        raise bad_request(f"the request has {len(messages)} messages; this deployment "
                          f"accepts at most {limits.max_messages}", "too_many_messages")
    media: list[RemoteMedia] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _malformed(f"messages[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise _malformed(f"messages[{index}].role must be a string")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if content is None:
            # An assistant turn that only calls tools has no content.
            if role == "assistant":
                continue
            raise _malformed(f"messages[{index}].content is required for role {role!r}")
        if not isinstance(content, list):
            raise _malformed(f"messages[{index}].content must be a string or a list of "
                             "content parts")
        for part_index, part in enumerate(content):
            _check_part(part, f"messages[{index}].content[{part_index}]", media)
    return media


def _check_part(part: object, where: str, media: list[RemoteMedia]) -> None:
    if not isinstance(part, dict):
        raise _malformed(f"{where} must be an object")
    part_type = part.get("type")
    if not isinstance(part_type, str):
        raise _malformed(f"{where}.type must be a string")
    if part_type == "text":
        if not isinstance(part.get("text"), str):
            raise _malformed(f"{where}.text must be a string")
    elif part_type in _URL_PARTS:
        media.append(_media_url(part, part_type, where))
    elif part_type == "input_audio":
        _check_input_audio(part, where)
    # Other types (image_embeds, refusal, ...) are left to the instances to judge.


def _media_url(part: dict, part_type: str, where: str) -> RemoteMedia:
    """Where the URL of a media part lives: {"image_url": {"url": U}} or {"image_url": U}."""
    modality, field = _URL_PARTS[part_type]
    value = part.get(field)
    if isinstance(value, dict):
        holder, key, location = value, "url", f"{where}.{field}.url"
    elif isinstance(value, str):
        holder, key, location = part, field, f"{where}.{field}"
    else:
        raise _malformed(f"{where}.{field} must be an object with a string 'url'")
    url = holder.get(key)
    if not isinstance(url, str) or not url:
        raise _malformed(f"{location} must be a non-empty string")
    return RemoteMedia(modality, url, holder, key, where)


def _check_input_audio(part: dict, where: str) -> None:
    # Inline audio only ({"data": base64, "format": "wav"}): no URL, so no URL policy.
    audio = part.get("input_audio")
    if not (isinstance(audio, dict) and isinstance(audio.get("data"), str)
            and isinstance(audio.get("format"), str)):
        raise _malformed(f"{where}.input_audio must be an object with string 'data' "
                         "and 'format'")


def _check_image_count(media: list[RemoteMedia], limits: Limits) -> None:
    # Counted before any image is decoded, so an over-full request costs no decoding.
    images = sum(1 for item in media if item.modality == "image")
    if images > limits.max_images:
        raise bad_request(f"the request has {images} images; this deployment accepts at "
                          f"most {limits.max_images} per request", "too_many_images")


def _check_prompt(body: dict) -> None:
    """/v1/completions: a non-empty string, list of strings, token ids or lists of them."""
    prompt = body.get("prompt")
    if prompt is None and body.get("prompt_embeds") is not None:
        return  # vLLM's prompt embeddings instead of text; the instance checks them
    if isinstance(prompt, str):
        if not prompt:
            raise _malformed("'prompt' must not be empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise _malformed("'prompt' must be a non-empty string or list")
    first = prompt[0]
    if isinstance(first, str):
        ok = all(isinstance(item, str) and item for item in prompt)
    elif isinstance(first, list):
        ok = all(isinstance(ids, list) and ids and _token_ids(ids) for ids in prompt)
    else:
        ok = _token_ids(prompt)
    if not ok:
        raise _malformed("'prompt' must be a non-empty string, a list of non-empty "
                         "strings, a list of token ids or a list of non-empty lists of "
                         "token ids")


def _token_ids(ids: list) -> bool:
    # type() rather than isinstance: True and False are ints to isinstance.
    return all(type(token) is int and token >= 0 for token in ids)


def _check_media_url(item: RemoteMedia, limits: Limits,
                     image_pixels: dict[str, int] | None) -> bool:
    """Apply the URL policy to one media URL; True when it must be fetched."""
    url = item.url
    if url[:5].lower() == "data:":
        if item.modality == "image":
            raw = _decode_data_url(url, item.where, limits.max_image_bytes)
            _, pixels = inspect_image(raw, limits, item.where)
            if image_pixels is not None:
                image_pixels[url] = pixels
        else:
            _base64_start(url, item.where)  # video and audio are decoded by vLLM
        return False
    host = _http_host(url, item.where)
    if not limits.allow_remote_urls:
        raise bad_request(
            f"{item.where}: remote media URLs (http/https, here {host}) are turned off in "
            "this deployment; send the media inline as a data: URL "
            "(data:<mime>;base64,...), or have the operator enable remote URLs in the "
            "deployment file with `proxy: {limits: {allow_remote_urls: true}}`",
            "remote_url_disabled")
    return True


def _http_host(url: str, where: str) -> str:
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


def _base64_start(url: str, where: str) -> int:
    """Where the base64 text of a data: URL starts. Only base64 data URLs, as vLLM
    reads them (RFC 2397: data:[<mediatype>][;<param>=<value>]*;base64,<data>)."""
    # Found by position rather than split: the payload can be tens of MB, and every
    # slice of it is a copy.
    comma = url.find(",", 5, 5 + _MAX_DATA_URL_HEADER)
    if comma < 0 or url[5:comma].rpartition(";")[2] != "base64":
        raise bad_request(f"{where}: data URLs must be base64 "
                          "(data:<mime>;base64,<data>)", "bad_base64")
    return comma + 1


def _decode_data_url(url: str, where: str, max_bytes: int) -> bytes:
    payload = url[_base64_start(url, where):]
    # The decoded size follows from the text's length: refuse before decoding anything.
    decoded_size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if decoded_size > max_bytes:
        raise _image_bytes_too_large(where, decoded_size, max_bytes)
    try:
        # Strict, like vLLM's own decoding: no whitespace, no URL-safe alphabet, so
        # what passes here also decodes on the instances.
        return b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise bad_request(f"{where}: the data URL is not valid base64 ({err})",
                          "bad_base64") from None


def _image_bytes_too_large(where: str, size: int, max_bytes: int) -> ProxyError:
    return bad_request(f"{where}: the image is {size} bytes; this deployment accepts at "
                       f"most {max_bytes} bytes per image", "image_too_large", status=413)


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
        raise _image_bytes_too_large(where, len(raw), limits.max_image_bytes)
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
