//! Following a run that goes on after its request was answered: a migration (`PUT /migrate`)
//! and a live snapshot (`PUT /snapshot/create` with `live`) answer as they start, and `tinyvmm
//! client` then asks their status (`GET /migrate`, `GET /snapshot`) until its phase is final,
//! so that its exit status is the run's outcome (unless `--no-wait`).
//!
//! A migration that completes ends its source VMM (its API socket goes with it), but not
//! before a client that followed it has read `completed` (or a few seconds have passed:
//! `migration::slot::LINGER_FOR_FOLLOWER`): a source that can no longer be reached while its
//! migration was under way (it refuses, resets or closes the connection of a status request)
//! ended without it, stopped or crashed ([`Outcome::SourceEnded`]), and the migration's
//! outcome is unknown.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::{send, ClientRequest};
use crate::api::client::ClientError;

/// How long the client waits between two status requests: a few per second are cheap for the
/// VMM (each is a lock and a copy of the progress) and make the progress line move.
const POLL: Duration = Duration::from_millis(50);

/// A run the client follows to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Followed {
    /// `PUT /migrate`, followed with `GET /migrate`.
    Migration,
    /// A live `PUT /snapshot/create`, followed with `GET /snapshot`.
    LiveSnapshot,
}

impl Followed {
    /// The request that reads its status.
    fn status_request(self) -> ClientRequest {
        match self {
            Followed::Migration => ClientRequest::Migration,
            Followed::LiveSnapshot => ClientRequest::SnapshotStatus,
        }
    }

    /// Its name in messages.
    pub(super) fn name(self) -> &'static str {
        match self {
            Followed::Migration => "the migration",
            Followed::LiveSnapshot => "the live snapshot",
        }
    }
}

/// How a followed run ended, as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Outcome {
    /// Its status said a final phase (`completed`, `failed`, `cancelled`, `unconfirmed`), or
    /// the status request was not answered 200: the answer's status and body.
    Ended {
        /// The status request's answer's status.
        status: u16,
        /// Its body.
        body: Value,
    },
    /// The VMM could no longer be reached while a migration was under way: it ended without
    /// telling the client how the migration ended. The last status it answered.
    SourceEnded {
        /// The last status body (`Null` if none came).
        last: Value,
    },
}

impl Outcome {
    /// Whether the run completed: its last status said so.
    pub(super) fn completed(&self) -> bool {
        match self {
            Outcome::Ended { status, body } => {
                *status == 200 && body["phase"].as_str() == Some("completed")
            }
            Outcome::SourceEnded { .. } => false,
        }
    }
}

/// Whether a status body's phase says the run still goes on.
fn under_way(body: &Value) -> bool {
    matches!(
        body["phase"].as_str(),
        Some("setup" | "pre_copy" | "stop_and_copy")
    )
}

/// Asks the VMM at `socket` for `followed`'s status, each request waiting `timeout` at most,
/// until its phase is final; `progress` gets each status under way.
pub(super) fn follow(
    socket: &Path,
    followed: Followed,
    timeout: Option<Duration>,
    mut progress: impl FnMut(&Value),
) -> Result<Outcome, ClientError> {
    let request = followed.status_request();
    let mut last = Value::Null;
    loop {
        match send(socket, &request, timeout) {
            Ok((200, body)) if under_way(&body) => {
                progress(&body);
                last = body;
            }
            Ok((status, body)) => return Ok(Outcome::Ended { status, body }),
            // Gone while a migration ran, without saying how it ended. A connection the
            // source refused, reset or closed mid-answer is that source ending (a live VMM
            // answers, even to refuse a client): its socket file may still take a connection
            // for a moment while the dying process's files close, so whether it is reachable
            // afterwards does not tell.
            Err(e)
                if followed == Followed::Migration
                    && (e.connection_lost() || !reachable(socket)) =>
            {
                return Ok(Outcome::SourceEnded { last });
            }
            Err(e) => return Err(e),
        }
        std::thread::sleep(POLL);
    }
}

/// Whether anything still listens on the socket at `path`.
fn reachable(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

/// One line of a status under way, for a terminal: the phase, the round, the bytes so far of
/// guest memory, and the pages left.
pub(super) fn progress_line(followed: Followed, body: &Value) -> String {
    let number = |key: &str| body[key].as_u64().unwrap_or(0);
    let copied = match followed {
        Followed::Migration => number("bytes_sent"),
        Followed::LiveSnapshot => number("bytes_written"),
    };
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    format!(
        "{}: {}, round {}, {:.1} of {:.1} MiB copied, {} pages left",
        followed.name(),
        body["phase"].as_str().unwrap_or("?"),
        number("round"),
        mib(copied),
        mib(number("guest_memory_bytes")),
        number("pages_left"),
    )
}

/// Writes `line` over the terminal's current line on stderr.
pub(super) fn show_progress(line: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = write!(stderr, "\r\x1b[K{line}");
    let _ = stderr.flush();
}

/// Clears the progress line on stderr.
pub(super) fn clear_progress() {
    show_progress("");
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_a_completed_phase_is_a_completed_run() {
        let ended = |status, phase: &str| Outcome::Ended {
            status,
            body: json!({ "phase": phase }),
        };
        assert!(ended(200, "completed").completed());
        for phase in ["failed", "cancelled", "unconfirmed"] {
            assert!(!ended(200, phase).completed(), "{phase}");
        }
        assert!(!ended(404, "completed").completed());
        assert!(!Outcome::SourceEnded { last: Value::Null }.completed());
        for phase in ["setup", "pre_copy", "stop_and_copy"] {
            assert!(under_way(&json!({ "phase": phase })), "{phase}");
        }
        assert!(!under_way(&json!({ "phase": "completed" })));
    }

    /// A source that dies mid-request closes the connection while its listening socket may
    /// still take connections for a moment (its files close one by one): that is the source
    /// ending, not a failure to talk to it. Here a listener that stays open and closes every
    /// connection it accepts, unanswered.
    #[test]
    fn a_connection_cut_while_a_migration_is_followed_is_the_source_ending() {
        let path =
            std::env::temp_dir().join(format!("tinyvmm-follow-cut-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            // Two connections: the status request, then whatever else the client tries.
            for _ in 0..2 {
                match listener.accept() {
                    Ok((stream, _)) => drop(stream),
                    Err(_) => return,
                }
            }
        });
        let outcome = follow(
            &path,
            Followed::Migration,
            Some(Duration::from_secs(60)),
            |_| {},
        );
        // Let the server's second accept end, whatever the client did.
        let _ = std::os::unix::net::UnixStream::connect(&path);
        server.join().expect("the server thread");
        let _ = std::fs::remove_file(&path);
        assert!(
            matches!(outcome, Ok(Outcome::SourceEnded { ref last }) if last.is_null()),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_progress_line_says_the_phase_round_and_bytes() {
        let body = json!({
            "phase": "pre_copy", "round": 3, "bytes_written": 3u64 << 20,
            "guest_memory_bytes": 8u64 << 20, "pages_left": 12,
        });
        assert_eq!(
            progress_line(Followed::LiveSnapshot, &body),
            "the live snapshot: pre_copy, round 3, 3.0 of 8.0 MiB copied, 12 pages left"
        );
    }
}
