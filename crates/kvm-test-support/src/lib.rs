//! How the project's integration tests use `/dev/kvm`.
//!
//! A test calls [`require_kvm`] first. Without a usable `/dev/kvm` it prints a loud SKIPPED
//! line and the test returns early; with one, the test's name is appended to the file named by
//! `$KVM_TEST_LOG`, which `tests/run.sh` counts so that CI reports how many KVM tests ran.

use std::fs::OpenOptions;
use std::io::Write;

/// Whether `/dev/kvm` can be opened for reading and writing. When it cannot, prints why the test
/// `name` is skipped; when it can, records that `name` ran on KVM.
pub fn require_kvm(name: &str) -> bool {
    if let Err(e) = OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        eprintln!("SKIPPED {name}: cannot open /dev/kvm ({e}): this KVM test did not run");
        return false;
    }
    if let Ok(path) = std::env::var("KVM_TEST_LOG") {
        let mut log = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open $KVM_TEST_LOG ({path}): {e}"));
        // One write per line: tests run in parallel, and an O_APPEND write this small lands whole,
        // where `writeln!` may split the name and the newline into two writes that interleave.
        log.write_all(format!("{name}\n").as_bytes())
            .unwrap_or_else(|e| panic!("cannot write $KVM_TEST_LOG: {e}"));
    }
    true
}
