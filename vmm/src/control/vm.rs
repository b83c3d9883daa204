//! The whole VM: `GET` and `PATCH /vm`, `PUT /actions`.

use serde::{Deserialize, Serialize};

/// The VM's run state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum RunState {
    /// The guest runs commands.
    Running,
    /// The guest runs no command until resumed.
    Paused,
}

/// `PATCH /vm` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatePatch {
    /// `Paused` or `Resumed`.
    pub state: VmStateRequest,
}

/// The states a client may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmStateRequest {
    /// Pause.
    Paused,
    /// Resume.
    Resumed,
}

/// `PUT /actions` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmAction {
    /// Only `Stop`: shut the VMM down.
    pub action_type: VmActionType,
}

/// Actions on the whole VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmActionType {
    /// Stop the guest and the VMM.
    Stop,
}

/// `GET /vm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmInfo {
    /// Running or paused.
    pub state: RunState,
    /// vCPUs (0 once shutting down).
    pub vcpus: usize,
}
