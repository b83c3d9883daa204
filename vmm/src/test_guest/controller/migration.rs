//! The test guest's side of a migration: starting one, refusing what would change the VM
//! while it runs, and taking back what it leaves when it ends.

use std::sync::Arc;

use super::Controller;
use crate::control::migration::MigrateRequest;
use crate::control::vm::RunState;
use crate::control::{ControllerError, ErrorKind, Request};
use crate::migration::source::SourceVm;
use crate::migration::{Endpoint, Migration};
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::MigrationRecord;

impl Controller {
    /// Once the migration thread has ended without completing, takes back the vCPUs it held.
    pub(super) fn settle_migration(&mut self) {
        let Some(migration) = &mut self.migration else {
            return;
        };
        if migration.is_running() || migration.completed() {
            return;
        }
        let ending = migration.join();
        if !ending.held.is_empty() {
            // The destination may run the VM: it stays paused here until a client says.
            self.state = RunState::Paused;
            self.held = ending.held;
        }
    }

    /// Why `request` cannot run now: the VM is moving (its layout, run state and guest must
    /// stay as the migration found them), has moved, or may run on the destination of a
    /// migration that ended unconfirmed (then nothing may run or change the guest here).
    pub(super) fn refused_while_migrating(&self, request: &Request) -> Option<ControllerError> {
        let migration = self.migration.as_ref()?;
        let reads = matches!(
            request,
            Request::GetMemory
                | Request::GetDirtyLog
                | Request::GetHotplug
                | Request::GetVm
                | Request::GetMigration
                | Request::CancelMigration
                | Request::Act(_)
        );
        if reads {
            return None;
        }
        if !self.held.is_empty() {
            return refused_while_held(request);
        }
        if migration.completed() {
            return Some(ControllerError::conflict(format!(
                "the VM has migrated to {}; this VMM is exiting",
                migration.info().destination
            )));
        }
        migration.is_running().then(|| {
            ControllerError::conflict(
                "a migration is under way: GET /migrate for its progress, PUT /migrate/cancel to stop it",
            )
        })
    }

    pub(super) fn migrate(&mut self, request: MigrateRequest) -> Result<(), ControllerError> {
        let endpoint: Endpoint = request.destination.parse().map_err(ControllerError::bad)?;
        if request.local && !matches!(endpoint, Endpoint::Unix(_)) {
            return Err(ControllerError::bad(format!(
                "local mode hands memory over on a Unix socket: {} is not one",
                request.destination
            )));
        }
        if request.timeout_s == 0 {
            return Err(ControllerError::bad("timeout_s must be at least 1"));
        }
        let vcpus = self.vcpus.as_ref().ok_or_else(|| {
            ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
        })?;
        let handles = vcpus
            .migration_handles()
            .map_err(|e| ControllerError::conflict(format!("the VM cannot migrate now: {e}")))?;
        let vm = SourceVm {
            memory: Arc::clone(self.vm.memory()),
            vcpus: handles,
            state: Box::new(MigrationRecord {
                hotplug: self.hotplug.as_ref().map(HotplugArea::state),
                paused: self.state == RunState::Paused,
            }),
        };
        let migration = Migration::start(&request, endpoint, vm, self.interrupt)
            .map_err(|e| ControllerError::internal(format!("starting the migration: {e}")))?;
        self.migration = Some(migration);
        Ok(())
    }
}

/// Why `request` is refused while a migration's unconfirmed ending holds the VM here: the
/// destination may run it, so nothing may run the guest or change what moved (its memory, its
/// hotplug area) until a client resumes it. Besides reads (allowed before this is asked),
/// only pausing and resuming (the way out), snapshots, dirty logging and harvests run nothing
/// in the guest; everything else, a request added later included, is refused.
fn refused_while_held(request: &Request) -> Option<ControllerError> {
    let allowed = matches!(
        request,
        Request::PatchVm(_)
            | Request::SwitchDirtyLog(_)
            | Request::Harvest(_)
            | Request::CreateSnapshot(_)
    );
    (!allowed).then(|| {
        ControllerError::conflict(format!(
            "{} is refused: the last migration is unconfirmed (GET /migrate): the destination \
             got the whole VM and may be running it, so nothing runs or changes the guest here; \
             if the destination does not run it, PATCH /vm {{\"state\": \"Resumed\"}} takes \
             it back here",
            request.name()
        ))
    })
}
