//! The test guest's side of a migration: its vCPUs and State record for the generic
//! migration (`migration::slot`).

use std::sync::Arc;

use super::Controller;
use crate::control::migration::MigrateRequest;
use crate::control::vm::RunState;
use crate::control::{ControllerError, ErrorKind};
use crate::migration::slot::checked_endpoint;
use crate::precopy::SourceVm;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::MigrationRecord;

impl Controller {
    /// Once the migration thread has ended without completing, takes back the vCPUs it held.
    pub(super) fn settle_migration(&mut self) {
        if self.migration.settle() {
            // The destination may run the VM: it stays paused here until a client says.
            self.state = RunState::Paused;
        }
    }

    pub(super) fn migrate(&mut self, request: MigrateRequest) -> Result<(), ControllerError> {
        checked_endpoint(&request)?;
        let vcpus = self.vcpus.as_ref().ok_or_else(|| {
            ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
        })?;
        let handles = vcpus
            .migration_handles()
            .map_err(|e| ControllerError::conflict(format!("the VM cannot migrate now: {e}")))?;
        let vm = SourceVm {
            memory: Arc::clone(self.vm.memory()),
            vcpus: handles,
        };
        let state = Box::new(MigrationRecord {
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
            paused: self.state == RunState::Paused,
        });
        self.migration.start(&request, vm, state, self.interrupt)
    }
}
