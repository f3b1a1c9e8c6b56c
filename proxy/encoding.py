"""The encode stage of one request: its images and video chunks spread over the encoders
at once.

Runs inside the proxy process (asyncio). Each item (an image, or a chunk of a video's
frames: proxy/video.py) is assigned an encoder by the E policy (the same item goes to
the same encoder under hash affinity; least-loaded counts the items already assigned in
this request). The items of one encoder go in batches of at most `encoder_batch` per
request, and every batch runs at the same time: prefill waits for all of them, so a
4-image request (or a 16-frame video) on two encoders costs about half its encode time
on one. A batch whose encoder fails goes to the next encoder once (upstream.py's
fail-over) before the request fails.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from epd_serve.proxy.errors import HandoffError, ProxyError
from epd_serve.proxy.features import EncodeItems, read_encoder_params
from epd_serve.proxy.routing import Router, RouteRequest
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import StageRecord, Trip
from epd_serve.proxy.upstream import Upstream, single_token


class NoEncoder(ProxyError):
    """No encoder could compute the images (none healthy, or every one failed)."""


class Encoder:
    def __init__(self, upstream: Upstream, router: Router, batch: int, fan_out: bool = True):
        self.upstream = upstream
        self.router = router
        self.batch = batch
        self.fan_out = fan_out

    def assign(self, work: EncodeItems,
               indices: list[int]) -> list[tuple[list[InstanceState], list[int]]]:
        """Batches of item indices, each with its encoders (first choice first)."""
        sizes = work.sizes
        planned: dict[int, float] = defaultdict(float)  # id(encoder) -> work assigned here
        by_encoder: dict[tuple[int, bool], tuple[list[InstanceState], list[int]]] = {}
        whole: list[InstanceState] | None = None  # without fan-out: one encoder for all
        for i in indices:
            order = whole or self.router.choose("E", RouteRequest(cost=sizes[i],
                                                                  key=work.keys[i]))
            if not self.fan_out:
                whole = order
            if not order:
                raise NoEncoder(503, "no healthy encoder (E) instance: requests with images "
                                "are refused until one is back; text requests are served",
                                "service_unavailable", reason="no_encoder")
            if self.fan_out and (work.is_chunk(i) or not self.router.policy("E").affinity):
                # Spread this request's own items: the table does not count them yet. A
                # video's chunks always are: they gain nothing from affinity (a video
                # seen before is found in the MM Store) and all from encoding at once.
                best = min(order, key=lambda e: (planned[id(e)], order.index(e)))
                order = [best, *(e for e in order if e is not best)]
            planned[id(order[0])] += sizes[i]
            # Images and video chunks in separate requests: an encoder's entries index
            # the items of one modality (EncodeItems.learn).
            by_encoder.setdefault((id(order[0]), work.is_chunk(i)), (order, []))[1].append(i)
        batches = []
        for order, items in by_encoder.values():
            for start in range(0, len(items), self.batch):
                batches.append((order, items[start:start + self.batch]))
        return batches

    async def encode(self, path: str, work: EncodeItems, indices: list[int],
                     trip: Trip) -> None:
        """Encode the items `indices`; what the encoders publish lands in `work`."""
        batches = self.assign(work, indices)
        started = time.perf_counter()
        results = await asyncio.gather(
            *(self._batch(path, work, order, items, sum(work.sizes[i] for i in items), trip)
              for order, items in batches),
            return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for error in failed:
            if not isinstance(error, Exception):
                raise error  # cancelled: the client left
        if failed:
            first = failed[0]
            if isinstance(first, HandoffError) or (isinstance(first, ProxyError)
                                                   and first.status < 500):
                raise first  # not a failed encoder; standing in would hide the mismatch
            raise NoEncoder(502, f"{len(failed)} of {len(batches)} media batches could not be "
                            f"encoded: {first}", "upstream_error", reason="encode_failed")
        served = sorted({name for name in results})
        trip.stages.append(StageRecord("E", "+".join(served),
                                       (time.perf_counter() - started) * 1e3))

    async def encode_whole(self, path: str, body: dict, trip: Trip) -> dict | None:
        """Encode a request the encoders take whole (audio); its ec params."""
        if not self.router.choose("E"):
            raise NoEncoder(503, "no healthy encoder (E) instance", "service_unavailable",
                            reason="no_encoder")
        try:
            _, encoded = await self.upstream.post("E", path, single_token(body), trip)
        except ProxyError as err:
            if err.status < 500:
                raise
            raise NoEncoder(502, str(err), "upstream_error", reason="encode_failed") from None
        published = encoded.get("ec_transfer_params")
        read_encoder_params(published)  # a malformed one fails here, naming the field
        return published

    async def _batch(self, path: str, work: EncodeItems, order: list[InstanceState],
                     items: list[int], cost: float, trip: Trip) -> str:
        # One retry on another encoder: a failing image should not visit every encoder.
        batch_trip = Trip(trip.request_id, True, RouteRequest(cost=cost),
                          trace_id=trip.trace_id)
        try:
            inst, answer = await self.upstream.post(
                "E", path, single_token(work.encoder_body(items)), batch_trip, order[:2])
        finally:
            trip.retries += batch_trip.retries
            trip.stages += [s for s in batch_trip.stages if s.failed]
            trip.encodes += [s for s in batch_trip.stages if not s.failed]
        work.learn(answer.get("ec_transfer_params"), items)
        return inst.name
