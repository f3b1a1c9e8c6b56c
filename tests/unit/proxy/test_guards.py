"""The proxy's request parsing and guards: body shape (errors name the bad field's
path), the fields only the proxy sets, media parts of every type keyed by the proxy,
client embeddings, image limits and decoding checks, the URL policy, and remote
fetching (address policy, size and time limits, download budgets, inlining), against a
local aiohttp server on 127.0.0.1. No instances, no model; runs in a few seconds."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import socket
import struct
import warnings
import zlib

import pydantic
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from PIL import Image

from epd_serve.proxy import guards
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import CHAT_PATH, COMPLETIONS_PATH, Limits
from epd_serve.proxy.remote_media import PublicAddressResolver, RemoteFetcher, is_public_address
from epd_serve.proxy.request import MEDIA_PARTS, ParsedRequest, parse_request
from epd_serve.proxy.tenancy import ANONYMOUS, Tenant, image_key

LIMITS = Limits()
REMOTE = Limits(allow_remote_urls=True)
EMBEDDINGS = Limits(allow_client_embeddings=True)


# ----------------------------------------------------------------------------------
# Building requests and images
# ----------------------------------------------------------------------------------

def png_bytes(width: int = 64, height: int = 64, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb's shape):
    a 1x1 PNG with its IHDR dimensions and checksum rewritten."""
    raw = bytearray(png_bytes(1, 1))
    # 8-byte signature, then the IHDR chunk: length, b"IHDR", 13 bytes of data, CRC.
    raw[16:24] = struct.pack(">II", width, height)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    return bytes(raw)


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict) -> dict:
    return {"model": "qwen", "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]},
    ]}


def parse(body: object, limits: Limits = LIMITS, path: str = CHAT_PATH,
          kv_keys: frozenset[str] = frozenset()) -> ParsedRequest:
    return parse_request(json.dumps(body).encode(), path, limits, kv_keys)


def sealed(body: object, limits: Limits = LIMITS, tenant: Tenant = ANONYMOUS) -> dict:
    """The body the stages get, keyed as the proxy keys it."""
    parsed = parse(body, limits)
    return parsed.seal(lambda item: tenant.media_key(
        "qwen", item.part_type if item.kind.embeddings else item.modality,
        parsed.hash_factors, item.payload()), tenant.cache_salt(parsed.client_salt))


def refused(body: object, limits: Limits = LIMITS, path: str = CHAT_PATH,
            kv_keys: frozenset[str] = frozenset()) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        parse(body, limits, path, kv_keys)
    return caught.value


def assert_error(err: ProxyError, status: int, reason: str, *words: str) -> None:
    assert (err.status, err.reason) == (status, reason), err.message
    for word in words:
        assert word in err.message, err.message


def sent_parts(body: dict) -> list[dict]:
    return body["messages"][-1]["content"]


# ----------------------------------------------------------------------------------
# parse_request: valid requests
# ----------------------------------------------------------------------------------

def test_valid_requests_parse_without_changing_the_body():
    body = chat(image_part(data_url(png_bytes())),
                {"type": "input_image", "image_url": data_url(png_bytes(8, 8))},
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    body["messages"].append({"role": "assistant", "content": None,
                             "tool_calls": [{"id": "1", "type": "function"}]})
    before = copy.deepcopy(body)
    parsed = parse(body)
    assert parsed.body == before
    assert [(m.part_type, m.modality) for m in parsed.media] == [
        ("image_url", "image"), ("input_image", "image"), ("video_url", "video"),
        ("input_audio", "audio")]
    assert [m.pixels for m in parsed.images] == [64 * 64, 8 * 8]
    assert parsed.other_media and parsed.text_chars == len("Answer briefly.What is this?")
    assert parsed.downloads() == []
    for prompt in ("Once upon a time", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse({"prompt": prompt}, path=COMPLETIONS_PATH).media == []


def test_limits_refuse_unknown_fields_and_load_from_a_deployment_section():
    assert Limits.model_validate({"allow_remote_urls": True}).allow_remote_urls
    with pytest.raises(pydantic.ValidationError):
        Limits.model_validate({"allow_remote_url": True})
    with pytest.raises(pydantic.ValidationError):
        Limits(max_images=0)


# ----------------------------------------------------------------------------------
# The proxy is the only author of media identities
# ----------------------------------------------------------------------------------

VICTIM = data_url(png_bytes(color=(10, 200, 10)))
ATTACKER = data_url(png_bytes(color=(200, 10, 10)))


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": ATTACKER}},
    {"type": "image_url", "image_url": ATTACKER},
    {"type": "input_image", "image_url": ATTACKER},
    {"type": "input_image", "image_url": {"url": ATTACKER}},
    {"type": "image", "image": ATTACKER},
])
def test_every_image_part_leaves_as_image_url_under_the_proxys_key(part):
    target = image_key("qwen", VICTIM)
    (sent,) = sent_parts(sealed(chat({**part, "uuid": target})))[1:]
    assert sent == {"type": "image_url", "image_url": {"url": ATTACKER},
                    "uuid": image_key("qwen", ATTACKER)}
    assert sent["uuid"] != target


@pytest.mark.parametrize("part, canonical", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
     {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}),
    ({"type": "audio_url", "audio_url": "data:audio/wav;base64,AAAA"},
     {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}),
])
def test_video_and_audio_parts_leave_keyed_by_the_proxy(part, canonical):
    (sent,) = sent_parts(sealed(chat({**part, "uuid": "../../etc/chosen"})))[1:]
    assert {k: v for k, v in sent.items() if k != "uuid"} == canonical
    assert len(sent["uuid"]) == 64 and int(sent["uuid"], 16) >= 0  # our hex key


def test_keys_follow_content_model_and_processing_not_the_part_type():
    a, b = sealed(chat(image_part(VICTIM), {"type": "image", "image": VICTIM}))["messages"][1][
        "content"][1:]
    assert a["uuid"] == b["uuid"] == image_key("qwen", VICTIM)
    other = sent_parts(sealed(chat(image_part(ATTACKER))))[1]["uuid"]
    with_kwargs = sent_parts(sealed({**chat(image_part(VICTIM)),
                                     "mm_processor_kwargs": {"max_pixels": 3136}}))[1]["uuid"]
    as_video = sent_parts(sealed(chat({"type": "video_url", "video_url": VICTIM})))[1]["uuid"]
    assert len({a["uuid"], other, with_kwargs, as_video}) == 4


def test_a_tenant_with_a_secret_gets_its_own_keys_and_salt():
    tenant = Tenant("key-1", b"secret-of-key-1")
    mine = sealed(chat(image_part(VICTIM)), tenant=tenant)
    assert sent_parts(mine)[1]["uuid"] != image_key("qwen", VICTIM)
    assert mine["cache_salt"] == tenant.cache_salt(None)
    # A client's own salt partitions its requests further, inside its tenant only.
    salted = sealed({**chat(image_part(VICTIM)), "cache_salt": "mine"}, tenant=tenant)
    assert salted["cache_salt"] not in ("mine", mine["cache_salt"])
    assert "cache_salt" not in sealed(chat(image_part(VICTIM)))  # open: none invented
    assert sealed({**chat(), "cache_salt": "s"})["cache_salt"] == "s"


def test_text_parts_may_not_carry_a_uuid():
    # vLLM reads any part that has a uuid as media, whatever its type.
    err = refused(chat({"type": "text", "text": "hi", "uuid": "x",
                        "image_url": {"url": ATTACKER}}))
    assert_error(err, 400, "malformed", "$.messages[1].content[1].uuid")


@pytest.mark.parametrize("field, value, words", [
    ("ec_transfer_params", {"x": 1}, "ec_transfer_params"),
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.9"},
     "kv_transfer_params.do_remote_prefill"),
    ("vllm_xargs", {"kv_transfer_params": {"transfer_id": "t"}}, "vllm_xargs.kv_transfer"),
])
def test_fields_only_the_proxy_sets_are_refused(field, value, words):
    assert_error(refused({**chat(), field: value}), 400, "proxy_field", words)
    assert_error(refused({"prompt": "x", field: value}, path=COMPLETIONS_PATH), 400,
                 "proxy_field", words)


def test_the_handoffs_own_steering_keys_pass():
    body = {**chat(), "kv_transfer_params": {"epd_mode": "whole"}}
    assert parse(body, kv_keys=frozenset({"epd_mode"})).body["kv_transfer_params"] == {
        "epd_mode": "whole"}
    assert_error(refused(body), 400, "proxy_field", "may set only: none")


@pytest.mark.parametrize("part_type", [t for t, k in MEDIA_PARTS.items()
                                       if k.embeddings and t != "prompt_embeds"])
def test_client_embeddings_are_refused_unless_the_deployment_opts_in(part_type):
    field = MEDIA_PARTS[part_type].field
    metadata_only = {"type": part_type, field: {"image_grid_thw": [1, 2, 2]},
                     "uuid": image_key("qwen", VICTIM)}
    assert_error(refused(chat(metadata_only)), 400, "client_embeddings",
                 "allow_client_embeddings")
    # Even where allowed, a reference to a stored feature is the proxy's alone.
    assert_error(refused(chat(metadata_only), EMBEDDINGS), 400, "client_embeddings",
                 "not a reference")
    tensor = {"type": part_type, field: "UEsDBAAAAAAA", "uuid": image_key("qwen", VICTIM)}
    (sent,) = sent_parts(sealed(chat(tensor), EMBEDDINGS))[1:]
    assert sent[field] == "UEsDBAAAAAAA" and sent["uuid"] != image_key("qwen", VICTIM)
    other = sent_parts(sealed(chat({**tensor, field: "UEsDBAAAAAAB"}), EMBEDDINGS))[1]
    assert other["uuid"] != sent["uuid"]  # keyed by the tensors' content


def test_prompt_embeddings_are_client_embeddings_too():
    assert_error(refused({"prompt_embeds": "UEsDBA"}, path=COMPLETIONS_PATH), 400,
                 "client_embeddings")
    assert parse({"prompt_embeds": "UEsDBA"}, EMBEDDINGS, COMPLETIONS_PATH).media


# ----------------------------------------------------------------------------------
# parse_request: malformed bodies name the bad field
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, words", [
    ([{"role": "user"}], "JSON object"),
    ({"messages": "hello"}, "'messages'"),
    ({"messages": []}, "'messages'"),
    ({"messages": ["hello"]}, "$.messages[0]"),
    ({"messages": [{"content": "hi"}]}, "`role`"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "'wizard' - at `$.messages[0].role`"),
    ({"messages": [{"role": "user", "content": 7}]}, "$.messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "required for role 'user'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "$.messages[0].content[0]"),
    (chat({"image_url": {"url": "data:,"}}), "`type` - at `$.messages[1].content[1]`"),
    (chat({"type": "file", "file": {"file_id": "f"}}), "'file' - at `$.messages[1].content[1]"),
    (chat({"type": "text", "text": 3}), "$.messages[1].content[1].text"),
    (chat({"type": "image_url"}), "`image_url` - at `$.messages[1].content[1]`"),
    (chat({"type": "image_url", "image_url": {"detail": "auto"}}), "`url`"),
    (chat({"type": "image_url", "image_url": {"url": ""}}), "non-empty URL"),
    (chat({"type": "input_audio", "input_audio": "AAAA"}), "$.messages[1].content[1].input_audio"),
    (chat({"type": "input_audio", "input_audio": {"data": "AA", "format": "wav;x,"}}),
     "format"),
    ({**chat(), "stream": "yes"}, "$.stream"),
    ({**chat(), "cache_salt": ""}, "cache_salt"),
])
def test_malformed_chat_bodies(body, words):
    assert_error(refused(body), 400, "malformed", words)


@pytest.mark.parametrize("body", [
    {}, {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [1, "a"]},
    {"prompt": [True]}, {"prompt": [[]]}, {"prompt": 5},
])
def test_malformed_completion_prompts(body):
    assert_error(refused(body, path=COMPLETIONS_PATH), 400, "malformed", "'prompt'")


def test_too_many_messages():
    body = {"messages": [{"role": "user", "content": "hi"}] * 5}
    assert_error(refused(body, Limits(max_messages=4)), 400, "too_many_messages", "5", "4")


# ----------------------------------------------------------------------------------
# parse_request: inline images, counted before anything is decoded
# ----------------------------------------------------------------------------------

def test_too_many_images_is_counted_before_any_decoding():
    body = chat(*[image_part("data:image/png;base64,not base64!")] * 33)
    assert_error(refused(body), 400, "too_many_images", "33", "32")


def test_every_kind_of_media_counts():
    body = chat(*[{"type": "video_url", "video_url": "https://example.com/a.mp4"}] * 3,
                *[{"type": "audio_url", "audio_url": "https://example.com/a.wav"}] * 2)
    assert_error(refused(body, Limits(allow_remote_urls=True, max_media_parts=4)), 400,
                 "too_many_media", "5", "4")


def test_videos_are_counted_on_their_own():
    body = chat(*[{"type": "video_url", "video_url": "https://example.com/a.mp4"}] * 3)
    assert_error(refused(body, Limits(allow_remote_urls=True, max_videos=2)), 400,
                 "too_many_videos", "3", "2")


@pytest.fixture
def pixel_decoders(monkeypatch) -> list[tuple]:
    """Every pixel decoder Pillow makes (what decoding an image takes), as it is made."""
    made: list[tuple] = []
    getdecoder = Image._getdecoder

    def recording(*args):
        made.append(args)
        return getdecoder(*args)

    monkeypatch.setattr(Image, "_getdecoder", recording)
    return made


def test_decompression_bomb_header_is_refused_without_decoding(pixel_decoders):
    Image.open(io.BytesIO(png_bytes(4, 4))).load()
    assert pixel_decoders  # the spy sees an image decoded ...
    pixel_decoders.clear()
    err = refused(chat(image_part(data_url(png_declaring(30000, 30000)))))
    assert_error(err, 413, "image_too_large", "messages[1].content[1]", "pixels")
    assert pixel_decoders == []  # judged from the header: not one pixel decoded


def test_image_over_the_pixel_limit_names_its_size():
    err = refused(chat(image_part(data_url(png_declaring(7000, 7000)))))
    assert_error(err, 413, "image_too_large", "7000x7000", "36000000")


def test_pillow_bomb_warning_as_error_is_still_a_413():
    # 100M pixels: above Pillow's warning threshold, below our (raised) limit.
    limits = Limits(max_image_pixels=150_000_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        err = refused(chat(image_part(data_url(png_declaring(10000, 10000)))), limits)
    assert_error(err, 413, "image_too_large", "pixels")


def test_image_over_the_byte_limit():
    raw = png_bytes(256, 256)
    err = refused(chat(image_part(data_url(raw))), Limits(max_image_bytes=len(raw) - 1))
    assert_error(err, 413, "image_too_large", "bytes")


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,iVBORw0KGgo*", "not valid base64"),
    ("data:image/png;base64,iVBO\nRw0KGgo=", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgoé", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64", "must be base64"),
])
@pytest.mark.parametrize("decoder", ["installed", "standard library"])
def test_bad_base64(url, words, decoder, monkeypatch):
    if decoder == "standard library":
        monkeypatch.setattr(guards, "b64decode", base64.b64decode)
    assert_error(refused(chat(image_part(url))), 400, "bad_base64", words)


@pytest.mark.parametrize("raw", [
    b"this is plain text, not an image",
    png_bytes()[:10],                           # cut inside the header
    png_bytes(256, 256)[:-30],                  # header fine, image data cut short
])
def test_undecodable_images(raw):
    err = refused(chat(image_part(data_url(raw))))
    assert_error(err, 400, "undecodable_image", "not a readable image")


# ----------------------------------------------------------------------------------
# parse_request: URL policy
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("part", [
    image_part("file:///etc/passwd"),
    image_part("FILE:///etc/passwd"),
    image_part("ftp://example.com/cat.png"),
    image_part("/etc/passwd"),
    {"type": "video_url", "video_url": {"url": "file:///tmp/clip.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "file:///tmp/a.wav"}},
])
def test_local_files_and_other_schemes_are_forbidden(part):
    err = refused(chat(part))
    assert_error(err, 400, "forbidden_url", "not accepted", "data:")


def test_remote_urls_are_off_by_default():
    for part in (image_part("https://example.com/cat.png"),
                 {"type": "input_image", "image_url": "http://example.com/cat.png"},
                 {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}):
        err = refused(chat(part))
        assert_error(err, 400, "remote_url_disabled", "example.com",
                     "allow_remote_urls: true")


def test_remote_urls_when_allowed_come_back_as_items_to_fetch():
    body = chat(image_part("https://example.com/cat.png"),
                {"type": "input_image", "image_url": "https://example.com/dog.png"},
                image_part(data_url(png_bytes())))
    items = parse(body, REMOTE).downloads()
    assert [(i.modality, i.url, i.where) for i in items] == [
        ("image", "https://example.com/cat.png", "messages[1].content[1]"),
        ("image", "https://example.com/dog.png", "messages[1].content[2]")]
    assert_error(refused(chat(image_part("http://:80/x")), REMOTE), 400, "malformed", "host")
    assert_error(refused(chat(image_part("http://h:99999/")), REMOTE), 400, "malformed")


# ----------------------------------------------------------------------------------
# Address policy
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700::1111", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.3.4", False),
    ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("240.0.0.1", False),
    ("255.255.255.255", False), ("::1", False), ("::", False), ("fe80::1", False),
    ("fd00::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False),
    ("64:ff9b::a00:1", False), ("not an address", False),
])
def test_is_public_address(address, public):
    assert is_public_address(address) is public


class FakeDNS(AbstractResolver):
    """Answers every name with fixed addresses (a rebinding or hostile DNS)."""

    def __init__(self, *addresses: str):
        self.addresses = addresses
        self.asked: list[str] = []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        self.asked.append(host)
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0,
                 "flags": 0} for a in self.addresses]

    async def close(self):
        pass


def test_resolver_keeps_only_public_addresses():
    async def scenario():
        resolver = PublicAddressResolver(FakeDNS("10.0.0.7", "93.184.216.34"))
        assert [r["host"] for r in await resolver.resolve("mixed.test", 80)] == [
            "93.184.216.34"]
        with pytest.raises(OSError, match="non-public"):
            await PublicAddressResolver(FakeDNS("169.254.169.254")).resolve("meta.test")
    asyncio.run(scenario())


# ----------------------------------------------------------------------------------
# Remote fetching
# ----------------------------------------------------------------------------------

def fetch_error(fetcher_factory, url: str) -> ProxyError:
    """Inline one image URL with a fresh fetcher; the error."""
    async def scenario():
        fetcher = fetcher_factory()
        body = chat(image_part(url))
        try:
            with pytest.raises(ProxyError) as caught:
                await fetcher.inline(parse(body, fetcher.limits).downloads())
            return caught.value
        finally:
            await fetcher.close()
    return asyncio.run(scenario())


@pytest.fixture
def connects(monkeypatch) -> list:
    """The address of every connection a socket of this process attempts (what
    aiohttp's connector does for a download, through the event loop)."""
    attempted: list = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def recording(original):
        def attempt(sock, address):
            attempted.append(address)
            return original(sock, address)
        return attempt

    monkeypatch.setattr(socket.socket, "connect", recording(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", recording(connect_ex))
    return attempted


@pytest.mark.parametrize("url, host", [
    ("http://127.0.0.1:9/cat.png", "127.0.0.1"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    ("http://10.0.0.1/cat.png", "10.0.0.1"),
    ("http://[::1]:9/cat.png", "::1"),
    ("http://localhost:9/cat.png", "localhost"),
])
def test_non_public_targets_are_refused_quickly(url, host, connects):
    err = fetch_error(lambda: RemoteFetcher(REMOTE), url)
    assert_error(err, 400, "forbidden_url", host, "not a public")
    assert connects == []  # refused before any connection: nothing to wait for


def test_a_name_resolving_to_the_metadata_address_is_refused_at_resolve_time(connects):
    dns = FakeDNS("169.254.169.254")
    err = fetch_error(lambda: RemoteFetcher(REMOTE, resolver=dns),
                      "http://images.example.test/cat.png")
    assert_error(err, 400, "forbidden_url", "images.example.test")
    assert dns.asked == ["images.example.test"] and connects == []


class ImageServer:
    """A local HTTP server (127.0.0.1 only) with a few misbehaving routes."""

    def __init__(self):
        self.image = png_bytes(32, 32)
        self.hits: dict[str, int] = {}
        self.base = ""
        self.sending = 0  # clip.mp4 answers being sent at once, and the most seen
        self.most_sending = 0
        app = web.Application()
        app.router.add_get("/{name}", self.handle)
        self.runner = web.AppRunner(app)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] = self.hits.get(name, 0) + 1
        if name == "cat.png":
            return web.Response(body=self.image, content_type="image/png")
        if name == "slow.png":  # answers only when the server shuts down
            await self.shutting_down.wait()
        if name == "big.png":
            return web.Response(body=b"\0" * 4096, content_type="image/png")
        if name == "big-chunked.png":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(8):
                await response.write(b"\0" * 1024)
            return response
        if name == "text.png":
            return web.Response(text="not an image", content_type="image/png")
        if name == "clip.mp4":  # 4 KiB, taking 50 ms
            self.sending += 1
            self.most_sending = max(self.most_sending, self.sending)
            await asyncio.sleep(0.05)
            self.sending -= 1
            return web.Response(body=b"\1" * 4096, content_type="video/mp4")
        if name == "redirect":
            raise web.HTTPFound("/cat.png")
        if name == "to-file":
            raise web.HTTPFound("file:///etc/passwd")
        if name == "loop":
            raise web.HTTPFound("/loop")
        raise web.HTTPNotFound()

    async def __aenter__(self) -> ImageServer:
        self.shutting_down = asyncio.Event()
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.base = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutting_down.set()
        await self.runner.cleanup()


def with_server(scenario, limits: Limits = REMOTE):
    """Run `scenario(server, fetcher)` against a fresh server and a fetcher that may
    reach loopback (the server's address)."""
    async def run():
        async with ImageServer() as server:
            fetcher = RemoteFetcher(limits, allow_private=True)
            try:
                return await scenario(server, fetcher)
            finally:
                await fetcher.close()
    return asyncio.run(run())


async def inline_error(fetcher: RemoteFetcher, url: str) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        await fetcher.inline(parse(chat(image_part(url)), fetcher.limits).downloads())
    return caught.value


def test_fetch_inlines_images_and_fetches_a_repeated_url_once():
    async def scenario(server, fetcher):
        url = f"{server.base}/cat.png"
        body = chat(image_part(url), {"type": "input_image", "image_url": url},
                    image_part(f"{server.base}/redirect"))
        items = parse(body, fetcher.limits).downloads()
        await fetcher.inline(items)
        assert [item.url for item in items] == [data_url(server.image)] * 3
        assert server.hits == {"cat.png": 2, "redirect": 1}  # once direct, once redirected
    with_server(scenario)


def test_fetch_timeout_is_a_400_within_the_timeout():
    async def scenario(server, fetcher):
        err = await inline_error(fetcher, f"{server.base}/slow.png")
        # slow.png answers only once the server shuts down, after this: the fetch was
        # ended by its own deadline, with the server's one answer still pending.
        assert not server.shutting_down.is_set() and server.hits == {"slow.png": 1}
        return err
    err = with_server(scenario, Limits(allow_remote_urls=True, fetch_timeout_s=0.3))
    assert_error(err, 400, "fetch_timeout", "127.0.0.1", "0.3 s")


@pytest.mark.parametrize("name", ["big.png", "big-chunked.png"])
def test_oversized_remote_body_is_refused(name):
    async def scenario(server, fetcher):
        return await inline_error(fetcher, f"{server.base}/{name}")
    err = with_server(scenario, Limits(allow_remote_urls=True, max_image_bytes=2048))
    assert_error(err, 413, "image_too_large", "127.0.0.1", "2048")


@pytest.mark.parametrize("name, status, reason, words", [
    ("missing.png", 400, "fetch_failed", "HTTP 404"),
    ("text.png", 400, "undecodable_image", "not a readable image"),
    ("to-file", 400, "forbidden_url", "'file:'"),
    ("loop", 400, "fetch_failed", "redirected more than"),
])
def test_remote_failures(name, status, reason, words):
    async def scenario(server, fetcher):
        return await inline_error(fetcher, f"{server.base}/{name}")
    assert_error(with_server(scenario), status, reason, words)


def test_unreachable_host_is_a_400(connects):
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err = fetch_error(lambda: RemoteFetcher(REMOTE, allow_private=True),
                      f"http://127.0.0.1:{port}/cat.png")
    assert_error(err, 400, "fetch_failed", "127.0.0.1")
    assert ("127.0.0.1", port) in connects  # the spy sees a download's connection


def clips(server, n: int) -> dict:
    return chat(*[{"type": "video_url", "video_url": f"{server.base}/clip.mp4?n={i}"}
                  for i in range(n)])


def test_a_requests_downloads_share_one_byte_budget():
    async def scenario(server, fetcher):
        with pytest.raises(ProxyError) as caught:
            await fetcher.inline(parse(clips(server, 2), fetcher.limits).downloads())
        return caught.value
    err = with_server(scenario, Limits(allow_remote_urls=True,
                                       max_fetched_bytes_per_request=6000))
    assert_error(err, 413, "media_too_large", "6000", "max_fetched_bytes_per_request")


@pytest.mark.parametrize("slots", [1, 3])
def test_downloads_wait_for_one_of_the_proxys_slots(slots):
    async def scenario(server, fetcher):
        items = parse(clips(server, 6), fetcher.limits).downloads()
        await fetcher.inline(items)
        assert all(item.url.startswith("data:video/mp4;base64,") for item in items)
        return server.most_sending
    assert with_server(scenario, Limits(allow_remote_urls=True, max_videos=6,
                                        max_fetches_in_flight=slots)) == slots


def test_downloads_count_against_the_proxys_byte_budget():
    from epd_serve.proxy.admission import Admission
    from epd_serve.proxy.metrics import ProxyMetrics

    limits = Limits(allow_remote_urls=True, max_body_bytes=1000, max_body_bytes_in_flight=6000)

    async def scenario(server, fetcher):
        admission = Admission(limits, ProxyMetrics())
        with admission.admit() as ticket:
            with pytest.raises(ProxyError) as caught:
                await fetcher.inline(parse(clips(server, 2), limits).downloads(), ticket)
            assert admission.body_bytes == ticket.body_bytes > 0
        assert admission.body_bytes == 0  # given back with the request
        return caught.value
    assert_error(with_server(scenario, limits), 503, "overloaded", "max_body_bytes_in_flight")
