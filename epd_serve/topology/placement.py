"""Where each instance of a multi-node deployment runs: the `cluster:` section of a
deployment file, and the pure mapping of a plan onto its nodes.

Pure Python (pydantic); imported by the config loader, the CLI (`topology`, `launch
--emit-shell`) and the Ray launcher. Nothing here talks to Ray: a placement that
cannot fit is refused here, before anything starts, saying what is missing.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epd_serve.topology.notation import Instance, Plan

# The Ray node label whose value is a node's name in the deployment file
# (`ray start --labels epd-node=<name>`); placement groups select nodes by it.
NODE_LABEL = "epd-node"


class NodeSpec(BaseModel):
    """One machine of the cluster, as the deployment may use it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$", max_length=63, description="The "
                      f"node's name; Ray finds it by the node label {NODE_LABEL}=<name>.")
    address: str = Field(description="The node's IP address on the cluster network: its "
                         "instances bind to it, and their URLs and KV/EC addresses use it.")
    devices: list[int] = Field(min_length=1, description="Devices of this node the "
                               "deployment may use (given to Ray at `ray start`); on the "
                               "cpu platform, logical slots.")
    stages: list[Literal["E", "P", "D"]] | None = Field(
        None, description="Only instances whose stages are all listed run here, e.g. "
        "[D] for a decode node; default: any.")

    @model_validator(mode="after")
    def _check(self) -> NodeSpec:
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ValueError(f"node {self.name}: address must be an IP address, "
                             f"got {self.address!r}") from None
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"node {self.name}: device ids must be unique")
        return self


class ClusterSpec(BaseModel):
    """The `cluster:` section: the Ray cluster a deployment spans, node by node."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field("auto", description="The Ray cluster to join: 'auto' (the one "
                         "this machine belongs to), '<head ip>:<port>', or 'local': start "
                         "one Ray node per entry of `nodes` on this machine (to try a "
                         "placement; the tests).")
    head: str | None = Field(None, description="Node that runs the proxy and the MM "
                             "Store's master; default: the first node.")
    head_port: int = Field(6379, description="Port of the Ray head (`ray start --head`).")
    nodes: list[NodeSpec] = Field(min_length=1)
    placement_timeout_s: float = Field(120.0, gt=0, description="How long Ray may take "
                                       "to reserve every instance's devices.")

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster node names must be unique, got {names}")
        if self.head is not None and self.head not in names:
            raise ValueError(f"cluster.head {self.head!r} is not one of the nodes {names}")
        if self.address == "local":
            remote = [n.name for n in self.nodes if not ipaddress.ip_address(n.address).is_loopback]
            if remote:
                raise ValueError("cluster.address 'local' starts every node on this machine: "
                                 f"nodes {remote} need a loopback address such as 127.0.0.1")
        return self

    @property
    def head_node(self) -> NodeSpec:
        return self.node(self.head or self.nodes[0].name)

    def node(self, name: str) -> NodeSpec:
        return next(node for node in self.nodes if node.name == name)


def ray_resource_args(resource: str, amount: float) -> dict:
    """Ray's keyword for `amount` of a device resource, the same in `ray.remote` options,
    `add_node` and (dashed) `ray start`: CPU and GPU have their own; any other, such as
    NPU, is a custom resource."""
    if resource == "CPU":
        return {"num_cpus": amount}
    if resource == "GPU":
        return {"num_gpus": amount}
    return {"resources": {resource: amount}}


class PlacementError(ValueError):
    """The plan does not fit the cluster; the message names what is missing."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one instance runs: its node and that node's device ids."""

    node: str
    address: str
    devices: tuple[int, ...]


def place(plan: Plan, cluster: ClusterSpec) -> dict[str, Slot]:
    """Instance name -> slot. Each device group of the plan (co-located instances, or a
    tensor-parallel instance's devices) lands whole on one node that takes all its
    stages. Replicas spread: a group goes to the node holding the fewest groups like it,
    then to the fullest such node (so different stages share nodes and P -> D stays
    local where it can), then to the first in file order."""
    free = {node.name: list(node.devices) for node in cluster.nodes}
    alike: Counter[tuple[str, str]] = Counter()
    slots: dict[str, Slot] = {}
    for group in plan.groups():
        plan_devices = sorted({d for inst in group for d in inst.devices})
        stages = {stage for inst in group for stage in inst.roles}
        kind = "-".join(inst.roles for inst in group)
        fits, refusals = [], []
        for node in cluster.nodes:
            if node.stages is not None and not stages <= set(node.stages):
                refusals.append(f"{node.name} takes stages {''.join(node.stages)} only")
            elif len(free[node.name]) < len(plan_devices):
                refusals.append(f"{node.name} has {len(free[node.name])} of "
                                f"{len(node.devices)} devices free")
            else:
                fits.append(node)
        if not fits:
            raise PlacementError(f"cannot place {_describe(group)} ({len(plan_devices)} "
                                 f"device(s) on one node): {'; '.join(refusals)}")
        node = min(fits, key=lambda n: (alike[n.name, kind], len(free[n.name]),
                                        cluster.nodes.index(n)))
        taken = dict(zip(plan_devices, free[node.name]))
        del free[node.name][:len(plan_devices)]
        alike[node.name, kind] += 1
        for inst in group:
            slots[inst.name] = Slot(node.name, node.address,
                                    tuple(taken[d] for d in inst.devices))
    return slots


def _describe(group: list[Instance]) -> str:
    names = ", ".join(f"{inst.name} [{inst.roles}]" for inst in group)
    return f"co-located {names}" if len(group) > 1 else names
