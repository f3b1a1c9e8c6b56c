"""The epd-serve proxy: OpenAI-compatible front door that routes E -> P -> D.

Importing the package loads only its typed config (the deployment file and the
launcher need that much); `create_app` loads the server on first use.
"""

from epd_serve.proxy.config import InstanceEntry, ProxyConfig, ProxySettings

__all__ = ["InstanceEntry", "ProxyConfig", "ProxySettings", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from epd_serve.proxy.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
