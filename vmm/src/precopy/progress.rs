//! Where a pre-copy run is: its [`Phase`] and its [`Progress`], which a migration's
//! `GET /migrate` and a live snapshot's `GET /snapshot` each present in words of their own.

use serde::Serialize;

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    /// Getting the sink ready (a migration connects and exchanges the memory layout).
    Setup,
    /// Copying memory while the guest runs.
    PreCopy,
    /// The guest is paused: the last pages and the state go.
    StopAndCopy,
    /// The sink has the whole VM: a migration's destination runs it (this VMM exits), or a
    /// live snapshot is written.
    Completed,
    /// It failed; the VM runs here as before.
    Failed,
    /// A client or the timeout cancelled it; the VM runs here as before.
    Cancelled,
    /// A migration's destination got the whole VM but its answer did not come: it may run the
    /// VM, so the VM stays paused here (`PATCH /vm {"state": "Resumed"}` runs it here again).
    Unconfirmed,
}

impl Phase {
    /// Whether the rounds still run: setup, pre-copy or stop-and-copy. Any other phase is
    /// final; the thread behind it ends a moment after it is set.
    pub(crate) fn under_way(self) -> bool {
        matches!(self, Phase::Setup | Phase::PreCopy | Phase::StopAndCopy)
    }
}

/// A run's progress. A live snapshot's `GET /snapshot` shows it as it is (flattened into
/// `LiveSnapshotInfo`); a migration's `GET /migrate` names three of its fields in its own
/// words (`MigrationInfo`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Progress {
    /// Where it is.
    pub(crate) phase: Phase,
    /// The round of pages under way (1: every page that holds data).
    pub(crate) round: u32,
    /// Bytes of pages written to the sink so far (a page the guest dirtied again is written
    /// again).
    pub(crate) bytes_written: u64,
    /// The guest memory when the run started (round 1 carries the pages of it that hold
    /// data): what `bytes_written` goes towards.
    pub(crate) guest_memory_bytes: u64,
    /// Pages the last harvest found dirty: what the next round carries (0 until round 1 ends).
    pub(crate) pages_left: u64,
    /// Pages the guest dirtied per second over the last round.
    pub(crate) dirty_rate_pages_per_second: f64,
    /// Bytes per second the last round carried; during round 1, the average since the start.
    pub(crate) throughput_bytes_per_second: f64,
    /// The pause `pages_left` would take at that throughput (plus the last harvest).
    pub(crate) estimated_pause_ms: f64,
    /// The pause began although the estimate did not fit the budget (`on_timeout: force`, at
    /// the timeout or once the harvest alone outlasted the budget): expect a longer pause.
    pub(crate) forced: bool,
    /// The pause the VM saw, once completed: from pausing to the sink's last word (a
    /// migration's destination runs the VM) or to the vCPUs going on (a live snapshot).
    pub(crate) pause_ms: Option<f64>,
    /// Milliseconds since the run started.
    pub(crate) elapsed_ms: f64,
    /// Why it failed or was cancelled.
    pub(crate) error: Option<String>,
}
