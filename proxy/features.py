"""The media of a request as the MM Store sees them (runs in the proxy process).

Each image has the proxy's content key (request.py, tenancy.py), which E, P, D and the
store agree on: it is the image's `uuid`, which vLLM then uses as the feature's hash. After the encoder (or
the store, for an image seen before) has the feature, prefill and decode are sent a
reference instead of the pixels: an `image_embeds` part holding only the placeholder
metadata the encoder published (the image grid) plus the `uuid`, so they neither
decode nor preprocess the image. An engine that takes no such reference (vLLM 0.23;
`feature_refs: pixels`) is sent the pixels with the `uuid` instead: it preprocesses the
image but takes the feature from the store under that key rather than encoding it. A
video is encoded in chunks of frames, each stored under its own key
(protocols/feature_chunks.py); prefill and decode are sent its frames, with its chunks'
keys (joined) in `vllm_xargs` for their connector, or, where the engine takes references
and every chunk's encoder published its grid, a `video_embeds` reference: the video's
grid (its chunks' frame patches added up) under its chunks' joined key, so prefill
neither decodes nor preprocesses the frames. A prefill instance is told the keys
ahead of the request (prefetch hints) so it can pull the features while the request is
on its way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import msgspec
import zmq

from epd_serve.mmstore import FeatureStore, StoreError, StoreSpec, open_store
from epd_serve.protocols.encoder import EncoderParams
from epd_serve.protocols.feature_chunks import VIDEO_KEYS_ARG, joined_key
from epd_serve.protocols.params import ParamsError, from_dict
from epd_serve.proxy.errors import malformed_params
from epd_serve.proxy.request import ParsedRequest, with_parts
from epd_serve.proxy.video import frame_list_url

log = logging.getLogger("epd_serve.proxy.features")


# After a failed attempt to open the MM Store (its server down, or not started yet), the
# next is made no sooner than this; requests meanwhile go without the store.
REOPEN_EVERY_S = 5.0

# The placeholder metadata of a Qwen-VL video: [temporal patches, height, width] in patches.
VIDEO_GRID = "video_grid_thw"

# Request fields an encoder needs besides the images: they change the feature (or, the
# salt, which requests may share what the encoder caches).
ENCODER_FIELDS = ("model", "mm_processor_kwargs", "media_io_kwargs", "cache_salt")


def read_encoder_params(ec_transfer_params: object) -> EncoderParams | None:
    """An encoder's `ec_transfer_params` as protocols/encoder.py types them; None where
    it published none."""
    if ec_transfer_params is None:
        return None
    try:
        return from_dict(EncoderParams, ec_transfer_params, "ec_transfer_params")
    except ParamsError as err:
        raise malformed_params(err, "the encoder") from None


class EncodeItems:
    """What the encoders compute for one request: each image, and each chunk of frames of
    each video (proxy/video.py), with its key; the bodies each stage gets; what the
    encoders said."""

    def __init__(self, parsed: ParsedRequest):
        images = parsed.images
        self._positions = [(item.message, item.part) for item in images]
        self.image_keys = [item.key for item in images]
        # The request with its pixels, each medium tagged with its key (request.py): what
        # prefill and decode get when they are sent no reference (they then load the
        # stored feature under the key, or encode the medium themselves).
        self.pixel_body = parsed.sent
        self.parts = [parsed.sent["messages"][m]["content"][p] for m, p in self._positions]
        self.sizes = [float(item.pixels or 1) for item in images]
        self.keys: list[str] = list(self.image_keys)  # one per item the encoders compute
        self._video_chunks: list[list[str]] = []  # per video, its chunks' keys
        self._video_positions = [(video.message, video.part) for video in parsed.videos]
        for video in parsed.videos:
            self._video_chunks.append(video.chunk_keys)
            for key, (start, end) in zip(video.chunk_keys, video.chunks):
                self.keys.append(key)
                self.parts.append({"type": "video_url", "uuid": key, "video_url": {
                    "url": frame_list_url(video.frames[start:end])}})
                self.sizes.append(video.pixels * (end - start) / len(video.frames))
        self.has_video = bool(parsed.videos)
        # key -> placeholder metadata (e.g. image_grid_thw), as the encoder published it
        self.placeholders: dict[str, dict] = {}
        # key -> the feature hash an encoder stored it under, where that is not the key
        # (vLLM hashes processor and media kwargs into it)
        self.stored_as: dict[str, str] = {}
        self.ec_params: dict = {}  # every encoder's ec_transfer_params, merged

    def __len__(self) -> int:
        return len(self.keys)

    def is_chunk(self, index: int) -> bool:
        """Whether item `index` is a chunk of a video (images come first)."""
        return index >= len(self.image_keys)

    def encoder_body(self, indices: list[int]) -> dict:
        """The request an encoder runs for some of the items: just those, with the key
        to store each video chunk under (its connector's own hash of it may differ)."""
        body = {k: self.pixel_body[k] for k in ENCODER_FIELDS if k in self.pixel_body}
        body["messages"] = [{"role": "user", "content": [self.parts[i] for i in indices]}]
        chunks = [self.keys[i] for i in indices if self.is_chunk(i)]
        if chunks:
            body["vllm_xargs"] = {VIDEO_KEYS_ARG: chunks}
        return body

    def learn(self, ec_transfer_params: dict | None, indices: list[int]) -> None:
        """Take what the encoder published for the items `indices` it was sent. Its
        entries are keyed by vLLM's feature hash, which is our key unless the request
        carries processor kwargs (vLLM then hashes them in); `item_indices` then say
        which of the items sent it is. An encoder that published nothing (no EC
        connector) leaves the items without placeholders; one whose entries do not
        match protocols/encoder.py fails the request (HandoffError, naming the field)."""
        published = read_encoder_params(ec_transfer_params)
        if published is None:
            return
        # Passed on as published: a consumer's connector may read keys of its own
        # beside `metadata` (protocols/encoder.py).
        self.ec_params.update(ec_transfer_params)
        sent = [self.keys[i] for i in indices]
        for identifier, item in published.items():
            if identifier in sent:
                self.placeholders[identifier] = item.metadata
                continue
            for index in item.item_indices:
                if 0 <= index < len(sent):
                    self.placeholders[sent[index]] = item.metadata
                    self.stored_as[sent[index]] = identifier

    def video_keys(self) -> list[str]:
        """Per video (prompt order), its chunks' keys joined: what prefill's connector
        reads and joins for the video (protocols/feature_chunks.py). The encoders store
        each chunk under its key, which the request names (`encoder_body`)."""
        return [joined_key(chunks) for chunks in self._video_chunks]

    @property
    def prefill_keys(self) -> list[str]:
        """The features prefill reads: each image's, each video's chunks joined."""
        return [self.stored_as.get(k, k) for k in self.image_keys] + self.video_keys()

    def keyed_body(self) -> dict:
        """The request with its pixels, and with each video's chunk keys for prefill's
        connector (the engine's own hash of the video is no key the store holds)."""
        if not self.has_video:
            return self.pixel_body
        xargs = {**(self.pixel_body.get("vllm_xargs") or {}),
                 VIDEO_KEYS_ARG: self.video_keys()}
        return {**self.pixel_body, "vllm_xargs": xargs}

    def video_placeholder(self, index: int) -> dict | None:
        """Video `index`'s placeholder metadata, joined from what its chunks' encoders
        published: their grids, temporal patches added up (height and width the same in
        every chunk). None where a chunk has none, or has metadata besides the grid
        (which this cannot join): the video is then sent as frames."""
        grids = []
        for key in self._video_chunks[index]:
            published = self.placeholders.get(key) or {}
            grid = published.get(VIDEO_GRID)
            if set(published) != {VIDEO_GRID} or not isinstance(grid, list) or len(grid) != 3:
                return None
            grids.append(grid)
        if not grids or any(grid[1:] != grids[0][1:] for grid in grids):
            return None
        return {VIDEO_GRID: [sum(grid[0] for grid in grids), *grids[0][1:]]}

    @property
    def complete(self) -> bool:
        """Every image and video can be sent as a reference: the encoders published the
        placeholder metadata of each."""
        return bool(self.keys) and all(self.placeholders.get(k) for k in self.image_keys) \
            and all(self.video_placeholder(i) for i in range(len(self._video_chunks)))

    def reference_body(self) -> dict:
        """The request with every image and video replaced by a reference to its stored
        feature (a video's: its chunks', joined, which the video's key names)."""
        references = {
            position: {"type": "image_embeds", "image_embeds": self.placeholders[key],
                       "uuid": key}
            for position, key in zip(self._positions, self.image_keys)}
        for index, (position, key) in enumerate(zip(self._video_positions, self.video_keys())):
            references[position] = {"type": "video_embeds",
                                    "video_embeds": self.video_placeholder(index), "uuid": key}
        return with_parts(self.keyed_body(), references)


class FeatureDirectory:
    """The proxy's handle on the MM Store (lookups) and on prefill's prefetch listeners."""

    def __init__(self, spec: StoreSpec, prefetch_endpoints: list[str]):
        self.spec = spec
        self._store: FeatureStore | None = None
        self._opening = threading.Lock()
        self._attempt: asyncio.Task | None = None  # opening on a worker thread
        self._failed = False  # an attempt failed: the next ones are not waited for
        self._reopen_at = 0.0  # time.monotonic() of the next attempt after a failure
        self._ctx = zmq.Context()
        self._hint_socks: dict[str, zmq.Socket] = {}
        self._encode = msgspec.msgpack.Encoder()
        # Connect now: a hint sent on a socket still connecting can arrive after the
        # request it was meant to get ahead of.
        for endpoint in prefetch_endpoints:
            self._socket(endpoint)

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._hint_socks.get(endpoint)
        if sock is None:
            sock = self._hint_socks[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(f"tcp://{endpoint}")
        return sock

    def _client(self) -> FeatureStore:
        # Opened on first use (the store may come up after the proxy's first request),
        # on a worker thread (it may wait on the store's server): once, under the lock.
        if self._store is None:
            with self._opening:
                if self._store is None:
                    self._store = open_store(self.spec)
        return self._store

    async def _open(self) -> FeatureStore | None:
        """The store client, or None while the store cannot be opened. Opening asks the
        store's server, which takes its whole deadline (2 s) when the server is down,
        so it runs on a worker thread, never on the event loop. The first attempt is
        waited for (the launcher starts the store before the proxy: it is normally
        up); once one has failed, the next is made at most every REOPEN_EVERY_S, in the
        background, and requests go on without the store meanwhile: their images are
        encoded, and a reference prefill cannot load is recomputed from the pixels."""
        if self._store is not None:
            return self._store
        if self._attempt is None and time.monotonic() >= self._reopen_at:
            self._attempt = asyncio.create_task(self._try_to_open())
        if self._attempt is not None and not self._failed:
            await asyncio.shield(self._attempt)  # a client leaving stops no one else's
        return self._store

    async def _try_to_open(self) -> None:
        try:
            await asyncio.to_thread(self._client)
        except Exception as err:  # StoreError, OSError, zmq's: no store to use now
            self._failed = True
            self._reopen_at = time.monotonic() + REOPEN_EVERY_S
            log.warning("MM Store at %s cannot be opened (%s); requests go without it, "
                        "next try in %g s", self.spec.address, err, REOPEN_EVERY_S)
        else:
            if self._failed:
                log.info("MM Store at %s is open", self.spec.address)
        finally:
            self._attempt = None

    async def stored(self, keys: list[str]) -> dict[str, dict]:
        """key -> placeholder metadata for the keys the store holds now ({} where the
        encoder published none: usable with the pixels, not as a reference); {} while
        the store cannot be opened."""
        client = await self._open()
        if client is None:
            return {}

        def look() -> dict[str, dict]:
            found = {}
            for key in keys:
                meta = client.lookup(key)
                if meta is not None:
                    found[key] = meta.placeholder
            return found

        try:
            # The shared-memory directory is read locally (microseconds); other backends
            # ask a server, which must not block the event loop.
            return look() if self.spec.backend == "shm" else await asyncio.to_thread(look)
        except StoreError as err:
            log.warning("MM Store lookup failed (%s); encoding as if nothing were stored", err)
            return {}

    async def drop(self, keys: list[str]) -> None:
        """Delete features from the store (fault injection: a feature lost after E)."""
        def delete() -> None:
            for key in keys:
                self._client().delete(key)

        await asyncio.to_thread(delete)

    def hint(self, endpoint: str | None, keys: list[str]) -> None:
        """Tell a prefill instance which features to pull; never blocks or fails."""
        if not endpoint or not keys:
            return
        try:
            self._socket(endpoint).send(self._encode.encode(keys), zmq.NOBLOCK)
        except zmq.Again:
            pass  # listener gone or far behind: the load reads the store itself

    def close(self) -> None:
        if self._attempt is not None:
            self._attempt.cancel()  # the thread finishes its try; nobody waits for it
        for sock in self._hint_socks.values():
            sock.close()
        self._ctx.term()
        if self._store is not None:
            self._store.close()
