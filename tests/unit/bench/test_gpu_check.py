"""The GPU check (scripts/gpu-check.sh, benchmarks/gpu_check.py) on this machine: with
no GPU it still drives the real sender and receiver (the CPU as the device), checks the
bytes that landed, says the CUDA parts were skipped, and ends with its summary line;
all of it with vLLM unimportable, as on the GPU machine. Its KV caches are the views
vLLM 0.32's `create_kv_cache_views` makes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SUMMARY = "summary: overlap=skipped exposed_ms=skipped bw_ratio=skipped ec_gbps=skipped"
KV_LINE = re.compile(r"^kv (\w+) on cpu: (\d+) requests, (\d+) layers in ([\d/]+) groups, "
                     r"(\d+) B a request landed and verified; .* overlap ([\d.]+)%$", re.M)


def gpu_check_module():
    """benchmarks/gpu_check.py as a module (benchmarks/ is not a package)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check",
                                                      REPO / "benchmarks/gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The script's output, run with a `vllm` package ahead of the real one on the path
    that refuses to be imported."""
    stub = tmp_path_factory.mktemp("no-vllm")
    (stub / "vllm").mkdir()
    (stub / "vllm" / "__init__.py").write_text(
        'raise ImportError("vLLM is not installed on the GPU machine")\n')
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stub)}
    env.pop("GPU_CHECK_WHEELS", None)
    done = subprocess.run([str(REPO / "scripts/gpu-check.sh"), "--device", "cpu",
                           "--requests", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_cpu_run_drives_the_sender_and_says_the_cuda_parts_were_skipped(cpu_run):
    shape = gpu_check_module().SMALL
    assert "vllm not imported" in cpu_run
    assert "no GPU (asked for the CPU): the CUDA parts are skipped" in cpu_run
    found = KV_LINE.findall(cpu_run)
    assert [layout for layout, *_ in found] == ["LBHNC", "LBNHC"], cpu_run
    page = shape.kv_heads * shape.block_size * 2 * shape.head_dim * 2  # bf16 k and v
    for _, requests, layers, groups, nbytes, overlap in found:
        assert (int(requests), int(layers)) == (2, shape.layers)
        # Layer groups, not one write: the group path ran (the last layer goes alone).
        assert all(int(g) >= 2 for g in groups.split("/"))
        assert int(nbytes) == shape.layers * (shape.tokens // shape.block_size) * page
        assert 0 <= float(overlap) <= 100
    assert cpu_run.rstrip().splitlines()[-1] == SUMMARY


def test_the_check_imports_no_vllm():
    code = ("import sys, runpy; sys.modules['vllm'] = None; "
            f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--requests', '1', "
            f"'--layouts', 'LBHNC', '--tokens', '32']; "
            f"runpy.run_path({str(REPO / 'benchmarks/gpu_check.py')!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1] == SUMMARY


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kv_caches_are_the_views_vllm_makes(layout):
    pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.32's KV cache layouts")
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    check = gpu_check_module()
    shape, blocks = check.SMALL, 7
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.kv_heads,
                             head_size=shape.head_dim, dtype=torch.bfloat16)
    vllm_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, shape.layers,
                                                            vllm_layout)
    tensor = KVCacheTensor(size=shape.layers * blocks * spec.page_size_bytes,
                           layers=[f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    theirs = create_kv_cache_views(raw, spec, blocks, vllm_layout, tensor)
    ours = check.kv_caches(layout, shape, blocks, torch.bfloat16, torch.device("cpu"))
    assert len(ours) == len(theirs) == shape.layers
    for mine, vllms in zip(ours, theirs):
        assert (mine.shape, mine.stride(), mine.dtype) == (vllms.shape, vllms.stride(),
                                                           vllms.dtype)
        assert mine.storage_offset() == vllms.storage_offset()
    assert ours[0].untyped_storage().nbytes() == raw.untyped_storage().nbytes()
    # FlashAttention's k and v: [blocks, tokens, heads, head_dim] each.
    key, value = check.k_and_v(ours[1], shape.head_dim)
    assert key.shape == value.shape == (blocks, shape.block_size, shape.kv_heads, shape.head_dim)
