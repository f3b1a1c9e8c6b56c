"""Downloading a request's remote media, once, from public addresses only.

Used by the proxy's app only when the deployment sets `limits.allow_remote_urls`:
`RemoteFetcher.inline` takes a parsed request's remote media items (request.py),
downloads each distinct URL once, refuses targets that are not public internet
addresses (checked on the address the connection actually uses, so DNS rebinding does
not help; redirects are followed by hand and checked again), runs guards' image checks
on the bytes, and turns each item's URL into a data: URL, so no instance fetches
anything. Every kind of media counts alike: at most `max_fetches_in_flight` downloads
run at once in the whole proxy, one request downloads at most
`max_fetched_bytes_per_request` in all, and what is downloaded counts against the
proxy's byte budget (admission.py) as it arrives. Every refusal is a 400/413
ProxyError with a reason label.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from epd_serve.proxy.admission import Ticket
from epd_serve.proxy.errors import ProxyError, bad_request
from epd_serve.proxy.guards import Limits, check_image_bytes, http_host
from epd_serve.proxy.request import MediaItem

try:
    from pybase64 import b64encode  # vLLM's, much faster than the standard library's
except ImportError:  # pragma: no cover
    from base64 import b64encode

__all__ = ["DownloadBudget", "ForbiddenAddress", "PublicAddressResolver", "RemoteFetcher",
           "is_public_address"]

# Redirects are followed by hand, at most this many, so that every hop's target goes
# through the same scheme and address checks as the URL the client sent.
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK = 64 * 1024



# 64:ff9b::/96 (NAT64) carries an IPv4 address in its last 32 bits; on a NAT64 network
# 64:ff9b::a00:1 reaches 10.0.0.1, so the embedded address is what gets judged.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public_address(address: str) -> bool:
    """True for a global unicast address: not loopback, private (RFC 1918, ULA),
    link-local (169.254.0.0/16 with the cloud metadata address, fe80::/10), shared
    (100.64.0.0/10), multicast, reserved or unspecified."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    # is_global alone lets IPv4 multicast through on older Pythons; the explicit checks
    # say what is meant whatever the Python version's tables hold.
    return (ip.is_global and not ip.is_multicast and not ip.is_reserved
            and not ip.is_private and not ip.is_loopback and not ip.is_link_local
            and not ip.is_unspecified)


class ForbiddenAddress(OSError):
    """A media URL's host is (or resolves only to) addresses that are not public."""

    def __init__(self, host: str, addresses: list[str]):
        super().__init__(f"{host} resolves only to non-public addresses "
                         f"({', '.join(addresses)})")
        self.host = host


class PublicAddressResolver(AbstractResolver):
    """Resolves through `inner` (aiohttp's default resolver unless given) and keeps
    only public addresses. The connector connects to what this returns, so the check
    applies to the address actually used: a name that answers a public address to a
    first lookup and 169.254.169.254 to the next gains nothing."""

    def __init__(self, inner: AbstractResolver | None = None, allow_private: bool = False):
        self._inner = inner
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        if self._inner is None:  # aiohttp's resolvers want a running loop to be made
            self._inner = aiohttp.DefaultResolver()
        results = await self._inner.resolve(host, port, family)
        if self._allow_private:
            return results
        public = [result for result in results if is_public_address(result["host"])]
        if not public:
            raise ForbiddenAddress(host, [result["host"] for result in results])
        return public

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()


class DownloadBudget:
    """What one request may still download: its own cap, and the proxy's byte budget
    through the request's admission ticket (none in tests that fetch alone)."""

    def __init__(self, max_bytes: int, ticket: Ticket | None = None):
        self.left = max_bytes
        self.max_bytes = max_bytes
        self.ticket = ticket

    def take(self, size: int, where: str) -> None:
        if size > self.left:
            raise bad_request(f"{where}: the request's remote media come to more than this "
                              f"deployment downloads for one request ({self.max_bytes} bytes, "
                              "proxy.limits.max_fetched_bytes_per_request)",
                              "media_too_large", status=413)
        self.left -= size
        if self.ticket is not None:
            self.ticket.charge(size)


class RemoteFetcher:
    """Downloads a request's remote media and inlines it as data: URLs.

    One per proxy process (it holds a connection pool); `close()` at shutdown.
    `allow_private=True` lets loopback and private targets through: for tests only.
    """

    def __init__(self, limits: Limits, *, allow_private: bool = False,
                 resolver: AbstractResolver | None = None):
        self.limits = limits
        self.allow_private = allow_private
        self._inner_resolver = resolver  # tests inject a fake DNS here
        self._resolver: PublicAddressResolver | None = None
        self._session: aiohttp.ClientSession | None = None
        # Downloads at once, whole proxy: the rest wait their turn.
        self._slots = asyncio.Semaphore(limits.max_fetches_in_flight)

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: aiohttp sessions belong to the running event loop.
        if self._session is None:
            self._resolver = PublicAddressResolver(self._inner_resolver, self.allow_private)
            connector = aiohttp.TCPConnector(resolver=self._resolver, limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector,
                # Proxies from the environment would resolve names themselves,
                # beyond the resolver's check.
                trust_env=False,
                # Compressed answers could inflate past the size cap inside one read.
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=self.limits.fetch_timeout_s))
        return self._session

    async def close(self) -> None:
        session, resolver = self._session, self._resolver
        self._session = self._resolver = None
        if session is not None:
            await session.close()
        if resolver is not None:  # handed to the connector, so not closed by it
            await resolver.close()

    async def inline(self, items: list[MediaItem], ticket: Ticket | None = None) -> None:
        """Download every item's URL (each distinct URL once, all concurrently, within
        the proxy's download slots), check it, and make it the item's data: URL. Raises
        ProxyError (400/413) for the first failure; the others are then cancelled."""
        budget = DownloadBudget(self.limits.max_fetched_bytes_per_request, ticket)
        groups: dict[tuple[str, str], list[MediaItem]] = {}
        for item in items:
            groups.setdefault((item.modality, item.url), []).append(item)
        tasks = [asyncio.create_task(self._inline_group(group, budget))
                 for group in groups.values()]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _inline_group(self, group: list[MediaItem], budget: DownloadBudget) -> None:
        first = group[0]
        data_url = await self.fetch_data_url(first.url, first.modality, first.where, budget)
        for item in group:
            item.url = data_url

    async def fetch_data_url(self, url: str, modality: str, where: str = "media",
                             budget: DownloadBudget | None = None) -> str:
        """The checked content of one remote URL as a data: URL."""
        host = _host_for_messages(url)
        budget = budget or DownloadBudget(self.limits.max_fetched_bytes_per_request)
        try:
            raw, content_type = await asyncio.wait_for(
                self._download(url, modality, where, budget), self.limits.fetch_timeout_s)
        except ProxyError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            raise bad_request(f"{where}: fetching {host} took longer than "
                              f"{self.limits.fetch_timeout_s:g} s", "fetch_timeout") from None
        except aiohttp.ClientConnectorError as err:
            if isinstance(err.os_error, ForbiddenAddress):
                raise _forbidden_target(where, host) from None
            raise _fetch_failed(where, host, err) from None
        except (aiohttp.ClientError, OSError, ValueError) as err:
            raise _fetch_failed(where, host, err) from None
        if modality == "image":
            mime = check_image_bytes(raw, self.limits, where)
        else:
            mime = content_type if "/" in content_type else "application/octet-stream"
        return f"data:{mime};base64,{b64encode(raw).decode('ascii')}"

    async def _download(self, url: str, modality: str, where: str,
                        budget: DownloadBudget) -> tuple[bytes, str]:
        async with self._slots:
            return await self._download_in_slot(url, modality, where, budget)

    async def _download_in_slot(self, url: str, modality: str, where: str,
                                budget: DownloadBudget) -> tuple[bytes, str]:
        session = self._client()
        for _ in range(MAX_REDIRECTS + 1):
            host = http_host(url, where)
            self._check_literal_address(host, where)
            async with session.get(url, allow_redirects=False,
                                   headers={"Accept-Encoding": "identity"}) as response:
                if response.status in _REDIRECT_STATUSES:
                    url = self._redirect_target(response, host, where)
                    continue
                return await self._read_body(response, host, where,
                                             self._size_cap(modality, host, where), budget)
        raise bad_request(f"{where}: {host} redirected more than {MAX_REDIRECTS} times",
                          "fetch_failed")

    def _check_literal_address(self, host: str, where: str) -> None:
        # aiohttp connects to an IP-address host without asking the resolver, so the
        # address policy is applied here for those.
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return  # a name: the resolver judges what it resolves to
        if not self.allow_private and not is_public_address(host):
            raise _forbidden_target(where, host)

    def _size_cap(self, modality: str, host: str, where: str) -> tuple[int, ProxyError]:
        """The most bytes a download may have, and the error for one that has more."""
        if modality == "image":
            max_bytes, reason = self.limits.max_image_bytes, "image_too_large"
        else:
            max_bytes, reason = self.limits.max_media_bytes, "media_too_large"
        return max_bytes, bad_request(f"{where}: the file at {host} is larger than this "
                                      f"deployment accepts ({max_bytes} bytes)", reason,
                                      status=413)

    @staticmethod
    def _redirect_target(response: aiohttp.ClientResponse, host: str, where: str) -> str:
        location = response.headers.get("Location")
        if not location:
            raise bad_request(f"{where}: {host} answered a redirect without a Location",
                              "fetch_failed")
        return urljoin(str(response.url), location)

    @staticmethod
    async def _read_body(response: aiohttp.ClientResponse, host: str, where: str,
                         size_cap: tuple[int, ProxyError],
                         budget: DownloadBudget) -> tuple[bytes, str]:
        if response.status != 200:
            raise bad_request(f"{where}: {host} answered HTTP {response.status}",
                              "fetch_failed")
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise bad_request(f"{where}: {host} sent a {encoding}-encoded body though "
                              "asked for identity", "fetch_failed")
        max_bytes, too_large = size_cap
        if response.content_length is not None and response.content_length > max_bytes:
            raise too_large
        body = bytearray()
        async for chunk in response.content.iter_chunked(_READ_CHUNK):
            if len(body) + len(chunk) > max_bytes:
                raise too_large
            budget.take(len(chunk), where)
            body += chunk
        return bytes(body), response.content_type


def _host_for_messages(url: str) -> str:
    try:
        return urlsplit(url).hostname or url[:64]
    except ValueError:
        return url[:64]


def _forbidden_target(where: str, host: str) -> ProxyError:
    return bad_request(f"{where}: the media URL's host {host} is not a public internet "
                       "address (loopback, private, link-local and similar targets are "
                       "refused)", "forbidden_url")


def _fetch_failed(where: str, host: str, err: BaseException) -> ProxyError:
    detail = str(err) or type(err).__name__
    return bad_request(f"{where}: fetching from {host} failed ({detail})", "fetch_failed")
