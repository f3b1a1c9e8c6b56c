"""The preflight's deployment checks (epd_serve/runtime/preflight_deployment.py): each
on made-up facts, then read from a start-up plan, then what the launcher refuses to
start through them."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from epd_serve.backends import get_platform
from epd_serve.deployment import schema
from epd_serve.deployment.resolve import resolve
from epd_serve.runtime.child import port_in_use
from epd_serve.runtime.plan import startup_plan
from epd_serve.runtime import preflight_deployment as deployment
from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING
from epd_serve.runtime.supervision import LaunchError
from tests.ports import free_port_block

GIB = 1 << 30


@pytest.mark.parametrize("present, tiny, level", [
    (True, None, OK), (False, "qwen2_vl", OK), (False, None, ERROR)])
def test_model(present, tiny, level):
    row = deployment.check_model("/m/x", present, tiny)
    assert row.level == level
    if not present and tiny:
        assert "builds the tiny qwen2_vl model" in row.found
    if level == ERROR:
        assert "tiny_model: qwen2_vl" in row.fix and "/m/x" in row.fix


def test_ports_held_by_a_bound_socket_are_reported():
    base = free_port_block(3)
    ports = [("127.0.0.1", base, "proxy"), ("127.0.0.1", base + 1, "instance e0"),
             ("127.0.0.1", base + 2, "KV port of p0"), ("10.255.0.9", 9000, "instance d0")]
    local = lambda host: host.startswith("127.")  # noqa: E731
    free = deployment.check_ports(ports, local, port_in_use, "x.yaml")
    assert free.level == OK
    assert f"all 3 free on 127.0.0.1: {base}-{base + 2}" in free.found
    assert "1 on other nodes not checked" in free.found
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        row = deployment.check_ports(ports, local, port_in_use, "x.yaml")
    assert row.level == ERROR
    assert row.found == f"in use: {base + 1} (instance e0) on 127.0.0.1"
    assert "epd-serve down x.yaml" in row.fix
    assert deployment.check_ports(ports, local, port_in_use, "x.yaml").level == OK


ARENA = deployment.store_arena_bytes(512 << 20)
QUEUE = deployment.VLLM_SHM_QUEUE_BYTES


@pytest.mark.parametrize("backend, store, instances, free, level", [
    ("shm", ARENA, 3, 24 * GIB, OK),
    ("shm", ARENA, 3, ARENA + QUEUE - 1, ERROR),
    ("shm", ARENA, 3, ARENA + QUEUE + (1 << 20), WARNING),
    (None, 0, 3, 64 << 20, ERROR),  # Docker's default 64 MiB: vLLM refuses to start
    (None, 0, 3, 1 * GIB, OK),
    ("mooncake", 0, 2, 1 * GIB, OK),
])
def test_dev_shm(backend, store, instances, free, level):
    row = deployment.check_dev_shm(backend, store, instances, free, 24 * GIB, "x.yaml")
    assert (row.level, row.check) == (level, "/dev/shm")
    assert bool(row.fix) == (level != OK)
    if level == ERROR:
        assert "mount -o remount,size=" in row.fix
        if free < GIB:  # 24 GiB mounted, under 1 GiB free: the used space stays
            assert "size=25G" in row.fix
        assert ("mm_store.capacity in x.yaml" in row.fix) == bool(store)
    if backend == "mooncake":
        assert "counted under memory" in row.found


def test_store_arena_is_its_capacity_plus_the_slot_directory():
    assert 512 << 20 < ARENA <= (512 << 20) + (1 << 20)


@pytest.mark.parametrize("available, level", [(30.0, OK), (17.0, WARNING), (15.0, ERROR)])
def test_memory(available, level):
    needs = [("e0", 5.0), ("p0", 5.0), ("d0", 5.0), ("MM Store (shm)", 0.5)]
    row = deployment.check_memory(needs, available, "cpu", "x.yaml")
    assert row.level == level
    assert f"needs about 15.5 GiB (e0 5.0, p0 5.0, d0 5.0, MM Store (shm) 0.5); " \
           f"{available:.1f} GiB available" in row.found
    if level != OK:
        assert "VLLM_CPU_KVCACHE_SPACE" in row.fix and "epd-serve down x.yaml" in row.fix
    assert "VLLM_CPU_KVCACHE_SPACE" not in deployment.check_memory(needs, 1.0, "cuda", "x.yaml").fix


def test_memory_and_ports_of_a_deployment_on_other_nodes():
    row = deployment.check_memory([], 20.0, "cuda", "x.yaml", skipped=16)
    assert row.level == OK and row.found.startswith("nothing runs on this machine")
    assert "16 instance(s) on other nodes not counted" in row.found
    ports = deployment.check_ports([("10.0.0.2", 8100, "instance e0")], lambda h: False,
                               port_in_use, "x.yaml")
    assert ports.level == OK and ports.found.startswith("none of them binds on this machine")


def _resolved(platform: str, notation: str, **extra):
    cfg = schema.Deployment(name="t", platform=platform, deployment=notation,
                            model="/models/m", served_model_name="m", **extra)
    return resolve(cfg, Path("/proj"))


def test_host_memory_of_a_cpu_instance_follows_its_kv_cache():
    cpu = get_platform("cpu")
    default = {l.name: cpu.host_memory_gib(l) for l in _resolved("cpu", "(E-P)-D").launches}
    # 2.27 GB of front processes + 1.33 GB of worker, plus the KV cache the HAL gives:
    # 2 GiB for a device of its own, the floor of 2 * 0.8 for p0 beside the encoder.
    assert default["d0"] == pytest.approx(3.35 + 2, abs=0.01)
    assert default["p0"] == pytest.approx(3.35 + 1, abs=0.01)
    smaller = _resolved("cpu", "E-P-D", env={"VLLM_CPU_KVCACHE_SPACE": "1"}).launches
    assert cpu.host_memory_gib(smaller[1]) == pytest.approx(3.35 + 1, abs=0.01)
    # An encoder-only instance allocates no KV cache (measured: benchmarks/encoder_kind.py).
    assert cpu.host_memory_gib(smaller[0]) == default["e0"] == pytest.approx(3.35, abs=0.01)


def test_host_memory_of_a_device_instance_grows_with_its_ranks():
    cuda = get_platform("cuda")
    (tp1,) = _resolved("cuda", "TP1").launches
    (tp2,) = _resolved("cuda", "TP2").launches
    assert cuda.host_memory_gib(tp2) - cuda.host_memory_gib(tp1) == pytest.approx(4.0)



# -- read from the start-up plan -----------------------------------------------------
def _deployment(tmp_path: Path, notation: str = "E-P-D", model: bool = True, **extra):
    """A one-host CPU deployment on free ports with an MM Store; its model directory
    holds what is_model_dir looks for where `model`."""
    base = free_port_block(40)
    model_dir = tmp_path / "model"
    if model:
        model_dir.mkdir()
        (model_dir / "config.json").write_text("{}")
        (model_dir / "model.safetensors").write_bytes(b"")
    cfg = schema.Deployment(name="pre", deployment=notation, model=str(model_dir),
                            served_model_name="m", proxy_port=base, base_port=base + 10,
                            kv_base_port=base + 30, work_dir=str(tmp_path / "work"),
                            mm_store={"capacity": "16MiB", "port": base + 20,
                                      "metrics_port": base + 21,
                                      "prefetch_base_port": base + 24}, **extra)
    return resolve(cfg, tmp_path)


class ReadyPlatform(type(get_platform("cpu"))):
    """The CPU platform, its packages taken as installed (the engine environment check
    is not what these tests look at)."""

    def check_available(self) -> None:
        pass


def _ready(dep):
    return dataclasses.replace(dep, platform=ReadyPlatform())


def test_the_ports_checked_are_every_port_the_plan_binds(tmp_path):
    dep = _deployment(tmp_path)
    steps = startup_plan(dep)
    ports = deployment.plan_ports(steps)
    assert {(port, user) for _, port, user in ports} == set(dep.ports().items())
    by_step = {step.name: step.address for step in steps}
    assert all(host == by_step["proxy"] for host, port, _ in ports
               if port == dep.config.proxy_port)


def test_the_launcher_refuses_a_taken_port_of_the_plan_naming_it_and_its_process(tmp_path):
    dep = _ready(_deployment(tmp_path))
    steps = startup_plan(dep)
    d0 = next(step for step in steps if step.name == "d0")
    kv = next(port for port, user in d0.ports.items() if user == "KV port of d0")
    deployment.refuse_to_start(dep, steps)  # all free: nothing to refuse
    with socket.socket() as held:
        held.bind((d0.address, kv))
        held.listen()
        with pytest.raises(schema.ConfigError) as refused:
            deployment.refuse_to_start(dep, steps)
        row = deployment.check_ports(deployment.plan_ports(steps), lambda host: True,
                                     port_in_use, "CONFIG")
    message = str(refused.value)
    assert message.startswith(f"cannot start pre: ports in use: {kv} (KV port of d0) on "
                              f"{d0.address}; ")
    # The doctor's row, word for word: one check, two callers.
    assert message == deployment.refusal(dep, row)
    assert "epd-serve down CONFIG" in message and "\n" not in message


def test_the_launcher_checks_the_ports_of_the_plan_it_is_given(tmp_path):
    """Not the deployment's own list: a port only the plan names is checked too."""
    dep = _ready(_deployment(tmp_path))
    steps = startup_plan(dep)
    extra = dep.config.proxy_port + 39  # the last of the free block, used by nothing
    steps[-1] = dataclasses.replace(steps[-1], ports={**steps[-1].ports,
                                                      extra: "the proxy's second port"})
    assert extra not in dep.ports()
    with socket.socket() as held:
        held.bind((steps[-1].address, extra))
        held.listen()
        with pytest.raises(schema.ConfigError, match=rf"{extra} \(the proxy's second port\)"):
            deployment.refuse_to_start(dep, steps)


def test_a_model_the_plan_loads_but_that_is_not_there_is_refused(tmp_path):
    dep = _ready(_deployment(tmp_path, model=False))
    with pytest.raises(schema.ConfigError) as refused:
        deployment.refuse_to_start(dep, startup_plan(dep))
    message = str(refused.value)
    model = str(tmp_path / "model")
    assert message.startswith(f"cannot start pre: model {model} not found")
    assert f"epd-serve model tiny --family qwen2_vl {model}" in message


def test_a_tiny_model_not_built_yet_is_fine_for_the_doctor_not_for_the_launcher(tmp_path):
    """`up` builds it before the launcher checks (bringup.ensure_model); a launcher
    started without that must not start engines on an empty folder."""
    dep = _ready(_deployment(tmp_path, model=False, tiny_model="qwen2_vl"))
    steps = startup_plan(dep)
    (doctor_row,) = deployment.model_rows(steps, lambda host: True, dep.config.tiny_model)
    assert doctor_row.level == OK and "not built yet" in doctor_row.found
    with pytest.raises(schema.ConfigError, match="model .* not found"):
        deployment.refuse_to_start(dep, steps)


def test_the_engine_environment_is_checked_last_and_refused_by_name(tmp_path):
    class Missing(ReadyPlatform):
        def check_available(self) -> None:
            raise RuntimeError("vLLM is not installed")

    dep = dataclasses.replace(_deployment(tmp_path), platform=Missing())
    with pytest.raises(LaunchError, match=r"cannot start pre: engine environment \S+ is not "
                                          r"ready for cpu: vLLM is not installed; install"):
        deployment.refuse_to_start(dep, startup_plan(dep))
    # A model or port problem is said first: it is the one the user fixes first.
    gone = dataclasses.replace(_deployment(tmp_path / "b", model=False), platform=Missing())
    with pytest.raises(schema.ConfigError):
        deployment.refuse_to_start(gone, startup_plan(gone))


def test_the_doctor_leaves_processes_on_other_nodes_to_the_doctor_there(tmp_path):
    dep = _deployment(tmp_path)
    rows = {r.check: r for r in deployment.deployment_rows(dep, startup_plan(dep), "x.yaml",
                                                          local_hosts=lambda host: False)}
    assert rows["model"].level == OK and "no instance loads one on this machine" \
        in rows["model"].found
    assert rows["ports"].found.startswith("none of them binds on this machine")
    assert rows["memory"].found.startswith("nothing runs on this machine")
    assert "3 instance(s) on other nodes not counted" in rows["memory"].found
    assert "needs nothing" in rows["/dev/shm"].found


def test_memory_counts_the_processes_the_plan_starts_here(tmp_path):
    dep = _deployment(tmp_path)
    steps = startup_plan(dep)
    row = deployment.memory_row(dep, steps, "x.yaml", lambda host: True)
    for name in ("e0", "p0", "d0", "MM Store (shm)", "proxy and store server"):
        assert f"{name} " in row.found
