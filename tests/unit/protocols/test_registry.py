"""The registry is the one list of KV protocols: every protocol's proxy hand-off and
engine connectors import from what it names (ours here; vLLM's registered by name in
vLLM's KVConnectorFactory; vllm-ascend's defined in the source tree of the pinned
release), and the proxy, the platforms and the config files all take their names from it."""

from __future__ import annotations

import ast
import importlib
import typing
from pathlib import Path

import pytest

from epd_serve.backends import get_platform
from epd_serve.protocols.registry import PROTOCOLS, ProtocolName, connectors_on, resolve
from epd_serve.proxy.config import ProxyConfig
from epd_serve.proxy.handoff import HANDOFFS, make_handoff
from epd_serve.proxy.handoff.base import Handoff

REPO = Path(__file__).resolve().parents[3]
# Unpacked by scripts/setup-vllm023.sh (as tests/unit/connectors/test_vllm_ascend_scheduler.py
# finds it).
ASCEND_SOURCE = REPO / ".venv-vllm023" / "vllm-ascend-0.23.0.post1" / "vllm_ascend"
CONNECTORS = [(name, platform, connector) for name, p in PROTOCOLS.items()
              for platform, connector in p.connectors.items()]


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_each_protocols_hand_off_imports_from_the_registry(name):
    handoff = PROTOCOLS[name].handoff_class()
    assert issubclass(handoff, Handoff) and handoff.name == name
    assert HANDOFFS[name] is handoff


@pytest.mark.parametrize("name, platform, connector", CONNECTORS,
                         ids=[f"{n}-{p}" for n, p, _ in CONNECTORS])
def test_each_protocols_connectors_import_from_the_registry(name, platform, connector):
    if connector.module_path is not None:  # ours: importable here (vLLM 0.32 installed)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        assert issubclass(connector.load(), KVConnectorBase_V1)
    elif platform == "ascend":  # vllm-ascend's own: defined in the pinned release's source
        if not ASCEND_SOURCE.is_dir():
            pytest.skip("vllm-ascend's source is unpacked by scripts/setup-vllm023.sh")
        defined = {node.name for path in (ASCEND_SOURCE / "distributed").rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ClassDef)}
        assert connector.name in defined
        registered = (ASCEND_SOURCE / "distributed/kv_transfer/__init__.py").read_text()
        assert f'"{connector.name}"' in registered  # vllm-ascend registers it by that name
    else:  # vLLM's own: registered by name
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        assert connector.name in KVConnectorFactory._registry


def test_the_platforms_take_their_kv_connectors_from_the_registry():
    for platform in ("cpu", "cuda", "ascend"):
        plat = get_platform(platform)
        offered = connectors_on(platform)
        assert offered and all(plat.kv_connector(n) is c for n, c in offered.items())
        assert not hasattr(plat, "kv_connectors")  # no second table on the platform
    with pytest.raises(ValueError, match="'mooncake' does not run on ascend; "
                                         "choose one of epd, ascend-layerwise"):
        get_platform("ascend").kv_connector("mooncake")


def test_config_fields_take_exactly_the_registrys_names():
    assert typing.get_args(ProtocolName) == tuple(PROTOCOLS)
    for name in PROTOCOLS:
        assert ProxyConfig(model="m", instances=[], kv_protocol=name).kv_protocol == name
    with pytest.raises(ValueError, match="kv_protocol"):
        ProxyConfig(model="m", instances=[], kv_protocol="nixl")
    with pytest.raises(ValueError, match="unknown KV hand-off 'nixl'"):
        make_handoff("nixl", None, None)


def test_the_protocols_package_imports_nothing_above_it():
    for module in ("params", "epd_push", "mooncake_pull", "ascend_layerwise", "encoder",
                   "registry"):
        source = Path(importlib.import_module(f"epd_serve.protocols.{module}").__file__)
        imported = {alias.name for node in ast.walk(ast.parse(source.read_text()))
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(ast.parse(source.read_text()))
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in imported if m.startswith(("vllm", "epd_serve"))
                    and not m.startswith("epd_serve.protocols")}, module


def test_resolve_reads_vllms_factory_style_paths():
    assert resolve("epd_serve.protocols.registry:PROTOCOLS") is PROTOCOLS
