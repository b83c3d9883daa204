//! Snapshots: `PUT /snapshot/create`.

use serde::{Deserialize, Serialize};

use crate::precopy::{OnTimeout, Progress};

/// `PUT /snapshot/create` (Firecracker's shape).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreate {
    /// `Full` or `Diff`.
    pub(crate) snapshot_type: SnapshotType,
    /// Where the state file goes (it must not exist).
    pub(crate) snapshot_path: std::path::PathBuf,
    /// Where the memory file goes (it must not exist).
    pub(crate) mem_file_path: std::path::PathBuf,
    /// Take a Full snapshot of the running VM: memory is copied in rounds while it runs,
    /// and it pauses only for the last pages and its state (`GET /snapshot` follows it).
    #[serde(default)]
    pub(crate) live: bool,
    /// A live snapshot's longest pause (default [`LIVE_DOWNTIME_MS`]).
    #[serde(default)]
    pub(crate) downtime_ms: Option<u64>,
    /// Seconds a live snapshot's rounds may take before `on_timeout` applies (default
    /// [`LIVE_TIMEOUT_S`]).
    #[serde(default)]
    pub(crate) timeout_s: Option<u64>,
    /// What a live snapshot does at its timeout, or once the pause cannot fit `downtime_ms`
    /// (default `force`: pause anyway; `cancel`: give up).
    #[serde(default)]
    pub(crate) on_timeout: Option<OnTimeout>,
}

/// A live snapshot's pause budget unless the request says.
pub(crate) const LIVE_DOWNTIME_MS: u64 = 10;
/// How long a live snapshot's rounds may take unless the request says.
pub(crate) const LIVE_TIMEOUT_S: u64 = 60;

impl SnapshotCreate {
    /// Why this request (not live) cannot snapshot a VM that is `paused` or not: a live field
    /// set on it, or a VM that runs.
    pub(crate) fn check_paused(&self, paused: bool) -> Result<(), super::ControllerError> {
        let live_field = [
            ("downtime_ms", self.downtime_ms.is_some()),
            ("timeout_s", self.timeout_s.is_some()),
            ("on_timeout", self.on_timeout.is_some()),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name));
        if let Some(field) = live_field {
            return Err(super::ControllerError::bad(format!(
                "{field} applies to live snapshots only (\"live\": true)"
            )));
        }
        if !paused {
            return Err(super::ControllerError::bad(
                "the VM is running: pause it first with PATCH /vm {\"state\": \"Paused\"}, or \
                 take a live snapshot (\"live\": true)",
            ));
        }
        Ok(())
    }
}

/// What a snapshot holds of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
pub enum SnapshotType {
    /// Every page that holds data.
    Full,
    /// The pages dirtied since the previous snapshot.
    Diff,
}

/// `GET /snapshot`: the last live snapshot, under way or ended: its files and id besides its
/// pre-copy run's [`Progress`], whose fields it shows as they are (`phase`: `setup`,
/// `pre_copy`, `stop_and_copy`, then `completed`, `failed` or `cancelled`; `bytes_written`
/// into the memory file; `pause_ms` from its vCPUs pausing to their going on).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveSnapshotInfo {
    /// Its state file.
    snapshot_path: std::path::PathBuf,
    /// Its memory file.
    mem_file_path: std::path::PathBuf,
    /// The snapshot's id once completed (its state file says it too).
    snapshot_id: Option<String>,
    /// Its pre-copy run's progress.
    #[serde(flatten)]
    progress: Progress,
}

impl LiveSnapshotInfo {
    /// A live snapshot's progress: its pre-copy run's, into `paths` (state, memory), with
    /// its `snapshot_id` once written.
    pub(crate) fn of(
        run: Progress,
        paths: &[std::path::PathBuf; 2],
        snapshot_id: Option<String>,
    ) -> Self {
        LiveSnapshotInfo {
            snapshot_path: paths[0].clone(),
            mem_file_path: paths[1].clone(),
            snapshot_id,
            progress: run,
        }
    }
}

/// `PUT /working-set/stop` where no recording is under way.
pub(crate) fn no_recording() -> super::ControllerError {
    super::ControllerError::conflict(
        "no working-set recording is under way: restore with --mem-backend uffd \
         --record-working-set FILE (a recording also ends after --record-secs, or when the VMM \
         stops)",
    )
}
