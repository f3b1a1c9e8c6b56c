#!/usr/bin/env bash
# Runs a command in a private network namespace that holds only loopback.
# Mooncake's transfer engine listens on every interface whatever it is asked, so the
# demo and the tests run inside one: nothing they start is reachable from outside.
# Root uses `ip netns`; others fall back to an unprivileged user+network namespace.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
if [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null; then
    ns="epd-$$"
    ip netns add "$ns"
    trap 'ip netns delete "$ns" 2>/dev/null || true' EXIT
    ip -n "$ns" link set lo up
    ip netns exec "$ns" "$@"
elif unshare --user --map-root-user --net true 2>/dev/null; then
    exec unshare --user --map-root-user --net sh -c 'ip link set lo up && exec "$@"' sh "$@"
else
    echo "$0: cannot create a network namespace (needs root, or unprivileged user namespaces)" >&2
    exit 1
fi
