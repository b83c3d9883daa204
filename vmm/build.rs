//! Assembles the built-in test guest (`resources/guest/test_guest.S`) with GNU as and extracts
//! its code with objcopy: the repository holds the readable source, the build makes the bytes.
//! Also records the commit the binary is built from (`TINYVMM_COMMIT`, for `--version` and
//! `GET /`): `git rev-parse`'s, or `unknown` outside a git checkout.

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

/// `git` with `args` in the crate's folder: its output's first line, if it ran and succeeded.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let line = text.lines().next()?.trim().to_owned();
    (output.status.success() && !line.is_empty()).then_some(line)
}

/// Sets `TINYVMM_COMMIT`, and reruns when the checked-out commit changes.
fn record_commit() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TINYVMM_COMMIT={commit}");
    // HEAD names a branch, whose ref moves on each commit (a file, or a line of packed-refs).
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let (Some(common), Some(branch)) = (
        git(&["rev-parse", "--git-common-dir"]),
        git(&["rev-parse", "--symbolic-full-name", "HEAD"]),
    ) {
        let common = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(common);
        watched.push(Some(common.join(branch).display().to_string()));
        watched.push(Some(common.join("packed-refs").display().to_string()));
    }
    // A path that does not exist would make cargo rerun this script on every build.
    for path in watched.into_iter().flatten() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

fn main() {
    record_commit();
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
