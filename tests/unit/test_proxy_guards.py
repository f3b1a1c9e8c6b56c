"""The proxy's request guards: body shape, image limits and decoding checks, the URL
policy, and remote fetching (address policy, size and time limits, inlining), against
a local aiohttp server on 127.0.0.1. No instances, no model; runs in a few seconds."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import socket
import struct
import time
import warnings
import zlib

import pydantic
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from PIL import Image

from epd_serve.proxy import guards
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.guards import CHAT_PATH, COMPLETIONS_PATH, Limits, check_request
from epd_serve.proxy.remote_media import PublicAddressResolver, RemoteFetcher, is_public_address

LIMITS = Limits()
REMOTE = Limits(allow_remote_urls=True)


# ----------------------------------------------------------------------------------
# Building requests and images
# ----------------------------------------------------------------------------------

def png_bytes(width: int = 64, height: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
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


def refused(body: object, limits: Limits = LIMITS, path: str = CHAT_PATH) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        check_request(body, path, limits)
    return caught.value


def assert_error(err: ProxyError, status: int, reason: str, *words: str) -> None:
    assert (err.status, err.reason) == (status, reason), err.message
    for word in words:
        assert word in err.message, err.message


# ----------------------------------------------------------------------------------
# check_request: valid requests
# ----------------------------------------------------------------------------------

def test_valid_requests_pass_unchanged():
    body = chat(image_part(data_url(png_bytes())),
                {"type": "input_image", "image_url": data_url(png_bytes(8, 8))},
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    body["messages"].append({"role": "assistant", "content": None,
                             "tool_calls": [{"id": "1", "type": "function"}]})
    before = copy.deepcopy(body)
    assert check_request(body, CHAT_PATH, LIMITS) == []
    assert body == before
    for prompt in ("Once upon a time", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert check_request({"prompt": prompt}, COMPLETIONS_PATH, LIMITS) == []
    # Other routes are not this module's business beyond being a JSON object.
    assert check_request({"anything": 1}, "/v1/models", LIMITS) == []


def test_text_request_is_cheap():
    body = chat()
    start = time.perf_counter()
    for _ in range(1000):
        check_request(body, CHAT_PATH, LIMITS)
    assert (time.perf_counter() - start) / 1000 < 50e-6  # microseconds in practice


def test_limits_refuse_unknown_fields_and_load_from_a_deployment_section():
    assert Limits.model_validate({"allow_remote_urls": True}).allow_remote_urls
    with pytest.raises(pydantic.ValidationError):
        Limits.model_validate({"allow_remote_url": True})
    with pytest.raises(pydantic.ValidationError):
        Limits(max_images=0)


# ----------------------------------------------------------------------------------
# check_request: malformed bodies
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, words", [
    ([{"role": "user"}], "JSON object"),
    ({"messages": "hello"}, "'messages'"),
    ({"messages": []}, "'messages'"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "required for role 'user'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    (chat({"image_url": {"url": "data:,"}}), "messages[1].content[1].type"),
    (chat({"type": "text", "text": 3}), ".text must be a string"),
    (chat({"type": "image_url"}), ".image_url must be an object"),
    (chat({"type": "image_url", "image_url": {"detail": "auto"}}), ".image_url.url"),
    (chat({"type": "image_url", "image_url": {"url": ""}}), ".image_url.url"),
    (chat({"type": "input_audio", "input_audio": "AAAA"}), ".input_audio"),
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
# check_request: inline images
# ----------------------------------------------------------------------------------

def test_too_many_images_is_counted_before_any_decoding():
    body = chat(*[image_part("data:image/png;base64,not base64!")] * 33)
    assert_error(refused(body), 400, "too_many_images", "33", "32")


def test_decompression_bomb_header_is_refused_without_decoding():
    start = time.perf_counter()
    err = refused(chat(image_part(data_url(png_declaring(30000, 30000)))))
    assert time.perf_counter() - start < 0.5
    assert_error(err, 413, "image_too_large", "messages[1].content[1]", "pixels")


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
# check_request: URL policy
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
    items = check_request(body, CHAT_PATH, REMOTE)
    assert [(i.modality, i.url) for i in items] == [
        ("image", "https://example.com/cat.png"), ("image", "https://example.com/dog.png")]
    assert items[0].holder is body["messages"][1]["content"][1]["image_url"]
    assert items[1].holder is body["messages"][1]["content"][2]
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

def fetch_error(fetcher_factory, url: str) -> tuple[ProxyError, float]:
    """Inline one image URL with a fresh fetcher; the error and how long it took."""
    async def scenario():
        fetcher = fetcher_factory()
        body = chat(image_part(url))
        try:
            start = time.perf_counter()
            with pytest.raises(ProxyError) as caught:
                await fetcher.inline(check_request(body, CHAT_PATH, fetcher.limits))
            return caught.value, time.perf_counter() - start
        finally:
            await fetcher.close()
    return asyncio.run(scenario())


@pytest.mark.parametrize("url, host", [
    ("http://127.0.0.1:9/cat.png", "127.0.0.1"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    ("http://10.0.0.1/cat.png", "10.0.0.1"),
    ("http://[::1]:9/cat.png", "::1"),
    ("http://localhost:9/cat.png", "localhost"),
])
def test_non_public_targets_are_refused_quickly(url, host):
    err, took = fetch_error(lambda: RemoteFetcher(REMOTE), url)
    assert_error(err, 400, "forbidden_url", host, "not a public")
    assert took < 0.5


def test_a_name_resolving_to_the_metadata_address_is_refused_at_resolve_time():
    dns = FakeDNS("169.254.169.254")
    err, took = fetch_error(lambda: RemoteFetcher(REMOTE, resolver=dns),
                            "http://images.example.test/cat.png")
    assert_error(err, 400, "forbidden_url", "images.example.test")
    assert dns.asked == ["images.example.test"] and took < 0.5


class ImageServer:
    """A local HTTP server (127.0.0.1 only) with a few misbehaving routes."""

    def __init__(self):
        self.image = png_bytes(32, 32)
        self.hits: dict[str, int] = {}
        self.base = ""
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
        await fetcher.inline(check_request(chat(image_part(url)), CHAT_PATH,
                                           fetcher.limits))
    return caught.value


def test_fetch_inlines_images_and_fetches_a_repeated_url_once():
    async def scenario(server, fetcher):
        url = f"{server.base}/cat.png"
        body = chat(image_part(url), {"type": "input_image", "image_url": url},
                    image_part(f"{server.base}/redirect"))
        await fetcher.inline(check_request(body, CHAT_PATH, fetcher.limits))
        expected = data_url(server.image)
        parts = body["messages"][1]["content"]
        assert parts[1]["image_url"]["url"] == expected
        assert parts[2]["image_url"] == expected
        assert parts[3]["image_url"]["url"] == expected
        assert server.hits == {"cat.png": 2, "redirect": 1}  # once direct, once redirected
    with_server(scenario)


def test_fetch_timeout_is_a_400_within_the_timeout():
    async def scenario(server, fetcher):
        start = time.perf_counter()
        err = await inline_error(fetcher, f"{server.base}/slow.png")
        return err, time.perf_counter() - start
    err, took = with_server(scenario, Limits(allow_remote_urls=True, fetch_timeout_s=0.3))
    assert_error(err, 400, "fetch_timeout", "127.0.0.1", "0.3 s")
    assert took < 0.8


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


def test_unreachable_host_is_a_400():
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err, _ = fetch_error(lambda: RemoteFetcher(REMOTE, allow_private=True),
                         f"http://127.0.0.1:{port}/cat.png")
    assert_error(err, 400, "fetch_failed", "127.0.0.1")
