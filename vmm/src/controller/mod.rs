//! The one controller: the one place where requests change a running VM, whatever its guest
//! kind. It takes the typed [`Request`]s of `control` and returns a typed [`Reply`] or a
//! [`ControllerError`]; it knows no transport (the API socket, `api`, turns HTTP into requests
//! and replies into HTTP). The services every kind shares are answered here once: the memory
//! manager's reads, the client's dirty log, the snapshot chain, the migration slot, the
//! loader's working-set recording and the run state. What differs per kind (its memory map,
//! hotplug memory, commands, vCPUs, devices and saved state) a [`Guest`] answers
//! (`test_guest::controller`, `linux::controller`); a request a kind lacks is refused here.

pub(crate) mod guest;

pub(crate) use guest::{Guest, GuestRequest, Moving};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::control::dirty_log::DirtyLogClient;
use crate::control::memory::{memory_info, region_info};
use crate::control::migration::{MigrateRequest, MigrationInfo};
use crate::control::snapshot::{no_recording, SnapshotCreate};
use crate::control::vm::{
    LazyRestoreInfo, RunState, VmAction, VmActionType, VmInfo, VmStateRequest,
};
use crate::control::{Apply, ControllerError, Outcome, Reply, Request, Ticket};
use crate::migration::slot::{checked_endpoint, MigrationSlot};
use crate::precopy::SourceVm;
use crate::snapshot::SnapshotChain;

/// Applies requests to a running VM of guest kind `G`, one at a time.
#[derive(Debug)]
pub struct Controller<G: Guest> {
    guest: G,
    state: RunState,
    /// Set by a client's stop (`PUT /actions`): the VMM should stop.
    stop: Arc<AtomicBool>,
    /// The client's dirty logging and harvests.
    dirty_log: DirtyLogClient,
    /// The snapshots taken: the last one (what the next Diff follows) and the chain's reader
    /// of the dirty log.
    chain: SnapshotChain,
    /// The last migration, under way or ended, and the vCPUs an unconfirmed one held.
    migration: MigrationSlot<G::Vcpu>,
    /// Set when the VMM is asked to stop while a request runs (SIGINT/SIGTERM): a migration's
    /// and a live snapshot's waits end at it.
    interrupt: &'static AtomicBool,
}

impl<G: Guest> Controller<G> {
    /// A controller over `guest` (paused if `paused`: a restored or received guest); a
    /// client's stop sets `stop`.
    pub(crate) fn over(guest: G, paused: bool, stop: Arc<AtomicBool>) -> Self {
        Controller {
            guest,
            state: if paused {
                RunState::Paused
            } else {
                RunState::Running
            },
            stop,
            dirty_log: DirtyLogClient::default(),
            chain: SnapshotChain::new(),
            migration: MigrationSlot::default(),
            interrupt: crate::lifecycle::termination_signal(),
        }
    }

    /// The guest.
    pub(crate) fn guest(&self) -> &G {
        &self.guest
    }

    /// The guest, to change.
    pub(crate) fn guest_mut(&mut self) -> &mut G {
        &mut self.guest
    }

    /// The VM starts paused (a restored VM: `PATCH /vm {"state": "Resumed"}` continues it).
    pub(crate) fn paused(self) -> Self {
        Controller {
            state: RunState::Paused,
            ..self
        }
    }

    /// Whether the VMM should stop: a client asked, or the VM migrated away.
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.migrated()
    }

    /// Whether the VM runs on a migration's destination now.
    pub(crate) fn migrated(&self) -> bool {
        self.migration.completed()
    }

    /// The last migration's progress, if one was started.
    pub(crate) fn migration_info(&self) -> Option<MigrationInfo> {
        self.migration.info()
    }

    /// Cancels a migration or a live snapshot under way and waits for it (the VMM is
    /// stopping); the guest's vCPUs are the kind's to stop.
    pub(crate) fn end_copies(&mut self) {
        self.migration.shut_down();
        self.chain.shut_down(self.guest.memory());
    }

    fn apply_now(&mut self, request: Request) -> Outcome {
        if self.migration.settle() {
            // The destination may run the VM: it stays paused here until a client says.
            self.state = RunState::Paused;
        }
        self.chain.settle(self.guest.memory());
        if let Some(refused) = self
            .migration
            .refusal(&request)
            .or_else(|| self.chain.refusal(&request))
        {
            return Err(refused);
        }
        let name = request.name();
        let own = match request {
            Request::GetMemory => return Ok(Reply::Memory(memory_info(self.guest.memory()))),
            Request::GetRegion(id) => {
                return Ok(Reply::Region(region_info(self.guest.memory(), id)?))
            }
            Request::SwitchDirtyLog(switch) => {
                self.dirty_log.switch(self.guest.memory(), switch)?;
                return Ok(Reply::Done);
            }
            Request::Harvest(harvest) => {
                return Ok(Reply::Harvest(
                    self.dirty_log.harvest(self.guest.memory(), harvest)?,
                ))
            }
            Request::GetDirtyLog => {
                return Ok(Reply::DirtyLog(
                    self.dirty_log
                        .info(self.guest.memory(), self.chain.consumer()),
                ))
            }
            Request::GetVm => return Ok(Reply::Vm(self.vm_info())),
            Request::PatchVm(patch) => return self.patch_vm(patch.state),
            Request::CreateSnapshot(create) => {
                return self.create_snapshot(create).map(|()| Reply::Done)
            }
            Request::GetSnapshot => return self.chain.live_info().map(Reply::Snapshot),
            Request::CancelSnapshot => return self.chain.cancel_live().map(|()| Reply::Done),
            Request::StopRecording => {
                return match self.guest.loader() {
                    Some(loader) if loader.stop_recording() => Ok(Reply::Done),
                    _ => Err(no_recording()),
                }
            }
            Request::Act(VmAction {
                action_type: VmActionType::Stop,
            }) => {
                self.stop.store(true, Ordering::Release);
                self.guest.cut_short();
                return Ok(Reply::Done);
            }
            Request::Migrate(request) => return self.migrate(request).map(|()| Reply::Done),
            Request::GetMigration => return self.migration.get().map(Reply::Migration),
            Request::CancelMigration => return self.migration.cancel().map(|()| Reply::Done),
            Request::AddRegion(add) => GuestRequest::AddRegion(add),
            Request::RemoveRegion(id) => GuestRequest::RemoveRegion(id),
            Request::PatchRegion(id, patch) => GuestRequest::PatchRegion(id, patch),
            Request::GetHotplug => GuestRequest::GetHotplug,
            Request::ConfigureHotplug(config) => GuestRequest::ConfigureHotplug(config),
            Request::RequestHotplug(request) => GuestRequest::RequestHotplug(request),
            Request::Guest(command) => GuestRequest::Command(command),
        };
        self.guest
            .answer(own, self.state)
            .unwrap_or_else(|| Err(ControllerError::not_found(format!("{name} {}", G::LACKS))))
    }

    fn vm_info(&self) -> VmInfo {
        let failure = self.guest.failure().cloned();
        VmInfo {
            state: match failure {
                Some(_) => RunState::Failed,
                None => self.state,
            },
            vcpus: self.guest.vcpu_count(),
            failure,
            lazy_restore: self
                .guest
                .loader()
                .map(|loader| LazyRestoreInfo::of(loader.stats())),
        }
    }

    fn patch_vm(&mut self, state: VmStateRequest) -> Outcome {
        if let Some(failure) = self.guest.failure() {
            return Err(ControllerError::conflict(format!(
                "{failure}. It runs nothing more: stop the VMM (PUT /actions Stop)"
            )));
        }
        match state {
            VmStateRequest::Paused => {
                let reply = self.guest.pause(self.state)?;
                self.state = RunState::Paused;
                Ok(reply)
            }
            VmStateRequest::Resumed => {
                self.guest.resume(&mut self.migration);
                self.state = RunState::Running;
                Ok(Reply::Done)
            }
        }
    }

    fn create_snapshot(&mut self, create: SnapshotCreate) -> Result<(), ControllerError> {
        let memory = Arc::clone(self.guest.memory());
        let paused = self.state == RunState::Paused;
        if create.live {
            self.guest.refuse_moving(Moving::LiveSnapshot)?;
            let vcpus = self.guest.moving_vcpus(Moving::LiveSnapshot, paused)?;
            let write_state = self.guest.state_writer();
            return self
                .chain
                .start_live(&memory, &create, vcpus, write_state, self.interrupt);
        }
        create.check_paused(paused)?;
        let write_state = self.guest.state_writer();
        let guest = &mut self.guest;
        self.chain
            .create(&memory, &create, || guest.save_vcpus(), write_state)
            .map(|_| ())
    }

    fn migrate(&mut self, request: MigrateRequest) -> Result<(), ControllerError> {
        self.guest.refuse_moving(Moving::Migration)?;
        checked_endpoint(&request)?;
        let paused = self.state == RunState::Paused;
        let vm = SourceVm {
            memory: Arc::clone(self.guest.memory()),
            vcpus: self.guest.moving_vcpus(Moving::Migration, paused)?,
        };
        let record = self.guest.migration_record(paused);
        self.migration.start(&request, vm, record, self.interrupt)
    }
}

impl<G: Guest> Apply for Controller<G> {
    /// Applies `request`. A request may answer [`Reply::Deferred`]: its answer comes from
    /// [`settle`](Apply::settle).
    fn apply(&mut self, request: Request) -> Outcome {
        let outcome = self.apply_now(request);
        // A request that ran the guest (a new region's check) may have seen a vCPU fail.
        self.guest.note_failure();
        outcome
    }

    fn notifier(&self) -> Option<std::os::fd::RawFd> {
        self.guest.notifier()
    }

    fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        let ready = self.guest.settle();
        self.guest.note_failure();
        ready
    }

    fn cut_short(&mut self) {
        self.guest.cut_short();
    }
}

#[cfg(test)]
mod tests;
