"""The epd-serve proxy: OpenAI-compatible front door that routes E -> P -> D."""

from epd_serve.proxy.app import create_app
from epd_serve.proxy.state import InstanceEntry, ProxyConfig

__all__ = ["InstanceEntry", "ProxyConfig", "create_app"]
