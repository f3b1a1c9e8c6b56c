#!/usr/bin/env bash
# Checks every engine command line the shipped deployment files emit against the engine
# each platform pins: installs the platform's stack into a scratch environment (re-used
# until pyproject.toml or the install script change) and runs `epd-serve check-flags`
# there on the platform's folder of configs/, which feeds each instance's flags, KV/EC
# transfer configs and environment through that engine's own parser, config classes
# and connector factories.
#   scripts/check-engine-flags.sh [cpu] [cuda] [ascend]     (default: all three)
# No GPU or NPU is needed. The CPU stack is the project's .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=${EPD_ENGINE_CHECK_DIR:-.epd/engine-check}
platforms=("$@")
((${#platforms[@]})) || platforms=(cpu cuda ascend)

# Where each platform's shipped deployment files are: this repository's, not the package's.
declare -A configs=([cpu]=configs/cpu [cuda]=configs/h800 [ascend]=configs/atlas-800i-a2)

status=0
for platform in "${platforms[@]}"; do
    [ -n "${configs[$platform]:-}" ] || { echo "unknown platform $platform" >&2; status=1; continue; }
    echo "== $platform"
    if [ "$platform" = cpu ]; then
        bash scripts/setup.sh >/dev/null
        venv=.venv
    else
        venv=$scratch/$platform
        stamp=$venv/.installed
        want=$(cat pyproject.toml scripts/install-engine.sh | sha256sum | cut -d' ' -f1)
        if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
            echo "installing the pinned $platform stack into $venv (minutes; log: $venv.log)"
            mkdir -p "$scratch"
            # From the package index only: a machine's local wheel folders may hold
            # another build of a pinned version (e.g. a CPU torch 2.13.0).
            env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null \
                bash scripts/install-engine.sh "$platform" "$venv" --engine-only >"$venv.log" 2>&1 \
                || { echo "install failed; see $venv.log" >&2; tail -5 "$venv.log" >&2; status=1; continue; }
            echo "$want" >"$stamp"
        fi
    fi
    "$venv/bin/python" -m epd_serve.cli check-flags "${configs[$platform]}" || status=1
done
exit $status
