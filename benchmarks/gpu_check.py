"""A GPU check of the KV sender and the feature path that fits one GPU and needs
no vLLM (torch, numpy, msgspec, pyzmq, xxhash, prometheus-client; scripts/gpu-check.sh
runs it, within 8 minutes on one H100).

KV: prefill and decode share the device, each with its own KV cache laid out as vLLM
0.32's `create_kv_cache_views` lays it out for FlashAttention (one buffer, a
[blocks, heads, tokens, k+v] view per layer, in the physical order of LBHNC or LBNHC).
A forward pass of Qwen2-7B-sized layers (hidden 3584, 28 query and 4 KV heads of 128,
MLP 18944; one layer's weights run as every layer) over a 4096-token prefill chunk
writes each layer's KV into its blocks as FlashAttention's cache update does, then
calls the real `Sender` (sender.py, group mode, layer groups fitted from calibration)
with device events recorded on the forward's stream (events.py), against a real
`Receiver` over the side channel. The transfer engine is `DeviceCopyLink`
(device_copy.py): every segment a `cudaMemcpyAsync` on a stream of its own. Per layout,
medians over `--requests` requests after one warm-up, each request's decode blocks
checked byte for byte against prefill's:
- overlap = 1 - exposed / link busy time (as benchmarks/kv_transfer_bench.py), at
  least 0;
- exposed: the last write's completion after the forward pass ended (the sender's own
  measure, sent to decode in `Done`);
- copy GB/s: the writes' bytes over the device time of their copies (events on the copy
  stream, while the forward pass computes beside them); bw_ratio = that over one plain
  `cudaMemcpyAsync` of the same bytes on an idle device. The sender's own view, bytes
  over link busy time, is printed too: it includes its completion polling (POLL_S).
Features: benchmarks/mmstore_cuda.py's staged E -> P path (pinned `HostStaging` on both
sides, as the EC connector's workers use it) through the shared-memory MM Store;
ec_gbps = feature bytes over E -> P total at the largest size.

Ends with one line:
  summary: overlap=<pct> exposed_ms=<x> bw_ratio=<x> ec_gbps=<x>
(the worst layout's overlap, exposed time and ratio). Without a GPU the CUDA parts are
skipped and said so (every summary value `skipped`); the sender path still runs on the
CPU, small shapes, the CPU as device, and its bytes are checked. A transfer that fails
or a block that arrives changed stops the check with that error (exit status 1).

    PYTHONPATH=. python benchmarks/gpu_check.py [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import socket
import statistics
import sys
import time
import types
from pathlib import Path

try:
    import msgspec  # noqa: F401  (the side channel's messages; the MM Store's)
    import zmq  # noqa: F401  (the side channel)
except ImportError as missing:
    sys.exit(f"gpu check: {missing.name} is not installed: give scripts/gpu-check.sh a "
             "folder of wheels in GPU_CHECK_WHEELS (how to download them: see that script)")

import torch
import torch.nn.functional as F

from epd_serve.connectors.epd_kv.device_copy import DeviceCopyLink
from epd_serve.connectors.epd_kv.events import device_setter, marker
from epd_serve.connectors.epd_kv.layout import describe_layer, storage_spans
from epd_serve.connectors.epd_kv.messages import FinishedSend, RecvPlan, SendChunk, blocks_to_ship
from epd_serve.connectors.epd_kv.receiver import Receiver
from epd_serve.connectors.epd_kv.sender import Sender
from epd_serve.connectors.epd_kv.settings import Settings

# vLLM 0.32's physical orders of the logical [L, B, H, N, C] dimensions
# (vllm/v1/kv_cache_layout.py): the two FlashAttention runs with on one GPU.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}
CALIBRATION_BYTES = 16 << 20  # as the KV worker's scratch (worker.py)
WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    block_size: int = 16

    def __str__(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, "
                f"{self.q_heads} query and {self.kv_heads} KV heads x {self.head_dim}, "
                f"{self.tokens}-token prefill, {self.block_size}-token blocks")


QWEN2_7B = Shape(layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4,
                 head_dim=128, tokens=4096)
# The CPU run: the sender path at Qwen2-7B's depth, small enough for a unit test.
SMALL = Shape(layers=28, hidden=128, intermediate=256, q_heads=4, kv_heads=2, head_dim=32,
              tokens=64)


# -- the KV caches -------------------------------------------------------------------
def kv_caches(layout: str, shape: Shape, num_blocks: int, dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    """One engine's per-layer caches, as vLLM 0.32's `create_kv_cache_views` makes them
    for a full-attention layer (no padded pages, no kernel-block split): byte strides of
    [L, B, H, N, C] in the layout's physical order over one int8 buffer (C: k and v of
    one head and token), each layer's [B, H, N, C] view read as `dtype`."""
    content = 2 * shape.head_dim * torch.empty((), dtype=dtype).element_size()
    logical = (shape.layers, num_blocks, shape.kv_heads, shape.block_size, content)
    strides, size = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim], size = size, size * logical[dim]
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, logical, strides)
    return [view[layer].view(dtype) for layer in range(shape.layers)]


def k_and_v(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's (key_cache, value_cache), each [B, N, H, D]."""
    return cache.transpose(1, 2).split(head_dim, dim=-1)


# -- the model -------------------------------------------------------------------------
class Layer:
    """One decoder layer's weights, run as every layer (the compute is the same)."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device):
        generator = torch.Generator(device=device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=generator, device=device,
                               dtype=dtype) / math.sqrt(rows)

        qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
        self.shape = shape
        self.qkv = weight(shape.hidden, qkv)
        self.o = weight(shape.q_heads * shape.head_dim, shape.hidden)
        self.gate_up = weight(shape.hidden, 2 * shape.intermediate)
        self.down = weight(shape.intermediate, shape.hidden)

    def attention(self, x: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
        """Projections, the KV written into `cache` at (blocks, slots) per token as
        `reshape_and_cache_flash` does, causal attention."""
        s = self.shape
        q, k, v = (F.rms_norm(x, (s.hidden,)) @ self.qkv).split(
            [s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        k = k.reshape(-1, s.kv_heads, s.head_dim)
        v = v.reshape(-1, s.kv_heads, s.head_dim)
        key_cache, value_cache = k_and_v(cache, s.head_dim)
        key_cache[blocks, slots] = k
        value_cache[blocks, slots] = v
        heads = [t.transpose(0, 1).unsqueeze(0) for t in
                 (q.reshape(-1, s.q_heads, s.head_dim), k, v)]
        out = F.scaled_dot_product_attention(*heads, is_causal=True, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(-1, s.q_heads * s.head_dim)

    def rest(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and MLP."""
        x = x + attended @ self.o
        gate, up = (F.rms_norm(x, (self.shape.hidden,)) @ self.gate_up).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.down


# -- prefill and decode in one process --------------------------------------------------
class Records:
    """The sender's and receiver's stats (vLLM's container is not needed here)."""

    def __init__(self):
        self.records: list = []

    def record(self, key: str) -> None:
        self.records.append(key)

    def record_send(self, *values) -> None:
        self.records.append(("sent", *values))


@dataclasses.dataclass
class Measured:
    nbytes: int
    groups: int
    prefill_ms: float
    transfer_ms: float
    exposed_ms: float
    copy_gbps: float | None  # device time of the copies (None on the CPU)

    @property
    def overlap(self) -> float:
        """Share of the link's busy time hidden behind the forward pass; none where the
        writes ended later after the pass than they were busy (they started after it)."""
        return max(0.0, 1 - self.exposed_ms / self.transfer_ms) if self.transfer_ms else 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {WAIT_S:.0f}s")
        time.sleep(0.001)
    return value


class Pair:
    """A prefill `Sender` and a decode `Receiver` on one device, each with its own KV
    cache, moving blocks through one `DeviceCopyLink`, driven as an engine drives them
    (tests/unit/connectors/test_epd_kv_transfer.py drives them the same way)."""

    def __init__(self, layout: str, shape: Shape, dtype: torch.dtype, device: torch.device):
        self.shape, self.device = shape, device
        per_request = -(-shape.tokens // shape.block_size)
        # Prefill's blocks in one run; decode's in two, swapped (two segments a layer).
        self.p_blocks = list(range(1, 1 + per_request))
        half = per_request // 2
        self.d_blocks = list(range(3 + half, 3 + per_request)) + list(range(3, 3 + half))
        num_blocks = per_request + 4
        self.prefill = kv_caches(layout, shape, num_blocks, dtype, device)
        self.decode = kv_caches(layout, shape, num_blocks, dtype, device)
        p_layouts = [describe_layer(cache, num_blocks) for cache in self.prefill]
        d_layouts = [describe_layer(cache, num_blocks) for cache in self.decode]
        tokens = torch.arange(shape.tokens, device=device)
        self.slot_blocks = torch.tensor(self.p_blocks, device=device)[tokens // shape.block_size]
        self.slots = tokens % shape.block_size
        self.link = DeviceCopyLink(device)
        self._scratch = torch.zeros(CALIBRATION_BYTES, dtype=torch.uint8, device=device)
        self.link.register(storage_spans(self.prefill) + storage_spans(self.decode)
                           + storage_spans([self._scratch]), device.type)
        self.link_model = self.link.calibrate(self._scratch.data_ptr(), CALIBRATION_BYTES)
        self.link.take_copy_times()  # the calibration's
        settings = Settings(kv_cache_layout=layout, mode="group", group_size="auto")
        self.port = free_port()
        self.sender = Sender(self.link, p_layouts, shape.block_size, "prefill", 0, settings,
                             self.link_model, Records(), marker(device), layout,
                             device_setter(device))
        self.sender.start(self.port)
        self.receiver = Receiver(d_layouts, shape.block_size, "decode", 0,
                                 self.link.session_id, settings, Records(), layout)
        self.receiver.start()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()

    def request(self, n: int, layer: Layer) -> Measured:
        """Reserve, prefill, wait for decode's report; check decode's blocks."""
        s, transfer, request = self.shape, f"t{n}", f"r{n}"
        self.receiver.reserve(RecvPlan(f"d-{request}", transfer, "127.0.0.1", self.port,
                                       self.d_blocks, 0, s.tokens))
        # Reserved before prefill computes, as when decode is idle. Read off decode's
        # record, as the connector's unit tests do.
        wait(lambda: getattr(self.receiver._incoming.get(transfer), "acked", False),
             f"prefill acknowledged reservation {transfer}")
        first, end = blocks_to_ship(s.tokens, s.tokens, s.block_size, 0)
        chunk = SendChunk(request, transfer, self.p_blocks, 0, s.tokens, s.tokens, first, end,
                          "group")
        generator = torch.Generator(device=self.device).manual_seed(n)
        x = torch.randn(s.tokens, s.hidden, generator=generator, device=self.device,
                        dtype=layer.qkv.dtype)
        self._synchronize()
        self.sender.begin_step(types.SimpleNamespace(sends=[chunk], finished_sends=[],
                                                     preempted=[], num_tokens=s.tokens))
        for index, cache in enumerate(self.prefill):
            attended = layer.attention(x, cache, self.slot_blocks, self.slots)
            self.sender.layer_saved(index)  # vLLM's save_kv_layer: after attention
            x = layer.rest(x, attended)
        self.sender.forward_done()
        report = self._report(f"d-{request}")
        if report["outcome"] != "done":
            raise RuntimeError(f"transfer {transfer} {report['outcome']}: "
                               f"{report.get('reason', '')}")
        self.sender.begin_step(types.SimpleNamespace(
            sends=[], finished_sends=[FinishedSend(request, transfer, False)], preempted=[],
            num_tokens=0))
        wait(lambda: request in self.sender.take_finished(), f"prefill freed {request}")
        self._check_blocks(transfer)
        copies = self.link.take_copy_times()
        copy_gbps = None
        if self.device.type != "cpu":
            copy_gbps = sum(b for b, _ in copies) / sum(t for _, t in copies) / 1e9
        return Measured(report["bytes"], report["groups"], report["prefill_ms"],
                        report["transfer_ms"], report["exposed_ms"], copy_gbps)

    def _report(self, request: str) -> dict:
        def taken():
            _, _, reports = self.receiver.take_results()
            return reports.get(request)

        return wait(taken, f"decode's report of {request}")

    def _check_blocks(self, transfer: str) -> None:
        self._synchronize()
        p_index = torch.tensor(self.p_blocks, device=self.device)
        d_index = torch.tensor(self.d_blocks, device=self.device)
        for layer, (p, d) in enumerate(zip(self.prefill, self.decode)):
            if not torch.equal(p[p_index].view(torch.int16), d[d_index].view(torch.int16)):
                raise RuntimeError(f"transfer {transfer}: layer {layer}'s KV differs in "
                                   "decode's blocks")

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)


def plain_copy_gbps(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """One `cudaMemcpyAsync` of `nbytes` between two buffers on an idle device."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream(device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9


@dataclasses.dataclass
class LayoutResult:
    layout: str
    overlap: float
    exposed_ms: float
    bw_ratio: float | None


def check_kv(layout: str, shape: Shape, requests: int, device: torch.device) -> LayoutResult:
    dtype = torch.bfloat16
    layer = Layer(shape, dtype, device)
    pair = Pair(layout, shape, dtype, device)
    where = "" if device.type != "cpu" else " on cpu"
    model = pair.link_model
    print(f"kv {layout}{where}: {pair.link.transport} link calibrated at "
          f"{model.overhead_s * 1e3:.3f} ms per write + {model.bytes_per_s / 1e9:.2f} GB/s")
    try:
        pair.request(0, layer)  # warm-up: kernels, and the sender learns the compute time
        runs = [pair.request(n, layer) for n in range(1, requests + 1)]
    finally:
        pair.close()
    nbytes = runs[0].nbytes
    overlap = statistics.median(r.overlap for r in runs)
    exposed = statistics.median(r.exposed_ms for r in runs)
    transfer = statistics.median(r.transfer_ms for r in runs)
    groups = sorted({r.groups for r in runs})
    print(f"kv {layout}{where}: {requests} requests, {shape.layers} layers in "
          f"{'/'.join(map(str, groups))} groups, {nbytes} B a request landed and verified; "
          f"prefill {statistics.median(r.prefill_ms for r in runs):.2f} ms, link busy "
          f"{transfer:.3f} ms ({nbytes / transfer / 1e6:.2f} GB/s as the sender sees it), "
          f"exposed {exposed:.3f} ms, overlap {overlap * 100:.2f}%")
    if device.type == "cpu":
        return LayoutResult(layout, overlap, exposed, None)
    copy = statistics.median(r.copy_gbps for r in runs)
    plain = plain_copy_gbps(nbytes, device)
    print(f"kv {layout}: copies {copy:.1f} GB/s on the device beside the forward pass, one "
          f"plain cudaMemcpyAsync of the same {nbytes} B {plain:.1f} GB/s, "
          f"ratio {copy / plain:.3f}")
    return LayoutResult(layout, overlap, exposed, copy / plain)


# -- the feature path -------------------------------------------------------------------
def check_ec(sizes: list[str], repeats: int, port: int) -> float:
    """GB/s of the staged E -> P path at the largest of `sizes`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mmstore_cuda

    rows = mmstore_cuda.measure(sizes, repeats, port)
    mmstore_cuda.print_table(rows)
    if not all(row.intact for row in rows):
        raise RuntimeError("the features reached the consumer's GPU changed")
    largest = max(rows, key=lambda row: row.nbytes)
    gbps = largest.nbytes / largest.medians["E->P total"] / 1e9
    print(f"ec: staged E -> P {gbps:.2f} GB/s for {largest.label} "
          f"({largest.nbytes / 2**20:.1f} MiB)")
    return gbps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda where torch sees a GPU, else cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--requests", type=int, default=5, help="measured, per layout")
    parser.add_argument("--tokens", type=int, help="prefill chunk (default: 4096 on a "
                        f"GPU, {SMALL.tokens} on the CPU)")
    parser.add_argument("--ec-sizes", default="1080x1920,4096x3112")
    parser.add_argument("--ec-repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=18760, help="the MM Store's (and +1)")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in LAYOUTS:
            parser.error(f"unknown layout {layout!r}; choose of {', '.join(LAYOUTS)}")
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    print(f"gpu check: python {platform.python_version()}, torch {torch.__version__}, "
          f"vllm {'imported' if sys.modules.get('vllm') is not None else 'not imported'}")
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}")
        shape = QWEN2_7B
    else:
        device = torch.device("cpu")
        why = "asked for the CPU" if args.device == "cpu" else "torch sees no GPU"
        print(f"no GPU ({why}): the CUDA parts are skipped (7B-sized compute, device "
              "copies and their bandwidth, the MM Store's staged path); the sender path "
              "runs with the CPU as its device, small shapes, bytes checked")
        shape = SMALL
    if args.tokens:
        shape = dataclasses.replace(shape, tokens=args.tokens)
    print(f"kv: {shape}, bf16")
    results = [check_kv(layout, shape, args.requests, device) for layout in layouts]
    if not cuda:
        print("summary: overlap=skipped exposed_ms=skipped bw_ratio=skipped ec_gbps=skipped")
        return 0
    ec_gbps = check_ec(args.ec_sizes.split(","), args.ec_repeats, args.port)
    overlap = min(r.overlap for r in results)
    exposed = max(r.exposed_ms for r in results)
    ratio = min(r.bw_ratio for r in results)
    print(f"summary: overlap={overlap * 100:.2f}% exposed_ms={exposed:.3f} "
          f"bw_ratio={ratio:.3f} ec_gbps={ec_gbps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
