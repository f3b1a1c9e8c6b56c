"""The running proxy's state (`Proxy`) and the typed keys its handlers reach it by.

Runs in the proxy process. `create_app` (app.py) builds one `Proxy` and puts it on the
aiohttp app under `PROXY`; every handler (routes_*.py) reads it back as
`request.app[PROXY]`, aiohttp's way of sharing state, so nothing lives in module globals
and two apps in one process (the tests) never share a table or a metric.
"""

from __future__ import annotations

import os
import re
import resource

import aiohttp
from aiohttp import web

from epd_serve.proxy.admission import Admission, requests_for_descriptors
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.handoff import HANDOFFS
from epd_serve.proxy.hop_client import HopClient
from epd_serve.proxy.ids import random_hex
from epd_serve.proxy.membership import Membership, load_roster
from epd_serve.proxy.metrics import ProxyMetrics
from epd_serve.proxy.pipeline import Pipeline
from epd_serve.proxy.remote_media import RemoteFetcher
from epd_serve.proxy.request import ParsedRequest
from epd_serve.proxy.role_control import RoleController
from epd_serve.proxy.roles import RoleSwitcher
from epd_serve.proxy.routing import Router
from epd_serve.proxy.state import InstanceTable
from epd_serve.proxy.tenancy import INTERNAL_TOKEN_ENV, Tenant, Tenants, is_admin, is_internal
from epd_serve.proxy.timeline import TraceStore
from epd_serve.proxy.upstream import Upstream
from epd_serve.proxy.video import VideoPreparer

# Both clients to the instances (aiohttp's and the hop client): how long a connection
# may take to open, and how long one stays idle in the pool.
CONNECT_TIMEOUT_S = 10.0
IDLE_CONNECTION_S = 2.0

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")  # fullmatch: `$` would let a \n end it


class Proxy:
    """Everything one proxy holds while it runs."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.table = InstanceTable()
        for entry, source in load_roster(config):
            self.table.add(entry, source)
        self.metrics = ProxyMetrics()
        self.metrics.count_in_flight(lambda: self.table.instances)
        self.router = Router(lambda: self.table.instances, {
            "E": config.routing.E, "P": config.routing.P, "D": config.routing.D})
        # Asked for keys but given none: refuse to start rather than serve openly.
        self.tenants = Tenants.from_env(config.api_key_env, config.tenant_isolation)
        self.admin_key = os.environ.get(config.admin_key_env) if config.admin_key_env else None
        self.internal_token = os.environ.get(INTERNAL_TOKEN_ENV) or None
        self.fetcher = RemoteFetcher(config.limits) if config.limits.allow_remote_urls else None
        self.videos = VideoPreparer(config.limits, config.routing.video_chunk_frames)
        self.admission = Admission(config.limits, self.metrics, requests_for_descriptors(
            config.limits, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), self.tenants.all)
        self.client_kv_keys = HANDOFFS[config.kv_protocol].allowed_client_keys(
            config.fault_injection) if config.kv_protocol in HANDOFFS else frozenset()
        self.traces = TraceStore()
        self.roles = RoleSwitcher(self.table, self.metrics, config)
        # Our epd hand-off sends decode its hop as prefill starts (handoff/epd_push.py).
        self.controller = RoleController(self.table, self.roles, config.role_control,
                                         decode_starts_with_prefill=config.kv_protocol == "epd")
        self.session: aiohttp.ClientSession | None = None  # probes, liveness, bootstrap
        self.hops: HopClient | None = None  # the requests' hops (hop_client.py)
        self.pipeline: Pipeline | None = None
        self.membership: Membership | None = None

    def is_operator(self, request) -> bool:
        """A request carrying the admin key, or the internal token (the deployment's own
        tools: the launcher's warm-up)."""
        return is_admin(request, self.admin_key) or is_internal(request, self.internal_token)

    def shows_stages(self, request) -> bool:
        """Whether the request is shown which stages served it (x-epd-stages, timelines):
        they tell what is cached, by anyone sharing its caches (`stage_headers`)."""
        return self.config.stage_headers == "clients" or self.is_operator(request)

    @staticmethod
    def request_ids_for(given: str) -> tuple[str, str]:
        """(the id the client knows the request by, the id the engines get). Engines,
        the KV hand-offs and their connectors key state by the second, so it is ours,
        unique per request, and unguessable (a client who saw its own cannot name
        another's); a client's valid X-Request-Id leads it, so engine logs still say
        whose request it was, and is what the answer and the log carry."""
        own = f"epd-{random_hex(12)}"
        if not REQUEST_ID.fullmatch(given):
            return own, own
        return given, f"{given}-{own}"

    def key_of(self, tenant: Tenant, parsed: ParsedRequest):
        """The content key of each media item of `parsed`, in `tenant`'s namespace."""
        model = self.config.model

        def key(item) -> str:
            modality = item.part_type if item.kind.embeddings else item.modality
            return tenant.media_key(model, modality, parsed.hash_factors, item.payload(),
                                    parsed.client_salt)

        return key

    async def start(self) -> None:
        # Both clients drop idle connections before the instances do (uvicorn closes
        # them after 5 s), so a request is rarely sent on a connection that is being
        # closed. No cap on connections here: admission.py caps the requests at what
        # the process's open files carry, and a per-connector cap would queue a hand-off's
        # decode behind another request's prefill (ascend-layerwise: decode waits on it).
        read_s = self.config.request_timeout_s
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=read_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             auto_decompress=False)
        self.hops = HopClient(connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=read_s,
                              idle_for_s=IDLE_CONNECTION_S)
        upstream = Upstream(self.router, self.session, self.metrics, self.config.deadlines,
                            self.config.model, self.hops)
        self.pipeline = Pipeline(self.table, self.router, upstream, self.config)
        self.membership = Membership(self.table, self.session, self.metrics, self.config)
        self.membership.save()
        self.membership.start()
        # Runs whatever the roster (a switchable instance may register later); a round
        # while it is off is one attribute read.
        self.membership.spawn(self.controller.run())

    async def stop(self) -> None:
        await self.roles.stop()
        await self.membership.stop()
        self.pipeline.close()
        self.videos.close()
        if self.fetcher is not None:
            await self.fetcher.close()
        await self.session.close()
        self.hops.close()


# Typed keys (aiohttp's AppKey/RequestKey): a handler that reads them gets the type back.
PROXY = web.AppKey("proxy", Proxy)  # the running Proxy (tests look inside it too)
TENANT = web.RequestKey("tenant", Tenant)  # whose request it is (the door decides)
