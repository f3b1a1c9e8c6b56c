"""The Ascend platform: our connectors by default on vllm-ascend 0.23 (layer-grouped KV
over Mooncake's Ascend transport, the MM Store for features), vllm-ascend's layer-wise
KV connector and vLLM's file EC connector on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_serve.backends import get_platform
from epd_serve.connectors.epd_kv import fabric
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.deployment import schema
from epd_serve.deployment.resolve import resolve
from epd_serve.runtime import bringup

REPO = Path(__file__).resolve().parents[3]
ATLAS_CONFIGS = sorted((REPO / "configs/atlas-800i-a2").glob("*.yaml"))


def resolved(notation: str, **extra):
    cfg = schema.Deployment(name="t", platform="ascend", deployment=notation,
                            model="/models/m", served_model_name="m", **extra)
    return resolve(cfg, Path("/proj"))


def commands(dep) -> dict[str, tuple[list[str], dict[str, str]]]:
    plat = dep.platform
    return {l.name: (plat.command(l), plat.environment(l)) for l in dep.launches}


def transfer_config(cmd: list[str], kind: str) -> dict | None:
    flag = f"--{kind}-transfer-config"
    return json.loads(cmd[cmd.index(flag) + 1]) if flag in cmd else None


def test_kv_goes_through_our_connector_over_mooncakes_ascend_transport():
    inst = commands(resolved("E-P-D"))
    p_cmd, p_env = inst["p0"]
    assert p_env["ASCEND_RT_VISIBLE_DEVICES"] == "1" and "CUDA_VISIBLE_DEVICES" not in p_env
    assert "--attention-backend" not in p_cmd  # vllm-ascend picks its NPU attention
    assert transfer_config(p_cmd, "kv") == {
        "kv_connector": "EPDKVConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "epd_serve.connectors.epd_kv", "kv_port": 8900,
        "kv_connector_extra_config": {"protocol": "ascend", "host": "127.0.0.1",
                                      "role": "kv_producer"}}
    d_kv = transfer_config(inst["d0"][0], "kv")
    assert d_kv["kv_role"] == "kv_consumer" and d_kv["kv_port"] == 8901
    assert d_kv["kv_connector_extra_config"]["protocol"] == "ascend"
    assert d_kv["kv_load_failure_policy"] == "recompute"
    # The settings our connector builds itself from in the engine accept it, and the
    # transport it reports is the one the NPU wheel installs.
    settings = Settings.from_extra_config(d_kv["kv_connector_extra_config"])
    assert fabric.installed_transport(settings.protocol, {}, []) == "ascend"


def test_features_go_through_the_mm_store_on_this_node_by_default():
    dep = resolved("E-P-D")
    assert dep.mm_store is not None and dep.mm_store.backend == "shm"
    inst = commands(dep)
    e_ec = transfer_config(inst["e0"][0], "ec")
    assert e_ec["ec_connector"] == "EPDECConnector" and e_ec["ec_role"] == "ec_producer"
    assert e_ec["ec_connector_module_path"] == "epd_serve.connectors.epd_ec"
    for name in ("p0", "d0"):  # decode loads features only if it must compute the prompt
        ec = transfer_config(inst[name][0], "ec")
        assert ec["ec_connector"] == "EPDECConnector" and ec["ec_role"] == "ec_consumer"
        assert ec["ec_connector_extra_config"]["store"]["backend"] == "shm"


def test_engine_flags_on_vllm_0_23():
    inst = commands(resolved("(E-P)-D"))
    e_cmd = inst["e0"][0]
    # vllm-ascend runs its dummy (warm-up) passes through the whole model whatever
    # --mm-encoder-only says: eager mode keeps it from capturing graphs for them.
    for flag in ("--mm-encoder-only", "--enforce-eager", "--no-enable-prefix-caching"):
        assert flag in e_cmd
    assert e_cmd[e_cmd.index("--gpu-memory-utilization") + 1] == "0.18"
    # Prefill and decode are sent the pixels with the image's uuid (vLLM 0.23 takes no
    # metadata-only image_embeds), so they need no --enable-mm-embeds; and nothing
    # encoder-only leaks into them.
    for name in ("p0", "d0"):
        cmd = inst[name][0]
        assert "--enable-mm-embeds" not in cmd and "--mm-encoder-only" not in cmd
        assert "--enforce-eager" not in cmd


def test_the_engine_cores_store_client_is_kept_out_of_the_kv_budget():
    """Two nodes share features through the Mooncake Store over the Ascend transport:
    prefill's and decode's engine cores start a transfer engine on their NPU after vLLM
    sized the KV cache, so their budget leaves room for it; the encoder's (a worker's,
    counted by vLLM) and a one-node store's (shm) leave none."""
    def fractions(mm_store):
        dep = resolved("E-P-D", mm_store=mm_store)
        return {name: float(cmd[cmd.index("--gpu-memory-utilization") + 1])
                for name, (cmd, _) in commands(dep).items()}

    on_one_node = fractions({"backend": "shm"})
    across_nodes = fractions({"backend": "mooncake", "protocol": "ascend"})
    assert on_one_node == {"e0": 0.9, "p0": 0.9, "d0": 0.9}
    assert across_nodes == {"e0": 0.9, "p0": 0.87, "d0": 0.87}


def test_vllm_ascends_layerwise_connector_stays_selectable():
    inst = commands(resolved("(E-P)-D", kv_connector="ascend-layerwise"))
    p_kv = transfer_config(inst["p0"][0], "kv")
    assert p_kv == {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_producer",
                    "kv_buffer_device": "npu", "kv_port": "8900"}
    assert transfer_config(inst["d0"][0], "kv")["kv_port"] == "8901"


def test_vllms_file_ec_connector_stays_selectable():
    dep = resolved("E-P-D", mm_store={"backend": "file"})
    inst = commands(dep)
    assert transfer_config(inst["e0"][0], "ec") == {
        "ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": "/proj/.epd/t/ec_cache"}}
    assert transfer_config(inst["d0"][0], "ec") is None  # decode gets KV, not features
    assert dep.mm_store is None


def test_kv_connectors_of_other_platforms_are_refused_with_the_choices():
    with pytest.raises(schema.ConfigError, match="'mooncake' does not run on ascend; "
                                                 "choose one of epd, ascend-layerwise"):
        resolved("P-D", kv_connector="mooncake")
    assert get_platform("ascend").own_connectors_unavailable is None


@pytest.mark.parametrize("path", ATLAS_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_atlas_file_uses_our_connectors(path):
    dep = bringup.load(path)
    plat = dep.platform
    kv_instances = [l for l in dep.launches if l.kv_role is not None]
    ec_instances = [l for l in dep.launches if l.ec_role is not None]
    assert kv_instances or ec_instances  # (E-PD)x8 hands off features only
    for launch in kv_instances:
        kv = plat.kv_transfer_config(launch)
        assert kv["kv_connector"] == "EPDKVConnector"
        assert kv["kv_connector_extra_config"]["protocol"] == "ascend"
    for launch in ec_instances:
        assert plat.ec_transfer_config(launch)["ec_connector"] == "EPDECConnector"


def test_the_two_node_file_shares_features_through_mooncake_store_on_the_ascend_transport():
    dep = bringup.load(REPO / "configs/atlas-800i-a2/two-node.yaml")
    store = dep.mm_store
    assert (store.backend, store.protocol, store.host) == ("mooncake", "ascend", "10.0.0.1")
    # Decode on node1 reads the same store as the encoders and prefill on node0.
    decode = [l for l in dep.launches if l.name.startswith("d")]
    assert decode and {l.node for l in decode} == {"node1"}
    assert all(l.mm_store == store for l in decode)


def test_switchable_instances_with_the_mooncake_store_on_ascends_transport_are_refused():
    """Their workers would publish features beside their KV link: two transfer engines
    in one process, which Ascend's transport refuses; the shm store is fine."""
    path = REPO / "configs/atlas-800i-a2/two-node.yaml"
    assert bringup.load(path).plan.to_notation() == "2E-6P-8D"
    with pytest.raises(schema.ConfigError, match=r"may switch role \(~\).*allows one per process"):
        bringup.load(path, deployment="2E-6P-8D~")
    assert any(l.kv_role == "kv_both" for l in resolved("E-P-D~").launches)
