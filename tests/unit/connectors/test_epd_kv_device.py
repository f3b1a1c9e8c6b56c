"""The prefill sender as it runs on a GPU or NPU, where a hook only means the kernels are
queued: fake device events that complete when the test says so show that no byte is
read before the event of the layers it carries has completed (group, layer and whole
modes), and that the per-layer compute time comes from the events, not from the CPU
gaps between hooks. Also: which blocks each prefill chunk ships, how the events are
created, and what the connector tells vLLM about graphs and layouts."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from epd_serve.connectors import compat
from epd_serve.connectors.epd_kv import events
from epd_serve.connectors.epd_kv.connector import EPDKVConnector
from epd_serve.connectors.epd_kv.messages import blocks_to_ship
from epd_serve.connectors.epd_kv.scheduler import EPDKVScheduler
from epd_serve.connectors.epd_kv.settings import Settings

from .test_epd_kv_transfer import (  # noqa: F401  (make_pair is a fixture)
    BLOCK_SIZE,
    LAYERS,
    acknowledged,
    make_pair,
    recv_plan,
    results,
    send_chunk,
    wait_for,
)

LAYER_MS = 40.0  # device time per layer the fake events report


class FakeEvent:
    """A device event: `synchronize` blocks until the test completes it; its time is
    the device's time when it was recorded (LAYER_MS per layer recorded before it)."""

    def __init__(self, device_ms: float):
        self.device_ms = device_ms
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "a test event was never completed"

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.device_ms - self.device_ms


class FakeDevice:
    """Records an event per mark; the device's clock advances LAYER_MS per layer hook."""

    def __init__(self):
        self.events: list[FakeEvent] = []
        self.layers_run = 0

    def mark(self) -> FakeEvent:
        self.events.append(FakeEvent(self.layers_run * LAYER_MS))
        return self.events[-1]

    def complete_all(self) -> None:
        for event in self.events:
            event.done.set()


def step(pair, device: FakeDevice, mode: str, transfer="t1", blocks=(2, 3, 4)) -> None:
    """One prefill step on the device: hooks fire at once (kernels are only queued)."""
    chunk = send_chunk(transfer, blocks, mode=mode)
    pair.sender.begin_step(types.SimpleNamespace(sends=[chunk], finished_sends=[],
                                                 preempted=[], num_tokens=12))
    for layer in range(LAYERS):
        device.layers_run += 1
        pair.sender.layer_saved(layer)
    pair.sender.forward_done()


@pytest.mark.parametrize("mode", ["group", "layer", "whole"])
def test_no_byte_is_read_before_the_device_event_of_its_layers_completes(make_pair, mode):
    device = FakeDevice()
    pair = make_pair(mark=device.mark)
    reads = []
    copy = pair.link.submit
    pair.link.submit = lambda *args: (reads.append(args), copy(*args))[1]
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    step(pair, device, mode)
    assert device.events, "a device job was queued without an event to wait on"
    time.sleep(0.3)  # time for a submit thread that does not wait to read the KV
    assert reads == [] and not pair.d_memory.any()
    device.complete_all()
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"
    assert reads and np.array_equal(pair.d_memory[:, 9:12], pair.p_memory[:, 2:5])


def test_a_step_without_layer_hooks_sends_every_layer_after_the_pass(make_pair):
    # A full CUDA graph replay runs no per-layer hook: the step's KV still goes, whole.
    device = FakeDevice()
    pair = make_pair(mark=device.mark)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    pair.sender.begin_step(types.SimpleNamespace(sends=[send_chunk()], finished_sends=[],
                                                 preempted=[], num_tokens=12))
    pair.sender.forward_done()
    device.complete_all()
    report = results(pair)["reports"]["d-req"]
    assert (report["outcome"], report["groups"]) == ("done", 1)
    assert np.array_equal(pair.d_memory[:, 9:12], pair.p_memory[:, 2:5])


def test_a_group_is_written_once_its_own_event_completes_not_before(make_pair):
    device = FakeDevice()
    pair = make_pair(mark=device.mark)
    written = []
    copy = pair.link.submit
    pair.link.submit = lambda *args: (written.append(len(args[3])), copy(*args))[1]
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    step(pair, device, "layer")
    start, *layer_events = device.events  # the step's first layer, then one per layer
    assert len(layer_events) == LAYERS
    start.done.set()
    layer_events[0].done.set()
    wait_for(lambda: len(written) == 1, what="layer 0 written once its event completed")
    time.sleep(0.2)
    assert len(written) == 1  # layer 1's event has not completed: nothing more is read
    device.complete_all()
    assert results(pair)["reports"]["d-req"]["outcome"] == "done"


def test_layer_compute_time_comes_from_device_events_not_cpu_gaps(make_pair):
    device = FakeDevice()
    pair = make_pair(mark=device.mark)
    pair.receiver.reserve(recv_plan(pair))
    acknowledged(pair)
    step(pair, device, "layer")
    device.complete_all()
    report = results(pair)["reports"]["d-req"]
    assert report["outcome"] == "done"
    # Hooks came microseconds apart on the CPU; the device took LAYER_MS per layer.
    assert pair.sender.compute.layer_s_per_token == pytest.approx(LAYER_MS / 1e3 / 12)
    # The prefill time reported is the device's, from the first layer to the last.
    assert report["prefill_ms"] == pytest.approx((LAYERS - 1) * LAYER_MS)


def test_device_events_are_blocking_timed_and_on_the_devices_current_stream():
    made = []

    class Module:
        @staticmethod
        def current_stream(device):
            return ("stream of", device)

        class Event:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                made.append(self)

            def record(self, stream):
                self.stream = stream

    device = types.SimpleNamespace(type="cuda", index=0)
    event = events.marker(device, Module)()
    assert event.kwargs == {"enable_timing": True, "blocking": True}
    assert event.stream == ("stream of", device)
    assert events.marker(types.SimpleNamespace(type="cpu")) is None


@pytest.mark.parametrize("end, prompt, shipped, expected", [
    (6, 12, 0, (0, 1)),  # block 1 is half written: it goes with the next chunk
    (12, 12, 1, (1, 3)),  # ... which fills it, and the last one ships the tail too
    (10, 10, 2, (2, 3)),  # a partial tail block goes with the last chunk
    (3, 12, 0, (0, 0)),  # a chunk that fills no block ships nothing
    (12, 12, 0, (0, 3)),  # prefill's own cached blocks go with its first chunk
])
def test_each_block_is_shipped_once_with_the_chunk_that_fills_it(end, prompt, shipped, expected):
    assert blocks_to_ship(end, prompt, 4, shipped) == expected


def test_the_scheduler_ships_every_block_of_a_chunked_prompt_exactly_once():
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK_SIZE),
                                   kv_transfer_config=types.SimpleNamespace(kv_role="kv_producer"))
    scheduler = EPDKVScheduler(config, Settings())
    # Prefill had the first block cached: its first chunk starts at token 4.
    request = types.SimpleNamespace(request_id="r", num_computed_tokens=4, num_prompt_tokens=15,
                                    kv_transfer_params={"do_remote_decode": True,
                                                        "transfer_id": "t"})
    scheduler.update_state_after_alloc(request, None, 0)
    shipped = []
    # The blocks each chunk's step allocates, as vLLM's scheduler output gives them.
    for count, new_blocks in ((3, [5, 6]), (5, [7]), (3, [8])):  # [4, 7), [7, 12), [12, 15)
        first = request.num_computed_tokens == 4
        out = types.SimpleNamespace(
            total_num_scheduled_tokens=count, num_scheduled_tokens={"r": count},
            preempted_req_ids=set(),
            scheduled_new_reqs=[types.SimpleNamespace(req_id="r", block_ids=([5, 6],))]
            if first else [],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[] if first else ["r"], new_block_ids=[] if first else [(new_blocks,)],
                resumed_req_ids=set()))
        (chunk,) = scheduler.build_connector_meta(out).sends
        shipped += chunk.block_ids[chunk.first_block:chunk.end_block]
        request.num_computed_tokens += count
    assert shipped == [5, 6, 7, 8]


def test_decode_keeps_full_graphs_and_the_layout_asked_of_vllm():
    piecewise = EPDKVConnector.requires_piecewise_for_cudagraph
    assert piecewise({"role": "kv_producer"}) and piecewise({})
    assert not piecewise({"role": "kv_consumer"})
    assert not piecewise({"role": "kv_producer", "mode": "whole"})

    def config(extra):
        return types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config=extra))

    # LBHNC by default, by the name the running vLLM gives it (HND before vLLM 0.32).
    default = "LBHNC" if compat.STRIDE_ORDER_LAYOUTS else "HND"
    assert EPDKVConnector.get_required_kvcache_layout(config({})) == default
    assert EPDKVConnector.get_required_kvcache_layout(config({"kv_cache_layout": "auto"})) is None
    with pytest.raises(ValueError, match="kv_cache_layout must be one of"):
        Settings.from_extra_config({"kv_cache_layout": "NHD"})
