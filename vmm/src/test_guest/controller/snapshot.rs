//! The test guest's snapshots: the chain of Full and Diff snapshots (`snapshot::chain`) on a
//! paused VM, with the test guest's state file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use kvm_memslots_persist::MemoryLayout;

use super::Controller;
use crate::control::snapshot::SnapshotCreate;
use crate::control::vm::RunState;
use crate::control::{ControllerError, ErrorKind};
use crate::snapshot::SnapshotInfo;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::{SnapshotState, STATE_VERSION};

impl Controller {
    pub(super) fn create_snapshot(
        &mut self,
        create: SnapshotCreate,
    ) -> Result<(), ControllerError> {
        if self.state != RunState::Paused {
            return Err(ControllerError::bad(
                "the VM is running: pause it first with PATCH /vm {\"state\": \"Paused\"}",
            ));
        }
        let memory = Arc::clone(self.vm.memory());
        let mut chain = std::mem::take(&mut self.chain);
        let taken = chain.create(&memory, &create, |info, layout, file| {
            self.write_state(info, layout, file)
        });
        self.chain = chain;
        taken.map(|_| ())
    }

    /// Writes what the snapshot is, every vCPU's state, the layout and the hotplug area into
    /// the state file.
    fn write_state(
        &mut self,
        info: SnapshotInfo,
        layout: &MemoryLayout,
        state_file: &File,
    ) -> Result<(), ControllerError> {
        let vcpus = self.vcpus.as_mut().ok_or_else(|| {
            ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
        })?;
        let states = vcpus
            .save_states()
            .map_err(|e| ControllerError::internal(e.to_string()))?;
        let state = SnapshotState {
            version: STATE_VERSION,
            snapshot: Some(info),
            layout: layout.clone(),
            vcpus: states,
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
        };
        state_file
            .write_all_at(&state.to_bytes(), 0)
            .map_err(|e| ControllerError::internal(format!("the snapshot failed: {e}")))
    }
}
