"""The Mooncake Store client's device seam: on the ascend protocol a thread without an
NPU (an engine core) is given the instance's first visible one before the store's
setup, one with an NPU keeps it, other protocols touch none; and a client is refused in
a process that already runs an Ascend transfer engine of ours."""

from __future__ import annotations

import pytest

from epd_serve.mmstore import StoreSpec
from epd_serve.mmstore import mooncake as mooncake_store
from epd_serve.mmstore import transfer_engines


@pytest.mark.parametrize("protocol, current, expected", [
    ("ascend", None, 0),  # the engine core: no NPU on this thread
    ("ascend", 3, None),  # the encoder's worker: vLLM set its NPU, keep it
    ("ascend", 0, None),
    ("tcp", None, None),
    ("rdma", None, None),
])
def test_the_npu_to_set_follows_the_protocol_and_the_threads_device(protocol, current, expected):
    assert mooncake_store.npu_to_set(protocol, current) == expected


def test_prepare_thread_sets_npu_0_only_where_the_thread_has_none():
    calls = []

    def asked(answer):
        return lambda: calls.append("asked") or answer

    mooncake_store.prepare_thread("ascend", asked(None), lambda i: calls.append(("set", i)))
    assert calls == ["asked", ("set", 0)]
    calls.clear()
    mooncake_store.prepare_thread("ascend", asked(2), lambda i: calls.append(("set", i)))
    assert calls == ["asked"]
    calls.clear()
    mooncake_store.prepare_thread("tcp", asked(None), lambda i: calls.append(("set", i)))
    assert calls == []  # nothing asked of CANN either


def test_a_store_client_beside_an_ascend_kv_engine_is_refused_before_setup(monkeypatch):
    class Probe:
        def close(self):
            pass

    prepared = []
    monkeypatch.setattr(transfer_engines, "_engines", {})
    monkeypatch.setattr(mooncake_store.socket, "create_connection", lambda *a: Probe())
    monkeypatch.setattr(mooncake_store, "prepare_thread", prepared.append)
    token = transfer_engines.claim_engine("the epd KV connector", "ascend")
    try:
        with pytest.raises(transfer_engines.EngineConflict, match="MM Store's Mooncake client"):
            mooncake_store.MooncakeStore(StoreSpec(backend="mooncake", protocol="ascend"))
    finally:
        transfer_engines.release_engine(token)
    assert prepared == ["ascend"]
