"""KV hand-off protocols as the proxy drives them; one file each (see base.py)."""

from epd_serve.proxy.handoff.ascend_layerwise import AscendLayerwise
from epd_serve.proxy.handoff.base import Handoff
from epd_serve.proxy.handoff.epd_push import EPDPush
from epd_serve.proxy.handoff.mooncake_pull import MooncakePull

HANDOFFS: dict[str, type[Handoff]] = {h.name: h for h in (EPDPush, MooncakePull, AscendLayerwise)}


def make_handoff(name: str, upstream, config) -> Handoff:
    if name not in HANDOFFS:
        raise ValueError(f"unknown KV hand-off {name!r}; choose one of {', '.join(HANDOFFS)}")
    return HANDOFFS[name](upstream, config)


__all__ = ["HANDOFFS", "Handoff", "make_handoff"]
