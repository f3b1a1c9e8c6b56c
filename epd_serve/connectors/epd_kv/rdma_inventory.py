"""This host's RDMA devices, their ports and GIDs, and which GID Mooncake takes on each.

Used by `epd-serve doctor` (CLI process); no torch, vLLM or Mooncake imports. The
decisions are pure functions of the facts they are handed; the reader of the real facts
(sysfs) is at the bottom.

Read against Mooncake's sources of the 0.3.13 wheels (the same in v0.3.12.post1 and on
main after 0.3.13; the installed engine holds the tier names and log lines below):
- `loadGlobalConfig` (mooncake-transfer-engine/src/config.cpp): the GID index is
  MC_GID_INDEX, else NCCL_IB_GID_INDEX, read with atoi and ignored outside 0-255; none
  set means automatic choice (`GlobalConfig::gid_index = -1`). The port is MC_IB_PORT,
  default 1. Our KV connector sets MC_GID_INDEX from `gid_index` when the file gives one.
- `RdmaContext::openRdmaDevice` (.../rdma_transport/rdma_context.cpp): the port must be
  ACTIVE. With an index given, ibv_query_gid reads that entry and a NULL GID drops the
  device ("GID is NULL, please check your GID index by specifying MC_GID_INDEX"), as
  does an index past the table. Without one, `findBestGidIndex` asks ibv_query_gid_ex
  for every entry of the port's table and takes the first of
  `rankAutoGidCandidates` (.../rdma_transport/rdma_gid_probe.h), mirrored by `auto_gid`.
- `RdmaTransport::initializeRdmaResources` disables every device whose context fails;
  with none left the RDMA transport does not start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence

from epd_serve.connectors.epd_kv import fabric

IB, ROCE_V1, ROCE_V2 = "IB", "RoCE v1", "RoCE v2"
INFINIBAND, ETHERNET = "InfiniBand", "Ethernet"
# Mooncake's classes of an automatically chosen GID, best first (AutoGidCandidateClass).
TIERS = ("network-routable", "no-network-routable", "network-private-v4",
         "network-degraded", "no-network-private-v4", "no-network-degraded",
         "fallback-nonzero")
# Interfaces Mooncake takes for container overlays (isOverlayNetwork).
OVERLAY_PREFIXES = ("flannel", "cni", "calico", "vxlan", "docker")
# IPv4 ranges Mooncake calls private (isOverlayIPv4): RFC 1918 and CGNAT.
PRIVATE_V4 = tuple(ipaddress.ip_network(n) for n in
                   ("10.0.0.0/8", "172.16.0.0/12", "100.64.0.0/10"))
DEFAULT_IB_PORT = 1
SYSFS = "/sys/class/infiniband"


@dataclasses.dataclass(frozen=True)
class Gid:
    """One entry of a port's GID table, as sysfs shows it."""

    index: int
    value: str  # "0000:0000:0000:0000:0000:ffff:0a00:0001" (ports/<p>/gids/<i>)
    kind: str | None  # IB | RoCE v1 | RoCE v2; None: the entry is unused (no type)
    netdev: str = ""  # the interface it belongs to (gid_attrs/ndevs/<i>), "" if none

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(int(self.value.replace(":", "") or "0", 16))

    @property
    def null(self) -> bool:
        return int(self.address) == 0

    def text(self) -> str:
        """The GID as an address: "::ffff:10.0.0.1", "fe80::a288:c2ff:fe3b:1"."""
        mapped = self.address.ipv4_mapped
        return f"::ffff:{mapped}" if mapped is not None else str(self.address)


@dataclasses.dataclass(frozen=True)
class Port:
    number: int
    state: str  # "ACTIVE", "DOWN", ... (ports/<p>/state without its number)
    link_layer: str  # InfiniBand | Ethernet
    gids: tuple[Gid, ...]  # the whole table, unused entries included

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def netdev(self) -> str:
        return next((g.netdev for g in self.gids if g.netdev), "")

    def used_gids(self) -> list[Gid]:
        return [g for g in self.gids if not g.null]


@dataclasses.dataclass(frozen=True)
class Device:
    name: str  # mlx5_0
    dev_name: str  # uverbs0: its /dev/infiniband node ("" if unknown)
    accessible: bool  # /dev/infiniband/<dev_name> opens for reading and writing
    ports: tuple[Port, ...]

    def port(self, number: int) -> Port | None:
        return next((p for p in self.ports if p.number == number), None)

    def as_hca(self) -> fabric.Hca:
        return fabric.Hca(self.name, self.dev_name, any(p.active for p in self.ports),
                          self.accessible)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The GID Mooncake takes on one device's port, or why it drops the device."""

    device: str
    port: int
    gid: Gid | None  # None: the device is dropped
    how: str  # a TIERS name (automatic), "set" (gid_index / MC_GID_INDEX), or why dropped

    @property
    def usable(self) -> bool:
        return self.gid is not None


# -- the facts, as Mooncake reads them -----------------------------------------------
def gid_kind(type_text: str | None, link_layer: str) -> str | None:
    """What ibv_query_gid_ex reports as the entry's type: the kernel's "IB/RoCE v1" is IB
    on an InfiniBand port and RoCE v1 on an Ethernet one (rdma-core); None: unused."""
    if type_text is None:
        return None
    text = type_text.strip()
    if text == "RoCE v2":
        return ROCE_V2
    if text == "IB/RoCE v1":
        return IB if link_layer == INFINIBAND else ROCE_V1
    return None


def atoi(text: str) -> int:
    """C's atoi: leading blanks, a sign, digits; 0 where there are none."""
    text = text.lstrip()
    sign, digits = 1, ""
    if text[:1] in "+-" and text:
        sign, text = (-1 if text[0] == "-" else 1), text[1:]
    for char in text:
        if not char.isdigit():
            break
        digits += char
    return sign * int(digits) if digits else 0


def set_gid_index(env: Mapping[str, str], gid_index: int | None = None) -> int | None:
    """The GID index the engine is told (None: it chooses). `gid_index`: the KV
    connector's setting, which it exports as MC_GID_INDEX before the engine starts."""
    if gid_index is not None:
        return gid_index
    for name in (fabric.GID_INDEX, "NCCL_IB_GID_INDEX"):
        if name in env:
            value = atoi(env[name])
            return value if 0 <= value < 256 else None
    return None


def ib_port(env: Mapping[str, str]) -> int:
    """The port Mooncake opens on every device: MC_IB_PORT (0-255), else 1."""
    if "MC_IB_PORT" in env:
        value = atoi(env["MC_IB_PORT"])
        if 0 <= value < 256:
            return value
    return DEFAULT_IB_PORT


def gid_tier(gid: Gid) -> str | None:
    """Mooncake's class of an entry (classifyAutoGidCandidate); None: not a candidate."""
    if gid.kind is None or gid.null or gid.kind not in (ROCE_V2, IB):
        return None
    address = gid.address
    mapped = address.ipv4_mapped
    roce_v2 = gid.kind == ROCE_V2
    overlay_iface = roce_v2 and bool(gid.netdev) and _overlay_interface(gid.netdev)
    private_v4 = (roce_v2 and not overlay_iface and mapped is not None
                  and any(mapped in net for net in PRIVATE_V4))
    link_local = roce_v2 and mapped is None and address.is_link_local
    degraded = overlay_iface or link_local
    prefix = "network" if gid.netdev else "no-network"
    if degraded:
        return f"{prefix}-degraded"
    if private_v4:
        return f"{prefix}-private-v4"
    return f"{prefix}-routable"


def auto_gid(gids: Sequence[Gid]) -> tuple[Gid, str] | None:
    """The GID Mooncake chooses on a port by itself, with its class (findBestGidIndex):
    the best class, the lowest index within it; else the first used entry of another
    type (a RoCE v1 GID: "fallback-nonzero"); None: it finds none and drops the device."""
    ranked = sorted(((TIERS.index(tier), g.index, g, tier) for g in gids
                     if (tier := gid_tier(g)) is not None), key=lambda t: t[:2])
    if ranked:
        return ranked[0][2], ranked[0][3]
    fallback = next((g for g in gids if g.kind is not None and not g.null), None)
    return (fallback, TIERS[-1]) if fallback is not None else None


def choose(device: Device, port_number: int, gid_index: int | None) -> Choice:
    """The GID Mooncake takes on `device`, given the index it is told (None: its own
    choice)."""
    port = device.port(port_number)
    if port is None:
        return Choice(device.name, port_number, None, f"has no port {port_number} "
                                                      "(MC_IB_PORT)")
    if not port.active:
        return Choice(device.name, port_number, None, f"port {port_number} is {port.state}")
    if gid_index is None:
        picked = auto_gid(port.gids)
        if picked is None:
            return Choice(device.name, port_number, None, "no usable GID on port "
                                                          f"{port_number}")
        return Choice(device.name, port_number, picked[0], picked[1])
    if gid_index >= len(port.gids):
        return Choice(device.name, port_number, None,
                      f"GID {gid_index} does not exist (its table has {len(port.gids)})")
    gid = port.gids[gid_index]
    if gid.null:
        return Choice(device.name, port_number, None, f"GID {gid_index} is empty")
    return Choice(device.name, port_number, gid, "set")


def preferred_gid(port: Port) -> Gid | None:
    """The GID a node's peers reach this port by: on Ethernet (RoCE) the lowest RoCE v2
    entry holding an interface's IPv4 address, not a container overlay's; on
    InfiniBand, or without such an entry, Mooncake's own choice."""
    if port.link_layer == ETHERNET:
        for gid in port.gids:
            if (gid.kind == ROCE_V2 and gid.netdev and not _overlay_interface(gid.netdev)
                    and gid.address.ipv4_mapped is not None):
                return gid
    picked = auto_gid(port.gids)
    return picked[0] if picked else None


def _overlay_interface(netdev: str) -> bool:
    return netdev.startswith(OVERLAY_PREFIXES) or netdev == "tunl0"


# -- what the deployment file should say ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Advice:
    """The NICs Mooncake would use, and the lines that make it use the right ones."""

    choices: list[Choice]  # one per device Mooncake's discovery keeps
    left_out: list[str]  # the devices it drops, each with why
    astray: list[str]  # used NICs whose GID is not the one their peers reach them by
    device_line: str  # "device_name: mlx5_0,mlx5_1" ("" when no NIC is usable)
    gid_line: str  # "gid_index: 3"; "" where Mooncake's own choice is right
    gid_note: str  # what the GID choice is, in words


def advise(devices: Sequence[Device], env: Mapping[str, str], device_name: str = "",
           gid_index: int | None = None) -> Advice:
    """What Mooncake makes of `devices` with these settings, and what the deployment
    file should say: the usable NICs, and a gid_index only where Mooncake's automatic
    choice differs from `preferred_gid` on some NIC and one index fixes every NIC."""
    port = ib_port(env)
    told = set_gid_index(env, gid_index)
    kept, left_out = fabric.screen_hcas([d.as_hca() for d in devices], device_name, env)
    by_name = {d.name: d for d in devices}
    choices = [choose(by_name[name], port, told) for name in kept]
    left_out += [f"{c.device}: {c.how}" + (" (Mooncake drops it: 'GID is NULL')"
                                          if c.how.endswith("is empty") else "")
                 for c in choices if not c.usable]
    astray = [f"{c.device} GID {c.gid.index} is not the RoCE v2 IPv4 GID {want.index} its "
              "peers reach it by" for c in choices if c.usable
              and (want := preferred_gid(by_name[c.device].port(port))) is not None
              and want.index != c.gid.index]
    # What the file should say, judged as if nothing were set: Mooncake's own choice.
    own = [choose(by_name[name], port, None) for name in kept]
    usable = [c for c in own if c.usable]
    wrong = {}  # device -> the index its peers reach it by, where Mooncake's is another
    for choice in usable:
        want = preferred_gid(by_name[choice.device].port(port))
        if want is not None and want.index != choice.gid.index:
            wrong[choice.device] = want.index
    device_line = f"device_name: {','.join(c.device for c in usable)}" if usable else ""
    picks = ", ".join(f"{c.device} GID {c.gid.index} ({c.how})" for c in usable)
    if not wrong:
        return Advice(choices, left_out, astray, device_line, "",
                      f"Mooncake's own choice is right, leave gid_index out: {picks}"
                      if usable else "no NIC has a usable GID")
    wanted = {preferred_gid(by_name[c.device].port(port)).index for c in usable}
    took = {c.device: c.gid.index for c in usable}
    mislead = ", ".join(f"{name} would take GID {took[name]} instead of its RoCE v2 IPv4 "
                        f"GID {index}" for name, index in sorted(wrong.items()))
    if len(wanted) == 1:
        index = wanted.pop()
        return Advice(choices, left_out, astray, device_line, f"gid_index: {index}",
                      f"Mooncake's own choice is wrong here: {mislead}")
    return Advice(choices, left_out, astray, device_line, "",
                  f"Mooncake's own choice is wrong here ({mislead}), and no one gid_index "
                  "serves every NIC (their RoCE v2 IPv4 GIDs sit at "
                  f"{', '.join(map(str, sorted(wanted)))}): name only NICs whose index "
                  "agrees, or give each NIC's interface its address in the same order")


def describe_port(device: Device, port: Port, choice: Choice | None) -> str:
    """One line: "mlx5_0 port 1: ACTIVE, RoCE (Ethernet, ens1f0), GIDs 0 fe80::1 RoCE v1,
    ...; Mooncake takes GID 3 (network-private-v4)"."""
    medium = "InfiniBand" if port.link_layer == INFINIBAND else \
        f"RoCE ({port.link_layer}{', ' + port.netdev if port.netdev else ''})"
    used = port.used_gids()
    gids = ", ".join(f"{g.index} {g.text()} {g.kind or 'unused'}"
                     + (f" {g.netdev}" if g.netdev and g.netdev != port.netdev else "")
                     for g in used) or "none"
    line = f"{device.name} port {port.number}: {port.state}, {medium}; GIDs ({len(used)} " \
           f"of {len(port.gids)} entries used): {gids}"
    if choice is not None and choice.port == port.number:
        line += (f"; Mooncake takes GID {choice.gid.index} ({choice.how})" if choice.usable
                 else f"; Mooncake drops it: {choice.how}")
    return line


# -- reader of the real facts --------------------------------------------------------
def read_devices(root: str = SYSFS, dev_dir: str = "/dev/infiniband") -> list[Device]:
    """Every RDMA device under `root` with its ports and whole GID tables. An unused
    entry's type cannot be read (the kernel answers EINVAL): its kind is None."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    devices = []
    for name in names:
        base = os.path.join(root, name)
        ports = []
        for number in sorted(_numbers(os.path.join(base, "ports"))):
            port_dir = os.path.join(base, "ports", str(number))
            link_layer = _read(os.path.join(port_dir, "link_layer")) or ""
            state = (_read(os.path.join(port_dir, "state")) or "").partition(":")[2].strip()
            gids = []
            for index in sorted(_numbers(os.path.join(port_dir, "gids"))):
                value = _read(os.path.join(port_dir, "gids", str(index))) or ""
                kind = gid_kind(_read(os.path.join(port_dir, "gid_attrs", "types", str(index))),
                                link_layer)
                netdev = _read(os.path.join(port_dir, "gid_attrs", "ndevs", str(index))) or ""
                gids.append(Gid(index, value, kind, netdev))
            ports.append(Port(number, state or "unknown", link_layer, tuple(gids)))
        verbs = sorted(_names(os.path.join(base, "device", "infiniband_verbs")))
        dev_name = verbs[0] if verbs else ""
        accessible = bool(dev_name) and os.access(os.path.join(dev_dir, dev_name),
                                                  os.R_OK | os.W_OK)
        devices.append(Device(name, dev_name, accessible, tuple(ports)))
    return devices


def _read(path: str) -> str | None:
    try:
        with open(path) as text:
            return text.read().strip()
    except (OSError, ValueError):
        return None


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _numbers(path: str) -> list[int]:
    return [int(n) for n in _names(path) if n.isdigit()]
