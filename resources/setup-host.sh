#!/usr/bin/env bash
# Checks and installs what building and testing the project needs on a Debian 12 host.
# Idempotent; run as root (it installs Debian packages with apt-get when they are missing).
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found: install Rust 1.85 or newer (rustup) first" >&2
    exit 1
fi

need=()
for tool in cc:gcc as:binutils objcopy:binutils lz4:lz4 dpkg-deb:dpkg iasl:acpica-tools \
    python3:python3; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
# Debian's python3 makes virtual environments only with python3-venv (ensurepip).
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip' 2>/dev/null; then
    need+=(python3-venv)
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# The API spec's validator and PyYAML (tests/run.sh validates docs/api.yaml; the conformance
# test reads it), from PyPI into a virtual environment of the project's own under target/.
venv="$(cd "$(dirname "$0")/.." && pwd)/target/spec-venv"
if ! "$venv/bin/python" -c 'import openapi_spec_validator, yaml' 2>/dev/null; then
    echo "installing openapi-spec-validator and PyYAML into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        'openapi-spec-validator>=0.7,<1' 'PyYAML>=6'
fi

if [ ! -e /dev/kvm ]; then
    echo "warning: /dev/kvm is missing: KVM integration tests will be SKIPPED" >&2
fi
