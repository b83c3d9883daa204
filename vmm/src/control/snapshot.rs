//! Snapshots: `PUT /snapshot/create`.

use serde::{Deserialize, Serialize};

/// `PUT /snapshot/create` (Firecracker's shape).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreate {
    /// `Full` or `Diff`.
    pub snapshot_type: SnapshotType,
    /// Where the state file goes (it must not exist).
    pub snapshot_path: std::path::PathBuf,
    /// Where the memory file goes (it must not exist).
    pub mem_file_path: std::path::PathBuf,
}

/// What a snapshot holds of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
pub enum SnapshotType {
    /// Every page that holds data.
    Full,
    /// The pages dirtied since the previous snapshot.
    Diff,
}
