"""HAL: the engine command lines and environments each platform generates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from epd_serve.backends import get_platform
from epd_serve.deployment import schema
from epd_serve.deployment.resolve import resolve
from epd_serve.backends.hal import memory_shares
from epd_serve.topology.notation import parse


def resolved(platform: str, notation: str, **extra):
    cfg = schema.Deployment(name="t", platform=platform, deployment=notation,
                            model="/models/m", served_model_name="m", **extra)
    return resolve(cfg, Path("/proj"))


def by_name(dep):
    plat = get_platform(dep.config.platform)
    return {l.name: (plat.command(l), plat.environment(l), l) for l in dep.launches}


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_memory_shares_split_colocated_devices():
    assert memory_shares(parse("E-P-D")) == {"e0": 1.0, "p0": 1.0, "d0": 1.0}
    assert memory_shares(parse("(E-P)-D")) == {"e0": 0.2, "p0": 0.8, "d0": 1.0}
    shares = memory_shares(parse("(E-P-D)"))
    assert shares["e0"] == pytest.approx(1 / 9) and shares["p0"] == pytest.approx(4 / 9)


def test_cuda_e_p_d_commands():
    inst = by_name(resolved("cuda", "E-P-D", devices=[4, 5, 6]))
    e_cmd, e_env, _ = inst["e0"]
    assert e_cmd[:3] == ["vllm", "serve", "/models/m"]
    assert e_env["CUDA_VISIBLE_DEVICES"] == "4"
    assert flag(e_cmd, "--gpu-memory-utilization") == "0.9"
    # Attention and sampling are vLLM's choice (FlashAttention on Hopper).
    assert "--attention-backend" not in e_cmd and "VLLM_USE_FLASHINFER_SAMPLER" not in e_env
    assert "--mm-encoder-only" in e_cmd and "--kv-transfer-config" not in e_cmd
    # Our EC connector over the node's shared-memory MM Store.
    store = {"backend": "shm", "host": "127.0.0.1", "port": 8990, "metrics_port": 8991,
             "capacity_bytes": 2 << 30, "name": "t", "protocol": "tcp", "hold_s": 60.0}
    e_ec = json.loads(flag(e_cmd, "--ec-transfer-config"))
    assert e_ec["ec_connector"] == "EPDECConnector" and e_ec["ec_role"] == "ec_producer"
    assert e_ec["ec_connector_module_path"] == "epd_serve.connectors.epd_ec"
    assert e_ec["ec_connector_extra_config"]["store"] == store
    assert e_ec["ec_connector_extra_config"]["prefetch_port"] is None

    p_cmd, p_env, p = inst["p0"]
    assert p_env["CUDA_VISIBLE_DEVICES"] == "5"
    p_ec = json.loads(flag(p_cmd, "--ec-transfer-config"))
    assert p_ec["ec_role"] == "ec_consumer" and p_ec["ec_connector_extra_config"]["store"] == store
    # Prefill listens for prefetch hints on its own port.
    assert p_ec["ec_connector_extra_config"]["prefetch_port"] == p.prefetch_port == 8960
    # Our connector by default, over RDMA, its side channel on the instance's KV port.
    assert json.loads(flag(p_cmd, "--kv-transfer-config")) == {
        "kv_connector": "EPDKVConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "epd_serve.connectors.epd_kv", "kv_port": 8900,
        "kv_connector_extra_config": {"protocol": "rdma", "host": "127.0.0.1",
                                      "role": "kv_producer"}}
    assert flag(p_cmd, "--port") == "8101"

    d_cmd, d_env, d = inst["d0"]
    assert d_env["CUDA_VISIBLE_DEVICES"] == "6"
    kv = json.loads(flag(d_cmd, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_consumer" and kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_port"] == d.kv_port == 8901
    assert kv["kv_connector_extra_config"]["role"] == "kv_consumer"  # full decode graphs
    # Decode gets image references; it loads features only if it must recompute.
    d_ec = json.loads(flag(d_cmd, "--ec-transfer-config"))
    assert d_ec["ec_role"] == "ec_consumer" and d_ec["ec_connector_extra_config"]["prefetch_port"] is None


def test_file_backend_keeps_vllms_file_connector_and_no_store_process():
    dep = resolved("cuda", "E-P-D", mm_store={"backend": "file"})
    inst = by_name(dep)
    assert json.loads(flag(inst["e0"][0], "--ec-transfer-config")) == {
        "ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": "/proj/.epd/t/ec_cache"}}
    assert "--ec-transfer-config" not in inst["d0"][0]
    assert dep.mm_store is None and 8990 not in dep.ports()


def test_instances_sent_references_run_without_vllms_processor_cache():
    # A reference and the image's pixels share vLLM's item hash: with its processor
    # cache on, pixels sent after a failed reference reached the engine as the reference.
    cache_off = ["--mm-processor-cache-gb", "0"]

    def cache_flags(dep) -> dict[str, bool]:
        return {name: any(cmd[i:i + 2] == cache_off for i in range(len(cmd)))
                for name, (cmd, _, _) in by_name(dep).items()}

    assert cache_flags(resolved("cuda", "E-P-D")) == {"e0": False, "p0": True, "d0": True}
    assert cache_flags(resolved("cuda", "E-PD")) == {"e0": False, "pd0": True}
    # Never sent a reference: the pixels, tagged with their keys, every time.
    assert not any(cache_flags(resolved("cuda", "E-P-D", feature_refs="pixels")).values())
    assert not any(cache_flags(resolved("cuda", "P-D")).values())  # no images stored


def test_store_ports_are_the_deployments_and_text_only_plans_have_no_store():
    dep = resolved("cpu", "E-P-D", mm_store={"port": 7000, "metrics_port": 7001,
                                             "prefetch_base_port": 7100, "capacity": "64MiB"})
    assert dep.mm_store.capacity_bytes == 64 << 20
    ports = dep.ports()
    assert ports[7000].startswith("MM Store") and ports[7001] == "MM Store metrics"
    assert ports[7100] == "prefetch hints of p0"
    assert resolved("cpu", "P-D").mm_store is None


def test_vllms_mooncake_connector_stays_selectable():
    inst = by_name(resolved("cuda", "E-P-D", kv_connector="mooncake"))
    p_cmd, p_env, p = inst["p0"]
    assert p_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8900" and p.kv_port == 8900
    assert json.loads(flag(p_cmd, "--kv-transfer-config")) == {
        "kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma"}}
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in inst["d0"][1]
    cpu = by_name(resolved("cpu", "P-D", kv_connector="mooncake"))
    kv = json.loads(flag(cpu["p0"][0], "--kv-transfer-config"))
    assert kv["kv_connector_module_path"] == "epd_serve.connectors.mooncake_cpu"


def test_kv_connector_settings_reach_the_engines_and_typos_are_refused():
    inst = by_name(resolved("cpu", "P-D", kv_connector_config={"mode": "layer"}))
    kv = json.loads(flag(inst["p0"][0], "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"] == {"protocol": "tcp", "mode": "layer",
                                               "host": "127.0.0.1", "role": "kv_producer"}
    with pytest.raises(schema.ConfigError, match="unknown epd KV connector setting.*'mdoe'"):
        resolved("cpu", "P-D", kv_connector_config={"mdoe": "layer"})
    with pytest.raises(schema.ConfigError, match="unknown KV transfer mode 'chunk'"):
        resolved("cpu", "P-D", kv_connector_config={"mode": "chunk"})
    with pytest.raises(schema.ConfigError, match="does not run on cpu; choose one of epd, mooncake"):
        resolved("cpu", "P-D", kv_connector="ascend-layerwise")
    with pytest.raises(ValidationError, match="'epd', 'mooncake' or 'ascend-layerwise'"):
        resolved("cuda", "P-D", kv_connector="nixl")


def test_a_deployment_that_injects_faults_has_its_kv_connector_honour_them():
    """`fault_injection: true` (tests) reaches prefill's epd connector, which alone
    can inject KV faults; without it the connector ignores a request's epd_fault."""
    faulty = by_name(resolved("cpu", "P-D", fault_injection=True))
    extra = json.loads(flag(faulty["p0"][0], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["fault_injection"] is True
    plain = by_name(resolved("cpu", "P-D"))
    extra = json.loads(flag(plain["p0"][0], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert "fault_injection" not in extra
    mooncake = by_name(resolved("cpu", "P-D", kv_connector="mooncake", fault_injection=True))
    assert "fault_injection" not in flag(mooncake["p0"][0], "--kv-transfer-config")


def test_kv_ports_go_to_instances_that_send_or_receive_kv():
    dep = resolved("cuda", "E-P-D-D", kv_base_port=9000)
    assert [l.kv_port for l in dep.launches] == [None, 9000, 9001, 9002]
    assert {p for p, user in dep.ports().items() if user.startswith("KV port")} == {9000, 9001, 9002}
    (monolithic,) = resolved("cuda", "TP2", kv_base_port=9000).launches
    assert monolithic.kv_port is None


@pytest.mark.parametrize("platform", ["cuda", "cpu", "ascend"])
def test_an_attention_backend_named_in_the_file_reaches_every_instance(platform):
    inst = by_name(resolved(platform, "(E-P)-D", attention_backend="flashinfer"))
    assert {name: flag(cmd, "--attention-backend") for name, (cmd, _, _) in inst.items()} \
        == {"e0": "FLASHINFER", "p0": "FLASHINFER", "d0": "FLASHINFER"}


@pytest.mark.parametrize("extra, says", [
    ({"attention_backend": "flash-attn"}, "letters, digits and '_'"),
    ({"attention_backend": ""}, "letters, digits and '_'"),
    ({"attention_backend": "FLASH_ATTN", "engine_args": {"attention_backend": "FLASHINFER"}},
     "given twice"),
    ({"attention_backend": "FLASH_ATTN", "role_engine_args": {"D": {"attention-backend": "X"}}},
     "given twice"),
])
def test_attention_backend_key_is_checked(extra, says):
    with pytest.raises(ValidationError, match=says):
        schema.Deployment(name="t", platform="cuda", deployment="E-P-D", model="/m", **extra)


def test_cuda_colocated_instances_share_a_device_with_split_memory():
    inst = by_name(resolved("cuda", "(E-P)-D"))
    assert inst["e0"][1]["CUDA_VISIBLE_DEVICES"] == inst["p0"][1]["CUDA_VISIBLE_DEVICES"] == "0"
    assert flag(inst["e0"][0], "--gpu-memory-utilization") == "0.18"
    assert flag(inst["p0"][0], "--gpu-memory-utilization") == "0.72"
    assert inst["d0"][1]["CUDA_VISIBLE_DEVICES"] == "1"


def test_cuda_tensor_parallel_instance_sees_both_devices():
    (cmd, env, _), = by_name(resolved("cuda", "TP2")).values()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert flag(cmd, "--tensor-parallel-size") == "2"
    assert "--kv-transfer-config" not in cmd and "--ec-transfer-config" not in cmd


def test_ascend_uses_npu_visibility_and_its_allocator():
    # The connectors Atlas deployments use: tests/unit/backends/test_ascend_platform.py.
    inst = by_name(resolved("ascend", "(E-P)-D"))
    p_cmd, p_env, _ = inst["p0"]
    assert p_env["ASCEND_RT_VISIBLE_DEVICES"] == "0" and "CUDA_VISIBLE_DEVICES" not in p_env
    assert p_env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert "--attention-backend" not in p_cmd
    assert flag(inst["e0"][0], "--gpu-memory-utilization") == "0.18"
    assert inst["d0"][1]["ASCEND_RT_VISIBLE_DEVICES"] == "1"


def test_cpu_commands_use_our_connectors_and_kv_cache_env():
    inst = by_name(resolved("cpu", "(E-P)-D", engine_args={"limit_mm_per_prompt": '{"image":2}'}))
    e_cmd, e_env, _ = inst["e0"]
    assert e_cmd[:4] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert "--gpu-memory-utilization" not in e_cmd
    assert e_env["VLLM_CPU_KVCACHE_SPACE"] == "1" and e_env["VLLM_TARGET_DEVICE"] == "cpu"
    ec = json.loads(flag(e_cmd, "--ec-transfer-config"))
    assert ec["ec_connector"] == "EPDECConnector"
    assert ec["ec_connector_module_path"] == "epd_serve.connectors.epd_ec"
    p_cmd, p_env, _ = inst["p0"]
    kv = json.loads(flag(p_cmd, "--kv-transfer-config"))
    assert kv["kv_connector_module_path"] == "epd_serve.connectors.epd_kv"
    assert kv["kv_connector_extra_config"] == {"protocol": "tcp", "host": "127.0.0.1",
                                               "role": "kv_producer"}
    assert p_env["MC_FORCE_TCP"] == "1" and p_env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert p_env["OMP_WAIT_POLICY"] == "PASSIVE" and p_env["KMP_BLOCKTIME"] == "0"
    assert p_env["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    # A host with cores to spare turns vLLM's KV split back on in the deployment file.
    split = by_name(resolved("cpu", "TP1", env={"VLLM_CPU_ATTN_SPLIT_KV": "1"}))
    assert split["epd0"][1]["VLLM_CPU_ATTN_SPLIT_KV"] == "1"
    assert "--enforce-eager" in p_cmd
    assert flag(p_cmd, "--limit-mm-per-prompt") == '{"image":2}'
    assert inst["d0"][1]["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_engine_python_starts_each_platforms_engine_with_that_interpreter(tmp_path):
    # A virtualenv's bin/python is a link to the base interpreter: the path must stay
    # the link's, or the engine would run without the environment's packages.
    python = tmp_path / "engine-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    cli = ["-m", "vllm.entrypoints.cli.main", "serve"]  # what `vllm serve` runs
    programs = {"cpu": ["-m", "vllm.entrypoints.openai.api_server", "--model"],
                "cuda": cli, "ascend": cli}
    for platform, program in programs.items():
        cfg = schema.Deployment(name="t", platform=platform, deployment="P-D",
                                model="/models/m", engine_python="engine-env/bin/python")
        for cmd, _, launch in by_name(resolve(cfg, tmp_path)).values():
            assert launch.engine_python == str(python)
            assert cmd[:len(program) + 2] == [str(python), *program, "/models/m"], platform
    # Without it: epd-serve's own interpreter, or the `vllm` script on PATH.
    assert by_name(resolved("cuda", "P-D"))["p0"][0][:3] == ["vllm", "serve", "/models/m"]


def test_engine_python_is_refused_where_the_engine_is_no_python_module(tmp_path):
    class Binary(type(get_platform("cpu"))):
        def engine_launcher(self):
            return ["/opt/engine/bin/serve"]

    (tmp_path / "python").symlink_to(sys.executable)
    cfg = schema.Deployment(name="t", deployment="P-D", model="/models/m",
                            engine_python="python")
    with pytest.raises(ValueError, match="engine_python cannot choose its interpreter"):
        Binary().command(resolve(cfg, tmp_path).launches[0])


def test_role_engine_args_apply_to_instances_running_that_stage():
    inst = by_name(resolved("cuda", "EP-D", role_engine_args={"E": {"max_num_batched_tokens": 99},
                                                               "D": {"enforce_eager": True}}))
    assert flag(inst["ep0"][0], "--max-num-batched-tokens") == "99"
    assert "--enforce-eager" not in inst["ep0"][0] and "--enforce-eager" in inst["d0"][0]
    # A merged EP instance encodes for itself: no EC connector, but it still sends KV.
    assert "--ec-transfer-config" not in inst["ep0"][0]
    assert json.loads(flag(inst["ep0"][0], "--kv-transfer-config"))["kv_role"] == "kv_producer"


def test_role_env_applies_to_instances_running_that_stage_over_the_deployments_env():
    inst = by_name(resolved("cpu", "EP-D", env={"OMP_NUM_THREADS": "2", "X": "all"},
                            role_env={"D": {"OMP_NUM_THREADS": "1"}, "P": {"Y": "p"}}))
    ep_env, d_env = inst["ep0"][1], inst["d0"][1]
    assert (ep_env["OMP_NUM_THREADS"], ep_env["X"], ep_env["Y"]) == ("2", "all", "p")
    assert (d_env["OMP_NUM_THREADS"], d_env["X"]) == ("1", "all") and "Y" not in d_env


def test_hardware_packages_are_not_imported_by_the_backends():
    code = ("import sys, epd_serve.backends as b\n"
            "for n in b.PLATFORMS: b.get_platform(n)\n"
            "bad = [m for m in ('torch', 'torch_npu', 'flashinfer', 'vllm', 'vllm_ascend') "
            "if m in sys.modules]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="choose one of cpu, cuda, ascend"):
        get_platform("tpu")


def test_switchable_instances_are_full_engines_with_both_ends_of_each_handoff():
    dep = resolved("cpu", "E~-E-P-D~")
    inst = by_name(dep)
    e_cmd, _, e = inst["e0"]
    assert "--mm-encoder-only" not in e_cmd and not e.encoder_only  # E~ loads the LLM too
    assert "--mm-encoder-only" in inst["e1"][0]
    for name in ("e0", "d0"):
        cmd, _, launch = inst[name]
        kv = json.loads(flag(cmd, "--kv-transfer-config"))
        ec = json.loads(flag(cmd, "--ec-transfer-config"))
        assert (kv["kv_role"], ec["ec_role"]) == ("kv_both", "ec_both")
        assert kv["kv_load_failure_policy"] == "recompute"  # it may decode
        assert kv["kv_connector_extra_config"]["role"] == "kv_both"
        assert launch.prefetch_port is not None  # it may prefill: it takes prefetch hints
    # A plain E or P keeps its one end.
    assert json.loads(flag(inst["e1"][0], "--ec-transfer-config"))["ec_role"] == "ec_producer"
    assert json.loads(flag(inst["p0"][0], "--kv-transfer-config"))["kv_role"] == "kv_producer"
    # Memory: a switchable encoder weighs as a language-model instance, and holds a KV
    # cache in host memory where the encoder-only one holds none.
    assert memory_shares(parse("(E~-P)-D")) == {"e0": 0.5, "p0": 0.5, "d0": 1.0}
    cpu = get_platform("cpu")
    assert cpu.host_memory_gib(e) == cpu.host_memory_gib(inst["d0"][2]) \
        > cpu.host_memory_gib(inst["e1"][2]) + 1.0


def test_switchable_instances_reach_the_proxy_with_their_kv_and_prefetch_endpoints():
    from epd_serve.runtime.plan import proxy_config

    entries = {e.name: e for e in proxy_config(resolved("cpu", "E~-P-D~")).instances}
    assert entries["e0"].switchable and entries["d0"].switchable
    assert not entries["p0"].switchable
    for name in ("e0", "d0"):  # either may become the prefill whose KV a decode pulls
        assert entries[name].kv_endpoint and entries[name].prefetch_endpoint


def test_switchable_instances_need_a_kv_connector_that_sends_and_receives():
    with pytest.raises(schema.ConfigError, match="d0 may switch role.*kv_both.*'mooncake' "
                       "does not: use kv_connector 'epd'"):
        resolved("cpu", "P-D~", kv_connector="mooncake")
