#!/usr/bin/env bash
# Runs every test of the project: unit, property-based, concurrency and doc tests, and the
# integration tests on /dev/kvm. Installs what the tests need first.
#
# KVM integration tests append their name to $KVM_TEST_LOG when they really ran on /dev/kvm
# (and print a loud SKIPPED message when it is missing); this script counts them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

bash resources/setup-host.sh

# The API's contract: docs/api.yaml must be valid OpenAPI 3 (the conformance test,
# vmm/tests/conformance.rs, then holds the server to it, reading it with this Python).
export TINYVMM_PYTHON="$PWD/target/spec-venv/bin/python"
"$TINYVMM_PYTHON" -m openapi_spec_validator docs/api.yaml

# Debian's stock kernel for the boot tests (vmm/tests/boot.rs); they skip loudly without it.
if ! kernel=$(bash resources/fetch-kernel.sh); then
    echo "warning: Debian's kernel could not be fetched: the boot tests will be SKIPPED" >&2
else
    echo "kernel for the boot tests: $kernel"
fi

log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT
export KVM_TEST_LOG="$log_dir/kvm-tests-ran"
: >"$KVM_TEST_LOG"

# Integration tests run with optimisations: the slot-count tests do tens of thousands of
# ioctls and map operations, and the test profile keeps debug assertions on.
cargo test --workspace --locked --profile test-release

# The crate's example VMM, as a reader would run it from the README: a guest on real KVM.
if [ -e /dev/kvm ]; then
    cargo run --locked --release -p kvm-memslots --example minimal_vmm
else
    echo "SKIPPED the minimal_vmm example: /dev/kvm is missing"
fi

ran=$(sort -u "$KVM_TEST_LOG" | grep -c . || true)
echo "KVM integration tests run on /dev/kvm: $ran"
if [ -e /dev/kvm ] && [ "$ran" -eq 0 ]; then
    echo "error: /dev/kvm exists but no KVM integration test ran" >&2
    exit 1
fi
