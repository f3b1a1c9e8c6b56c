"""The preflight's RDMA checks (in epd_serve/runtime/preflight_machine.py) on fake sysfs
trees: NICs and GIDs, GPUDirect, and what a deployment's KV settings make of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_serve.runtime.plan import startup_plan
from epd_serve.runtime import preflight_machine as rdma
from epd_serve.runtime.preflight_rows import ERROR, OK, WARNING

REPO = Path(__file__).resolve().parents[3]


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
    row = rdma.check_rdma_devices(nics, {})
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
    row = rdma.check_rdma_devices(nics, {"NCCL_IB_GID_INDEX": "3"})
    assert "{device_name: mlx5_0,mlx5_1, gid_index: 3}" in row.found
    assert "mlx5_0 would take GID 6 instead of its RoCE v2 IPv4 GID 3" in row.found
    # A GID index already in the environment is what the engine takes.
    assert "NCCL_IB_GID_INDEX=3 in this environment: the engine takes GID 3" in row.found


def test_no_rdma_devices_is_a_warning_with_the_way_out():
    row = rdma.check_rdma_devices([], {})
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
    row = rdma.check_gpudirect(env, modules, driver, kernel, needed)
    assert row.level == level and says in row.found
    assert bool(row.fix) == (level != OK)


def test_rdma_settings_that_drop_every_nic_are_an_error_with_the_lines_to_use(tmp_path):
    nics = _nics(tmp_path, _ib(), _ib())
    row = rdma.check_rdma_settings(nics, {}, "rdma", "mlx5_0,mlx5_1", 3)
    assert row.level == ERROR and "Mooncake would drop every NIC: mlx5_0: GID 3 is empty" \
        in row.found
    assert row.fix == "set in kv_connector_config: {device_name: mlx5_0,mlx5_1} and no gid_index"
    ok = rdma.check_rdma_settings(nics, {}, "rdma", "", None)
    assert ok.level == OK and "mlx5_0 GID 0 fe80::2:c903:1:1 (no-network-routable)" in ok.found


def test_rdma_settings_warn_on_a_dropped_nic_or_a_gid_peers_do_not_reach(tmp_path):
    v6 = {6: ("2001:db8::15", "RoCE v2", "ens1")}
    nics = _nics(tmp_path, _roce("10.0.1.5", "ens1", v6), _roce("10.0.2.5", "ens2"))
    auto = rdma.check_rdma_settings(nics, {}, "rdma", "", None)
    assert auto.level == WARNING and "mlx5_0 GID 6 is not the RoCE v2 IPv4 GID 3" in auto.found
    assert auto.fix == "set in kv_connector_config: {device_name: mlx5_0,mlx5_1, gid_index: 3}"
    assert rdma.check_rdma_settings(nics, {}, "rdma", "", 3).level == OK
    missing = rdma.check_rdma_settings(nics, {}, "rdma", "mlx5_1,mlx5_7", 3)
    assert missing.level == WARNING and "mlx5_7: no such RDMA device" in missing.found


def test_rdma_settings_without_nics_or_over_tcp(tmp_path):
    row = rdma.check_rdma_settings([], {}, "rdma", "", None)
    assert row.level == ERROR and "fall back to TCP: libibverbs lists no RDMA device" in row.found
    forced = rdma.check_rdma_settings(_nics(tmp_path, _ib()), {"MC_FORCE_TCP": "1"}, "rdma",
                                        "", None)
    assert forced.level == ERROR and "MC_FORCE_TCP is set" in forced.found
    assert rdma.check_rdma_settings([], {}, "tcp", "", None).level == OK


def test_the_shipped_h800_files_leave_nics_and_gid_to_mooncake():
    from epd_serve.runtime import bringup

    for path in sorted((REPO / "configs/h800").glob("*.yaml")):
        dep = bringup.load(path)
        kv = {rdma.kv_fabric(dep.platform, step.launch) for step in startup_plan(dep)
              if step.kind == "instance" and step.launch.kv_role}
        assert kv <= {("rdma", "", None)}, path

