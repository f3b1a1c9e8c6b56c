"""Our connectors under vLLM's Model Runner V2, which vLLM 0.32 runs by default on CUDA
(wherever Triton is there): its own connector wrappers (vllm/v1/worker/gpu/
kv_connector.py and ec_connector.py), not the V1 runner's mixins, drive them. Here those
wrappers, as vLLM ships them, drive our KV connector through a prefill -> decode
hand-off (two workers in this process, a stand-in transfer engine copying the bytes)
and our EC connector through a feature stored by an encoder and loaded by a prefill.

What V2 does differently, and what each test holds to:
- KV: `start_load_kv` gets the step's scheduler output, request ids and token counts as
  keyword arguments; an asynchronous load starts after the forward; `finish_forward`
  comes right after the forward, `wait_for_save` and the transfer results only in
  `post_forward`, after sampling (so our connector ends the step's writes in the first
  of the two, as soon as under V1); a step without a forward is `no_forward`
  (pre_forward with no batch, then post_forward).
- EC: the wrapper binds the step, starts saves and loads, and after the encoder saves
  each output the encoder cache gained during the step (V1 saves inside its encoder
  loop); `get_finished` and the worker metadata are taken every step with an EC plan.

vLLM 0.32 only (0.23 has no Model Runner V2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.worker.gpu.kv_connector", reason="a vLLM with Model Runner V2")

from vllm.v1.worker.gpu import ec_connector as v2_ec  # noqa: E402
from vllm.v1.worker.gpu import kv_connector as v2_kv  # noqa: E402

from epd_serve.connectors.epd_ec.connector import EPDECConnector  # noqa: E402
from epd_serve.connectors.epd_ec.scheduler import ECStep  # noqa: E402
from epd_serve.connectors.epd_kv.connector import EPDKVConnector  # noqa: E402
from epd_serve.connectors.epd_kv.messages import FinishedSend, RecvPlan  # noqa: E402
from epd_serve.connectors.epd_kv.metadata import StepPlan  # noqa: E402
from epd_serve.mmstore import open_store  # noqa: E402

from ...waiting import wait_for  # noqa: E402
from .test_compat import compat_role, ec_connector, kv_config  # noqa: E402
from .test_epd_ec import GRID, decided, feature, request  # noqa: E402
from .test_epd_kv_both import (  # noqa: E402
    BLOCK_SIZE,
    BLOCKS,
    LAYERS,
    copying_link_workers,
    layer_name,
    send_chunk,
)


@pytest.fixture(scope="module")
def vllm_config():
    """A default VllmConfig: V2's wrapper opens a forward context with it for a step
    without a forward (its loads start there)."""
    from vllm.config import VllmConfig

    return VllmConfig()


def v2_kv_wrapper(monkeypatch, connector: EPDKVConnector, caches: dict,
                  vllm_config) -> v2_kv.ActiveKVConnector:
    """V2's wrapper around `connector`, made as V2's runner makes it (it takes the
    process's KV transfer group, which vLLM's engine sets up)."""
    monkeypatch.setattr(v2_kv, "get_kv_transfer_group", lambda: connector)
    return v2_kv.ActiveKVConnector(vllm_config, caches)


def step_output(plan: StepPlan, finished: set[str] = frozenset()):
    """A scheduler output as far as V2's KV wrapper reads it."""
    return SimpleNamespace(kv_connector_metadata=plan, has_sync_kv_loads=False,
                           finished_req_ids=set(finished))


def worker(role: str, seed: int, **settings) -> tuple[EPDKVConnector, dict]:
    """A worker-side KV connector over per-layer caches as vLLM 0.32 allocates them for
    either runner and hands them to connectors (vllm/v1/worker/utils.py,
    allocate_kv_cache): block-major [blocks, heads, block size, channels] views, filled
    with values of its own."""
    config = kv_config(role, heartbeat_s=0.1, **settings)
    config.kv_transfer_config.engine_id = f"{role}-v2-{seed}"
    connector = EPDKVConnector(config, compat_role("WORKER"), SimpleNamespace(num_blocks=BLOCKS))
    generator = torch.Generator().manual_seed(seed)
    caches = {layer_name(i): torch.rand(BLOCKS, 2, BLOCK_SIZE, 16, generator=generator)
              for i in range(LAYERS)}
    return connector, caches


@pytest.fixture
def prefill_and_decode(monkeypatch):
    copying_link_workers(monkeypatch)
    # `whole`: prefill sends every layer in one write once the forward pass is over.
    made = [worker("kv_producer", 1, mode="whole"), worker("kv_consumer", 2)]
    yield made
    for connector, _ in made:
        connector.shutdown()


def test_v2s_kv_wrapper_drives_a_prefill_to_decode_hand_off(monkeypatch, prefill_and_decode,
                                                            vllm_config):
    (prefill, p_caches), (decode, d_caches) = prefill_and_decode
    p_runner = v2_kv_wrapper(monkeypatch, prefill, p_caches, vllm_config)
    d_runner = v2_kv_wrapper(monkeypatch, decode, d_caches, vllm_config)
    prompt = 2 * BLOCK_SIZE
    # Decode's step: the request waits for its KV, nothing to run (no_forward).
    reserve = RecvPlan("d-req", "t-v2", "127.0.0.1", prefill.worker.port, [9, 10], 0, prompt)
    out = d_runner.no_forward(step_output(StepPlan(recvs=[reserve])))
    assert out.kv_connector_output is None or not out.kv_connector_output.finished_recving
    wait_for(lambda: decode.worker.receiver._incoming["t-v2"].acked,
             what="prefill acknowledged decode's reservation")
    # Prefill's step, as V2's execute_model and sample_tokens drive it.
    batch = SimpleNamespace(idx_mapping=torch.tensor([0]), req_ids=["p-req"], num_tokens=prompt)
    p_runner.pre_forward(step_output(StepPlan(sends=[send_chunk("p-req", "t-v2", [1, 2], prompt)],
                                              num_tokens=prompt)), batch)
    for layer in range(LAYERS):  # what vLLM's attention layers call, layer by layer
        prefill.save_kv_layer(layer_name(layer), p_caches[layer_name(layer)], None)
    p_runner.finish_forward()
    # The write starts right after the forward pass, not after sampling (post_forward).
    wait_for(lambda: all(torch.equal(d_caches[name][9:11], p_caches[name][1:3])
                         for name in d_caches), what="the KV written before post_forward")
    p_out = p_runner.post_forward(set())  # after sampling: wait_for_save, results
    assert p_out is not None and not p_out.invalid_block_ids
    assert not prefill.has_connector_metadata()  # cleared for the next step
    # Decode learns of the landed KV in a later step's results.
    received: set[str] = set()

    def landed() -> bool:
        output = d_runner.no_forward(step_output(StepPlan())).kv_connector_output
        if output is not None:
            assert not output.failed_recving and not output.invalid_block_ids
            received.update(output.finished_recving or ())
        return "d-req" in received

    wait_for(landed, what="decode's step reported the KV received")
    for layer in range(LAYERS):
        p_cache, d_cache = p_caches[layer_name(layer)], d_caches[layer_name(layer)]
        assert torch.equal(d_cache[9:11], p_cache[1:3])  # prefill's 1, 2 -> 9, 10
        assert not torch.equal(d_cache[11], p_cache[3])  # nothing else written
    # The prefilled request finishes; prefill frees its blocks once its writes ended.
    sent: set[str] = set()

    def freed() -> bool:
        plan = StepPlan(finished_sends=[FinishedSend("p-req", "t-v2", False)]) if not sent \
            else StepPlan()
        output = p_runner.no_forward(step_output(plan)).kv_connector_output
        sent.update((output.finished_sending or ()) if output is not None else ())
        return "p-req" in sent

    wait_for(freed, what="prefill's step reported the send finished")


def v2_ec_wrapper(monkeypatch, connector: EPDECConnector, cache: dict) -> v2_ec.ActiveECConnector:
    monkeypatch.setattr(v2_ec, "get_ec_transfer", lambda: connector)
    return v2_ec.ActiveECConnector(SimpleNamespace(), cache)


def ec_step(plan):
    return SimpleNamespace(ec_connector_metadata=plan, finished_req_ids=set())


def test_v2s_ec_wrapper_stores_what_the_encoder_made_and_prefill_loads_it(store_spec,
                                                                         monkeypatch):
    key = "encoded-under-v2"
    encoded = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    encoder = ec_connector(store_spec, "WORKER", producer=True, consumer=False)
    prefill_sched = ec_connector(store_spec, "SCHEDULER")
    prefill = ec_connector(store_spec, "WORKER")
    try:
        # The encoder's step: V2 saves what the encoder cache gained within it.
        encoder_cache: dict[str, torch.Tensor] = {}
        runner = v2_ec_wrapper(monkeypatch, encoder, encoder_cache)
        with runner.maybe_get_output(ec_step(ECStep(publish={key: GRID}))) as output:
            encoder_cache[key] = encoded  # the encoder ran
        assert output is not None and output.finished_recving is None
        with open_store(store_spec) as store:
            assert store.lookup(key).placeholder == GRID
        # Prefill's scheduler finds it stored and plans its load; V2 loads it.
        req = request("r1", feature(key))
        assert decided(prefill_sched.scheduler, req)
        prefill_sched.update_state_after_alloc(req, 0)
        plan = prefill_sched.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        assert key in plan.loads
        prefill_cache: dict[str, torch.Tensor] = {}
        runner = v2_ec_wrapper(monkeypatch, prefill, prefill_cache)
        with runner.maybe_get_output(ec_step(plan)):
            assert torch.equal(prefill_cache[key].float(), encoded)  # before the model runs
        assert prefill._connector_metadata is None  # cleared for the next step
        # A step with no work runs the connector's step too (V2's no_forward).
        runner.no_forward(ec_step(ECStep(loads=plan.loads)))
        assert prefill._connector_metadata is None
    finally:
        for connector in (encoder, prefill_sched, prefill):
            connector.shutdown()
