//! The test guest's controller: the one place where requests change a running test-guest
//! VM. It takes the typed [`Request`]s of `control` and returns a typed [`Reply`] or a
//! [`ControllerError`] whose kind says whose fault it was; it knows no transport (the API
//! socket, `api`, turns HTTP into requests and replies into HTTP). The test guest answers
//! every request; this file holds the VM's state and the dispatch, and each resource's
//! requests are carried out in a file of their own: `memory.rs`, `hotplug.rs`,
//! `guest.rs`, `snapshot.rs` and `migration.rs`.

mod guest;
mod hotplug;
mod memory;
mod migration;
mod snapshot;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::control::dirty_log::DirtyLogClient;
use crate::control::memory::{memory_info, region_info, MemoryInfo};
use crate::control::migration::MigrationInfo;
use crate::control::vm::{
    RunState, VmAction, VmActionType, VmFailure, VmInfo, VmStateRequest, FAILED_EXIT_STATUS,
};
use crate::control::{Apply, ControllerError, ErrorKind, Outcome, Reply, Request, Ticket};
use crate::migration::slot::MigrationSlot;
use crate::snapshot::SnapshotChain;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::vcpus::{GuestError, TestVm, VcpuHandle, Vcpus};
use guest::{Answer, Waiter};
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
    /// The client's dirty logging and harvests.
    dirty_log: DirtyLogClient,
    /// The snapshots taken: the last one (what the next Diff follows) and the chain's reader
    /// of the dirty log.
    chain: SnapshotChain,
    /// Set when the VMM is asked to stop while a request runs (SIGINT/SIGTERM): long requests
    /// stop at their next safe point.
    interrupt: &'static AtomicBool,
    /// The last migration, under way or ended, and the vCPUs an unconfirmed one held.
    migration: MigrationSlot<VcpuHandle>,
    /// Deferred requests waiting for guest commands to end.
    waiters: Vec<Waiter>,
    /// The next deferred request's ticket.
    next_ticket: u64,
    /// Why the guest failed, once a vCPU stopped on an error: sticky, said once on stderr.
    failure: Option<VmFailure>,
    /// The VMM is stopping: no new command starts.
    stopping: bool,
}

impl Apply for Controller {
    fn apply(&mut self, request: Request) -> Outcome {
        Controller::apply(self, request)
    }

    fn notifier(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.vcpus.as_ref().map(|v| v.notifier().as_raw_fd())
    }

    fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        Controller::settle(self)
    }

    fn cut_short(&mut self) {
        Controller::cut_short(self)
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
            dirty_log: DirtyLogClient::default(),
            chain: SnapshotChain::new(),
            interrupt: crate::lifecycle::termination_signal(),
            migration: MigrationSlot::default(),
            waiters: Vec::new(),
            next_ticket: 0,
            failure: None,
            stopping: false,
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
        self.migration.completed()
    }

    /// The last migration's progress, if one was started.
    pub fn migration_info(&self) -> Option<MigrationInfo> {
        self.migration.info()
    }

    /// Why the guest failed, if it has: the VMM should exit with [`FAILED_EXIT_STATUS`] once
    /// stopped.
    pub fn failure(&self) -> Option<&VmFailure> {
        self.failure.as_ref()
    }

    /// The answers of guest commands that ended since the last call, and of requests that
    /// waited for them; takes note of a vCPU that failed meanwhile.
    pub fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        let ready = self.collect_commands();
        self.note_failure();
        ready
    }

    /// The VMM is stopping: every command someone waits for is cut short (its answer comes
    /// from [`settle`](Self::settle)), and no new one starts.
    pub fn cut_short(&mut self) {
        self.stopping = true;
        self.cut_commands(true);
    }

    /// Says on stderr, once, that the guest failed, as soon as the vCPUs tell.
    fn note_failure(&mut self) {
        if self.failure.is_some() {
            return;
        }
        if let Some(failure) = self.vcpus.as_ref().and_then(Vcpus::failure) {
            eprintln!(
                "tinyvmm: {failure}; the VM is Failed (GET /vm), and stopping the VMM now exits \
                 {FAILED_EXIT_STATUS}"
            );
            self.failure = Some(failure.clone());
        }
    }

    /// Refuses what needs a guest that runs, once it has failed.
    fn refuse_if_failed(&self) -> Result<(), ControllerError> {
        match &self.failure {
            Some(failure) => Err(ControllerError::conflict(format!(
                "{failure}. It runs nothing more: stop the VMM (PUT /actions Stop)"
            ))),
            None => Ok(()),
        }
    }

    /// Stops the vCPUs (a migration or a live snapshot under way is cancelled first); returns
    /// the first error one of them stopped with.
    pub fn shut_down(&mut self) -> Result<(), GuestError> {
        self.migration.shut_down();
        self.chain.shut_down(self.vm.memory());
        match self.vcpus.take() {
            Some(vcpus) => vcpus.shut_down(),
            None => Ok(()),
        }
    }

    fn vcpus(&mut self) -> Result<&mut Vcpus, ControllerError> {
        self.refuse_if_failed()?;
        if self.stopping {
            return Err(ControllerError::new(
                ErrorKind::Unavailable,
                "the VMM is stopping: the guest starts no new command",
            ));
        }
        if self.state == RunState::Paused {
            return Err(ControllerError::conflict(
                "the VM is paused: the guest runs no command until it is resumed",
            ));
        }
        self.vcpus
            .as_mut()
            .ok_or_else(|| ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down"))
    }

    /// Refuses a check of new memory (which runs on every vCPU) while a vCPU runs a command.
    pub(super) fn refuse_if_busy(&self) -> Result<(), ControllerError> {
        let Some(vcpus) = &self.vcpus else {
            return Ok(());
        };
        match (0..vcpus.count()).find_map(|v| vcpus.running(v).map(|c| (v, c))) {
            Some((index, command)) => Err(ControllerError::conflict(format!(
                "vCPU {index} runs a {:?} command, and the guest checks new memory on every \
                 vCPU: wait for its answer or end it first (PUT /guest/command op cancel, or \
                 op stop_loop for a loop, with \"vcpu\": {index})",
                command.op
            ))),
            None => Ok(()),
        }
    }

    /// Applies `request`. A guest command answers [`Reply::Deferred`]: its answer comes from
    /// [`settle`](Self::settle) when the guest has reported.
    pub fn apply(&mut self, request: Request) -> Outcome {
        let outcome = self.apply_now(request);
        // A request that ran the guest (a new region's check) may have seen a vCPU fail.
        self.note_failure();
        outcome
    }

    fn apply_now(&mut self, request: Request) -> Outcome {
        self.settle_migration();
        self.chain.settle(self.vm.memory());
        if let Some(refused) = self
            .migration
            .refusal(&request)
            .or_else(|| self.chain.refusal(&request))
        {
            return Err(refused);
        }
        match request {
            Request::GetMemory => Ok(Reply::Memory(self.memory_info())),
            Request::GetRegion(id) => Ok(Reply::Region(region_info(self.vm.memory(), id)?)),
            Request::AddRegion(add) => self.add_region(add).map(Reply::RegionAdded),
            Request::RemoveRegion(id) => self.remove_region(id).map(|()| Reply::Done),
            Request::PatchRegion(id, patch) => self.patch_region(id, patch).map(|()| Reply::Done),
            Request::SwitchDirtyLog(switch) => {
                self.dirty_log.switch(self.vm.memory(), switch)?;
                Ok(Reply::Done)
            }
            Request::Harvest(harvest) => Ok(Reply::Harvest(
                self.dirty_log.harvest(self.vm.memory(), harvest)?,
            )),
            Request::GetDirtyLog => Ok(Reply::DirtyLog(
                self.dirty_log.info(self.vm.memory(), self.chain.consumer()),
            )),
            Request::GetHotplug => self
                .hotplug
                .as_ref()
                .map(|h| Reply::Hotplug(h.info()))
                .ok_or_else(no_hotplug_area),
            Request::ConfigureHotplug(config) => {
                self.configure_hotplug(config).map(|()| Reply::Done)
            }
            Request::RequestHotplug(request) => self.request_hotplug(request).map(|()| Reply::Done),
            Request::Guest(command) => self.guest_command(command),
            Request::GetVm => Ok(Reply::Vm(VmInfo {
                state: match self.failure {
                    Some(_) => RunState::Failed,
                    None => self.state,
                },
                vcpus: self.vcpus.as_ref().map_or(0, |v| v.count()),
                failure: self.failure.clone(),
            })),
            Request::PatchVm(patch) => {
                self.refuse_if_failed()?;
                match patch.state {
                    VmStateRequest::Paused => {
                        self.state = RunState::Paused;
                        // A write or verify under way ends where it is; the answer waits
                        // for it (write loops go on: stop_loop ends them).
                        let cut = self.cut_commands(false);
                        if !cut.is_empty() {
                            return Ok(self.defer(cut, Answer::Done));
                        }
                    }
                    VmStateRequest::Resumed => {
                        self.migration.resume_held();
                        // A restored VM's vCPUs take up the commands they were saved on.
                        self.resume_unfinished();
                        self.state = RunState::Running;
                    }
                }
                Ok(Reply::Done)
            }
            Request::CreateSnapshot(create) => self.create_snapshot(create).map(|()| Reply::Done),
            Request::GetSnapshot => self.chain.live_info().map(Reply::Snapshot),
            Request::CancelSnapshot => self.chain.cancel_live().map(|()| Reply::Done),
            Request::StopRecording => match self.vm.loader() {
                Some(loader) if loader.stop_recording() => Ok(Reply::Done),
                _ => Err(crate::control::snapshot::no_recording()),
            },
            Request::Act(VmAction {
                action_type: VmActionType::Stop,
            }) => {
                self.stop_requested = true;
                self.cut_short();
                Ok(Reply::Done)
            }
            Request::Migrate(request) => self.migrate(request).map(|()| Reply::Done),
            Request::GetMigration => self.migration.get().map(Reply::Migration),
            Request::CancelMigration => self.migration.cancel().map(|()| Reply::Done),
        }
    }

    fn memory_info(&self) -> MemoryInfo {
        memory_info(self.vm.memory())
    }
}
