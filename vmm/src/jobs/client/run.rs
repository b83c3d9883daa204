//! One `tinyvmm client` call: the request, its answer printed, a run it starts followed to
//! its end ([`follow()`]), and the exit status that says how it went.

use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

use super::follow::{clear_progress, follow, progress_line, show_progress, Outcome};
use super::{exit_status, render, send, timeout, ClientArgs, API_SOCK_ENV, TIMED_OUT};
use crate::api::client::ClientError;
use crate::jobs::args::UsageError;

/// The exit status of a failure the client names on stderr: a socket it cannot reach, a run
/// that did not complete, a verify that found a mismatch.
const FAILED: u8 = 1;

impl ClientArgs {
    /// Runs `tinyvmm client`: its log level, then the request to the socket of `--api-sock`
    /// or the environment (`run`); a usage error when neither names one.
    pub fn run(self) -> Result<ExitCode, UsageError> {
        if let Some(level) = self.log_level {
            crate::lifecycle::set_log_level(level);
        }
        let Some(socket) = self.api_sock.clone() else {
            return Err(UsageError {
                subcommand: None,
                kind: clap::error::ErrorKind::MissingRequiredArgument,
                message: format!(
                    "tinyvmm client needs the VMM's API socket: --api-sock PATH, or {API_SOCK_ENV}"
                ),
            });
        };
        Ok(ExitCode::from(run(&self, &socket)))
    }
}

/// Sends `args`' request to the VMM at `socket`, prints the answer (and follows a migration or
/// a live snapshot to its end), and returns the exit status: 0 for a 2xx (a followed run: once
/// completed), 4 for a 4xx, 5 for a 5xx, [`TIMED_OUT`], or [`FAILED`].
fn run(args: &ClientArgs, socket: &Path) -> u8 {
    let wait = timeout(&args.request, args.timeout);
    let (status, body) = match send(socket, &args.request, wait) {
        Ok(answer) => answer,
        Err(e) => return unanswered(socket, &e),
    };
    let Some(followed) = args
        .request
        .followed()
        .filter(|_| (200..300).contains(&status))
    else {
        let failed = args.request.failed(&body);
        let code = print_answer(args.json, status, body, failed.is_some());
        if let Some(failed) = failed {
            eprintln!("tinyvmm: {failed}");
            return FAILED;
        }
        return code;
    };
    // The run goes on after its answer: its status until it ends, a line on a terminal.
    let terminal = !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let outcome = follow(socket, followed, wait, |status| {
        if terminal {
            show_progress(&progress_line(followed, status));
        }
    });
    if terminal {
        clear_progress();
    }
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(e) => return unanswered(socket, &e),
    };
    let completed = outcome.completed();
    match outcome {
        Outcome::Ended { status, body } if status != 200 => {
            print_answer(args.json, status, body, false)
        }
        Outcome::Ended { status, body } => {
            let phase = body["phase"].as_str().unwrap_or("?").to_owned();
            let error = body["error"]
                .as_str()
                .unwrap_or("no reason given")
                .to_owned();
            print_answer(args.json, status, body, !completed);
            if completed {
                return 0;
            }
            eprintln!("tinyvmm: {} ended {phase}: {error}", followed.name());
            FAILED
        }
        Outcome::SourceEnded { last } => {
            eprintln!(
                "tinyvmm: {}: the source VMM ended during the migration (last seen: {}) without \
                 saying how it ended (it was stopped, or it crashed): the destination's API \
                 socket says whether the VM runs there",
                socket.display(),
                last["phase"].as_str().unwrap_or("no status yet")
            );
            if args.json {
                print_answer(true, 200, last, true);
            }
            FAILED
        }
    }
}

/// Prints an answer: its JSON body alone on stdout with `json`, else as a table, on stdout
/// unless it is a refusal or `failed`; returns its exit status.
fn print_answer(json: bool, status: u16, body: Value, failed: bool) -> u8 {
    let code = exit_status(status);
    if json {
        let body = if body.is_null() {
            serde_json::json!({})
        } else {
            body
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&body).expect("a JSON value prints")
        );
    } else if code == 0 && !failed {
        print!("{}", render(status, &body));
    } else {
        eprint!("tinyvmm: {}", render(status, &body));
    }
    code
}

/// The exit status of a request the VMM at `socket` did not answer, said on stderr.
fn unanswered(socket: &Path, e: &ClientError) -> u8 {
    match e {
        ClientError::TimedOut(_) => {
            eprintln!(
                "tinyvmm: {}: {e}; --timeout SECS waits longer (0: for ever)",
                socket.display()
            );
            TIMED_OUT
        }
        _ => {
            eprintln!("tinyvmm: {}: {e}", socket.display());
            FAILED
        }
    }
}
