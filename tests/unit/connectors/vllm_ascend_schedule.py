"""vllm-ascend 0.23.0.post1's own scheduler with our connectors, as an Atlas instance
runs them: run by test_vllm_ascend_scheduler.py with the vLLM 0.23 engine stack
(`.venv-vllm023`, the vLLM core of vllm-ascend 0.23) and vllm-ascend's Python source
(the package index's sdist, unpacked by scripts/setup-vllm023.sh).

    .venv-vllm023/bin/python tests/unit/connectors/vllm_ascend_schedule.py SOURCE WORKDIR

vllm-ascend patches the scheduler, not the model runner: importing
`vllm_ascend/patch/platform/patch_balance_schedule.py` replaces
`vllm.v1.core.sched.scheduler.Scheduler` with its `BalanceScheduler` (that file's last
line), whose own `schedule()` runs on a `kv_producer` and under balance scheduling.
Which loop ran is told by what it asks our connectors (`watch`), never by its private
attributes: vllm-ascend's main has no `_disable_preemption` (no prefill-node copy of
`schedule()`), and its balance copy asks `ensure_cache_available` itself.
Loaded from its file alone: the package's other platform patches need an NPU at
import. The one NPU-only import on the way (`vllm_ascend/utils.py`: `import torch_npu`)
is an empty module; nothing the scheduler does touches a device. The scheduler is
built by vLLM's own constructor (so its connector factories load ours from the
transfer configs), over a real MM Store and a tiny Qwen2-VL model, and driven by
`schedule()` calls. Prints one JSON object: what each scenario scheduled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

BALANCE_PATCH = "vllm_ascend/patch/platform/patch_balance_schedule.py"
EMBEDS = 16  # one image's placeholder tokens (and rows of its feature)
PROMPT = 48  # tokens, the image's among them


def load_balance_scheduler(source: Path):
    """vllm-ascend's scheduler patch, applied as vllm-ascend applies it."""
    import vllm.v1.core.sched.scheduler  # noqa: F401 - vLLM first, with no torch_npu about
    import vllm.v1.engine.core  # noqa: F401

    sys.path.insert(0, str(source))
    sys.modules["torch_npu"] = types.ModuleType("torch_npu")
    name = BALANCE_PATCH.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, source / BALANCE_PATCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.BalanceScheduler


def make_scheduler(model_dir: Path, store_spec, hint_port: int, kv_producer: bool):
    import torch
    from vllm.config import (CacheConfig, ECTransferConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched import scheduler as vllm_scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from epd_serve.connectors.epd_ec.settings import Settings

    cache = CacheConfig(block_size=16, enable_prefix_caching=False)
    cache.num_gpu_blocks = 256  # what the engine sets once it has profiled its memory
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                        max_model_len=1024, seed=0)
    ec_settings = Settings(store=store_spec, prefetch_port=hint_port)
    config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        ec_transfer_config=ECTransferConfig(
            ec_connector="EPDECConnector", ec_role="ec_consumer",
            ec_connector_module_path="epd_serve.connectors.epd_ec",
            ec_connector_extra_config=ec_settings.to_extra_config()),
        kv_transfer_config=KVTransferConfig(
            kv_connector="EPDKVConnector", kv_role="kv_producer",
            kv_connector_module_path="epd_serve.connectors.epd_kv",
            kv_connector_extra_config={"role": "kv_producer"}) if kv_producer else None,
    )
    kv_cache = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                        head_size=8, dtype=torch.float32))])
    # The name vLLM's engine core builds its scheduler from: vllm-ascend's, once patched.
    return vllm_scheduler.Scheduler(vllm_config=config, kv_cache_config=kv_cache,
                                    structured_output_manager=StructuredOutputManager(config),
                                    block_size=16, log_stats=True)


def image_request(request_id: str, key: str):
    """A prefill request as the proxy sends one on vLLM 0.23: the image's pixels, tagged
    with its MM Store key as its identifier, and `do_remote_decode`."""
    import torch
    from vllm.multimodal.inputs import (MultiModalBatchedField, MultiModalFeatureSpec,
                                        MultiModalFieldElem, MultiModalKwargsItem,
                                        PlaceholderRange)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    field = MultiModalBatchedField()
    data = MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=torch.zeros(64, 8), field=field),
        "image_grid_thw": MultiModalFieldElem(data=torch.tensor([1, 8, 8]), field=field),
    })
    feature = MultiModalFeatureSpec(data=data, modality="image", identifier=key,
                                    mm_position=PlaceholderRange(offset=8, length=EMBEDS))
    request = Request(request_id, list(range(1, PROMPT + 1)), SamplingParams(max_tokens=4),
                      None, mm_features=[feature])
    request.kv_transfer_params = {"do_remote_decode": True, "transfer_id": request_id}
    return request


def schedule_until_scheduled(scheduler, request, timeout_s: float = 10.0) -> dict:
    """Calls schedule() until the request is scheduled: how many passes it waited, what
    the scheduler chose to encode, what our EC connector loads instead."""
    scheduler.add_request(request)
    deadline = time.monotonic() + timeout_s
    passes = 0
    while time.monotonic() < deadline:
        output = scheduler.schedule()
        passes += 1
        if request.request_id in output.num_scheduled_tokens:
            loads = output.ec_connector_metadata.loads
            return {"waited_passes": passes - 1,
                    "encoded": output.scheduled_encoder_inputs.get(request.request_id, []),
                    "loaded": sorted(loads),
                    "loaded_rows": {k: list(v.meta.shape) for k, v in loads.items()}}
        time.sleep(0.01)
    return {"waited_passes": passes, "never_scheduled": True}


def watch(scheduler) -> dict:
    """What the scheduler's waiting loop asks our connectors, counted (its public
    calls, not its private state, which vllm-ascend's main no longer has): whether it
    asks the EC connector `ensure_cache_available` itself, and how often our KV
    connector answers None (the request then waits a step, in vLLM's loop and in every
    vllm-ascend copy of it)."""
    seen = {"asks_ec": 0, "kv_waits": 0}
    ec = scheduler.ec_connector
    ensure = ec.ensure_cache_available

    def counted_ensure(*args, **kwargs):
        seen["asks_ec"] += 1
        return ensure(*args, **kwargs)

    ec.ensure_cache_available = counted_ensure
    kv = scheduler.connector
    if kv is not None:
        matched = kv.get_num_new_matched_tokens

        def counted_matched(*args, **kwargs):
            answer = matched(*args, **kwargs)
            seen["kv_waits"] += answer[0] is None
            return answer

        kv.get_num_new_matched_tokens = counted_matched
    return seen


def main() -> int:
    source, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    balance_scheduler = load_balance_scheduler(source)

    import numpy as np
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    from epd_serve.models.tinymodel import HIDDEN, build_tiny_model
    from epd_serve.mmstore import FeatureMeta, StoreSpec, open_store
    from epd_serve.mmstore.service import StartedStore

    base = int(os.environ.get("EPD_TEST_PORT", "29400"))
    spec = StoreSpec(backend="shm", port=base, metrics_port=base + 1, capacity_bytes=64 << 20,
                     name=f"ascend-sched-{os.getpid()}")
    model_dir = build_tiny_model("qwen2_vl", workdir / "model")
    hidden = HIDDEN  # the vision encoder's output width: a feature the model can take
    feature = np.arange(EMBEDS * hidden, dtype=np.float32)
    meta = FeatureMeta((EMBEDS, hidden), "float32", {"image_grid_thw": [1, 8, 8]})
    result: dict = {"scheduler": f"{vllm_scheduler.Scheduler.__module__}."
                                 f"{vllm_scheduler.Scheduler.__qualname__}"}
    with StartedStore(spec), open_store(spec) as store:
        for key in ("stored", "stored-hinted"):
            store.put(key, feature.view(np.uint8), meta)

        # A prefill instance: kv_producer, so vllm-ascend's own schedule() runs.
        prefill = make_scheduler(model_dir, spec, base + 2, kv_producer=True)
        result["prefill_asked"] = watch(prefill)
        result["prefill_stored"] = schedule_until_scheduled(prefill,
                                                            image_request("p1", "stored"))
        result["prefill_missing"] = schedule_until_scheduled(prefill,
                                                             image_request("p2", "missing"))
        prefill.shutdown()

        # Balance scheduling on an instance with no KV connector (an E-PD's PD).
        os.environ["VLLM_ASCEND_BALANCE_SCHEDULING"] = "1"
        combined = make_scheduler(model_dir, spec, base + 3, kv_producer=False)
        result["balance_asked"] = watch(combined)
        loader = combined.ec_connector.scheduler.loader
        loader.hint(["stored-hinted"])  # what the proxy's hint does, read here in full
        result["balance_hinted"] = schedule_until_scheduled(
            combined, image_request("b1", "stored-hinted"))
        result["balance_not_hinted"] = schedule_until_scheduled(
            combined, image_request("b2", "stored"))
        combined.shutdown()
    result["is_vllm_ascend_scheduler"] = vllm_scheduler.Scheduler is balance_scheduler
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
