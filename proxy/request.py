"""One parsed request: everything the proxy reads out of a client's body, read once.

`parse_request(raw, path, limits)` decodes the JSON and checks it against the shapes
the proxy serves (msgspec structs built from the tables below, so a bad field is
refused with its path: "invalid request body: Invalid value 'wizard' - at
`$.messages[0].role`"), counts it against the limits, checks each inline image's
header and applies the URL policy (guards.py), and refuses the fields that only the
proxy sets. The `ParsedRequest` it returns is the only view of the request the rest of
the proxy reads: its media parts in prompt order and, once `seal` has given each of
them the proxy's content key, the body the stages are sent.

`MEDIA_PARTS` is the one table of media part types. Every part leaves in one canonical
form per modality, whatever form the client used (`input_image` and `image` become
`image_url`, `input_audio` becomes `audio_url`), with `uuid` set to the proxy's content
key: vLLM takes a part's uuid verbatim as the media's identity in its encoder and
prefix caches and in the MM Store, so the uuid a client writes is never sent on.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Union

import msgspec

from epd_serve.protocols.feature_chunks import VIDEO_KEYS_ARG, part_key
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.guards import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Limits,
    check_media_url,
    decode_data_url,
    inspect_image,
)

__all__ = ["MEDIA_PARTS", "MediaItem", "MediaKind", "ParsedRequest", "media_bytes",
           "parse_request", "with_parts"]


@dataclasses.dataclass(frozen=True)
class MediaKind:
    modality: str  # what the engine's processor takes: image, video, audio (or prompt)
    field: str  # the part's field holding the media
    canonical: str  # the part type it is sent on as
    embeddings: bool = False  # a tensor the client computed, not media to encode


MEDIA_PARTS: dict[str, MediaKind] = {
    "image_url": MediaKind("image", "image_url", "image_url"),
    "input_image": MediaKind("image", "image_url", "image_url"),  # OpenAI's Responses API
    "image": MediaKind("image", "image", "image_url"),
    "video_url": MediaKind("video", "video_url", "video_url"),
    "audio_url": MediaKind("audio", "audio_url", "audio_url"),
    "input_audio": MediaKind("audio", "input_audio", "audio_url"),
    "image_embeds": MediaKind("image", "image_embeds", "image_embeds", embeddings=True),
    "video_embeds": MediaKind("video", "video_embeds", "video_embeds", embeddings=True),
    "audio_embeds": MediaKind("audio", "audio_embeds", "audio_embeds", embeddings=True),
    "prompt_embeds": MediaKind("prompt", "data", "prompt_embeds", embeddings=True),
}
# Text-like part types -> the field holding their text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Top-level fields the proxy writes for the stages; a client may not.
PROXY_FIELDS = ("ec_transfer_params",)
_AUDIO_FORMAT = re.compile(r"^[A-Za-z0-9.+-]{1,32}$")


# ----------------------------------------------------------------------------------
# The shapes, as msgspec structs made from the tables
# ----------------------------------------------------------------------------------

class MediaURL(msgspec.Struct):
    url: str


class InputAudio(msgspec.Struct):
    data: str
    format: str


def _part_struct(part_type: str) -> type:
    """One content part type as a struct tagged by its `type`. Media parts may carry a
    client `uuid` (it is replaced, never sent on); text parts may not carry one, since
    vLLM reads a part that has one as media, whatever its type."""
    if part_type in TEXT_PARTS:
        fields = [(TEXT_PARTS[part_type], str), ("uuid", None, None)]
    else:
        kind = MEDIA_PARTS[part_type]
        if kind.embeddings:
            value: Any = Any  # judged in code: refused, or tensors by opt-in
        elif part_type == "input_audio":
            value = InputAudio
        elif part_type == "image":
            value = str
        else:
            value = Union[MediaURL, str]
        fields = [(kind.field, value), ("uuid", Any, None)]
    name = "".join(word.title() for word in part_type.split("_")) + "Part"
    return msgspec.defstruct(name, fields, tag_field="type", tag=part_type)


_PARTS = {t: _part_struct(t) for t in (*TEXT_PARTS, *MEDIA_PARTS)}
_Content = Union[str, list[Union[tuple(_PARTS.values())]], None]  # type: ignore[misc]
_MESSAGES = {role: msgspec.defstruct(f"{role.title()}Message", [("content", _Content, None)],
                                     tag_field="role", tag=role) for role in ROLES}


class _Common(msgspec.Struct):
    """Fields of both routes the proxy reads; others pass through unread."""

    stream: Union[bool, None] = None
    n: Union[int, None] = None
    seed: Union[int, None] = None
    echo: Union[bool, None] = None
    prompt_logprobs: Union[int, None] = None
    cache_salt: Union[str, None] = None
    kv_transfer_params: Union[dict[str, Any], None] = None
    ec_transfer_params: Any = None
    vllm_xargs: Union[dict[str, Any], None] = None
    mm_processor_kwargs: Union[dict[str, Any], None] = None
    media_io_kwargs: Union[dict[str, Any], None] = None


class _Chat(_Common):
    messages: list[Union[tuple(_MESSAGES.values())]] = []  # type: ignore[valid-type]


class _Completion(_Common):
    prompt: Any = None
    prompt_embeds: Any = None


# ----------------------------------------------------------------------------------
# What comes out
# ----------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class MediaItem:
    """One media part of the request."""

    part_type: str  # as the client wrote it
    kind: MediaKind
    where: str  # "messages[1].content[2]", for messages
    message: int  # its position in the body
    part: int
    url: str | None = None  # data: or http(s) URL (None for embeddings)
    embeddings: Any = None  # the client's tensors (opt-in)
    pixels: int = 0  # width x height of an inline image; a video's, per temporal patch
    key: str = ""  # the proxy's content key, set by ParsedRequest.seal
    # A video, once decoded (proxy/video.py): its frames as sent (base64 JPEG) and the
    # [start, end) frame ranges encoded as separate features (one: the whole video).
    frames: list[str] | None = None
    chunks: tuple[tuple[int, int], ...] = ()

    @property
    def modality(self) -> str:
        return self.kind.modality

    @property
    def chunk_keys(self) -> list[str]:
        """The uuids of this video's chunks, as the encoders are sent them."""
        return [part_key(self.key, index) for index in range(len(self.chunks))]

    @property
    def remote(self) -> bool:
        return self.url is not None and self.url[:5].lower() != "data:"

    def payload(self) -> bytes:
        """What its content key hashes: the media (as the data: URL carries it) or the
        client's tensors."""
        if self.url is not None:
            return media_bytes(self.url)
        return msgspec.json.encode(self.embeddings, order="sorted")

    def sent_part(self) -> dict:
        """The part as the stages get it: canonical form, the proxy's key as uuid."""
        kind = self.kind
        if kind.embeddings:
            part = {"type": kind.canonical, kind.field: self.embeddings}
            if kind.modality != "prompt":  # vLLM gives prompt embeddings no identity
                part["uuid"] = self.key
            return part
        return {"type": kind.canonical, kind.canonical: {"url": self.url}, "uuid": self.key}


@dataclasses.dataclass(eq=False)
class ParsedRequest:
    path: str
    body: dict  # as the client sent it
    media: list[MediaItem]
    text_chars: int
    stream: bool
    client_salt: str | None
    # The request fields that change what a media item becomes (vLLM hashes the same
    # ones into a feature's identity), canonical JSON: part of every content key.
    hash_factors: bytes
    sent: dict | None = None  # the body the stages get, once sealed
    samples: int = 1  # `n`
    prompts: list | None = None  # a completion's prompts, where it sends more than one
    # The parameter (prompt_logprobs, echo) for which the instance that answers must
    # compute the prompt itself (vLLM then reads no prompt KV from elsewhere); None.
    whole_prompt: str | None = None

    @property
    def images(self) -> list[MediaItem]:
        """The images the encoders compute, in prompt order."""
        return [m for m in self.media if m.modality == "image" and not m.kind.embeddings]

    @property
    def videos(self) -> list[MediaItem]:
        """The videos the encoders compute (in chunks of frames), in prompt order."""
        return [m for m in self.media if m.modality == "video" and not m.kind.embeddings]

    @property
    def other_media(self) -> bool:
        """Audio: the encoders take such a request whole."""
        return any(m.modality == "audio" and not m.kind.embeddings for m in self.media)

    def downloads(self) -> list[MediaItem]:
        return [m for m in self.media if m.remote]

    def seal(self, key_of, cache_salt: str | None) -> dict:
        """Give every media item its content key (`key_of(item)`, after any download)
        and build the body the stages get: media parts in canonical form keyed by the
        proxy, and the request's cache salt (None: none is sent)."""
        for item in self.media:
            item.key = key_of(item)
        body = with_parts(self.body, {(m.message, m.part): m.sent_part()
                                       for m in self.media if m.message >= 0})
        if cache_salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = cache_salt
        self.sent = body
        return body


def media_bytes(url: str) -> bytes:
    """A media URL as its content key hashes it (any text a JSON string may hold)."""
    return url.encode("utf-8", "surrogatepass")


def with_parts(body: dict, parts: dict[tuple[int, int], dict]) -> dict:
    """A copy of `body` whose parts at (message, part) are replaced; only the messages
    and content lists holding one are copied."""
    out = dict(body)
    if not parts:
        return out
    messages = list(body["messages"])
    for index in {m for m, _ in parts}:
        message = messages[index]
        content = list(message["content"])
        for (m, p), part in parts.items():
            if m == index:
                content[p] = part
        messages[index] = {**message, "content": content}
    out["messages"] = messages
    return out


# ----------------------------------------------------------------------------------
# parse_request
# ----------------------------------------------------------------------------------

def parse_request(raw: bytes | bytearray, path: str, limits: Limits,
                  client_kv_keys: frozenset[str] = frozenset()) -> ParsedRequest:
    """Read one chat or completion request. Raises ProxyError (400, or 413 for a size
    over a limit) for anything the proxy does not serve as sent. `client_kv_keys`: the
    kv_transfer_params keys a client may set (the KV hand-off's own steering keys)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err}", "malformed") from None
    if not isinstance(body, dict):
        raise _malformed("the request body must be a JSON object")
    chat = path == CHAT_PATH
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _malformed("'messages' must be a non-empty list")
        if len(messages) > limits.max_messages:
            raise bad_request(f"the request has {len(messages)} messages; this deployment "
                              f"accepts at most {limits.max_messages}", "too_many_messages")
    elif path != COMPLETIONS_PATH:
        raise bad_request(f"{path} is not served here", "malformed", 404)
    try:
        shape = msgspec.convert(body, _Chat if chat else _Completion)
    except msgspec.ValidationError as err:
        raise _malformed(f"invalid request body: {err}") from None
    _check_proxy_fields(shape, client_kv_keys)
    if chat:
        media, text_chars = _chat_media(shape)
    else:
        media, text_chars = _completion_media(shape)
    _check_counts(media, limits)
    for item in media:
        _check_item(item, limits)
    factors = {k: v for k, v in (("mm_processor_kwargs", shape.mm_processor_kwargs),
                                 ("media_io_kwargs", shape.media_io_kwargs)) if v}
    parsed = ParsedRequest(path, body, media, text_chars, bool(shape.stream), shape.cache_salt,
                           msgspec.json.encode(factors, order="sorted") if factors else b"")
    _read_sequences(parsed, shape, limits)
    return parsed


def _malformed(message: str) -> ProxyError:
    return bad_request(message, "malformed")


def _read_sequences(parsed: ParsedRequest, shape: _Common, limits: Limits) -> None:
    """How many sequences the request asks for (its prompts times `n`, within
    `max_sequences`), and whether its answer needs the prompt computed where it is
    answered (prompt log-probs, echo: the engine computes those prompts itself)."""
    if shape.n is not None and shape.n < 1:
        raise bad_request(f"'n' must be at least 1 (got {shape.n})", "bad_n")
    parsed.samples = shape.n or 1
    prompt = getattr(shape, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            and len(prompt) > 1:
        parsed.prompts = list(prompt)
    sequences = parsed.samples * len(parsed.prompts or [None])
    if sequences > limits.max_sequences:
        raise bad_request(f"the request asks for {sequences} sequences ('n' "
                          f"{parsed.samples} x {len(parsed.prompts or [None])} prompts); this "
                          f"deployment serves at most {limits.max_sequences} a request",
                          "too_many_sequences")
    if shape.prompt_logprobs is not None:
        parsed.whole_prompt = "prompt_logprobs"
    elif shape.echo:
        parsed.whole_prompt = "echo"


def _check_proxy_fields(shape: _Common, client_kv_keys: frozenset[str]) -> None:
    """The fields through which the proxy tells its stages how to hand a request on."""
    if shape.ec_transfer_params is not None:
        raise bad_request("ec_transfer_params is set by the proxy between its stages; a "
                          "client may not send it", "proxy_field")
    for key in shape.kv_transfer_params or ():
        if key not in client_kv_keys:
            allowed = ", ".join(sorted(client_kv_keys)) or "none"
            raise bad_request(f"kv_transfer_params.{key} is set by the proxy between its "
                              f"stages; a client may set only: {allowed}", "proxy_field")
    for key in ("kv_transfer_params", "ec_transfer_params", VIDEO_KEYS_ARG):
        if key in (shape.vllm_xargs or ()):
            raise bad_request(f"vllm_xargs.{key} is set by the proxy between its stages; a "
                              "client may not send it", "proxy_field")
    if shape.cache_salt == "":
        raise _malformed("cache_salt must be a non-empty string")


def _chat_media(shape: _Chat) -> tuple[list[MediaItem], int]:
    media: list[MediaItem] = []
    text_chars = 0
    for m, message in enumerate(shape.messages):
        content = message.content
        if isinstance(content, str):
            text_chars += len(content)
            continue
        if content is None:
            # An assistant turn that only calls tools has no content.
            if type(message) is _MESSAGES["assistant"]:
                continue
            raise _malformed(f"messages[{m}].content is required for role "
                             f"{type(message).__struct_config__.tag!r}")
        for p, part in enumerate(content):
            part_type = type(part).__struct_config__.tag
            field = TEXT_PARTS.get(part_type)
            if field is not None:
                text_chars += len(getattr(part, field))
                continue
            kind = MEDIA_PARTS[part_type]
            item = MediaItem(part_type, kind, f"messages[{m}].content[{p}]", m, p)
            value = getattr(part, kind.field)
            if kind.embeddings:
                item.embeddings = value
            elif part_type == "input_audio":
                if not _AUDIO_FORMAT.match(value.format):
                    raise _malformed(f"{item.where}.input_audio.format must be a file "
                                     "format name such as 'wav' or 'mp3'")
                item.url = f"data:audio/{value.format};base64,{value.data}"
            else:
                item.url = value if isinstance(value, str) else value.url
            media.append(item)
    return media, text_chars


def _completion_media(shape: _Completion) -> tuple[list[MediaItem], int]:
    """/v1/completions: a non-empty string, list of strings, token ids or lists of them;
    or vLLM's prompt embeddings instead of text (client embeddings)."""
    prompt = shape.prompt
    if shape.prompt_embeds is not None:
        if prompt is not None:
            # vLLM takes both (the embeddings as prompts of their own): the refusal of
            # client embeddings must not depend on a text prompt sent beside them.
            raise _malformed("send 'prompt' or 'prompt_embeds', not both")
        return [MediaItem("prompt_embeds", MEDIA_PARTS["prompt_embeds"], "prompt_embeds",
                          -1, -1, embeddings=shape.prompt_embeds)], 0
    if isinstance(prompt, str):
        if not prompt:
            raise _malformed("'prompt' must not be empty")
        return [], len(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            ok = all(isinstance(item, str) and item for item in prompt)
            chars = sum(len(item) for item in prompt) if ok else 0
        elif isinstance(first, list):
            ok = all(isinstance(ids, list) and ids and _token_ids(ids) for ids in prompt)
            chars = 4 * sum(len(ids) for ids in prompt) if ok else 0
        else:
            ok, chars = _token_ids(prompt), 4 * len(prompt)
        if ok:
            return [], chars
    raise _malformed("'prompt' must be a non-empty string, a list of non-empty strings, "
                     "a list of token ids or a list of non-empty lists of token ids")


def _token_ids(ids: list) -> bool:
    # type() rather than isinstance: True and False are ints to isinstance.
    return all(type(token) is int and token >= 0 for token in ids)


def _check_counts(media: list[MediaItem], limits: Limits) -> None:
    # Counted before anything is decoded or downloaded: an over-full request costs none.
    images = sum(1 for item in media if item.modality == "image")
    if images > limits.max_images:
        raise bad_request(f"the request has {images} images; this deployment accepts at "
                          f"most {limits.max_images} per request", "too_many_images")
    videos = sum(1 for item in media if item.modality == "video")
    if videos > limits.max_videos:
        raise bad_request(f"the request has {videos} videos; this deployment accepts at "
                          f"most {limits.max_videos} per request", "too_many_videos")
    if len(media) > limits.max_media_parts:
        raise bad_request(f"the request has {len(media)} media parts; this deployment "
                          f"accepts at most {limits.max_media_parts} per request",
                          "too_many_media")


def _check_item(item: MediaItem, limits: Limits) -> None:
    if item.kind.embeddings:
        _check_embeddings(item, limits)
        return
    where = f"{item.where}.{item.kind.field}"
    if not item.url:
        raise _malformed(f"{where} must be a non-empty URL")
    if check_media_url(item.url, item.where, limits):
        return  # downloaded (and checked) by remote_media.py
    if item.modality == "image":
        raw = decode_data_url(item.url, item.where, limits.max_image_bytes)
        item.pixels = inspect_image(raw, limits, item.where)[1]


def _check_embeddings(item: MediaItem, limits: Limits) -> None:
    if not limits.allow_client_embeddings:
        raise bad_request(
            f"{item.where}: {item.part_type} (tensors computed by the client) are not "
            "accepted by this deployment; send the media itself, or have the operator set "
            "`proxy: {limits: {allow_client_embeddings: true}}`", "client_embeddings")
    value = item.embeddings
    if isinstance(value, dict):
        tensors = bool(value) and all(isinstance(v, str) and v for v in value.values())
    else:
        tensors = isinstance(value, str) and bool(value)
    if not tensors:
        # Without a tensor, vLLM reads the part as a reference to a feature it already
        # holds under the part's uuid: only the proxy makes those.
        raise bad_request(f"{item.where}: {item.part_type} must carry the tensors "
                          "(base64), not a reference to a stored feature", "client_embeddings")
