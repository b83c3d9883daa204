//! Live migration of a test-guest VM between two tinyvmm processes, on kvm-memslots-persist's
//! memory stream: the source ([`source`]) copies memory in rounds while the guest runs, harvesting
//! what it dirtied (bitmap or ring), pauses it once what is left fits the downtime budget,
//! sends the last pages and the vCPU and device state, and stops only once the destination
//! (`tinyvmm receive`, [`crate::jobs::receive`]) says the VM runs there.

pub mod source;
pub mod transport;

use kvm_memslots_persist::{frame, unframe};
use serde::{Deserialize, Serialize};

use crate::test_guest::snapshot::SnapshotState;

pub use source::Migration;
pub use transport::{Connection, Endpoint, Listener};

const STATE_MAGIC: &[u8; 8] = b"TVMMIGR\0";
/// The migration state record's format version.
pub const MIGRATION_STATE_VERSION: u32 = 1;

/// What the State record of a migration carries: the snapshot state (layout, vCPUs, hotplug
/// area) and whether the VM was paused by a client.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationState {
    /// What a snapshot would save.
    pub snapshot: SnapshotState,
    /// The VM was paused (`PATCH /vm`): it stays paused on the destination.
    pub paused: bool,
}

impl MigrationState {
    /// The record's bytes (framed: magic, version, length, JSON, CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a migration state serialises");
        frame(STATE_MAGIC, MIGRATION_STATE_VERSION, &json)
    }

    /// Reads a State record, naming what is wrong with a bad one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let json = unframe(STATE_MAGIC, MIGRATION_STATE_VERSION, bytes)?;
        let state: MigrationState =
            serde_json::from_slice(json).map_err(|e| format!("the migration state: {e}"))?;
        // The snapshot state's own checks.
        state.snapshot.validate().map_err(|e| e.to_string())?;
        Ok(state)
    }
}
