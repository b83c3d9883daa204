//! Live migration: `PUT /migrate`, `GET /migrate`, `PUT /migrate/cancel`.

use serde::{Deserialize, Serialize};

use crate::precopy::{Phase, Progress};

/// What the rounds do at their timeout: the pre-copy engine's, which `PUT /migrate` and a live
/// `PUT /snapshot/create` both name.
pub use crate::precopy::OnTimeout;

/// `PUT /migrate`: move the running VM to a `tinyvmm receive` process.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// `unix:PATH` or `tcp:HOST:PORT`, where `tinyvmm receive` listens.
    pub(crate) destination: String,
    /// The longest pause the VM may see (its memory left over the measured throughput).
    #[serde(default = "default_downtime_ms")]
    pub(crate) downtime_ms: u64,
    /// Seconds before `on_timeout` applies.
    #[serde(default = "default_timeout_s")]
    pub(crate) timeout_s: u64,
    /// What to do at the timeout.
    #[serde(default = "default_on_timeout")]
    pub(crate) on_timeout: OnTimeout,
    /// Hand memfd-backed memory over with `SCM_RIGHTS` instead of copying it (Unix only).
    #[serde(default)]
    pub(crate) local: bool,
}

fn default_downtime_ms() -> u64 {
    300
}

fn default_timeout_s() -> u64 {
    60
}

fn default_on_timeout() -> OnTimeout {
    OnTimeout::Cancel
}

/// `GET /migrate`: where the migration goes, and its pre-copy run's progress in a migration's
/// words (three of [`Progress`]'s fields named as the API names them: `MigrationWords`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MigrationInfo {
    /// Where it goes.
    pub(crate) destination: String,
    /// Its pre-copy run's progress.
    #[serde(flatten, with = "MigrationWords")]
    pub(crate) progress: Progress,
}

/// [`Progress`] as `GET /migrate` names it (serde's remote derive: its fields, serialised
/// in place with three of them renamed): `bytes_sent`, `estimated_downtime_ms` and
/// `downtime_ms`, where a live snapshot's `GET /snapshot` says `bytes_written`,
/// `estimated_pause_ms` and `pause_ms`.
#[derive(Serialize)]
#[serde(remote = "Progress")]
struct MigrationWords {
    /// Where it is (`setup`, `pre_copy`, `stop_and_copy`, then `completed`, `failed`,
    /// `cancelled` or `unconfirmed`).
    phase: Phase,
    /// The round of pages under way (1: every page that holds data).
    round: u32,
    /// Bytes of pages sent so far.
    #[serde(rename = "bytes_sent")]
    bytes_written: u64,
    /// The guest memory being moved when the migration started (round 1 sends the pages of
    /// it that hold data): what `bytes_sent` goes towards.
    guest_memory_bytes: u64,
    /// Pages the last harvest found dirty: what the next round sends (0 until round 1 ends).
    pages_left: u64,
    /// Pages the guest dirtied per second over the last round.
    dirty_rate_pages_per_second: f64,
    /// Bytes per second the last round sent at; during round 1, the average since the start.
    throughput_bytes_per_second: f64,
    /// The pause `pages_left` would take at that throughput.
    #[serde(rename = "estimated_downtime_ms")]
    estimated_pause_ms: f64,
    /// The pause began although the estimate did not fit the budget (`on_timeout: force`, at
    /// the timeout or once the harvest alone outlasted the budget): expect a longer pause.
    forced: bool,
    /// The pause the VM saw (from pausing here to the destination's word that it runs there),
    /// once completed.
    #[serde(rename = "downtime_ms")]
    pause_ms: Option<f64>,
    /// Milliseconds since the migration started.
    elapsed_ms: f64,
    /// Why it failed or was cancelled.
    error: Option<String>,
}

impl MigrationInfo {
    /// A migration's progress: its pre-copy run's, to `destination`.
    pub(crate) fn of(run: Progress, destination: String) -> Self {
        MigrationInfo {
            destination,
            progress: run,
        }
    }

    /// One line for a source's log once the VM runs on the destination.
    pub(crate) fn completed_line(&self) -> String {
        let run = &self.progress;
        format!(
            "the VM runs on the migration's destination now: {} rounds, {:.1} MiB sent of {:.1} \
             MiB of guest memory in {:.0} ms, paused {:.1} ms{}",
            run.round,
            run.bytes_written as f64 / f64::from(1 << 20),
            run.guest_memory_bytes as f64 / f64::from(1 << 20),
            run.elapsed_ms,
            run.pause_ms.unwrap_or(f64::NAN),
            if run.forced {
                " (forced: the estimated pause had not fit downtime_ms)"
            } else {
                ""
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GET /migrate`'s JSON: the run's progress with three fields in a migration's words, and
    /// the destination; every field of `docs/api.yaml`'s `MigrationInfo`, and nothing else.
    #[test]
    fn migration_info_names_the_run_s_progress_in_a_migration_s_words() {
        let run = Progress {
            phase: Phase::Completed,
            round: 3,
            bytes_written: 4096,
            guest_memory_bytes: 1 << 20,
            pages_left: 2,
            dirty_rate_pages_per_second: 5.5,
            throughput_bytes_per_second: 6.5,
            estimated_pause_ms: 7.5,
            forced: true,
            pause_ms: Some(8.5),
            elapsed_ms: 9.5,
            error: None,
        };
        let info = MigrationInfo::of(run, "unix:/x".to_owned());
        let json = serde_json::to_value(&info).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!({
                "phase": "completed", "destination": "unix:/x", "round": 3, "bytes_sent": 4096,
                "guest_memory_bytes": 1 << 20, "pages_left": 2,
                "dirty_rate_pages_per_second": 5.5, "throughput_bytes_per_second": 6.5,
                "estimated_downtime_ms": 7.5, "forced": true, "downtime_ms": 8.5,
                "elapsed_ms": 9.5, "error": null
            })
        );
        let line = info.completed_line();
        assert!(line.contains("3 rounds, 0.0 MiB sent of 1.0 MiB"), "{line}");
    }
}
