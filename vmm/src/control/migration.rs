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

/// `GET /migrate`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MigrationInfo {
    /// Where it is (`setup`, `pre_copy`, `stop_and_copy`, then `completed`, `failed`,
    /// `cancelled` or `unconfirmed`).
    pub(crate) phase: Phase,
    /// Where it goes.
    pub(crate) destination: String,
    /// The round of pages under way (1: every page that holds data).
    round: u32,
    /// Bytes of pages sent so far.
    bytes_sent: u64,
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
    estimated_downtime_ms: f64,
    /// The pause began although the estimate did not fit the budget (`on_timeout: force`, at
    /// the timeout or once the harvest alone outlasted the budget): expect a longer pause.
    forced: bool,
    /// The pause the VM saw (from pausing here to the destination's word that it runs there),
    /// once completed.
    downtime_ms: Option<f64>,
    /// Milliseconds since the migration started.
    elapsed_ms: f64,
    /// Why it failed or was cancelled.
    error: Option<String>,
}

impl MigrationInfo {
    /// A migration's progress: its pre-copy run's, to `destination`.
    pub(crate) fn of(run: Progress, destination: String) -> Self {
        MigrationInfo {
            phase: run.phase,
            destination,
            round: run.round,
            bytes_sent: run.bytes_written,
            guest_memory_bytes: run.guest_memory_bytes,
            pages_left: run.pages_left,
            dirty_rate_pages_per_second: run.dirty_rate_pages_per_second,
            throughput_bytes_per_second: run.throughput_bytes_per_second,
            estimated_downtime_ms: run.estimated_pause_ms,
            forced: run.forced,
            downtime_ms: run.pause_ms,
            elapsed_ms: run.elapsed_ms,
            error: run.error,
        }
    }

    /// One line for a source's log once the VM runs on the destination.
    pub(crate) fn completed_line(&self) -> String {
        format!(
            "the VM runs on the migration's destination now: {} rounds, {:.1} MiB sent of {:.1} \
             MiB of guest memory in {:.0} ms, paused {:.1} ms{}",
            self.round,
            self.bytes_sent as f64 / f64::from(1 << 20),
            self.guest_memory_bytes as f64 / f64::from(1 << 20),
            self.elapsed_ms,
            self.downtime_ms.unwrap_or(f64::NAN),
            if self.forced {
                " (forced: the estimated pause had not fit downtime_ms)"
            } else {
                ""
            }
        )
    }
}
