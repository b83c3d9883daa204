//! Assembles the built-in test guest (`resources/guest/test_guest.S`) with GNU as and extracts
//! its code with objcopy: the repository holds the readable source, the build makes the bytes.

use std::path::PathBuf;
use std::process::Command;

fn run(cmd: &mut Command, what: &str) {
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "{what}: cannot run {:?} ({e}); install binutils (resources/setup-host.sh does)",
            cmd.get_program()
        )
    });
    assert!(status.success(), "{what} failed: {status}");
}

fn main() {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../resources/guest/test_guest.S");
    println!("cargo:rerun-if-changed={}", source.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("test_guest.o");
    let binary = out.join("test_guest.bin");
    run(
        Command::new("as")
            .arg("--64")
            .arg("-o")
            .arg(&object)
            .arg(&source),
        "assembling the test guest",
    );
    run(
        Command::new("objcopy")
            .args(["-O", "binary", "-j", ".text"])
            .arg(&object)
            .arg(&binary),
        "extracting the test guest's code",
    );
}
