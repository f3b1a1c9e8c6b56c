"""Worker side of the epd KV connector: the KV cache, the transfer engine, and the
prefill sender and/or decode receiver of this worker.

Runs in each engine worker process (one per tensor-parallel rank); rank r's side
channel listens on `kv_port + r` and talks only to rank r of the other engine (both
engines must use the same tensor-parallel size). A kv_producer runs a Sender, a
kv_consumer a Receiver, a kv_both worker both, over its one transfer engine (one link,
every KV region registered once): its sender listens on `kv_port + r` for the decode
instances it prefills for, its receiver reaches the prefill instances it decodes for at
theirs. The two share nothing else but the stats they record into.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import numpy as np

from epd_serve.connectors import compat
from epd_serve.connectors.epd_kv.events import device_setter, marker
from epd_serve.connectors.epd_kv.layout import describe_layer, layer_tensors
from epd_serve.connectors.epd_kv.metadata import StepPlan, TransferReport
from epd_serve.connectors.epd_kv.prompt_tail import PromptTailKeeper
from epd_serve.connectors.epd_kv.receiver import Receiver
from epd_serve.connectors.epd_kv.registration import HCCS_ALIGNMENT, MAX_ASCEND_REGIONS, kv_regions
from epd_serve.connectors.epd_kv.sender import Sender
from epd_serve.connectors.epd_kv.settings import RECEIVING_ROLES, SENDING_ROLES, Settings
from epd_serve.connectors.epd_kv.startup import open_link
from epd_serve.connectors.epd_kv.stats import EPDKVStats
from epd_serve.connectors.epd_kv.transfer import Link

logger = logging.getLogger("vllm.epd_serve.kv.worker")

CALIBRATION_BYTES = 16 << 20


def calibration_buffer(device, protocol: str) -> tuple[object, tuple[int, int]]:
    """The memory a sender calibrates its link through: (its owner, (address, bytes)).
    On the Ascend transport, memory of the KV's own device, 2 MiB-aligned as every ADXL
    registration must be: that transport moves NPU memory, so a host buffer would time
    a host memcpy, and it is a registration vllm-ascend never makes (one the transport
    may refuse, stopping the prefill at start). Elsewhere, host memory."""
    if protocol != "ascend":
        host = np.zeros(CALIBRATION_BYTES, dtype=np.uint8)
        return host, (host.ctypes.data, host.nbytes)
    import torch

    raw = torch.empty(CALIBRATION_BYTES + HCCS_ALIGNMENT, dtype=torch.uint8, device=device)
    start = raw.data_ptr() + (-raw.data_ptr() % HCCS_ALIGNMENT)
    return raw, (start, CALIBRATION_BYTES)


class TransferResults(NamedTuple):
    """What a worker's transfers did since the last look, by request id."""

    sending: set[str]  # prefill: finished sending, blocks free to go
    recving: set[str]  # decode: finished receiving, failed ones included
    failed: set[str]  # decode: receives that failed (the engine recomputes them)
    failed_blocks: set[int]  # decode: the blocks those failed receives were to fill


class EPDKVWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: Settings):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        transfer = vllm_config.kv_transfer_config
        self.settings = settings
        self.engine_id = transfer.engine_id
        self.sends = transfer.kv_role in SENDING_ROLES  # runs a Sender
        self.receives = transfer.kv_role in RECEIVING_ROLES  # runs a Receiver
        self.port = transfer.kv_port
        self.block_size = vllm_config.cache_config.block_size
        # The physical KV layout vLLM resolved (LBHNC, LBNHC, ...; HND or NHD before
        # vLLM 0.32): named when two engines' layouts differ.
        self.layout_name = compat.resolved_kv_cache_layout(vllm_config)
        self.num_blocks = kv_cache_config.num_blocks
        self.rank = get_tensor_model_parallel_rank()
        self.stats = EPDKVStats()
        self.layer_index: dict[str, int] = {}
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self._reports: dict[str, dict] = {}
        self._receiving_blocks: dict[str, list[int]] = {}  # decode: request id -> blocks
        self.prompt_tail: PromptTailKeeper | None = None  # decode
        self._scratch = None  # prefill: the calibration buffer, registered
        # Set by the sender or receiver thread when a transfer ends, for an empty step
        # to wait on.
        self.results_ready = threading.Event()

    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self.layer_index = {name: i for i, name in enumerate(names)}
        layouts = [describe_layer(kv_caches[name], self.num_blocks) for name in names]
        device = layer_tensors(kv_caches[names[0]])[0].device
        # A sender that calibrates registers its calibration buffer as well: one region
        # less for the KV.
        calibrates = self.sends and self.settings.stated_link is None
        regions = kv_regions({name: kv_caches[name] for name in names}, device.type,
                             MAX_ASCEND_REGIONS - (1 if calibrates else 0))
        scratch = None
        if calibrates:
            # Registered memory must outlive the engine: kept with the worker.
            self._scratch, scratch = calibration_buffer(device, self.settings.protocol)
        link, model = open_link(self.settings, regions, device.type, scratch, make_link=Link,
                                scratch_device_type=device.type
                                if self.settings.protocol == "ascend" else "cpu")
        model = self.settings.stated_link or model
        self.link = link
        layout = f"{self.layout_name or 'KV'} layout, block " + "; ".join(map(str, layouts[0].forms))
        if self.sends:
            self._start_sender(layouts, layout, model, device)
        if self.receives:
            self._start_receiver(layouts, layout)
            first = layer_tensors(kv_caches[names[0]])[0]
            self.prompt_tail = PromptTailKeeper([kv_caches[name] for name in names],
                                                first.shape[0] // self.num_blocks)

    def _start_sender(self, layouts: list, layout: str, model, device) -> None:
        """Prefill's side: its side channel takes decode's reservations on kv_port + rank."""
        link = self.link
        logger.info("epd-kv prefill rank %d: %d KV layers (%s), %d B per block and layer, "
                    "side channel %s:%d, transfer engine %s over %s, link calibrated at "
                    "%.3f ms per write + %.2f GB/s, mode %s", self.rank, len(layouts),
                    layout, layouts[0].block_bytes, self.settings.host,
                    self.port + self.rank, link.session_id, link.transport,
                    model.overhead_s * 1e3, model.bytes_per_s / 1e9, self.settings.mode)
        self.sender = Sender(link, layouts, self.block_size, self.engine_id, self.rank,
                             self.settings, model, self.stats, marker(device),
                             self.layout_name, device_setter(device), self.results_ready)
        self.sender.start(self.port + self.rank)

    def _start_receiver(self, layouts: list, layout: str) -> None:
        """Decode's side: reserves with the prefill workers its requests name; prefill
        writes into this worker's registered KV through the same transfer engine."""
        logger.info("epd-kv decode rank %d: %d KV layers (%s), transfer engine %s over %s",
                    self.rank, len(layouts), layout, self.link.session_id,
                    self.link.transport)
        self.receiver = Receiver(layouts, self.block_size, self.engine_id, self.rank,
                                 self.link.session_id, self.settings, self.stats,
                                 self.layout_name, self.results_ready)
        self.receiver.start()

    # -- per step ---------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        for _ in range(plan.internal_errors):
            self.stats.record("internal_errors")
        if self.sender is not None:
            self.sender.begin_step(plan)
        if self.receiver is not None:
            for recv in plan.recvs:
                self.receiver.reserve(recv)
                if recv.block_ids:  # none: nothing to receive, no result to come
                    self._receiving_blocks[recv.request_id] = recv.block_ids
            if self.prompt_tail is not None:
                self.prompt_tail.save(plan.keep)

    def layer_saved(self, layer_name: str) -> None:
        if self.sender is not None:
            self.sender.layer_saved(self.layer_index[layer_name])

    def forward_done(self) -> None:
        if self.prompt_tail is not None:
            self.prompt_tail.restore()
        if self.sender is not None:
            self.sender.forward_done()

    def fail_step(self, reason: str) -> None:
        """This step's hooks raised: the transfers it was writing fail (decode
        recomputes) instead of settling with layers missing."""
        if self.sender is not None:
            self.sender.fail_step(reason)

    def transfer_results(self, finished_req_ids: set[str], idle: bool = False
                         ) -> TransferResults:
        """The sender's finished sends and the receiver's results, merged: a kv_both
        worker has both, for different requests. After a step that computed nothing
        (`idle`), first waits for a transfer to end where one is awaited, at most
        `idle_step_wait_ms` (settings.py says why)."""
        wait_s = self.settings.idle_step_wait_ms / 1e3
        if idle and wait_s and not finished_req_ids and self._awaiting():
            self.results_ready.wait(wait_s)
        # Cleared before the results are taken: one that ends in between is taken now
        # and only makes the next wait return at once.
        self.results_ready.clear()
        sending = self.sender.take_finished() if self.sender is not None else set()
        if self.receiver is None:
            return TransferResults(sending, set(), set(), set())
        if finished_req_ids:
            self.receiver.abort(finished_req_ids)
        finished, failed, reports = self.receiver.take_results()
        self._reports.update(reports)
        if self.prompt_tail is not None:
            self.prompt_tail.landed(finished - failed)
            self.prompt_tail.forget(finished_req_ids)
        failed_blocks: set[int] = set()
        for request_id in finished:
            blocks = self._receiving_blocks.pop(request_id, [])
            if request_id in failed:
                failed_blocks.update(blocks)
        return TransferResults(sending, finished, failed, failed_blocks)

    def _awaiting(self) -> bool:
        """Whether a transfer of this worker is still to end: a request's blocks held
        for its writes (prefill), or KV still to land (decode)."""
        return (self.sender is not None and self.sender.awaiting()) \
            or (self.receiver is not None and self.receiver.awaiting())

    def take_reports(self) -> TransferReport | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return TransferReport(reports)

    def take_stats(self) -> EPDKVStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
