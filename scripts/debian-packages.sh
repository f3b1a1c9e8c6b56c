#!/usr/bin/env bash
# The Debian packages every environment here needs: Mooncake's transfer engine links
# libibverbs (even for TCP), libnuma and libcurl, and the tests and the demo put Mooncake
# into a loopback-only network namespace (iproute2). Installs only what is missing.
set -euo pipefail
missing=()
for pkg in libibverbs1 ibverbs-providers libnuma1 libcurl4 iproute2 procps; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing Debian packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
