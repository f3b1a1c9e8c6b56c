"""The RDMA inventory (rdma_inventory.py): GIDs read from a made-up sysfs tree, the GID
Mooncake picks by itself on each port, what a set index makes of it, and the lines the
deployment file should carry."""

from __future__ import annotations

import ipaddress

import pytest

from epd_serve.connectors.epd_kv import rdma_inventory as inv
from epd_serve.connectors.epd_kv.rdma_inventory import Gid

TABLE = 8  # entries per GID table here (mlx5: 255)
EMPTY = "0000:0000:0000:0000:0000:0000:0000:0000"


def gid_text(address: str) -> str:
    """An address as sysfs writes a GID: eight groups of four hex digits."""
    return ipaddress.IPv6Address(address).exploded


def make_device(root, name, gids, *, link_layer="Ethernet", state="4: ACTIVE", port=1,
                uverbs="uverbs0", dev_dir=None):
    """A /sys/class/infiniband/<name> tree. `gids`: index -> (address, sysfs type, netdev);
    every other entry of the table is empty and its type unreadable, as the kernel has it."""
    port_dir = root / name / "ports" / str(port)
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port_dir / sub).mkdir(parents=True, exist_ok=True)
    (port_dir / "state").write_text(state + "\n")
    (port_dir / "link_layer").write_text(link_layer + "\n")
    for index in range(TABLE):
        address, kind, netdev = gids.get(index, (None, None, ""))
        (port_dir / "gids" / str(index)).write_text((gid_text(address) if address else EMPTY)
                                                    + "\n")
        if kind is None:
            (port_dir / "gid_attrs" / "types" / str(index)).mkdir()  # reading it fails
        else:
            (port_dir / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")
        (port_dir / "gid_attrs" / "ndevs" / str(index)).write_text(netdev + "\n")
    (root / name / "device" / "infiniband_verbs" / uverbs).mkdir(parents=True, exist_ok=True)
    if dev_dir is not None:
        dev_dir.mkdir(exist_ok=True)
        (dev_dir / uverbs).write_text("")


def roce(ipv4: str, netdev: str, more: dict | None = None) -> dict:
    """A RoCE port as mlx5 fills it: link-local IPv6 then the IPv4 address, each as
    RoCE v1 and v2 (show_gids: 0-3)."""
    return {0: ("fe80::a288:c2ff:fe3b:1", "IB/RoCE v1", netdev),
            1: ("fe80::a288:c2ff:fe3b:1", "RoCE v2", netdev),
            2: (f"::ffff:{ipv4}", "IB/RoCE v1", netdev),
            3: (f"::ffff:{ipv4}", "RoCE v2", netdev), **(more or {})}


IB_PORT = {0: ("fe80::2:c903:1:1", "IB/RoCE v1", "")}


def devices(tmp_path, *specs):
    root, dev = tmp_path / "sys", tmp_path / "dev"
    for number, (gids, extra) in enumerate(specs):
        make_device(root, f"mlx5_{number}", gids, uverbs=f"uverbs{number}", dev_dir=dev,
                    **extra)
    return inv.read_devices(str(root), str(dev))


# -- reading sysfs ----------------------------------------------------------------------
def test_a_roce_port_is_read_with_its_whole_table(tmp_path):
    (device,) = devices(tmp_path, (roce("10.0.1.5", "ens1f0np0"), {}))
    assert (device.name, device.dev_name, device.accessible) == ("mlx5_0", "uverbs0", True)
    (port,) = device.ports
    assert (port.number, port.state, port.active, port.link_layer, port.netdev) == \
        (1, "ACTIVE", True, "Ethernet", "ens1f0np0")
    assert len(port.gids) == TABLE
    assert [(g.index, g.text(), g.kind) for g in port.used_gids()] == [
        (0, "fe80::a288:c2ff:fe3b:1", "RoCE v1"), (1, "fe80::a288:c2ff:fe3b:1", "RoCE v2"),
        (2, "::ffff:10.0.1.5", "RoCE v1"), (3, "::ffff:10.0.1.5", "RoCE v2")]
    assert port.gids[4].null and port.gids[4].kind is None


def test_an_infiniband_gid_of_the_kernels_v1_type_is_ib(tmp_path):
    (device,) = devices(tmp_path, (IB_PORT, {"link_layer": "InfiniBand"}))
    assert device.ports[0].gids[0].kind == "IB"
    assert inv.gid_kind("IB/RoCE v1", "Ethernet") == "RoCE v1"
    assert inv.gid_kind(None, "InfiniBand") is None


def test_a_device_without_its_dev_node_or_sysfs_is_reported_as_such(tmp_path):
    make_device(tmp_path / "sys", "mlx5_0", IB_PORT, state="1: DOWN")
    (device,) = inv.read_devices(str(tmp_path / "sys"), str(tmp_path / "absent"))
    assert not device.accessible and device.ports[0].state == "DOWN"
    assert inv.read_devices(str(tmp_path / "nothing")) == []


# -- Mooncake's own choice (findBestGidIndex) -------------------------------------------
def g(index, address, kind="RoCE v2", netdev="ens1"):
    return Gid(index, gid_text(address), kind, netdev)


@pytest.mark.parametrize("gid, tier", [
    (g(0, "2001:db8::5"), "network-routable"),
    (g(0, "::ffff:192.0.2.7"), "network-routable"),  # public IPv4
    (g(0, "::ffff:192.0.2.7", netdev=""), "no-network-routable"),
    (g(0, "::ffff:10.1.2.3"), "network-private-v4"),
    (g(0, "::ffff:172.20.0.1"), "network-private-v4"),
    (g(0, "::ffff:100.64.0.9", netdev=""), "no-network-private-v4"),
    (g(0, "fe80::1"), "network-degraded"),  # link-local: never across subnets
    (g(0, "::ffff:10.1.2.3", netdev="docker0"), "network-degraded"),  # an overlay's
    (g(0, "::ffff:10.1.2.3", netdev="tunl0"), "network-degraded"),
    (g(0, "fe80::1", netdev=""), "no-network-degraded"),
    (g(0, "fe80::2:c903:1:1", kind="IB", netdev=""), "no-network-routable"),
    (g(0, "fe80::1", kind="RoCE v1"), None),  # never a candidate
    (g(0, "::"), None),  # empty
    (Gid(0, gid_text("fe80::1"), None), None),  # its type cannot be read
])
def test_gid_tiers_follow_mooncakes_classification(gid, tier):
    assert inv.gid_tier(gid) == tier


def test_the_best_tier_wins_then_the_lowest_index():
    gids = [g(0, "fe80::1", kind="RoCE v1"), g(1, "fe80::1"), g(2, "::ffff:10.0.0.1"),
            g(3, "::ffff:10.0.0.2")]
    assert inv.auto_gid(gids) == (gids[2], "network-private-v4")
    routable = [*gids, g(4, "2001:db8::5")]
    assert inv.auto_gid(routable) == (routable[4], "network-routable")


def test_a_port_of_roce_v1_gids_only_falls_back_to_its_first_one():
    gids = [Gid(0, EMPTY, None), g(1, "fe80::1", kind="RoCE v1"),
            g(2, "::ffff:10.0.0.1", kind="RoCE v1")]
    assert inv.auto_gid(gids) == (gids[1], "fallback-nonzero")
    assert inv.auto_gid([Gid(0, EMPTY, None)]) is None


@pytest.mark.parametrize("env, setting, told", [
    ({}, None, None),
    ({"MC_GID_INDEX": "3"}, None, 3),
    ({"NCCL_IB_GID_INDEX": "5"}, None, 5),
    ({"MC_GID_INDEX": "1", "NCCL_IB_GID_INDEX": "5"}, None, 1),
    ({"MC_GID_INDEX": "300"}, None, None),  # ignored with a warning: automatic
    ({"MC_GID_INDEX": "abc"}, None, 0),  # atoi
    ({"MC_GID_INDEX": "3"}, 0, 0),  # the connector's gid_index is exported over it
])
def test_the_gid_index_the_engine_is_told(env, setting, told):
    assert inv.set_gid_index(env, setting) == told


def test_mc_ib_port_picks_the_port():
    assert inv.ib_port({}) == 1
    assert inv.ib_port({"MC_IB_PORT": "2"}) == 2
    assert inv.ib_port({"MC_IB_PORT": "-1"}) == 1


# -- what the deployment file should say --------------------------------------------------
def test_roce_on_private_ipv4_needs_no_setting(tmp_path):
    found = devices(tmp_path, (roce("10.0.1.5", "ens1"), {}), (roce("10.0.2.5", "ens2"), {}))
    advice = inv.advise(found, {})
    assert [(c.device, c.gid.index, c.how) for c in advice.choices] == [
        ("mlx5_0", 3, "network-private-v4"), ("mlx5_1", 3, "network-private-v4")]
    assert advice.device_line == "device_name: mlx5_0,mlx5_1"
    assert advice.gid_line == "" and "leave gid_index out" in advice.gid_note


def test_a_global_ipv6_gid_misleads_the_automatic_choice_and_gid_index_fixes_it(tmp_path):
    v6 = {6: ("2001:db8::15", "RoCE v2", "ens1")}
    found = devices(tmp_path, (roce("10.0.1.5", "ens1", v6), {}),
                    (roce("10.0.2.5", "ens2"), {}))
    advice = inv.advise(found, {})
    assert [c.gid.index for c in advice.choices] == [6, 3]
    assert advice.gid_line == "gid_index: 3"
    assert "mlx5_0 would take GID 6 instead of its RoCE v2 IPv4 GID 3" in advice.gid_note
    assert advice.astray == ["mlx5_0 GID 6 is not the RoCE v2 IPv4 GID 3 its peers reach it by"]
    assert inv.advise(found, {}, gid_index=3).astray == []


def test_no_one_gid_index_serves_nics_whose_ipv4_gids_sit_apart(tmp_path):
    moved = {3: ("2001:db8::15", "RoCE v2", "ens1"), 5: ("::ffff:10.0.1.5", "RoCE v2", "ens1")}
    found = devices(tmp_path, (roce("10.0.1.5", "ens1", moved), {}),
                    (roce("10.0.2.5", "ens2"), {}))
    advice = inv.advise(found, {})
    assert advice.gid_line == "" and "no one gid_index serves every NIC" in advice.gid_note


def test_gid_index_3_on_infiniband_drops_every_nic(tmp_path):
    found = devices(tmp_path, *[(IB_PORT, {"link_layer": "InfiniBand"})] * 2)
    own = inv.advise(found, {})
    assert [(c.gid.index, c.how) for c in own.choices] == [(0, "no-network-routable")] * 2
    assert own.device_line == "device_name: mlx5_0,mlx5_1" and own.gid_line == ""
    told = inv.advise(found, {}, gid_index=3)
    assert not any(c.usable for c in told.choices)
    assert told.left_out == ["mlx5_0: GID 3 is empty (Mooncake drops it: 'GID is NULL')",
                             "mlx5_1: GID 3 is empty (Mooncake drops it: 'GID is NULL')"]
    assert "does not exist" in inv.choose(found[0], 1, TABLE).how


def test_nics_that_cannot_serve_are_left_out_with_why(tmp_path):
    found = devices(tmp_path, (roce("10.0.1.5", "ens1"), {}),
                    (roce("10.0.2.5", "ens2"), {"state": "1: DOWN"}),
                    ({}, {}))  # ACTIVE, but not one GID
    advice = inv.advise(found, {})
    assert advice.device_line == "device_name: mlx5_0"
    assert any("mlx5_1: no port is ACTIVE" in why for why in advice.left_out)
    assert "mlx5_2: no usable GID on port 1" in advice.left_out
    named = inv.advise(found, {}, device_name="mlx5_0,mlx5_9")
    assert named.left_out == ["mlx5_9: no such RDMA device"]


def test_a_port_line_names_its_gids_and_mooncakes_pick(tmp_path):
    (device,) = devices(tmp_path, (roce("10.0.1.5", "ens1"), {}))
    choice = inv.choose(device, 1, None)
    line = inv.describe_port(device, device.ports[0], choice)
    assert line.startswith("mlx5_0 port 1: ACTIVE, RoCE (Ethernet, ens1); GIDs (4 of 8 "
                           "entries used): 0 fe80::a288:c2ff:fe3b:1 RoCE v1, ")
    assert "3 ::ffff:10.0.1.5 RoCE v2" in line
    assert line.endswith("Mooncake takes GID 3 (network-private-v4)")
