#!/usr/bin/env bash
# The main job: install (scripts/setup.sh), bring up E-P-D on the CPU backend with the
# tiny model, show where each stage ran, run a short load with its report, shut down.
# Extra arguments go to `epd-serve demo` (e.g. --config configs/cpu/e+p-d.yaml, which
# replaces the default E-P-D file: the last --config wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec scripts/in-netns.sh .venv/bin/epd-serve demo --config configs/cpu/e-p-d.yaml "$@"
