"""vLLM's MooncakeConnector: prefill computes the whole prompt, then decode pulls it.

The proxy asks the prefill instance's bootstrap server (`GET /query`) for its engine
id once per incarnation of that instance, runs prefill with `do_remote_decode`, then
decode with `do_remote_prefill` and where to pull from (the keys vLLM reads: the
structs of protocols/mooncake_pull.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from epd_serve.protocols.mooncake_pull import BootstrapWorkers, DecodeParams, PrefillParams
from epd_serve.protocols.params import ParamsError, from_dict, to_dict
from epd_serve.proxy.errors import ProxyError, malformed_params
from epd_serve.proxy.handoff.base import Handoff, decode_body
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.state import InstanceState
from epd_serve.proxy.trip import Trip
from epd_serve.proxy.upstream import TRANSPORT_ERRORS, single_token, upstream_error


class MooncakePull(Handoff):
    name = "mooncake"

    def __init__(self, upstream, config):
        super().__init__(upstream, config)
        self._engine_ids: dict[str, tuple[int, str]] = {}  # name -> (incarnation, id)

    async def _prefill(self, path: str, body: dict, trip: Trip,
                       prefill: list[InstanceState]) -> dict:
        """Run prefill; returns the decode request."""
        transfer_id = random_hex(16)
        p_inst, _ = await self.upstream.post("P", path, single_token(
            body, kv_transfer_params=to_dict(PrefillParams(transfer_id=transfer_id))),
            trip, prefill)
        return decode_body(body, to_dict(DecodeParams(
            remote_bootstrap_addr=p_inst.entry.kv_endpoint,
            remote_engine_id=await self._engine_id(p_inst), transfer_id=transfer_id)))

    async def complete(self, path, body, trip, prefill):
        decode_request = await self._prefill(path, body, trip, prefill)
        _, result = await self.upstream.post("D", path, decode_request, trip)
        return result

    async def stream(self, path, body, trip, prefill) -> AsyncIterator[bytes]:
        decode_request = await self._prefill(path, body, trip, prefill)
        return (await self.upstream.open_stream("D", path, decode_request, trip)).relay()

    async def _engine_id(self, inst: InstanceState) -> str:
        """The prefill engine's id from its bootstrap server; a restarted instance (new
        incarnation) has a new one."""
        cached = self._engine_ids.get(inst.name)
        if cached and cached[0] == inst.incarnation:
            return cached[1]
        if not inst.entry.kv_endpoint:
            raise ProxyError(500, f"prefill instance {inst.name} has no KV bootstrap URL")
        try:
            status, workers = await self.upstream.get_json(inst.entry.kv_endpoint + "/query")
        except TRANSPORT_ERRORS as err:
            raise ProxyError(502, f"KV bootstrap of prefill instance {inst.name} is "
                                  f"unreachable: {err}", "upstream_error") from None
        if status != 200:
            raise upstream_error(inst, status, str(workers))
        try:
            workers = from_dict(BootstrapWorkers, workers, "bootstrap /query")
        except ParamsError as err:
            raise malformed_params(err, f"the KV bootstrap of prefill instance {inst.name}") \
                from None
        if not workers:
            raise ProxyError(503, f"prefill instance {inst.name} has no KV worker registered yet")
        engine_id = next(iter(workers.values())).engine_id
        self._engine_ids[inst.name] = (inst.incarnation, engine_id)
        return engine_id
