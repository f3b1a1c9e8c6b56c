"""Multi-node deployments: where the shipped files put each instance, placements that
are refused before anything starts, what the operator's script starts per node, and
the Ray launcher's pure parts (node matching, resources, local nodes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epd_serve.backends import get_platform
from epd_serve.cli.main import main as cli_main
from epd_serve.deployment import schema
from epd_serve.runtime import bringup
from epd_serve.runtime.ray_launcher import local_node_args, node_problems, resource_options
from epd_serve.runtime.shell import emit_shell
from epd_serve.topology.notation import parse
from epd_serve.topology.placement import ClusterSpec, place

REPO = Path(__file__).resolve().parents[3]


def where(dep) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    return {l.name: (l.node, l.host, l.devices) for l in dep.launches}


@pytest.mark.parametrize("path", ["configs/h800/two-node.yaml",
                                  "configs/atlas-800i-a2/two-node.yaml"])
def test_shipped_two_node_files_put_encode_and_prefill_on_node0_and_decode_on_node1(path):
    dep = bringup.load(REPO / path)
    expected = {"e0": ("node0", "10.0.0.1", (0,)), "e1": ("node0", "10.0.0.1", (1,))}
    expected |= {f"p{i}": ("node0", "10.0.0.1", (2 + i,)) for i in range(6)}
    expected |= {f"d{i}": ("node1", "10.0.0.2", (i,)) for i in range(8)}
    assert where(dep) == expected
    assert dep.proxy_url == "http://10.0.0.1:8000"
    # Every URL and KV address of an instance is its node's, never loopback.
    for launch in dep.launches:
        assert launch.url.startswith(f"http://{launch.host}:")
        assert get_platform(dep.config.platform).environment(launch)["VLLM_HOST_IP"] == launch.host


def test_h800_two_node_shares_features_through_mooncake_on_the_head_over_rdma():
    dep = bringup.load(REPO / "configs/h800/two-node.yaml")
    store = dep.mm_store
    assert (store.backend, store.host, store.protocol) == ("mooncake", "10.0.0.1", "rdma")
    decode = next(l for l in dep.launches if l.name == "d0")
    assert decode.mm_store == store  # decode on node1 reads features across nodes
    line = get_platform("cuda").shell_line(decode)
    assert '"host":"10.0.0.2"' in line and '"protocol":"rdma"' in line


def test_shipped_cpu_cluster_file_puts_e_p_d_on_three_nodes():
    dep = bringup.load(REPO / "configs/cpu/ray-e-p-d.yaml")
    assert {name: node for name, (node, _, _) in where(dep).items()} == {
        "e0": "n1", "p0": "n0", "d0": "n2"}
    assert dep.config.cluster.head_node.name == "n0"


def cluster(*nodes: dict, **extra) -> ClusterSpec:
    return ClusterSpec.model_validate({"nodes": list(nodes), **extra})


def node(name: str, devices: int, stages: list[str] | None = None, address: str = "10.0.0.9"):
    return {"name": name, "address": address, "devices": list(range(devices)), "stages": stages}


def test_colocated_groups_stay_on_one_device_and_replicas_spread_over_nodes():
    slots = place(parse("(E-P)x2-2D"), cluster(node("a", 2), node("b", 2)))
    assert slots["e0"] == slots["p0"] and slots["e1"] == slots["p1"]
    assert slots["e0"].node != slots["e1"].node  # the two (E-P) groups on two nodes
    assert {slots["d0"].node, slots["d1"].node} == {"a", "b"}
    assert len({(s.node, s.devices) for s in slots.values()}) == 4


def test_tensor_parallel_instance_takes_devices_of_one_node():
    slots = place(parse("TP2"), cluster(node("a", 1), node("b", 3)))
    assert (slots["epd0"].node, slots["epd0"].devices) == ("b", (0, 1))


@pytest.mark.parametrize("notation, nodes, message", [
    ("E-P-D", [node("a", 1), node("b", 1)],
     r"cannot place d0 \[D\] \(1 device\(s\) on one node\): a has 0 of 1 devices free; "
     r"b has 0 of 1 devices free"),
    ("E-P-D", [node("a", 2, ["P", "D"]), node("b", 2, ["D"])],
     r"cannot place e0 \[E\].*a takes stages PD only; b takes stages D only"),
    ("TP2", [node("a", 1), node("b", 1)], r"epd0 \[EPD\] \(2 device\(s\) on one node\)"),
    ("(E-P)-D", [node("a", 2, ["E"]), node("b", 2, ["P", "D"])],
     r"co-located e0 \[E\], p0 \[P\].*a takes stages E only; b takes stages PD only"),
])
def test_a_placement_that_cannot_fit_is_refused_naming_what_is_missing(notation, nodes, message):
    with pytest.raises(ValueError, match=message):
        place(parse(notation), cluster(*nodes))


def cpu_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "configs" / "cpu" / "dep.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("name: t\nplatform: cpu\nmodel: m\n" + text)
    return path


TWO_NODES = """cluster:
  address: local
  nodes:
    - {name: a, address: 127.0.0.1, devices: [0, 1], stages: [E, P]}
    - {name: b, address: 127.0.0.1, devices: [0], stages: [D]}
"""


def test_a_node_local_store_is_refused_when_its_users_span_nodes(tmp_path):
    text = "deployment: E-P-D\nmm_store: {backend: shm}\n" + TWO_NODES
    with pytest.raises(schema.ConfigError, match=r"'shm' is shared memory on the head node a, "
                       r"but d0 on b also use it: set mm_store: \{backend: mooncake\}"):
        bringup.load(cpu_file(tmp_path, text))
    ok = bringup.load(cpu_file(tmp_path, text.replace("shm", "mooncake")))
    assert ok.mm_store.host == "127.0.0.1" and where(ok)["d0"][0] == "b"


@pytest.mark.parametrize("text, message", [
    ("deployment: P-D\ndevices: [0, 1]\n" + TWO_NODES, "'devices' is for one host"),
    ("deployment: P-D\nhost: 10.0.0.1\n" + TWO_NODES, "'host' is for one host"),
    ("deployment: P-D\n" + TWO_NODES.replace("127.0.0.1, devices: [0, 1]", "10.1.1.1, devices: [0, 1]"),
     r"'local' starts every node on this machine: nodes \['a'\] need a loopback address"),
    ("deployment: P-D\n" + TWO_NODES.replace("address: local", "head: c"),
     r"cluster.head 'c' is not one of the nodes \['a', 'b'\]"),
    ("deployment: P-D\n" + TWO_NODES.replace("name: b", "name: a"), "node names must be unique"),
    ("deployment: P-D\n" + TWO_NODES.replace("address: 127.0.0.1, devices: [0]", "address: nodeb, devices: [0]"),
     "address must be an IP address, got 'nodeb'"),
    ("deployment: 2P-D\n" + TWO_NODES.replace("[E, P]", "[E]"), r"cannot place p0 \[P\]"),
])
def test_bad_cluster_sections_are_config_errors(tmp_path, text, message):
    with pytest.raises(schema.ConfigError, match=message):
        bringup.load(cpu_file(tmp_path, text))


def test_emitted_cluster_script_starts_ray_per_node_then_up_on_the_head(tmp_path):
    dep = bringup.load(REPO / "configs/h800/two-node.yaml")
    script = emit_shell(dep, "/etc/epd/two-node.yaml")
    path = tmp_path / "cluster.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert ('CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 "$BIN/ray" start --node-ip-address=10.0.0.1 '
            "--labels=epd-node=node0 --head --port=6379 --num-gpus=8 ;;") in script
    assert ('"$BIN/ray" start --node-ip-address=10.0.0.2 --labels=epd-node=node1 '
            "--address=10.0.0.1:6379 --num-gpus=8 ;;") in script
    assert "CONFIG=/etc/epd/two-node.yaml" in script
    assert 'exec "$BIN/epd-serve" up "$CONFIG"' in script
    assert "# d7 [D], device(s) 7, http://10.0.0.2:8115" in script
    # An unknown node name is a usage error, not a silent no-op.
    result = subprocess.run(["bash", str(path), "node9"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_ascend_nodes_offer_npus_as_a_custom_ray_resource():
    dep = bringup.load(REPO / "configs/atlas-800i-a2/two-node.yaml")
    script = emit_shell(dep)
    assert ("ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \"$BIN/ray\" start "
            "--node-ip-address=10.0.0.2 --labels=epd-node=node1 --address=10.0.0.1:6379 "
            "'--resources={\"NPU\": 8}' ;;") in script


def test_topology_of_a_file_shows_each_instance_node(capsys):
    assert cli_main(["topology", str(REPO / "configs/cpu/ray-e-p-d.yaml")]) == 0
    out = capsys.readouterr().out
    assert "E-P-D across 3 node(s); proxy http://127.0.0.1:8000" in out
    assert "e0     [E]  node n1 (127.0.0.1), device(s) 0" in out


def ray_node(label: str | None, address: str = "10.0.0.1", alive: bool = True, **resources):
    return {"Alive": alive, "NodeManagerAddress": address,
            "Labels": {"epd-node": label} if label else {}, "Resources": resources}


def test_ray_nodes_are_matched_by_label_address_and_devices():
    spec = ClusterSpec.model_validate({"nodes": [
        {"name": "node0", "address": "10.0.0.1", "devices": [0, 1]},
        {"name": "node1", "address": "10.0.0.2", "devices": [0, 1]}]})
    good = [ray_node("node0", GPU=2), ray_node("node1", "10.0.0.2", GPU=4)]
    assert node_problems(spec, good, "GPU") == []
    problems = node_problems(spec, [ray_node("node0", GPU=1),
                                    ray_node("node1", "10.0.0.3", GPU=2),
                                    ray_node("node1", "10.0.0.2", alive=False, GPU=2)], "GPU")
    assert problems == ["node0 offers 1 GPU to Ray, the file lists 2 device(s)",
                        "node1 is at 10.0.0.3 in Ray but at 10.0.0.2 in the file"]
    assert node_problems(spec, [ray_node("node0", GPU=2)], "GPU") == [
        "no live Ray node is labelled epd-node=node1 (start it with `ray start ... "
        "--labels epd-node=node1`)"]


def test_device_shares_become_the_ray_options_of_each_platform():
    assert resource_options("CPU", 1 / 3) == {"num_cpus": 0.3333}
    assert resource_options("GPU", 0.5) == {"num_cpus": 0, "num_gpus": 0.5}
    assert resource_options("NPU", 2) == {"num_cpus": 0, "resources": {"NPU": 2}}
    spec = cluster(node("a", 3, address="127.0.0.1"))
    assert local_node_args(spec.nodes[0], "NPU")["resources"] == {"NPU": 3}
    cpu = local_node_args(spec.nodes[0], "CPU")
    assert (cpu["num_cpus"], cpu["labels"], cpu["node_ip_address"]) == (3, {"epd-node": "a"}, "127.0.0.1")


NO_RAY = """
import sys
sys.modules["ray"] = None  # as on a machine without the cluster extra
from epd_serve.runtime import bringup
from epd_serve.runtime.launcher import Launcher
from epd_serve.runtime.supervision import LaunchError
assert type(bringup.launcher_for(bringup.load(sys.argv[1]))) is Launcher
try:
    bringup.launcher_for(bringup.load(sys.argv[2]))
except LaunchError as err:
    print(err)
"""


def test_one_host_needs_no_ray_and_a_cluster_file_says_how_to_get_it():
    result = subprocess.run([sys.executable, "-c", NO_RAY, str(REPO / "configs/cpu/e-p-d.yaml"),
                             str(REPO / "configs/cpu/ray-e-p-d.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cpu-ray-e-p-d spans a cluster, which runs on Ray" in result.stdout
    assert "pip install 'epd-serve[cluster]'" in result.stdout


def test_a_ray_cluster_unlike_the_file_fails_start_up_with_why_and_leaves_nothing(
        tmp_path, monkeypatch):
    import ray

    from epd_serve.runtime import ray_launcher
    from epd_serve.runtime.supervision import LaunchError

    why = "b is at 127.0.0.2 in Ray but at 127.0.0.1 in the file"
    monkeypatch.setattr(ray_launcher, "node_problems", lambda *args: [why])
    dep = bringup.load(cpu_file(tmp_path, "deployment: P-D\nmm_store: {backend: mooncake}\n"
                               + TWO_NODES))
    # The check fails after Ray is joined and before any actor exists: stopping what
    # was started must not hide the reason.
    with pytest.raises(LaunchError, match=f"the Ray cluster does not have the nodes t places "
                       f"instances on: {why}"):
        bringup.bring_up(dep)
    assert not ray.is_initialized()


def test_the_driver_reports_a_lost_node_its_return_and_an_actor_error_once(tmp_path, monkeypatch):
    from epd_serve.runtime.ray_launcher import RayChild, RayLauncher

    dep = bringup.load(cpu_file(tmp_path, "deployment: P-D\nmm_store: {backend: mooncake}\n"
                               + TWO_NODES))
    launcher = RayLauncher(dep, on_event=lambda event: None)
    launcher.children = [RayChild(name="p0", node="a", health_url="", log_path=tmp_path / "p0")]
    ok = {"events": [], "restarts": 0, "gave_up": False, "exit_code": None, "error": None,
          "node_id": "n"}
    refused = {**ok, "gave_up": True, "error": "port 1 (instance p0) on 127.0.0.1 is in use"}
    answers = [TimeoutError(), TimeoutError(), ok, refused, refused]  # one per refresh
    monkeypatch.setattr(launcher, "_ask", lambda children, call: {"p0": answers.pop(0)})
    assert [launcher.supervise_once() for _ in range(5)] == [
        ["p0: its actor on node a does not answer (node lost?); Ray restarts it when the "
         "node is back"],
        [],
        ["p0: back on node a"],
        ["p0: port 1 (instance p0) on 127.0.0.1 is in use"],
        [],
    ]
    assert launcher.children[0].exit_code() == -1
