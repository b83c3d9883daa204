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
    # The build the Linux tests ran (they compare runs of one kernel with each other; none
    # depends on a particular version's output).
    banner=$(strings -n 20 "${kernel/vmlinuz-/vmlinux-}" 2>/dev/null | grep -m1 '^Linux version ' || true)
    echo "kernel version: ${banner:-unknown (no vmlinux)}"
fi

log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT
export KVM_TEST_LOG="$log_dir/kvm-tests-ran"
: >"$KVM_TEST_LOG"

# How fast this host's KVM runs guest ring 0 (an emulator on kvm_pvm, 5-7x faster on some
# machines of this kind than on others): the Linux tests' run times follow it.
cargo run --locked --profile test-release -q -p kvm-test-support --bin ring0-speed

# Integration tests run with optimisations: the slot-count tests do tens of thousands of
# ioctls and map operations, and the test profile keeps debug assertions on. Every test binary
# runs even when one fails; the script fails at the end if any did.
started=$SECONDS
status=0
cargo test --workspace --locked --profile test-release --no-fail-fast 2>&1 |
    tee "$log_dir/cargo-test.log" || status=$?

# Each test binary's time, slowest first, so that a slow run explains itself.
echo "test binaries by time (the whole test run: $((SECONDS - started)) s):"
awk '
    /^ *Running / {
        source = ($2 == "unittests") ? $3 : $2
        binary = $NF; gsub(/[()]/, "", binary); sub(/.*\//, "", binary); sub(/-[0-9a-f]+$/, "", binary)
        name = binary " " source
    }
    /^ *Doc-tests / { name = "doc-tests " $2 }
    /^test result: / && name != "" {
        secs = $NF; sub(/s$/, "", secs)
        printf "%9.2f s  %s (%s)\n", secs, name, ($3 == "ok." ? "ok" : "FAILED")
        name = ""
    }
' "$log_dir/cargo-test.log" | sort -rn | head -15

# The crate's example VMM, as a reader would run it from the README: a guest on real KVM.
# `cargo test` built it (with the workspace's features: `cargo run --example` would build the
# crate again for its own).
if [ -e /dev/kvm ]; then
    target/test-release/examples/minimal_vmm || status=$?
else
    echo "SKIPPED the minimal_vmm example: /dev/kvm is missing"
fi

ran=$(sort -u "$KVM_TEST_LOG" | grep -c . || true)
echo "KVM integration tests run on /dev/kvm: $ran"
if [ -e /dev/kvm ] && [ "$ran" -eq 0 ]; then
    echo "error: /dev/kvm exists but no KVM integration test ran" >&2
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "error: some tests failed (cargo test exited $status): see the FAILED lines above" >&2
fi
exit "$status"
