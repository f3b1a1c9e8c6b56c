"""Who a request belongs to, and the names it may use in caches other requests read.

Runs inside the proxy process. A deployment with API keys (`proxy.api_key_env` names a
variable holding one key, or several separated by commas) has one tenant per key;
without keys every client is the one anonymous tenant. Every media part's identity is
the proxy's content key (`Tenant.media_key`), a BLAKE3 hash of the model, the request
fields that change what the media becomes, and the media's bytes: equal keys mean equal
content, and no client can name another's. With tenant isolation (on by default where
keys are set) each tenant's keys and vLLM cache salt also hash in a secret derived from
its API key, so two tenants never share a prefix-cache block or an MM Store entry: one
tenant cannot read another's cached work, nor learn from a fast answer what another
sent.

Engines call the proxy back (span exports) with the deployment's internal token, which
the launcher generates at start and hands to the proxy and the instances in
INTERNAL_TOKEN_ENV; it is not a client key and opens no client route.
"""

from __future__ import annotations

import dataclasses
import hmac
import os

import blake3
from aiohttp import web

from epd_serve.protocols.feature_chunks import part_key
from epd_serve.proxy.errors import ProxyError
from epd_serve.proxy.request import media_bytes

INTERNAL_TOKEN_ENV = "EPD_INTERNAL_TOKEN"
INTERNAL_TOKEN_HEADER = "x-epd-internal-token"
ADMIN_KEY_HEADER = "x-epd-admin-key"
# Versioned: a change of what is hashed must not meet keys stored by an older proxy.
_MEDIA_KEY_DOMAIN = b"epd-serve media key v2\0"
_SALT_DOMAIN = b"epd-serve tenant salt v1\0"

__all__ = ["ADMIN_KEY_HEADER", "ANONYMOUS", "INTERNAL_TOKEN_ENV", "INTERNAL_TOKEN_HEADER",
           "Tenant", "Tenants", "bearer_token", "image_key", "is_admin", "is_internal",
           "keys_in", "own_key", "video_chunk_keys"]


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str  # for logs: "anonymous" or "key-<8 hex of its hash>"
    secret: bytes = b""  # hashed into its keys and cache salt; empty: shares caches
    # What its records (timelines) are filed under: the whole hash of its key, so no
    # two keys share one (eight hex digits of it would: 32 bits collide).
    id: str = "anonymous"

    def media_key(self, model: str, modality: str, factors: bytes, payload: bytes,
                  client_salt: str | None = None) -> str:
        """The content key of one media item: the same bytes, model and processing give
        the same key on every proxy of the deployment (and tenant). A request's own
        `cache_salt` is hashed in too: a client that salts its prompts for privacy
        shares no stored feature with anyone who does not send the same salt (else
        `E=store`, or a fast answer, would tell it someone sent this image)."""
        hasher = blake3.blake3(_MEDIA_KEY_DOMAIN)
        salt = b"" if client_salt is None else b"\1" + client_salt.encode()
        for piece in (self.secret, salt, model.encode(), modality.encode(), factors):
            hasher.update(len(piece).to_bytes(4, "little"))  # no two splits hash alike
            hasher.update(piece)
        hasher.update(payload)
        return hasher.hexdigest()

    def cache_salt(self, client_salt: str | None) -> str | None:
        """vLLM's cache_salt for the request: blocks are shared only between requests
        with the same salt. An isolated tenant's salt derives from its secret (a
        client's own salt is mixed in, partitioning its own requests further); without
        isolation the client's salt, if any, is passed on."""
        if not self.secret:
            return client_salt
        hasher = blake3.blake3(self.secret)
        if client_salt is not None:
            hasher.update(b"\0" + client_salt.encode())
        return hasher.hexdigest()[:32]


ANONYMOUS = Tenant("anonymous")


def image_key(model: str, url: str, tenant: Tenant = ANONYMOUS,
              client_salt: str | None = None) -> str:
    """The content key the proxy gives an image sent as `url` (a data: URL) with no
    processor kwargs: what E, P, D and the MM Store know the image's feature by."""
    return tenant.media_key(model, "image", b"", media_bytes(url), client_salt)


def video_chunk_keys(model: str, sent_url: str, chunk_frames: int = 4,
                     tenant: Tenant = ANONYMOUS) -> list[str]:
    """The keys of a video's chunks as the proxy sends them (`sent_url`: the frame list
    proxy/video.py made of it, chunks of `chunk_frames`, no processor kwargs)."""
    key = tenant.media_key(model, "video", b"", media_bytes(sent_url))
    frames = sent_url.count(",")  # "data:...;base64," then one comma between frames
    return [part_key(key, i) for i in range(-(-frames // chunk_frames))]


class Tenants:
    """The deployment's API keys, each a tenant; none: one open, anonymous tenant."""

    def __init__(self, keys: list[str], isolate: bool):
        self._by_key: dict[bytes, Tenant] = {}
        for key in keys:
            digest = blake3.blake3(_SALT_DOMAIN + key.encode()).digest()
            self._by_key[key.encode()] = Tenant(f"key-{digest.hex()[:8]}",
                                                digest if isolate else b"",
                                                id=f"key-{digest.hex()}")

    @classmethod
    def from_env(cls, variable: str | None, isolate: bool | None) -> "Tenants":
        """Keys from the environment variable `variable` (comma-separated); tenant
        isolation on by default where there are keys. A named variable that is unset or
        empty is an error: a deployment asked for keys must not serve openly."""
        if not variable:
            return cls([], False)
        keys = keys_in(variable)
        if not keys:
            raise ValueError(f"proxy.api_key_env names {variable}, which is not set (or "
                             "empty) in the proxy's environment")
        return cls(keys, True if isolate is None else isolate)

    @property
    def open(self) -> bool:
        return not self._by_key

    @property
    def all(self) -> list[Tenant]:
        """Every tenant the deployment has: its keys', or the anonymous one."""
        return list(self._by_key.values()) or [ANONYMOUS]

    def for_key(self, given: str) -> Tenant | None:
        """The tenant of an API key, None for a wrong one (the anonymous tenant when the
        deployment has no keys)."""
        if self.open:
            return ANONYMOUS
        token = given.encode()
        found = None
        for key, tenant in self._by_key.items():
            # Every key compared, each in constant time: the timing tells nothing.
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def authenticate(self, request: web.Request) -> Tenant:
        """The tenant whose key the request carries; 401 for a missing or wrong one."""
        found = self.for_key(bearer_token(request))
        if found is not None:
            return found
        raise ProxyError(401, "missing or wrong API key (Authorization: Bearer ...)",
                         "authentication_error", reason="unauthorized")


def keys_in(variable: str | None) -> list[str]:
    """The API keys in an environment variable (comma-separated); [] when unset."""
    if not variable:
        return []
    return [key.strip() for key in os.environ.get(variable, "").split(",") if key.strip()]


def own_key(variable: str | None) -> str | None:
    """The key the deployment's own tools (warm-up, status, trace) send: the first."""
    keys = keys_in(variable)
    return keys[0] if keys else None


def bearer_token(request: web.Request) -> str:
    """The key a request carries: `Authorization: Bearer <key>`, or `x-api-key`."""
    given = request.headers.get("authorization", "")
    if given[:7].lower() == "bearer ":
        return given[7:]
    return request.headers.get("x-api-key", "")


def is_admin(request: web.Request, admin_key: str | None) -> bool:
    """Whether the request carries the operator's admin key: in `x-epd-admin-key`
    (beside a tenant's own key), else as its bearer token. Never with no admin key set."""
    if not admin_key:
        return False
    given = request.headers.get(ADMIN_KEY_HEADER) or bearer_token(request)
    # Constant-time: the time a comparison takes must not tell how much of a key matched.
    return hmac.compare_digest(given.encode(), admin_key.encode())


def is_internal(request: web.Request, token: str | None) -> bool:
    """Whether the request carries the deployment's internal token."""
    if not token:
        return False
    given = request.headers.get(INTERNAL_TOKEN_HEADER, "")
    return hmac.compare_digest(given.encode(), token.encode())
