"""One codebase of our connectors for every vLLM from 0.23 (vllm-ascend's core) to 0.32+.

What compat.py detects is checked against the callers in the running vLLM; the
connectors are driven the way each API drives them, the older one by fakes shaped like
vllm-ascend's runner: per-layer (k, v) cache pairs, no cache manager bound to the KV
scheduler, no `request_finished`, `start_save_caches`, worker metadata or EC stats for
the EC connector. Runs under any vLLM (`.venv` and `.venv-vllm023`)."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from epd_serve.connectors import compat
from epd_serve.connectors.epd_ec import stats as ec_stats
from epd_serve.connectors.epd_ec.connector import EPDECConnector
from epd_serve.connectors.epd_ec.scheduler import ECStep
from epd_serve.connectors.epd_ec.settings import Settings as ECSettings
from epd_serve.connectors.epd_kv import worker as kv_worker
from epd_serve.connectors.epd_kv.connector import EPDKVConnector
from epd_serve.connectors.epd_kv.messages import RecvPlan
from epd_serve.connectors.epd_kv.metadata import StepPlan
from epd_serve.mmstore import open_store

from ...ports import free_port_block
from ...waiting import wait_for
from .test_epd_ec import GRID, ItemData, decided, feature, request, store_feature

NEW_API = pytest.param(True, id="vllm-0.32-api")
OLD_API = pytest.param(False, id="vllm-0.23-api")


def source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


# -- what is detected: a base class that declares a hook means an engine that calls it --

def test_the_ec_hooks_found_are_the_ones_this_vllm_calls():
    runner = source("vllm.v1.worker.ec_connector_model_runner_mixin")
    scheduler = source("vllm.v1.core.sched.scheduler")
    assert compat.EC_START_SAVE_CACHES == ("start_save_caches" in runner)
    assert compat.EC_WORKER_META == ("build_connector_worker_meta" in runner)
    assert compat.EC_FAILS_REQUESTS == ("take_unavailable_requests" in scheduler)
    assert compat.EC_STATS == ("get_ec_connector_stats" in scheduler)


def test_the_kv_result_path_found_is_the_one_this_vllms_runner_takes():
    runner = source("vllm.v1.worker.kv_connector_model_runner_mixin")
    assert (compat.KVConnectorTransferResults is not None) == ("get_transfer_results" in runner)
    assert "get_block_ids_with_load_errors" in runner  # both APIs ask for failed blocks


def test_kv_cache_layouts_are_asked_by_the_names_this_vllm_knows(monkeypatch):
    assert compat.kv_cache_layout_request("auto") is None
    monkeypatch.setattr(compat, "STRIDE_ORDER_LAYOUTS", True)
    assert compat.kv_cache_layout_request("LHBNC") == "LHBNC"
    monkeypatch.setattr(compat, "STRIDE_ORDER_LAYOUTS", False)
    assert compat.kv_cache_layout_request("LBHNC") == "HND"
    assert compat.kv_cache_layout_request("LBNHC") == "NHD"
    with pytest.raises(ValueError, match="NHD or HND only"):
        compat.kv_cache_layout_request("LHBNC")


def test_the_connector_asks_the_running_vllm_for_a_layout_it_can_make():
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    asked = EPDKVConnector.get_required_kvcache_layout(config)
    if compat.STRIDE_ORDER_LAYOUTS:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        assert asked == "LBHNC" and asked in KVCacheLayout.__members__
    else:
        from typing import get_args

        from vllm.v1.attention.backends.utils import KVCacheLayoutType

        assert asked == "HND" and asked in get_args(KVCacheLayoutType)


def test_a_device_index_comes_from_the_devices_own_torch_module(monkeypatch):
    asked = []

    def module(device_type):
        asked.append(device_type)
        return SimpleNamespace(current_device=lambda: 3)

    monkeypatch.setattr(torch, "get_device_module", module)
    assert compat.accelerator_device("npu") == "npu:3"  # vllm-ascend: not "cuda alike"
    assert compat.accelerator_device("cuda") == "cuda:3"
    assert compat.accelerator_device("cpu") == "cpu" and asked == ["npu", "cuda"]


# -- placeholder metadata where vLLM has no ec_connector.utils -------------------------

def audio(key: str):
    return SimpleNamespace(identifier=key, modality="audio", data=ItemData(),
                           mm_position=SimpleNamespace(get_num_embeds=lambda: 7))


def test_placeholder_metadata_is_collected_without_vllms_utils():
    features = [feature("img", pixels=True), audio("clip"), feature("img", offset=30)]
    resolver = compat.TablePlaceholderResolver(None)
    items = compat.collect_item_metadata(features, resolver)
    assert items == {"img": {"item_indices": [0, 2], "metadata": GRID},
                     "clip": {"item_indices": [1], "metadata": {"audio_num_tokens": [7]}}}
    assert "pixel_values" not in resolver.fields_for("image")  # pixels are the media
    # Where vLLM has its own, it says the same for the same fields.
    if compat.collect_ec_item_metadata is not compat.collect_item_metadata:
        assert compat.collect_ec_item_metadata(features, resolver) == items


# -- KV connector --------------------------------------------------------------------

def kv_config(role: str, **extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, engine_id=f"{role}-engine",
                                           kv_port=free_port_block(1, start=29600),
                                           kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=4, kv_cache_layout="LBHNC"))


def scheduled(new=(), cached=(), resumed=(), preempted=(), tokens=None):
    """A scheduler output as far as the connector reads it. `new`: (request id, block
    ids); `cached`: (request id, block ids added this step, or all of them if resumed)."""
    tokens = tokens or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), prompt_token_ids=None,
                                            num_computed_tokens=0) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], new_block_ids=[(list(b),) for _, b in cached],
            resumed_req_ids=set(resumed)),
        num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
        preempted_req_ids=set(preempted), finished_req_ids=set())


def test_prefill_ships_the_blocks_of_the_scheduler_outputs_with_no_cache_manager_bound():
    connector = EPDKVConnector(kv_config("kv_producer"), compat_role("SCHEDULER"),
                               SimpleNamespace(kv_cache_groups=[object()]))
    req = SimpleNamespace(request_id="r", num_computed_tokens=0, num_prompt_tokens=10,
                          status=SimpleNamespace(name="FINISHED_STOPPED"),
                          kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"})
    connector.update_state_after_alloc(req, None, 0)
    (chunk,) = connector.build_connector_meta(scheduled(new=[("r", [1, 2])],
                                                        tokens={"r": 6})).sends
    assert chunk.block_ids == [1, 2]
    # Preempted (its blocks freed), then resumed with other blocks, from its first token.
    req.num_computed_tokens = 0
    connector.build_connector_meta(scheduled(preempted=["r"]))
    plan = connector.build_connector_meta(scheduled(cached=[("r", [7, 8, 9])], resumed=["r"],
                                                    tokens={"r": 10}))
    assert plan.sends[0].block_ids == [7, 8, 9]
    assert connector.request_finished(req, [7, 8, 9]) == (True, None)  # pinned till sent
    assert connector.scheduler._block_ids == {}  # nothing kept of a finished request


def compat_role(name: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole[name]


class RecordingLink:
    """The transfer engine's wrapper, recording what it is asked to register."""

    registered: list = []

    def __init__(self, host, protocol, device_name, gid_index):
        self.session_id, self.transport = f"{host}:1", "tcp"

    def register(self, spans, device_type="cpu"):
        RecordingLink.registered.append((spans, device_type))


@pytest.fixture
def decode(monkeypatch):
    """A decode engine's worker-side connector over (k, v) caches, as vllm-ascend
    registers them; its prefill never answers, so every transfer fails."""
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(kv_worker, "Link", RecordingLink)
    RecordingLink.registered = []
    connector = EPDKVConnector(kv_config("kv_consumer", ack_timeout_s=0.3, heartbeat_s=0.1,
                                         peer_timeout_s=0.6),
                               compat_role("WORKER"), SimpleNamespace(num_blocks=16))
    caches = {f"model.layers.{i}.self_attn.attn": (torch.zeros(16, 4, 2, 8),
                                                   torch.zeros(16, 4, 2, 8))
              for i in range(2)}
    connector.register_kv_caches(caches)
    yield connector, caches
    connector.shutdown()


def receive(connector, transfer: str, blocks: list[int]) -> None:
    """Plan a receive from a prefill side channel nobody listens on."""
    silent_port = free_port_block(1, start=29700)
    plan = RecvPlan(f"req-{transfer}", transfer, "127.0.0.1", silent_port, blocks, 0,
                    4 * len(blocks))
    connector.bind_connector_metadata(StepPlan(recvs=[plan]))


def test_a_decode_worker_registers_each_k_and_v_cache_of_a_layer(decode):
    connector, caches = decode
    ((spans, device),) = RecordingLink.registered
    tensors = [t for pair in caches.values() for t in pair]
    assert device == "cpu"
    assert sorted(spans) == sorted((t.data_ptr(), t.nbytes) for t in tensors)
    layout = connector.worker.receiver.layouts[0]
    assert len(layout.forms) == 2 and layout.block_bytes == 2 * 4 * 2 * 8 * 4


def test_the_old_api_learns_a_failed_receive_by_its_blocks_once(decode):
    connector, _ = decode
    receive(connector, "t1", [3, 4, 5])
    sending, recving = wait_for(lambda: (got := connector.get_finished(set()))[1] and got,
                                what="the receive failed")
    assert sending is None and recving == {"req-t1"}  # finished (failed ones too) ...
    assert connector.get_block_ids_with_load_errors() == {3, 4, 5}  # ... and which blocks
    assert connector.get_block_ids_with_load_errors() == set()


@pytest.mark.skipif(compat.KVConnectorTransferResults is None,
                    reason="this vLLM reports failed receives by block only")
def test_the_new_api_learns_a_failed_receive_by_request_and_no_blocks(decode):
    connector, _ = decode
    receive(connector, "t2", [6, 7])
    results = wait_for(lambda: (got := connector.get_transfer_results(set())).finished_recving
                       and got, what="the receive failed")
    assert results.finished_recving == results.failed_recving == {"req-t2"}
    assert connector.get_block_ids_with_load_errors() == set()  # told once, by request


# -- EC connector --------------------------------------------------------------------

def ec_connector(store_spec, role: str, producer=False, consumer=True) -> EPDECConnector:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    config = SimpleNamespace(model_config=None, ec_transfer_config=SimpleNamespace(
        is_ec_producer=producer, is_ec_consumer=consumer,
        ec_connector_extra_config=ECSettings(store=store_spec).to_extra_config()))
    connector = EPDECConnector(config, ECConnectorRole[role])
    if connector.scheduler is not None:
        connector.scheduler.resolver._cache["image"] = {"image_grid_thw"}
    return connector


def step(*finished: str):
    return SimpleNamespace(finished_req_ids=set(finished))


def test_copies_are_given_back_when_vllm_reports_the_request_finished(store_spec):
    store_feature(store_spec, "held")
    connector = ec_connector(store_spec, "SCHEDULER")
    assert decided(connector.scheduler, request("r1", feature("held")))
    assert connector.has_cache_item("held")
    connector.build_connector_meta(step())
    assert connector.has_cache_item("held")  # still running
    # No request_finished (vLLM 0.23 never calls it): the next step's output says so.
    connector.build_connector_meta(step("r1"))
    assert not connector.has_cache_item("held")
    assert not connector.scheduler.loader.has_copy("held")  # nobody holds it any more
    connector.shutdown()


@pytest.mark.parametrize("fails_requests", [NEW_API, OLD_API])
def test_a_reference_to_a_missing_feature_is_failed_only_where_vllm_can(store_spec, monkeypatch,
                                                                        fails_requests):
    monkeypatch.setattr(compat, "EC_FAILS_REQUESTS", fails_requests)
    connector = ec_connector(store_spec, "SCHEDULER")
    req = request("r2", feature("nowhere"))
    assert decided(connector.scheduler, req) is False
    assert connector.ensure_cache_available(req, 0) is False  # decided once
    # Handed to vLLM to fail, where vLLM takes it; nothing piles up where it does not.
    assert connector.take_unavailable_requests() == ({"r2"} if fails_requests else set())
    connector.build_connector_meta(step("r2"))  # the client gave up on it
    assert not connector.scheduler._decided and not connector.scheduler._unavailable
    assert connector.scheduler.recorder.take()["events"]["unavailable"] == 1


class RecordingLog:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message, *args):
        self.lines.append(message % args)


@pytest.mark.parametrize("has_stats", [NEW_API, OLD_API])
def test_scheduler_counts_go_to_vllm_or_else_to_the_log(store_spec, monkeypatch, has_stats):
    monkeypatch.setattr(compat, "EC_STATS", has_stats)
    monkeypatch.setattr(ec_stats, "log", log := RecordingLog())
    connector = ec_connector(store_spec, "SCHEDULER")
    if not has_stats:
        connector.scheduler._logged.interval_s = 0
    assert decided(connector.scheduler, request("r3", feature("elsewhere", pixels=True)))
    connector.build_connector_meta(step())
    if has_stats:
        assert log.lines == []
        assert connector.get_ec_connector_stats().data["events"]["encoded_locally"] == 1
    else:
        assert log.lines == ["epd-ec scheduler counts (this vLLM has no EC metrics path): "
                             "encoded_locally=1"]
        assert connector.scheduler.recorder.take() is None  # taken, not kept for ever


@pytest.mark.parametrize("starts_saves", [NEW_API, OLD_API])
def test_the_encoder_stores_each_feature_with_its_placeholder_metadata(store_spec, monkeypatch,
                                                                       starts_saves):
    monkeypatch.setattr(compat, "EC_START_SAVE_CACHES", starts_saves)
    monkeypatch.setattr(compat, "EC_WORKER_META", starts_saves)
    monkeypatch.setattr(ec_stats, "log", log := RecordingLog())
    connector = ec_connector(store_spec, "WORKER", producer=True, consumer=False)
    key = f"encoded-{starts_saves}"
    encoder_cache = {key: torch.ones(4, 8)}

    def run_step(encode: bool) -> None:
        """One encoder step as the model runner of each API drives it."""
        connector.bind_connector_metadata(ECStep(publish={key: GRID}))
        if starts_saves:
            connector.start_save_caches(encoder_cache=encoder_cache)
        if encode:
            connector.save_caches(encoder_cache, key)
        connector.get_finished(set())
        connector.clear_connector_metadata()

    try:
        run_step(encode=True)
        with open_store(store_spec) as store:
            assert store.lookup(key).placeholder == GRID
            assert store.delete(key)  # evicted from the store ...
            run_step(encode=False)  # ... and asked for again: in the encoder cache only
            assert store.lookup(key).placeholder == GRID  # stored again
        if not starts_saves:  # no worker metadata to carry the counts: logged
            connector.worker._logged.interval_s = 0
            connector.get_finished(set())
            assert log.lines and "saved=2" in log.lines[-1]
    finally:
        connector.shutdown()
