"""`DeviceCopyLink`, the in-process transfer engine of the GPU check, on the CPU: it
writes between registered memory only, refuses a write before copying any of it, and
has what the sender and the drain thread use of `transfer.Link`."""

from __future__ import annotations

import pytest
import torch

from epd_serve.connectors.epd_kv.device_copy import DeviceCopyLink
from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.transfer import TransferError


@pytest.fixture
def memory():
    src = torch.arange(256, dtype=torch.int32).view(torch.uint8)  # 1 KiB
    dst = torch.zeros(2048, dtype=torch.uint8)
    link = DeviceCopyLink("cpu")
    link.register([(src.data_ptr(), src.numel()), (dst.data_ptr(), dst.numel())])
    return link, src, dst


def test_segments_land_where_they_are_addressed(memory):
    link, src, dst = memory
    base, far = src.data_ptr(), dst.data_ptr()
    write = link.submit(link.session_id, [base, base + 512], [far + 1024, far], [256, 128])
    assert link.done(write) and link.segments_ended(write)
    assert torch.equal(dst[1024:1280], src[:256]) and torch.equal(dst[:128], src[512:640])
    assert not dst[128:1024].any() and not dst[1280:].any()


@pytest.mark.parametrize("where", ["past the end", "unregistered", "another peer"])
def test_a_refused_write_copies_nothing(memory, where):
    link, src, dst = memory
    srcs, dsts, lens = [src.data_ptr()] * 2, [dst.data_ptr(), dst.data_ptr() + 64], [64, 64]
    peer = link.session_id
    if where == "past the end":
        lens[1] = src.numel() + 1
    elif where == "unregistered":
        dsts[1] = 4096
    else:
        peer = "127.0.0.1:12345"
    with pytest.raises(TransferError) as refused:
        link.submit(peer, srcs, dsts, lens)
    assert refused.value.unfinished is None and not dst.any()


def test_memory_of_another_device_is_refused():
    with pytest.raises(TransferError, match="copies on cpu, not on cuda memory"):
        DeviceCopyLink("cpu").register([(4096, 64)], "cuda")


def test_calibration_and_waiting_come_from_link(memory):
    link, src, dst = memory
    scratch = torch.zeros(1 << 16, dtype=torch.uint8)
    link.register([(scratch.data_ptr(), scratch.numel())])
    model = link.calibrate(scratch.data_ptr(), scratch.numel(), repeats=2)
    assert isinstance(model, LinkModel) and model.bytes_per_s > 0
    link.write(link.session_id, [src.data_ptr()], [dst.data_ptr()], [src.numel()])
    assert torch.equal(dst[:1024], src)
    assert link.take_copy_times() == []  # device times only: the CPU copies at submit
