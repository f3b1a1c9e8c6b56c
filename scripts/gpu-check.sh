#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): our KV sender's layer groups against device
# copies beside a 7B-sized prefill, and the MM Store's staged feature path, on one GPU,
# within 8 minutes, without vLLM. Ends with
#   summary: overlap=<pct> exposed_ms=<x> bw_ratio=<x> ec_gbps=<x>
# Without a GPU the CUDA parts are skipped (the summary says `skipped`).
#
#   scripts/gpu-check.sh [gpu_check.py options]
#
# Needs python3 (PYTHON overrides) with torch, numpy, xxhash and prometheus-client, and
# msgspec and pyzmq. Where those two cannot be installed (no network), give a folder of
# their wheels in GPU_CHECK_WHEELS: they are installed (pip --no-index, or unpacked
# where that python has no pip) into a temporary folder put on PYTHONPATH. Prepare it on
# a machine with network, for the GPU machine's Python (3.12, x86_64 here), from the
# repository root:
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --dest .gpu-wheels msgspec pyzmq
#   GPU_CHECK_WHEELS=.gpu-wheels scripts/gpu-check.sh
# (.gpu-wheels/ is ignored by git: copy it to the GPU machine with the checkout.)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
pythonpath=$repo
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    wheels=("$GPU_CHECK_WHEELS"/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "$0: no wheels in GPU_CHECK_WHEELS=$GPU_CHECK_WHEELS" >&2
        exit 2
    fi
    target=$(mktemp -d)
    trap 'rm -rf "$target"' EXIT
    if "$python" -m pip --version >/dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --no-index --no-deps \
            --disable-pip-version-check --target "$target" "${wheels[@]}"
    else
        echo "gpu check: $python has no pip: unpacking ${#wheels[@]} wheel(s) instead"
        for wheel in "${wheels[@]}"; do
            "$python" -m zipfile -e "$wheel" "$target"
        done
    fi
    pythonpath=$pythonpath:$target
fi
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
timeout --kill-after=10 480 "$python" "$repo/benchmarks/gpu_check.py" "$@"
