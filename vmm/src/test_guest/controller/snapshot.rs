//! The test guest's side of snapshots (the chain of Full and Diff snapshots on a paused VM
//! and live ones of a running VM are the controller's): its vCPUs and its state file.

use super::TestGuest;
use crate::control::{ControllerError, ErrorKind};
use crate::controller::Moving;
use crate::snapshot::live::StateWriter;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::{SnapshotState, TestGuestPart};
use crate::test_guest::vcpus::VcpuHandle;
use crate::vm::state::VcpuState;

impl TestGuest {
    /// The vCPUs as a live snapshot or a migration pauses and resumes them.
    pub(super) fn moving(&self, what: Moving) -> Result<Vec<VcpuHandle>, ControllerError> {
        let vcpus = self.vcpus.as_ref().ok_or_else(shutting_down)?;
        vcpus.migration_handles().map_err(|e| {
            ControllerError::conflict(match what {
                Moving::LiveSnapshot => format!("the VM cannot be snapshotted live now: {e}"),
                Moving::Migration => format!("the VM cannot migrate now: {e}"),
            })
        })
    }

    /// Every vCPU's state, the VM paused.
    pub(super) fn save(&mut self) -> Result<Vec<VcpuState>, ControllerError> {
        self.vcpus
            .as_mut()
            .ok_or_else(shutting_down)?
            .save_states()
            .map_err(|e| ControllerError::internal(e.to_string()))
    }

    /// Makes a snapshot's state file: what the snapshot is, every vCPU's state, the layout
    /// and the hotplug area (as it is now: nothing changes it while a live snapshot runs).
    pub(super) fn writer(&self) -> StateWriter {
        let hotplug = self.hotplug.as_ref().map(HotplugArea::state);
        Box::new(move |layout, vcpus| {
            let mut state =
                SnapshotState::new(layout.clone(), vcpus, None, true, TestGuestPart { hotplug });
            Ok(Box::new(move |info| {
                state.snapshot = Some(info);
                state.to_bytes()
            }))
        })
    }
}

fn shutting_down() -> ControllerError {
    ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
}
