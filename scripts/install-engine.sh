#!/usr/bin/env bash
# Installs epd-serve with one accelerator's pinned engine stack (pyproject's [cuda] or
# [ascend]) into a virtual environment: what an operator runs on an H800 or Atlas 800I
# A2 node (docs/h800.md, docs/atlas-800i-a2.md).
#   scripts/install-engine.sh cuda|ascend [VENV] [--engine-only]
# VENV defaults to .venv-<platform>. --engine-only installs what checking command lines
# needs on a machine without the device (scripts/check-engine-flags.sh): for Ascend,
# vllm-ascend's own package without torch-npu and triton-ascend, which import only with
# CANN (and on x86_64 are not all on PyPI: see docs/engine-stacks.md).
# The CPU stack is scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
platform=${1:?usage: scripts/install-engine.sh cuda|ascend [VENV] [--engine-only]}
venv=${2:-.venv-$platform}
engine_only=false
[ "${3:-}" = "--engine-only" ] && engine_only=true
# vllm-ascend 0.23.0's row of its compatibility matrix: the vLLM it runs on, and the
# index that carries triton-ascend 3.2.2 (not on PyPI).
ASCEND_VLLM=0.23.0
ASCEND_INDEX=${ASCEND_INDEX:-https://mirrors.huaweicloud.com/ascend/repos/pypi}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" install --disable-pip-version-check)
"${pip[@]}" -q --upgrade pip

case "$platform" in
cuda)
    "${pip[@]}" -e '.[cuda]'
    ;;
ascend)
    # vllm-ascend's documented two steps: vLLM first (its wheel pins CUDA's torch
    # 2.11.0), then the [ascend] row, which replaces torch with 2.10.0 + torch-npu.
    "${pip[@]}" "vllm==$ASCEND_VLLM"
    if $engine_only; then
        "${pip[@]}" torch==2.10.0 torchvision==0.25.0 torchaudio==2.10.0
        "${pip[@]}" --no-deps vllm-ascend==0.23.0
        "${pip[@]}" -e .
    else
        # On x86_64 hosts torch-npu wants PyTorch's CPU build of torch 2.10.0.
        extra=(--extra-index-url "$ASCEND_INDEX")
        [ "$(uname -m)" = x86_64 ] && extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
        "${pip[@]}" "${extra[@]}" -e '.[ascend]'
        # vLLM's requirements bring CUDA's triton, which shadows triton-ascend.
        "$venv/bin/pip" uninstall -y -q triton 2>/dev/null || true
    fi
    ;;
*)
    echo "install-engine: unknown platform '$platform' (cuda or ascend; the CPU stack is scripts/setup.sh)" >&2
    exit 2
    ;;
esac
"$venv/bin/python" -c "import vllm; print(f'install-engine: vLLM {vllm.__version__} in $venv')"
