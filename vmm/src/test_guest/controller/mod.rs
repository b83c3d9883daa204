//! The test guest's controller: the one place where requests change a running test-guest
//! VM. It takes the typed [`Request`]s of `control` and returns a typed [`Reply`] or a
//! [`ControllerError`] whose kind says whose fault it was; it knows no transport (the API
//! socket, `api`, turns HTTP into requests and replies into HTTP). The test guest answers
//! every request; this file holds the VM's state and the dispatch, and each resource's
//! requests are carried out in a file of their own: `memory.rs`, `dirty_log.rs`, `hotplug.rs`,
//! `guest.rs`, `snapshot.rs` and `migration.rs`.

mod dirty_log;
mod guest;
mod hotplug;
mod memory;
mod migration;
mod snapshot;

use std::sync::atomic::{AtomicBool, Ordering};

use kvm_memslots::DirtyConsumer;

use crate::control::dirty_log::DirtyRate;
use crate::control::memory::{memory_info, MemoryInfo};
use crate::control::migration::MigrationInfo;
use crate::control::vm::{RunState, VmAction, VmActionType, VmInfo, VmStateRequest};
use crate::control::{Apply, ControllerError, ErrorKind, Outcome, Reply, Request};
use crate::migration::{MigratingVcpu, Migration};
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::vcpus::{GuestError, TestVm, VcpuHandle, Vcpus};
use hotplug::no_hotplug_area;

const MIB: u64 = 1 << 20;
/// Where regions added without a guest address go (above the test area).
pub const AUTO_PLACE_BASE: u64 = 1 << 30;
/// Where the hotplug area starts.
pub const HOTPLUG_GPA: u64 = 32 << 30;

/// Applies requests to a running test-guest VM, one at a time.
#[derive(Debug)]
pub struct Controller {
    vm: TestVm,
    vcpus: Option<Vcpus>,
    state: RunState,
    hotplug: Option<HotplugArea>,
    stop_requested: bool,
    /// Harvests of every region so far, and the last one's time.
    harvests: u64,
    last_harvest: Option<std::time::Instant>,
    /// The dirty rate between the last two harvests of every region.
    dirty_rate: Option<DirtyRate>,
    /// The last snapshot (what the next Diff follows), and the pages harvested for a diff that
    /// failed (kept for the next one).
    snapshot_base: Option<snapshot::SnapshotBase>,
    /// The snapshot chain's reader of the dirty log, from the first Full snapshot on.
    chain: Option<DirtyConsumer>,
    /// Set when the VMM is asked to stop while a request runs (SIGINT/SIGTERM): long requests
    /// stop at their next safe point.
    interrupt: &'static AtomicBool,
    /// The last migration, under way or ended.
    migration: Option<Migration<VcpuHandle>>,
    /// vCPUs a migration left paused because the destination may run the VM (its answer did
    /// not come): `PATCH /vm {"state": "Resumed"}` lets them go on.
    held: Vec<VcpuHandle>,
}

impl Apply for Controller {
    fn apply(&mut self, request: Request) -> Outcome {
        Controller::apply(self, request)
    }
}

impl Controller {
    /// A controller for `vm`, whose guest runs on `vcpus`.
    pub fn new(vm: TestVm, vcpus: Vcpus) -> Self {
        Controller {
            vm,
            vcpus: Some(vcpus),
            state: RunState::Running,
            hotplug: None,
            stop_requested: false,
            harvests: 0,
            last_harvest: None,
            dirty_rate: None,
            snapshot_base: None,
            chain: None,
            interrupt: crate::lifecycle::termination_signal(),
            migration: None,
            held: Vec::new(),
        }
    }

    /// The VM starts paused (a restored VM: `PATCH /vm {"state": "Resumed"}` continues it).
    pub fn paused(self) -> Self {
        Controller {
            state: RunState::Paused,
            ..self
        }
    }

    /// Lets restored vCPUs that were saved mid-command (a write loop) run on; the others wait
    /// for their next command.
    pub fn resume_unfinished(&mut self) {
        if let Some(vcpus) = &mut self.vcpus {
            vcpus.resume_unfinished();
        }
    }

    fn interrupted(&self) -> bool {
        self.interrupt.load(Ordering::Acquire)
    }

    /// The VM.
    pub fn vm(&self) -> &TestVm {
        &self.vm
    }

    /// Whether the VMM should stop: a client asked, or the VM migrated away.
    pub fn stop_requested(&self) -> bool {
        self.stop_requested || self.migrated()
    }

    /// Whether the VM runs on a migration's destination now.
    pub fn migrated(&self) -> bool {
        self.migration.as_ref().is_some_and(Migration::completed)
    }

    /// The last migration's progress, if one was started.
    pub fn migration_info(&self) -> Option<MigrationInfo> {
        self.migration.as_ref().map(Migration::info)
    }

    /// Stops the vCPUs (a migration under way is cancelled first); returns the first error one
    /// of them stopped with.
    pub fn shut_down(&mut self) -> Result<(), GuestError> {
        if let Some(migration) = &mut self.migration {
            migration.cancel();
            migration.join();
        }
        match self.vcpus.take() {
            Some(vcpus) => vcpus.shut_down(),
            None => Ok(()),
        }
    }

    fn vcpus(&mut self) -> Result<&mut Vcpus, ControllerError> {
        if self.state == RunState::Paused {
            return Err(ControllerError::conflict(
                "the VM is paused: the guest runs no command until it is resumed",
            ));
        }
        self.vcpus
            .as_mut()
            .ok_or_else(|| ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down"))
    }

    /// Applies `request`.
    pub fn apply(&mut self, request: Request) -> Outcome {
        self.settle_migration();
        if let Some(refused) = self.refused_while_migrating(&request) {
            return Err(refused);
        }
        match request {
            Request::GetMemory => Ok(Reply::Memory(self.memory_info())),
            Request::AddRegion(add) => self.add_region(add).map(Reply::RegionAdded),
            Request::RemoveRegion(id) => self.remove_region(id).map(|()| Reply::Done),
            Request::PatchRegion(id, patch) => self.patch_region(id, patch).map(|()| Reply::Done),
            Request::SwitchDirtyLog(switch) => self.switch_dirty_log(switch).map(|()| Reply::Done),
            Request::Harvest(harvest) => self.harvest(harvest).map(Reply::Harvest),
            Request::GetDirtyLog => Ok(Reply::DirtyLog(self.dirty_log_info())),
            Request::GetHotplug => self
                .hotplug
                .as_ref()
                .map(|h| Reply::Hotplug(h.info()))
                .ok_or_else(no_hotplug_area),
            Request::ConfigureHotplug(config) => {
                self.configure_hotplug(config).map(|()| Reply::Done)
            }
            Request::RequestHotplug(request) => self.request_hotplug(request).map(|()| Reply::Done),
            Request::Guest(command) => self.guest_command(command).map(Reply::Guest),
            Request::GetVm => Ok(Reply::Vm(VmInfo {
                state: self.state,
                vcpus: self.vcpus.as_ref().map_or(0, |v| v.count()),
            })),
            Request::PatchVm(patch) => {
                self.state = match patch.state {
                    VmStateRequest::Paused => RunState::Paused,
                    VmStateRequest::Resumed => {
                        for vcpu in self.held.drain(..) {
                            vcpu.resume();
                        }
                        RunState::Running
                    }
                };
                Ok(Reply::Done)
            }
            Request::CreateSnapshot(create) => self.create_snapshot(create).map(|()| Reply::Done),
            Request::Act(VmAction {
                action_type: VmActionType::Stop,
            }) => {
                self.stop_requested = true;
                Ok(Reply::Done)
            }
            Request::Migrate(request) => self.migrate(request).map(|()| Reply::Done),
            Request::GetMigration => self
                .migration
                .as_ref()
                .map(|m| Reply::Migration(m.info()))
                .ok_or_else(|| ControllerError::not_found("no migration has been started")),
            Request::CancelMigration => match &self.migration {
                Some(m) if m.is_running() => {
                    m.cancel();
                    Ok(Reply::Done)
                }
                _ => Err(ControllerError::conflict("no migration is under way")),
            },
        }
    }

    fn memory_info(&self) -> MemoryInfo {
        memory_info(self.vm.memory())
    }
}
