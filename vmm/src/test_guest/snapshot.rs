//! A test-guest VM's snapshot state file: the memory layout (kvm-memslots' `MemoryLayout`) and
//! every vCPU's state, framed as a magic, the format version, the JSON and its CRC-32, so that
//! a truncated, corrupted or foreign file is refused before anything is built. The guest's
//! memory (its command blocks included) is in the memory file beside it.

use kvm_memslots::snapshot::MemoryLayout;
use serde::{Deserialize, Serialize};

use crate::api::types::HotplugConfig;
use crate::vm::state::VcpuState;

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"TVMSNAP\0";

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
    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a snapshot state serialises");
        let mut out = Vec::with_capacity(json.len() + 24);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        out.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        out
    }

    /// Reads a state file, naming what is wrong with a bad one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateFileError> {
        let bad = |why: String| StateFileError(why);
        if bytes.len() < 24 || &bytes[..8] != MAGIC {
            return Err(bad("not a tinyvmm snapshot (no TVMSNAP magic)".into()));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != STATE_VERSION {
            return Err(bad(format!(
                "format version {version}; this build reads version {STATE_VERSION}"
            )));
        }
        let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(24))
            .filter(|total| *total == bytes.len())
            .ok_or_else(|| {
                bad(format!(
                    "{} bytes, but its header announces {len} bytes of state (truncated or padded)",
                    bytes.len()
                ))
            })?;
        let json = &bytes[20..end - 4];
        let stored = u32::from_le_bytes(bytes[end - 4..].try_into().expect("4 bytes"));
        let computed = crc32fast::hash(json);
        if stored != computed {
            return Err(bad(format!(
                "checksum {computed:#010x} does not match the stored {stored:#010x} (corrupted)"
            )));
        }
        let state: SnapshotState = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
        if state.version != version || state.vcpus.is_empty() {
            return Err(bad(
                "no vCPU, or the header's and the state's versions differ".into(),
            ));
        }
        // The layout's own checks (alignment, overlaps, file offsets).
        MemoryLayout::from_bytes(&state.layout.to_bytes()).map_err(|e| bad(e.to_string()))?;
        Ok(state)
    }
}
