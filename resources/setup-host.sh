#!/usr/bin/env bash
# Checks and installs what building and testing the project needs on a Debian 12 host.
# Idempotent; run as root (it installs Debian packages with apt-get when they are missing).
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found: install Rust 1.85 or newer (rustup) first" >&2
    exit 1
fi

need=()
for tool in cc:gcc as:binutils objcopy:binutils lz4:lz4 dpkg-deb:dpkg iasl:acpica-tools; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

if [ ! -e /dev/kvm ]; then
    echo "warning: /dev/kvm is missing: KVM integration tests will be SKIPPED" >&2
fi
