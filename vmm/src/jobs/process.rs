//! The process around a subcommand that runs to an end (of `tinyvmm` and of `tinyvmm-bench`):
//! its open-file limit raised for many regions ([`raise_open_file_limit`]), and what it prints:
//! the human report on stdout, or with `--json` the JSON alone on stdout with `"passed"` and
//! the human report on stderr; a failure named on stderr (and in the JSON), with its exit
//! status; a report's JSON written to a file.

use std::path::Path;
use std::process::ExitCode;

use crate::lifecycle::{log, Ending, LogLevel, LoopError};

/// The job's report, or the exit status for how it failed, with the failure named on stderr
/// (and with `json`, on stdout as `{"passed": false, "error": ...}`): 130 when a signal
/// interrupted it, 1 otherwise.
pub fn job_report<R, E: std::fmt::Display>(
    outcome: Result<(Result<R, E>, Ending), LoopError>,
    failed: &str,
    json: bool,
) -> Result<R, ExitCode> {
    let (message, code) = match outcome {
        Ok((Ok(report), _)) => return Ok(report),
        Ok((Err(e), Ending::Interrupted)) => {
            let e = e.to_string();
            let message = if e.starts_with("interrupted") {
                e
            } else {
                format!("interrupted: {e}")
            };
            (message, 130)
        }
        Ok((Err(e), Ending::Finished | Ending::GuestFailed)) => (format!("{failed}{e}"), 1),
        Err(e) => (e.to_string(), 1),
    };
    eprintln!("tinyvmm: {message}");
    if json {
        print_json(false, serde_json::json!({ "error": message }));
    }
    Err(ExitCode::from(code))
}

/// Prints `fields` (a JSON object) with `"passed"` added, alone on stdout: what `--json`
/// prints on every subcommand.
pub(super) fn print_json(passed: bool, mut fields: serde_json::Value) {
    if let Some(object) = fields.as_object_mut() {
        object.insert("passed".into(), passed.into());
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&fields).expect("a JSON value prints")
    );
}

/// Prints `report`: the human report on stdout, or with `json` the JSON on stdout and the
/// human report on stderr; then `closing`, the line that says the run passed.
pub fn print_report<R: std::fmt::Display + serde::Serialize>(
    report: &R,
    json: bool,
    passed: bool,
    closing: &str,
) {
    if json {
        eprintln!("{report}");
        print_json(
            passed,
            serde_json::to_value(report).expect("the report is JSON"),
        );
        if !closing.is_empty() {
            eprintln!("{closing}");
        }
    } else {
        println!("{report}");
        if !closing.is_empty() {
            println!("{closing}");
        }
    }
}

/// Writes `report` as JSON to `path` (creating its folder).
pub fn write_json<R: serde::Serialize>(path: &Path, report: &R) -> ExitCode {
    let json = serde_json::to_string_pretty(report).expect("the report is JSON");
    let written = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir),
        _ => Ok(()),
    }
    .and_then(|()| std::fs::write(path, json + "\n"));
    match written {
        Ok(()) => {
            log(
                LogLevel::Info,
                format_args!("results written to {}", path.display()),
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tinyvmm: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft limit on open files to the hard limit, saying so on stderr: a VM holds a
/// file per shared region (a local migration hands one over per memfd region), and the usual
/// soft limit of 1024 would refuse a VM of more regions than that.
pub fn raise_open_file_limit() {
    if let Ok(Some((before, after))) = crate::host::raise_open_file_limit() {
        log(
            LogLevel::Info,
            format_args!(
                "note: open-file limit (RLIMIT_NOFILE) raised from {} to {} (hard limit {})",
                before.soft, after.soft, after.hard
            ),
        );
    }
}
