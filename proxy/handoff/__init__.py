"""KV hand-off protocols as the proxy drives them; one file each (see base.py).

Runs in the proxy process. Which class drives which protocol is the registry's to say
(protocols/registry.py, each protocol's `handoff`); HANDOFFS is that, imported.
"""

from epd_serve.protocols.registry import PROTOCOLS
from epd_serve.proxy.handoff.base import Handoff

HANDOFFS: dict[str, type[Handoff]] = {name: protocol.handoff_class()
                                      for name, protocol in PROTOCOLS.items()}


def make_handoff(name: str, upstream, config) -> Handoff:
    if name not in HANDOFFS:
        raise ValueError(f"unknown KV hand-off {name!r}; choose one of {', '.join(HANDOFFS)}")
    return HANDOFFS[name](upstream, config)


__all__ = ["HANDOFFS", "Handoff", "make_handoff"]
