"""What the epd KV connector does differently on Ascend, and the start-up of its
transfer engine: KV memory registered as vllm-ascend registers it (each k and v tensor's
own 2 MiB-aligned range, merged per allocation, at most 256 regions), segments that
continue one another sent as one, a deadline that allows for the first connect to a
decode session, threads that take the worker's device before they touch it, the
device's end of the forward pass kept when it comes before `wait_for_save`, and a
failed start-up that says what to check."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from epd_serve.connectors.epd_kv import events
from epd_serve.mmstore import transfer_engines
from epd_serve.connectors.epd_kv.deadlines import WriteDeadlines
from epd_serve.connectors.epd_kv.layout import (
    LayerLayout,
    Region,
    merge_contiguous,
    segments,
    storage_spans,
)
from epd_serve.connectors.epd_kv.registration import (
    HCCS_ALIGNMENT,
    MAX_ASCEND_REGIONS,
    RegistrationError,
    ascend_regions,
    kv_regions,
)
from epd_serve.connectors.epd_kv import worker as kv_worker
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.worker import CALIBRATION_BYTES, EPDKVWorker, calibration_buffer
from epd_serve.connectors.epd_kv.startup import StartupError, open_link
from epd_serve.connectors.epd_kv.transfer import TransferError

from ...waiting import wait_for
from .test_compat import kv_config
from .test_epd_kv_device import LAYER_MS, FakeDevice
from .test_epd_kv_transfer import (  # noqa: F401  (make_pair is a fixture)
    LAYERS,
    FakeLink,
    acknowledged,
    incoming,
    make_pair,
    prefill,
    recv_plan,
    results,
    send_chunk,
)

MiB = 1 << 20
BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 8, 16, 2, 128


# -- registration -------------------------------------------------------------------
def aligned_slice(nbytes: int) -> torch.Tensor:
    """vllm-ascend's `_allocate_int8_cache_tensor` (model_runner_v1.py:4004-4025): 2 MiB
    more than needed, sliced to the first 2 MiB boundary."""
    raw = torch.zeros(nbytes + HCCS_ALIGNMENT, dtype=torch.int8)
    offset = -raw.data_ptr() % HCCS_ALIGNMENT
    return raw[offset:offset + nbytes]


def ascend_layer(one_buffer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache), [blocks, tokens, heads, head_dim] bf16 each: two
    aligned allocations, or both halves of one."""
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    nbytes = torch.Size(shape).numel() * 2
    if one_buffer:
        both = aligned_slice(2 * nbytes)
        k, v = both[:nbytes], both[nbytes:]
    else:
        k, v = aligned_slice(nbytes), aligned_slice(nbytes)
    return k.view(torch.bfloat16).view(shape), v.view(torch.bfloat16).view(shape)


class FakeStorage:
    def __init__(self, base: int, nbytes: int):
        self.base, self.size = base, nbytes

    def data_ptr(self) -> int:
        return self.base

    def nbytes(self) -> int:
        return self.size


class FakeTensor:
    """A 1-D byte tensor at `address` in an allocation [base, base + size)."""

    def __init__(self, address: int, nbytes: int, storage: FakeStorage):
        self.address, self.shape, self.storage = address, (nbytes,), storage

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.shape[0]

    def stride(self) -> tuple[int, ...]:
        return (1,)

    def element_size(self) -> int:
        return 1

    def untyped_storage(self) -> FakeStorage:
        return self.storage


def test_ascend_registers_each_k_and_v_from_its_aligned_start_not_its_allocations_base():
    caches = {f"model.layers.{i}.self_attn.attn": ascend_layer() for i in range(3)}
    regions = ascend_regions(caches)
    tensors = [t for pair in caches.values() for t in pair]
    assert regions == sorted((t.data_ptr(), t.nbytes) for t in tensors)
    assert all(address % HCCS_ALIGNMENT == 0 for address, _ in regions)
    # The allocation itself starts below (vLLM's way: from its base, whole).
    assert {s for s, _ in storage_spans(caches.values())} != {a for a, _ in regions} \
        or all(t.untyped_storage().data_ptr() % HCCS_ALIGNMENT == 0 for t in tensors)
    assert kv_regions(caches, "cpu") == storage_spans(caches.values())  # CPU, CUDA: as before


def test_ranges_of_one_allocation_become_one_region():
    caches = {f"layer.{i}": ascend_layer(one_buffer=True) for i in range(2)}
    regions = ascend_regions(caches)
    # k and v of a layer: adjacent halves of one allocation (regions come in address
    # order, which need not be the layers' order of allocation)
    assert regions == sorted((k.data_ptr(), k.nbytes + v.nbytes) for k, v in caches.values())
    # Overlapping, adjacent and 4 KiB-apart ranges of one storage merge; others do not.
    storage = FakeStorage(0x4000_0000, 64 * MiB)
    base = storage.base
    tensors = {"a": FakeTensor(base, MiB, storage), "b": FakeTensor(base + MiB // 2, MiB, storage),
               "c": FakeTensor(base + 3 * MiB // 2 + 4096, MiB, storage),
               "d": FakeTensor(base + 8 * MiB, MiB, storage)}
    assert ascend_regions(tensors) == [(base, 5 * MiB // 2 + 4096), (base + 8 * MiB, MiB)]


def test_a_tensor_off_a_2mib_boundary_is_rounded_down_within_its_allocation_or_refused():
    storage = FakeStorage(0x4000_0000, 16 * MiB)
    inside = FakeTensor(storage.base + 2 * MiB + 4096, MiB, storage)
    assert ascend_regions({"layer.0": inside}) == [(storage.base + 2 * MiB, MiB + 4096)]
    unaligned = FakeStorage(0x4000_0000 + 4096, 16 * MiB)  # vLLM's own, unaligned allocation
    with pytest.raises(RegistrationError, match=r"layer\.0 \(v\).*2 MiB.*ADXL.*HCCS"):
        ascend_regions({"layer.0": (FakeTensor(unaligned.base + 4 * MiB, MiB, unaligned),
                                    FakeTensor(unaligned.base + 64, MiB, unaligned))})


def test_more_regions_than_hccl_allows_are_refused_at_start_up():
    def caches(layers: int) -> dict:
        made = {}
        for i in range(layers):
            address = 0x1000_0000 + 8 * i * MiB  # k and v: an allocation each
            k = FakeTensor(address, MiB, FakeStorage(address, MiB))
            v = FakeTensor(address + 4 * MiB, MiB, FakeStorage(address + 4 * MiB, MiB))
            made[f"layer.{i}"] = (k, v)
        return made

    assert len(ascend_regions(caches(MAX_ASCEND_REGIONS // 2))) == MAX_ASCEND_REGIONS
    with pytest.raises(RegistrationError, match="257 memory regions, more than 256: HCCL"):
        extra = FakeTensor(0x9000_0000, MiB, FakeStorage(0x9000_0000, MiB))
        ascend_regions(caches(MAX_ASCEND_REGIONS // 2) | {"extra": extra})
    with pytest.raises(RegistrationError, match="more than 255"):  # prefill's scratch
        kv_regions(caches(MAX_ASCEND_REGIONS // 2), "npu", MAX_ASCEND_REGIONS - 1)


# -- segments -------------------------------------------------------------------------
def test_segments_continuing_on_both_sides_are_one():
    assert merge_contiguous([200, 100, 300, 500], [1100, 1000, 1200, 5000], [100, 100, 100, 50]) \
        == ([100, 500], [1000, 5000], [300, 50])
    # Adjacent on one side only: still two.
    assert merge_contiguous([0, 100], [0, 500], [100, 100]) == ([0, 100], [0, 500], [100, 100])


def test_block_outermost_layers_of_a_block_go_as_one_segment():
    # BLHNC: a block holds each layer's page in turn, so layers 0-3 of a block are one run.
    layouts = [LayerLayout((Region(layer * 64, 4 * 64, 64),)) for layer in range(4)]
    srcs, dsts, lens = segments(layouts, layouts, range(4), [(1, 5, 1), (3, 2, 1)])
    assert (srcs, dsts, lens) == ([256, 768], [1280, 512], [256, 256])


def test_ascend_k_and_v_stay_one_segment_each_per_run():
    k_v = [LayerLayout((Region(0x1000_0000 * (2 * i + 1), 64, 64),
                        Region(0x1000_0000 * (2 * i + 2), 64, 64))) for i in range(3)]
    _, _, lens = segments(k_v, k_v, range(3), [(0, 4, 3)])
    assert lens == [192] * 6


# -- deadlines ------------------------------------------------------------------------
def test_writes_to_a_session_get_the_first_connect_allowance_until_one_lands():
    deadlines = WriteDeadlines(Settings(transfer_timeout_floor_s=1.0, first_connect_timeout_s=10.0))
    assert deadlines.timeout_s("d:1", 0.0) == 11.0
    deadlines.landed("d:1")
    assert deadlines.timeout_s("d:1", 0.0) == 1.0
    assert deadlines.timeout_s("d:2", 0.2) == pytest.approx(10.0 + 20 * 0.2)
    deadlines.failed("d:1")  # the transport connects afresh after a failure
    assert deadlines.timeout_s("d:1", 0.0) == 11.0
    with pytest.raises(ValueError, match="first_connect_timeout_s"):
        Settings.from_extra_config({"first_connect_timeout_s": -1})


def test_the_first_write_may_take_its_connect_the_next_ones_only_the_floor(make_pair):
    link = FakeLink()
    pair = make_pair(link=link, transfer_timeout_floor_s=0.3, first_connect_timeout_s=5.0)
    link.hold = threading.Event()
    threading.Timer(1.0, link.hold.set).start()  # the first write connects for a second
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    prefill(pair, mode="whole")
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"
    link.hold = threading.Event()  # connected: a write held past the floor fails now
    pair.receiver.reserve(recv_plan(pair, transfer="t2"))
    acknowledged(pair, "t2")
    prefill(pair, transfer="t2", mode="whole")
    wait_for(lambda: (i := incoming(pair, "t2")) is not None and i.outcome == "failed",
             what="the second write failed past the 0.3 s floor")
    link.hold.set()
    assert "not done after 0.30s" in results(pair)["reports"]["d-req"]["reason"]


# -- the device on our threads -----------------------------------------------------------
class FakeDeviceModule:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.set_on: list[tuple[str, object]] = []

    def set_device(self, device) -> None:
        if self.fail:
            raise RuntimeError("aclrtSetDevice failed")
        self.set_on.append((threading.current_thread().name, device))


def test_device_setter_sets_the_workers_device_and_nothing_on_the_cpu():
    module = FakeDeviceModule()
    npu = types.SimpleNamespace(type="npu", index=1)
    events.device_setter(npu, module)()
    assert module.set_on == [(threading.current_thread().name, npu)]
    assert events.device_setter(types.SimpleNamespace(type="cpu")) is None


def test_a_thread_takes_the_device_before_it_runs_and_failing_to_is_a_start_up_error():
    module = FakeDeviceModule()
    device = types.SimpleNamespace(type="npu", index=0)
    ran = []
    thread = events.start_thread(lambda: ran.append(list(module.set_on)), "probe",
                                 events.device_setter(device, module))
    thread.join(5)
    assert ran == [[("probe", device)]]
    with pytest.raises(RuntimeError, match="thread broken could not make the worker's device "
                                           "its own: RuntimeError: aclrtSetDevice failed"):
        events.start_thread(lambda: ran.append("never"), "broken",
                            events.device_setter(device, FakeDeviceModule(fail=True)))
    assert ran == [[("probe", device)]]


def test_the_senders_submit_and_completion_threads_take_the_device(make_pair):
    module = FakeDeviceModule()
    device = types.SimpleNamespace(type="npu", index=3)
    make_pair(on_device=events.device_setter(device, module))
    assert sorted(module.set_on) == [("epd-kv-_complete_loop", device),
                                     ("epd-kv-_submit_loop", device)]


# -- the end of the forward pass -----------------------------------------------------------
def test_the_devices_end_of_the_pass_wins_when_it_comes_before_forward_done(make_pair):
    device = FakeDevice()
    pair = make_pair(mark=device.mark)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    pair.sender.begin_step(types.SimpleNamespace(sends=[send_chunk(mode="layer")],
                                                 finished_sends=[], preempted=[], num_tokens=12))
    for layer in range(LAYERS):
        device.layers_run += 1
        pair.sender.layer_saved(layer)
    device.complete_all()  # the device is done before the engine calls wait_for_save
    wait_for(lambda: pair.sender._transfers["t1"].forward_end_measured,
             what="the submit thread timed the last layer's event")
    time.sleep(0.3)
    pair.sender.forward_done()
    report = results(pair)["reports"]["d-req"]
    assert report["outcome"] == "done"
    # The device's first to last layer, not that plus the 0.3 s before forward_done.
    assert report["prefill_ms"] == pytest.approx((LAYERS - 1) * LAYER_MS, abs=50)


# -- start-up -----------------------------------------------------------------------------
class FakeStartLink:
    fail_at: str | None = None
    made: list["FakeStartLink"] = []

    def __init__(self, host, protocol, device_name, gid_index):
        if self.fail_at == "start":
            raise TransferError("transfer engine failed to start (rdma on 10.0.0.1)")
        self.transport, self.session_id = protocol, f"{host}:1"
        self.registered: list = []
        FakeStartLink.made.append(self)

    def register(self, spans, device_type="cpu"):
        if self.fail_at == "register" and device_type == "cuda":
            raise TransferError("registering 1 KV cache allocation(s) failed")
        self.registered.append((spans, device_type))

    def calibrate(self, address, nbytes):
        if self.fail_at == "calibrate":
            raise TransferError("write failed")
        return ("model", address, nbytes)


@pytest.mark.parametrize("fail_at, step", [
    ("start", "starting the transfer engine (rdma on 10.0.0.1)"),
    ("register", "registering 1 region(s) of cuda KV cache memory (1.00 GiB) with the rdma"),
    ("calibrate", "the loopback calibration write through 10.0.0.1:1 (rdma)"),
])
def test_a_failed_start_up_says_which_step_failed_and_what_to_check(monkeypatch, fail_at, step):
    monkeypatch.setattr(FakeStartLink, "fail_at", fail_at)
    settings = Settings(host="10.0.0.1", protocol="rdma", device_name="mlx5_0", gid_index=3)
    with pytest.raises(StartupError) as failure:
        open_link(settings, [(1 << 30, 1 << 30)], "cuda", (4096, 1 << 20),
                  make_link=FakeStartLink)
    message = str(failure.value)
    assert step in message and isinstance(failure.value.__cause__, TransferError)
    for what in ("`protocol` ('rdma')", "`device_name` ('mlx5_0')", "`gid_index` (3)",
                 "kv_connector_extra_config", "WITH_NVIDIA_PEERMEM", "epd-serve doctor"):
        assert what in message


def test_a_failed_start_up_on_ascend_points_at_the_npu_setup_not_host_nics(monkeypatch):
    monkeypatch.setattr(FakeStartLink, "fail_at", "start")
    with pytest.raises(StartupError) as failure:
        open_link(Settings(protocol="ascend"), [(1 << 30, 1 << 30)], "npu",
                  make_link=FakeStartLink)
    message = str(failure.value)
    assert "/etc/hccn.conf" in message and "set_env.sh" in message
    assert "gid_index" not in message and "WITH_NVIDIA_PEERMEM" not in message


def test_a_good_start_up_registers_the_kv_then_calibrates_through_the_scratch(monkeypatch):
    monkeypatch.setattr(FakeStartLink, "fail_at", None)
    monkeypatch.setattr(FakeStartLink, "made", [])
    link, model = open_link(Settings(), [(8192, 4096)], "npu", (4096, 1024),
                            make_link=FakeStartLink)
    assert link.registered == [([(8192, 4096)], "npu"), ([(4096, 1024)], "cpu")]
    assert model == ("model", 4096, 1024)
    _, model = open_link(Settings(), [(8192, 4096)], "npu", make_link=FakeStartLink)
    assert model is None and FakeStartLink.made[-1].registered == [([(8192, 4096)], "npu")]


class CalibratingLink(FakeStartLink):
    """Records what a worker registers and whether it calibrates."""

    calibrated: list = []

    def calibrate(self, address, nbytes):
        CalibratingLink.calibrated.append((address, nbytes))
        return LinkModel(1e-4, 1e9)


def prefill_worker(monkeypatch, **settings) -> EPDKVWorker:
    """A prefill worker over aligned (k, v) caches as vllm-ascend allocates them."""
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(kv_worker, "Link", CalibratingLink)
    monkeypatch.setattr(FakeStartLink, "fail_at", None)
    monkeypatch.setattr(FakeStartLink, "made", [])
    monkeypatch.setattr(CalibratingLink, "calibrated", [])
    config = kv_config("kv_producer", **settings)
    worker = EPDKVWorker(config, types.SimpleNamespace(num_blocks=BLOCKS),
                         Settings.from_extra_config(dict(config.kv_transfer_config
                                                         .kv_connector_extra_config)))
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": ascend_layer()
                               for i in range(2)})
    return worker


def test_on_ascend_the_link_is_calibrated_through_the_kv_devices_memory_never_a_host_buffer(
        monkeypatch):
    worker = prefill_worker(monkeypatch, protocol="ascend")
    try:
        kv_device = "cpu"  # the NPU here: the caches' own device
        (link,) = FakeStartLink.made
        (_, kv_type), (scratch_spans, scratch_type) = link.registered
        assert kv_type == scratch_type == kv_device
        ((address, nbytes),) = scratch_spans
        # The buffer is a tensor of the KV's device (not a numpy host array), and what
        # is registered of it starts on a 2 MiB boundary, as ADXL needs.
        owner = worker._scratch
        assert isinstance(owner, torch.Tensor) and owner.device.type == kv_device
        assert address % HCCS_ALIGNMENT == 0 and nbytes == CALIBRATION_BYTES
        assert owner.data_ptr() <= address and address + nbytes <= owner.data_ptr() + owner.nbytes
        assert CalibratingLink.calibrated == [(address, nbytes)]
    finally:
        worker.shutdown()
    # Other transports calibrate through host memory, registered as such.
    buffer, (address, nbytes) = calibration_buffer(torch.device("cpu"), "rdma")
    assert not isinstance(buffer, torch.Tensor) and address == buffer.ctypes.data


def test_a_stated_link_model_replaces_the_calibration_and_its_buffer(monkeypatch):
    worker = prefill_worker(monkeypatch, protocol="ascend", link_overhead_ms=0.2,
                            link_gb_per_s=20.0)
    try:
        ((_, kv_type),) = FakeStartLink.made[0].registered  # the KV only
        assert CalibratingLink.calibrated == [] and worker._scratch is None
        assert worker.sender.table.link_cost.model.transfer_s(20e9) == pytest.approx(1.0002)
    finally:
        worker.shutdown()
    with pytest.raises(ValueError, match="give both"):
        Settings.from_extra_config({"link_gb_per_s": 20.0})


# -- one transfer engine per process ----------------------------------------------------
def test_a_second_ascend_transfer_engine_in_a_process_is_refused_tcp_ones_may_share(monkeypatch):
    monkeypatch.setattr(transfer_engines, "_engines", {})  # none of earlier tests' engines
    tokens = [transfer_engines.claim_engine("the epd KV connector", "tcp"),
              transfer_engines.claim_engine("the MM Store's Mooncake client", "tcp")]
    try:
        with pytest.raises(transfer_engines.EngineConflict, match="multiprocessing executor"):
            transfer_engines.claim_engine("the MM Store's Mooncake client", "ascend")
        for token in tokens:
            transfer_engines.release_engine(token)
        tokens = [transfer_engines.claim_engine("the epd KV connector", "ascend")]
        with pytest.raises(transfer_engines.EngineConflict,
                           match="the MM Store's Mooncake client would start a second .*"
                                 "runs the epd KV connector \\(ascend\\)"):
            transfer_engines.claim_engine("the MM Store's Mooncake client", "tcp")
    finally:
        for token in tokens:
            transfer_engines.release_engine(token)
    transfer_engines.release_engine(transfer_engines.claim_engine("the epd KV connector", "ascend"))  # freed


def test_regions_registered_the_ascend_way_carry_every_segment_through_a_real_engine():
    # Mooncake's engine (TCP on loopback, in the test netns) refuses a write into memory
    # outside the registered regions: decode's, registered the Ascend way, hold every
    # segment a transfer writes.
    from epd_serve.connectors.epd_kv.layout import block_runs, describe_layer
    from epd_serve.connectors.epd_kv.transfer import Link

    prefill = {f"layer.{i}": ascend_layer() for i in range(3)}
    decode = {f"layer.{i}": ascend_layer() for i in range(3)}
    for k, v in prefill.values():
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    link = Link("127.0.0.1", "tcp")
    link.register(ascend_regions(prefill) + ascend_regions(decode))
    src = [describe_layer(c, BLOCKS) for c in prefill.values()]
    dst = [describe_layer(c, BLOCKS) for c in decode.values()]
    link.write(link.session_id, *segments(src, dst, range(3), block_runs([1, 2, 5], [6, 7, 0])))
    for (pk, pv), (dk, dv) in zip(prefill.values(), decode.values()):
        assert torch.equal(dk[[6, 7, 0]], pk[[1, 2, 5]])
        assert torch.equal(dv[[6, 7, 0]], pv[[1, 2, 5]])
        assert not dk[[1, 2, 3, 4, 5]].any()
