"""What the transfer engine makes of the host's network (fabric.py), and a `Link`
configuring it: the environment set before the engine starts, the transport it reports,
RDMA refused rather than silently replaced by TCP, GPU memory refused without
GPUDirect. The tests that start a real engine need a loopback-only network namespace
(`scripts/in-netns.sh`, which `scripts/test.sh` uses)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from epd_serve.connectors.epd_kv import fabric
from epd_serve.connectors.epd_kv.fabric import Hca
from epd_serve.connectors.epd_kv.transfer import Link, TransferError

UP = Hca("mlx5_0", "uverbs0", active=True, accessible=True)
UP1 = Hca("mlx5_1", "uverbs1", active=True, accessible=True)
DOWN = Hca("mlx5_2", "uverbs2", active=False, accessible=True)
HIDDEN = Hca("mlx5_3", "uverbs3", active=True, accessible=False)  # no /dev node here
STORAGE = Hca("mlx5_4", "uverbs4", active=True, accessible=True)


# -- the environment ----------------------------------------------------------------
def test_tcp_forces_tcp_and_other_protocols_leave_the_choice_to_the_devices():
    assert fabric.engine_environment("tcp", None) == {"MC_FORCE_TCP": "1"}
    assert fabric.engine_environment("rdma", None) == {}
    assert fabric.engine_environment("rdma", 3) == {"MC_GID_INDEX": "3"}
    assert fabric.engine_environment("tcp", 0) == {"MC_FORCE_TCP": "1", "MC_GID_INDEX": "0"}


@pytest.mark.parametrize("gid", [-1, 256])
def test_a_gid_index_mooncake_would_ignore_is_refused(gid):
    with pytest.raises(ValueError, match="show_gids"):
        fabric.engine_environment("rdma", gid)


def test_device_names_are_trimmed_as_mooncake_does_not():
    assert fabric.device_list(" mlx5_0, mlx5_1 ,,") == ["mlx5_0", "mlx5_1"]
    assert fabric.device_list("") == []


# -- which HCAs and which transport ---------------------------------------------------
def test_every_usable_hca_is_taken_when_none_is_named():
    used, why = fabric.screen_hcas([UP, DOWN, HIDDEN, UP1], "", {})
    assert used == ["mlx5_0", "mlx5_1"]
    assert any("mlx5_2: no port is ACTIVE" in w for w in why)
    assert any("/dev/infiniband/uverbs3" in w for w in why)


def test_only_the_named_hcas_are_taken_and_a_missing_name_is_reported():
    used, why = fabric.screen_hcas([UP, UP1, STORAGE], "mlx5_0,mlx5_1,mlx5_9", {})
    assert used == ["mlx5_0", "mlx5_1"]  # the storage NIC stays out
    assert why == ["mlx5_9: no such RDMA device"]


def test_mc_te_filters_narrows_the_named_hcas_further():
    used, why = fabric.screen_hcas([UP, UP1], "", {"MC_TE_FILTERS": "mlx5_1"})
    assert used == ["mlx5_1"] and why == ["mlx5_0: not in MC_TE_FILTERS"]


@pytest.mark.parametrize("protocol, env, hcas, transport", [
    ("tcp", {"MC_FORCE_TCP": "1"}, ["mlx5_0"], "tcp"),  # HCAs present, TCP forced
    ("rdma", {"MC_FORCE_TCP": "0"}, ["mlx5_0"], "tcp"),  # Mooncake asks getenv, not its value
    ("rdma", {}, ["mlx5_0"], "rdma"),
    ("tcp", {}, ["mlx5_0"], "rdma"),  # the protocol alone does not choose
    ("rdma", {}, [], "tcp"),  # no HCA: TCP, silently
    ("rdma", {"MC_FORCE_HCA": "1"}, [], "rdma"),
    ("rdma", {"MC_INTRANODE_NVLINK": "1"}, ["mlx5_0"], "nvlink_intra"),
    ("ascend", {}, [], "ascend"),
    ("ascend", {"MC_FORCE_TCP": "1"}, [], "ascend"),  # NPU builds never read it
])
def test_the_installed_transport_follows_the_engines_own_rule(protocol, env, hcas, transport):
    assert fabric.installed_transport(protocol, env, hcas) == transport


def test_why_rdma_would_fall_back_to_tcp():
    assert "MC_FORCE_TCP is set" in fabric.why_not_rdma({"MC_FORCE_TCP": "1"}, [UP], "", [])
    assert "libibverbs lists no RDMA device" in fabric.why_not_rdma({}, [], "", [])
    _, why = fabric.screen_hcas([UP, DOWN], "mlx5_2,mlx5_7", {})
    text = fabric.why_not_rdma({}, [UP, DOWN], "mlx5_2,mlx5_7", why)
    assert "mlx5_7: no such RDMA device" in text and "mlx5_2: no port is ACTIVE" in text
    assert text.endswith("this host has mlx5_0, mlx5_2")


@pytest.mark.parametrize("states, active", [
    (["1: DOWN", "4: ACTIVE"], True),  # any port will do
    (["1: DOWN"], False),
    (["5: ACTIVE_DEFER"], False),  # Mooncake asks for IBV_PORT_ACTIVE exactly
    ([], False),
])
def test_an_active_port_is_read_from_sysfs(tmp_path, states, active):
    for port, state in enumerate(states, start=1):
        (tmp_path / "ports" / str(port)).mkdir(parents=True)
        (tmp_path / "ports" / str(port) / "state").write_text(state + "\n")
    assert fabric.has_active_port(str(tmp_path)) is active


# -- GPUDirect ----------------------------------------------------------------------
PROC_MODULES = """nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)
nvidia 56852480 400 nvidia_uvm,nvidia_peermem,nvidia_modeset, Live 0x0000000000000000 (POE)
ib_core 520192 9 rdma_ucm,ib_uverbs,mlx5_ib, Live 0x0000000000000000
"""
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build"
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Release Build"


def test_kernel_modules_and_version_are_read_from_their_texts():
    assert fabric.loaded_modules(PROC_MODULES) == {"nvidia_peermem", "nvidia", "ib_core"}
    assert fabric.kernel_version("5.15.0-91-generic") == (5, 15)
    assert fabric.kernel_version("6.8.0") == (6, 8)
    assert fabric.kernel_version("") == (0, 0)


@pytest.mark.parametrize("env, modules, driver, kernel, says", [
    # Mooncake's default (WITH_NVIDIA_PEERMEM unset, or unreadable): ibv_reg_mr.
    ({}, {"nvidia_peermem"}, PROPRIETARY, "5.4.0", None),
    ({}, {"nv_peer_mem"}, PROPRIETARY, "5.4.0", None),  # MLNX_OFED's peer-memory client
    ({}, {"nvidia"}, OPEN, "6.8.0", "modprobe nvidia_peermem"),  # DMA-BUF would do, unasked
    ({"WITH_NVIDIA_PEERMEM": "maybe"}, {"nvidia"}, OPEN, "6.8.0", "modprobe nvidia_peermem"),
    ({"WITH_NVIDIA_PEERMEM": "1"}, {"nvidia"}, OPEN, "6.8.0", "modprobe nvidia_peermem"),
    # WITH_NVIDIA_PEERMEM=0: DMA-BUF, which needs Linux 5.12 and the open modules.
    ({"WITH_NVIDIA_PEERMEM": "0"}, {"nvidia"}, OPEN, "5.15.0-91-generic", None),
    ({"WITH_NVIDIA_PEERMEM": "off"}, {"nvidia"}, PROPRIETARY, "6.8.0",
     "open GPU kernel modules"),
    ({"WITH_NVIDIA_PEERMEM": "false"}, {"nvidia_peermem"}, OPEN, "5.4.0", "Linux >= 5.12"),
])
def test_gpudirect_verdict(env, modules, driver, kernel, says):
    problem = fabric.gpudirect_problem(env, modules, driver, kernel)
    if says is None:
        assert problem is None
    else:
        assert says in problem and "protocol: tcp" in problem


# -- a Link configuring the engine --------------------------------------------------
class RecordingEngine:
    """Stands in for mooncake.engine.TransferEngine: records what it was started with
    and what was registered, starting nothing."""

    started: list = []

    def __init__(self):
        self.registered: list = []

    def initialize(self, host, metadata, protocol, device_name):
        RecordingEngine.started.append(
            {"args": (host, metadata, protocol, device_name),
             "env": {k: os.environ.get(k) for k in ("MC_FORCE_TCP", "MC_GID_INDEX")}})
        return 0

    def get_rpc_port(self):
        return 15000

    def batch_register_memory(self, addrs, sizes):
        self.registered.append((addrs, sizes))
        return 0


@pytest.fixture
def recording(monkeypatch):
    import mooncake.engine

    RecordingEngine.started = []
    monkeypatch.setattr(mooncake.engine, "TransferEngine", RecordingEngine)
    for name in ("MC_FORCE_TCP", "MC_GID_INDEX", "MC_TE_FILTERS", "WITH_NVIDIA_PEERMEM"):
        monkeypatch.delenv(name, raising=False)  # restored after the test either way
    return monkeypatch


def test_rdma_link_passes_the_named_nics_and_gid_before_the_engine_starts(recording):
    recording.setattr(fabric, "read_hcas", lambda: [UP, UP1, STORAGE])
    link = Link("10.0.0.1", "rdma", " mlx5_0, mlx5_1", gid_index=3)
    (start,) = RecordingEngine.started
    assert start["args"] == ("10.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0,mlx5_1")
    assert start["env"] == {"MC_FORCE_TCP": None, "MC_GID_INDEX": "3"}
    assert (link.transport, link.devices) == ("rdma", ["mlx5_0", "mlx5_1"])


def test_rdma_link_refuses_to_fall_back_to_tcp_and_starts_no_engine(recording):
    recording.setattr(fabric, "read_hcas", lambda: [DOWN])
    with pytest.raises(TransferError, match="fall back to TCP: mlx5_2: no port is ACTIVE"):
        Link("10.0.0.1", "rdma", "mlx5_2")
    assert RecordingEngine.started == []


def test_gpu_memory_over_rdma_is_refused_without_gpudirect(recording):
    recording.setattr(fabric, "read_hcas", lambda: [UP])
    link = Link("10.0.0.1", "rdma")
    recording.setattr(fabric, "read_gpudirect_facts", lambda: ({"nvidia"}, OPEN, "6.8.0"))
    with pytest.raises(TransferError, match="modprobe nvidia_peermem"):
        link.register([(4096, 1 << 20)], "cuda")
    assert link.engine.registered == []
    link.register([(4096, 1 << 20)])  # host memory needs no GPUDirect
    recording.setattr(fabric, "read_gpudirect_facts",
                      lambda: ({"nvidia", "nvidia_peermem"}, OPEN, "6.8.0"))
    link.register([(8192, 1 << 20)], "cuda")
    assert link.engine.registered == [([4096], [1 << 20]), ([8192], [1 << 20])]


def test_gpu_memory_over_tcp_needs_no_gpudirect(recording):
    recording.setattr(fabric, "read_hcas", lambda: [UP])
    recording.setattr(fabric, "read_gpudirect_facts", lambda: (set(), "", "5.4.0"))
    link = Link("127.0.0.1", "tcp")
    assert link.transport == "tcp" and link.devices == []
    link.register([(4096, 1 << 20)], "cuda")
    assert link.engine.registered == [([4096], [1 << 20])]


# -- a real engine ------------------------------------------------------------------
@pytest.fixture
def loopback_only():
    # Mooncake listens on every interface: same rule as tests/e2e/conftest.py.
    extra = [i for i in os.listdir("/sys/class/net") if i != "lo"]
    if extra and os.environ.get("EPD_ALLOW_HOST_NETWORK") != "1":
        pytest.fail(f"this network namespace has {extra}: run through scripts/test.sh "
                    "or scripts/in-netns.sh (loopback only)")


def test_a_tcp_link_starts_the_real_engine_with_tcp_forced(loopback_only, monkeypatch, capfd):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    link = Link("127.0.0.1", "tcp")
    assert os.environ["MC_FORCE_TCP"] == "1" and link.transport == "tcp"
    # The engine's own log: it saw the variable before choosing its transport.
    assert "MC_FORCE_TCP is set, using TCP transport only" in capfd.readouterr().err
    # And it moves bytes: from one half of a registered buffer to the other.
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    buffer[:4096] = np.arange(4096) % 251
    link.register([(buffer.ctypes.data, buffer.nbytes)])
    link.write(link.session_id, [buffer.ctypes.data], [buffer.ctypes.data + 32768], [4096])
    assert np.array_equal(buffer[32768:32768 + 4096], buffer[:4096])
