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
linux_pids=()
trap 'kill "${linux_pids[@]}" 2>/dev/null || true; rm -rf "$log_dir"' EXIT
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
profile=(--locked --profile test-release)

# The Linux boot tests (vmm/tests/boot.rs, linux_snapshot.rs) are the long pole: minutes of
# guest ring 0 in this host's emulator, 5-7x longer on a slow machine of this kind than on a
# fast one. They are built first and start at once; the rest of the suite is built and run
# beside them, filling the cores they leave (a build has stretches on one core). They are not
# among `cargo test`'s default targets (vmm/Cargo.toml), so nothing runs twice.
linux_targets=(boot linux_snapshot)
mapfile -t linux_bins < <(
    cargo test -p tinyvmm "${profile[@]}" --no-run --message-format=json-render-diagnostics \
        "${linux_targets[@]/#/--test=}" |
        python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["kind"] == ["test"]:
        print(message["target"]["src_path"], message["executable"], sep="\t")
')
if [ "${#linux_bins[@]}" -ne "${#linux_targets[@]}" ]; then
    echo "error: the Linux test binaries were not all built: ${linux_bins[*]}" >&2
    exit 1
fi
echo "the Linux tests (${linux_targets[*]}) run beside the rest's build and run; their output" \
    "follows at the end"
for i in "${!linux_bins[@]}"; do
    src=${linux_bins[$i]%%$'\t'*}
    bin=${linux_bins[$i]#*$'\t'}
    # As cargo runs an integration test: from the package's folder, with the path in the
    # header that the time table below reads.
    (
        echo "     Running ${src#"$PWD/vmm/"} ($bin)"
        cd vmm && "$bin"
    ) >"$log_dir/linux-$i.log" 2>&1 &
    linux_pids+=($!)
done

cargo test --workspace "${profile[@]}" --no-fail-fast 2>&1 |
    tee "$log_dir/cargo-test.log" || status=$?

# The Linux tests' output, as cargo would have printed it, once they have ended.
for i in "${!linux_pids[@]}"; do
    wait "${linux_pids[$i]}" || status=$?
    tee -a "$log_dir/cargo-test.log" <"$log_dir/linux-$i.log"
done

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
