//! The test guest's snapshots: the chain of Full and Diff snapshots (`snapshot::chain`) on a
//! paused VM, and live ones of a running VM, with the test guest's state file.

use std::sync::Arc;

use super::Controller;
use crate::control::snapshot::SnapshotCreate;
use crate::control::vm::RunState;
use crate::control::{ControllerError, ErrorKind};
use crate::snapshot::live::StateWriter;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::{SnapshotState, STATE_VERSION};

impl Controller {
    pub(super) fn create_snapshot(
        &mut self,
        create: SnapshotCreate,
    ) -> Result<(), ControllerError> {
        let memory = Arc::clone(self.vm.memory());
        if create.live {
            let vcpus = self.vcpus.as_ref().ok_or_else(shutting_down)?;
            let handles = vcpus.migration_handles().map_err(|e| {
                ControllerError::conflict(format!("the VM cannot be snapshotted live now: {e}"))
            })?;
            let write_state = self.state_writer();
            return self
                .chain
                .start_live(&memory, &create, handles, write_state, self.interrupt);
        }
        create.check_paused(self.state == RunState::Paused)?;
        let write_state = self.state_writer();
        let vcpus = self.vcpus.as_mut().ok_or_else(shutting_down)?;
        let save_states = || {
            vcpus
                .save_states()
                .map_err(|e| ControllerError::internal(e.to_string()))
        };
        self.chain
            .create(&memory, &create, save_states, write_state)
            .map(|_| ())
    }

    /// Makes a snapshot's state file: what the snapshot is, every vCPU's state, the layout
    /// and the hotplug area (as it is now: nothing changes it while a live snapshot runs).
    fn state_writer(&self) -> StateWriter {
        let hotplug = self.hotplug.as_ref().map(HotplugArea::state);
        Box::new(move |layout, vcpus| {
            let mut state = SnapshotState {
                version: STATE_VERSION,
                snapshot: None,
                layout: layout.clone(),
                vcpus,
                hotplug,
            };
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
