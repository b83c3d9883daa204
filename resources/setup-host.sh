#!/usr/bin/env bash
# Checks and installs what building and testing the project needs on a Debian 12 host.
# Idempotent; run as root (it installs Debian packages with apt-get when they are missing).
set -euo pipefail

# The Rust the workspace asks for (`rust-version` in Cargo.toml), and the one installed.
rust_needed=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$(dirname "$0")/../Cargo.toml")
if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found: install Rust $rust_needed or newer (rustup) first" >&2
    exit 1
fi
rust_have=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n' "$rust_needed" "$rust_have" | sort -V | head -n 1)" != "$rust_needed" ]; then
    echo "error: Rust $rust_have is older than the $rust_needed this project needs (rustup update)" >&2
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

# A small pool of 2 MiB hugetlb pages (1 GiB) for the tests of regions of huge pages, which
# skip loudly without one. Only raised, never lowered; the kernel may give fewer pages than
# asked where memory is fragmented.
want_huge=512
pool=/proc/sys/vm/nr_hugepages
if [ -r "$pool" ] && [ "$(cat "$pool")" -lt "$want_huge" ]; then
    echo "$want_huge" >"$pool" 2>/dev/null || true
    if [ "$(cat "$pool")" -lt "$want_huge" ]; then
        echo "warning: the hugetlb pool has $(cat "$pool") of the $want_huge 2 MiB pages the" \
            "huge-page tests want: some will be SKIPPED" >&2
    fi
fi

if [ ! -e /dev/kvm ]; then
    echo "warning: /dev/kvm is missing: KVM integration tests will be SKIPPED" >&2
fi
