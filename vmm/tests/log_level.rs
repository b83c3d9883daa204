//! `--log-level` on every subcommand: `error` leaves a clean run's stderr empty, `debug` logs
//! every API request as `--log-requests` does; and `boot --json` prints JSON alone on stdout.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

mod support;
use support::vmm::Vmm;

fn tinyvmm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("tinyvmm runs")
}

/// `tinyvmm serve` with no guest memory at `--log-level level`, asked for its VM and stopped
/// through the client; its stderr.
fn serve_at(level: &str) -> String {
    let mut vmm = Vmm::command(&format!("log-level-{level}"))
        .args(["--log-level", level, "serve"])
        .args(["--mem-mib", "0", "--slots", "1"])
        .spawn();
    // No request before the test's own: they are what the log must show.
    vmm.wait_for_socket_file();
    let sock = vmm.api().to_str().expect("a UTF-8 path").to_owned();
    for (command, status) in [("vm", 0), ("stop", 0)] {
        // The option is global: it goes after the subcommand too.
        let client = tinyvmm(&["client", "--api-sock", &sock, command, "--log-level", level]);
        assert_eq!(client.status.code(), Some(status), "{command}");
    }
    let output = vmm.wait(Duration::from_secs(120));
    assert!(output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn kvm_the_log_level_says_as_much_as_it_is_asked() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_the_log_level_says_as_much_as_it_is_asked") {
        return;
    }
    let quiet = serve_at("error");
    assert_eq!(quiet, "", "a clean run at error says nothing");
    let info = serve_at("info");
    assert!(
        info.contains("tinyvmm: serving the API on ") && info.ends_with("tinyvmm: stopped\n"),
        "{info}"
    );
    assert!(!info.contains("tinyvmm: api: "), "{info}");
    let debug = serve_at("debug");
    for line in [
        "tinyvmm: serving the API on ",
        "tinyvmm: api: GET /vm -> 200 in ",
        "tinyvmm: api: PUT /actions -> 204 in ",
    ] {
        assert!(
            debug.lines().any(|l| l.starts_with(line)),
            "{line} in:\n{debug}"
        );
    }
}

#[test]
fn an_unknown_log_level_is_a_usage_error() {
    let output = tinyvmm(&["check", "--log-level", "loud"]);
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("possible values: error, warn, info, debug"),
        "{stderr}"
    );
}

#[test]
fn boot_json_is_json_alone_on_stdout_even_when_it_fails() {
    let output = tinyvmm(&["boot", "--kernel", "/nonexistent/vmlinux", "--json"]);
    assert_eq!(output.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON alone ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    });
    assert_eq!(report["passed"], false, "{report}");
    assert!(
        report["error"]
            .as_str()
            .is_some_and(|e| e.contains("/nonexistent/vmlinux")),
        "{report}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.starts_with("tinyvmm: "), "{stderr}");
}
