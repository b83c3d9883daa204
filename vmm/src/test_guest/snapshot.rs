//! A test-guest VM's snapshot state file: the memory layout (kvm-memslots-persist's
//! `MemoryLayout`) and every vCPU's state, framed as a magic, the format version, the JSON and
//! its CRC-32, so that a truncated, corrupted or foreign file is refused before anything is
//! built. The guest's memory (its command blocks included) is in the memory file beside it.

use kvm_memslots_persist::{frame, unframe, MemoryLayout};
use serde::{Deserialize, Serialize};

use crate::control::hotplug::HotplugConfig;
use crate::migration::StateRecord;
use crate::vm::state::VcpuState;

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"TVMSNAP\0";

const STATE_MAGIC: &[u8; 8] = b"TVMMIGR\0";
/// The migration state record's format version.
pub const MIGRATION_STATE_VERSION: u32 = 1;

/// What a snapshot saves besides memory.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// The memory layout.
    pub layout: MemoryLayout,
    /// Every vCPU's state, by index.
    pub vcpus: Vec<VcpuState>,
    /// The hotplug area, if one was configured.
    #[serde(default)]
    pub hotplug: Option<HotplugState>,
}

/// The hotplug area's bookkeeping: its configuration, the blocks plugged, and which of its
/// slots are mapped (their regions are in the layout).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugState {
    /// As configured.
    pub config: HotplugConfig,
    /// Plugged blocks, from the area's start.
    pub plugged_blocks: u64,
    /// Whether each slot of the area is mapped.
    pub mapped: Vec<bool>,
}

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
#[error("invalid snapshot state file: {0}")]
pub struct StateFileError(pub String);

impl SnapshotState {
    /// The file's bytes (kvm-memslots-persist's [`frame`]: magic, version, length, JSON, CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a snapshot state serialises");
        frame(MAGIC, self.version, &json)
    }

    /// Reads a state file, naming what is wrong with a bad one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateFileError> {
        let bad = |why: String| StateFileError(why);
        let json = unframe(MAGIC, STATE_VERSION, bytes).map_err(bad)?;
        let state: SnapshotState = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
        state.validate()?;
        Ok(state)
    }

    /// The checks [`from_bytes`](Self::from_bytes) makes after parsing: a vCPU at least, this
    /// version, and a layout that passes [`MemoryLayout::validate`].
    pub fn validate(&self) -> Result<(), StateFileError> {
        let bad = |why: String| StateFileError(why);
        if self.version != STATE_VERSION || self.vcpus.is_empty() {
            return Err(bad(
                "no vCPU, or the header's and the state's versions differ".into(),
            ));
        }
        // The layout's own checks (version, alignment, order, overlaps, file offsets).
        self.layout.validate().map_err(|e| bad(e.to_string()))
    }
}

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

/// The test guest's [`StateRecord`]: what its migration sends besides the layout and the
/// vCPUs' states, taken when the migration starts.
#[derive(Debug)]
pub struct MigrationRecord {
    /// The hotplug area's bookkeeping.
    pub hotplug: Option<HotplugState>,
    /// Paused by a client.
    pub paused: bool,
}

impl StateRecord for MigrationRecord {
    fn to_bytes(&self, layout: &MemoryLayout, states: Vec<VcpuState>) -> Vec<u8> {
        MigrationState {
            snapshot: SnapshotState {
                version: STATE_VERSION,
                layout: layout.clone(),
                vcpus: states,
                hotplug: self.hotplug.clone(),
            },
            paused: self.paused,
        }
        .to_bytes()
    }
}
