"""The epd KV connector's settings: `kv_connector_extra_config` made typed.

Imported in every vLLM process that builds the connector. Unknown keys are refused by
name, so a typo in a deployment file fails at start-up instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epd_serve.connectors.epd_kv.grouping import MODES, LinkModel

# vLLM 0.32's layout names (vllm/v1/kv_cache_layout.py); describe_layer reads them all.
KV_CACHE_LAYOUTS = ("auto", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM's kv_role values this connector runs as. A `kv_both` instance sends the KV of
# the requests it prefills for another instance (`do_remote_decode`) and receives that
# of the requests it decodes for one (`do_remote_prefill`), so that an instance can
# change between prefill and decode at run time by the proxy's routing alone.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
SENDING_ROLES = ("kv_producer", "kv_both")
RECEIVING_ROLES = ("kv_consumer", "kv_both")
ROLES = ("", *KV_ROLES)


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"  # address the side channel and the transfer engine use
    protocol: str = "tcp"  # transfer engine transport: tcp | rdma | ascend
    device_name: str = ""  # RDMA device(s) for the transfer engine ("" = every HCA found)
    gid_index: int | None = None  # RoCE GID index of those devices (MC_GID_INDEX)
    # kv_producer | kv_consumer | kv_both, copied here by the HAL: vLLM asks some
    # classmethods (requires_piecewise_for_cudagraph) with the extra config alone
    role: str = ""
    # The KV cache layout asked of vLLM ("auto": the attention backend's choice; before
    # vLLM 0.32 only LBHNC and LBNHC, asked as HND and NHD: compat.py).
    # LBHNC is the one every backend that declares layouts accepts (the CPU's only one,
    # FlashInfer's on SM100; FlashAttention and FlashInfer elsewhere take any), so a
    # prefill and a decode on different backends still store blocks alike; and its
    # blocks are dense, one write segment per run of blocks.
    kv_cache_layout: str = "LBHNC"
    mode: str = "group"  # whole | layer | group
    # prefill: the link's cost as the deployment states it (both or neither), instead of
    # a loopback calibration at start (which writes within one device, never over the
    # link to another: on Ascend a local NPU copy). Sizes deadlines and layer groups
    # until real writes refine it (grouping.LinkEstimator).
    link_overhead_ms: float | None = None
    link_gb_per_s: float | None = None
    group_size: int | str = "auto"  # layers per group, or chosen from calibration
    ack_timeout_s: float = 5.0  # decode: the prefill worker must acknowledge a reservation
    heartbeat_s: float = 1.0  # decode: ping prefill workers with pending transfers
    peer_timeout_s: float = 10.0  # decode: prefill silent this long is taken for dead
    transfer_timeout_floor_s: float = 1.0  # prefill: least time a write may take ...
    transfer_timeout_slack: float = 20.0  # ... else this many times its expected time
    # prefill: added to a write's deadline until a write to that decode session has
    # landed, for the transport's first connect (Mooncake's Ascend transport allows
    # ASCEND_CONNECT_TIMEOUT, 10 s by default, for it: deadlines.py)
    first_connect_timeout_s: float = 10.0
    reservation_timeout_s: float = 120.0  # prefill: unmatched transfers are dropped
    release_grace_s: float = 30.0  # decode: wait for a failed transfer's writes to end
    # decode: the longest it holds the blocks of a transfer whose prefill may still write
    # them (silent, not known gone); prefill refuses writes for a reservation older than
    # `stale_reservation_s`, so neither side writes into blocks given to another. Both
    # sides must be given the same value (one deployment file does).
    fence_max_s: float = 600.0
    # decode: a reserved transfer must end (Done or Failed) within receive_timeout_base_s
    # of the reservation plus receive_timeout_per_gb_s per GB of KV it reserves; past
    # that decode cancels it and computes the prompt itself (its blocks are reused once
    # prefill says no write is running, at most release_grace_s later). Decode reserves
    # as soon as prefill has taken the request, so this covers prefill's queue and
    # compute as well as the writes; the per-GB part allows for a link as slow as
    # 100 MB/s. It is the bound for a prefill engine that hangs with its side channel
    # alive: a prefill that dies is given up after peer_timeout_s, one that restarts or
    # no longer knows the transfer within about two heartbeats, and a transfer it failed
    # before the reservation came at the reservation's answer.
    receive_timeout_base_s: float = 60.0
    receive_timeout_per_gb_s: float = 10.0
    # An engine with nothing to compute but transfers to wait for still steps: vLLM runs
    # an empty step about every millisecond, each a round trip between its engine core
    # and its worker, until a transfer ends. On a host whose cores the engines share,
    # that spinning takes most of a core from the very prefill decode waits for. So an
    # empty step waits in the worker, at most this long, for one of its transfers to
    # end (a request that arrives meanwhile is scheduled at most that much later, and
    # only at an engine that had nothing else to run). 0: no wait, vLLM's own pace.
    idle_step_wait_ms: float = 5.0
    fault_injection: bool = False  # honour kv_transfer_params["epd_fault"] (tests)

    @property
    def stated_link(self) -> LinkModel | None:
        """The link model the deployment states, if it does."""
        if self.link_gb_per_s is None:
            return None
        return LinkModel(self.link_overhead_ms / 1e3, self.link_gb_per_s * 1e9)

    @property
    def stale_reservation_s(self) -> float:
        """Prefill: a reservation older than this is never written (decode may have given
        its blocks away by `fence_max_s`); the margin is room for a write's own run."""
        return self.fence_max_s - min(60.0, self.fence_max_s / 2)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "Settings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown epd KV connector setting(s) {unknown}; "
                             f"known: {sorted(known)}")
        settings = cls(**extra)
        if settings.mode not in MODES:
            raise ValueError(f"unknown KV transfer mode {settings.mode!r}; "
                             f"choose one of {', '.join(MODES)}")
        if settings.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, "
                             f"not {settings.kv_cache_layout!r}")
        if (settings.link_overhead_ms is None) != (settings.link_gb_per_s is None):
            raise ValueError("link_overhead_ms and link_gb_per_s state the link's cost "
                             "together: give both, or neither (calibrated at start)")
        if settings.link_gb_per_s is not None and not (
                settings.link_gb_per_s > 0 and settings.link_overhead_ms >= 0):
            raise ValueError(f"link_gb_per_s must be positive and link_overhead_ms 0 or "
                             f"more, not {settings.link_gb_per_s!r} and "
                             f"{settings.link_overhead_ms!r}")
        if settings.gid_index is not None and not 0 <= settings.gid_index <= 255:
            raise ValueError(f"gid_index must be 0-255 (see `show_gids`), "
                             f"not {settings.gid_index!r}")
        if settings.first_connect_timeout_s < 0:
            raise ValueError(f"first_connect_timeout_s must be 0 or more, "
                             f"not {settings.first_connect_timeout_s!r}")
        if not 0 <= settings.idle_step_wait_ms <= 100:
            raise ValueError(f"idle_step_wait_ms must be 0-100, "
                             f"not {settings.idle_step_wait_ms!r}")
        if settings.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {settings.role!r}")
        if settings.group_size != "auto" and (not isinstance(settings.group_size, int)
                                               or settings.group_size < 1):
            raise ValueError(f"group_size must be 'auto' or a positive integer, "
                             f"not {settings.group_size!r}")
        return settings

    def transfer_timeout_s(self, expected_s: float) -> float:
        return max(self.transfer_timeout_floor_s, self.transfer_timeout_slack * expected_s)

    def receive_timeout_s(self, nbytes: int) -> float:
        return self.receive_timeout_base_s + self.receive_timeout_per_gb_s * nbytes / 1e9
