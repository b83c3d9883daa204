//! The test guest as a guest kind of the one controller (`controller::Controller`): what
//! only the test guest answers (its memory map, its hotplug area, its commands) and how its
//! vCPUs pause, save and move. It answers every request the controller passes on. This file
//! holds the guest's state and the [`Guest`] trait's answers, and each resource's requests are
//! carried out in a file of their own: `memory.rs`, `hotplug.rs`, `guest.rs`, `snapshot.rs`
//! and `migration.rs`.

mod guest;
mod hotplug;
mod memory;
mod migration;
mod snapshot;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_memslots_persist::LazyLoader;

use crate::control::vm::{RunState, VmFailure, FAILED_EXIT_STATUS};
use crate::control::{ControllerError, ErrorKind, Outcome, Reply, Ticket};
use crate::controller::guest::Memory;
use crate::controller::{Guest, GuestRequest, Moving};
use crate::migration::sink::StateRecord;
use crate::migration::slot::MigrationSlot;
use crate::snapshot::live::StateWriter;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::vcpus::{GuestError, TestVm, VcpuHandle, Vcpus};
use crate::vm::state::VcpuState;
use guest::{Answer, Waiter};
use hotplug::no_hotplug_area;

const MIB: u64 = 1 << 20;
/// Where regions added without a guest address go (above the test area).
const AUTO_PLACE_BASE: u64 = 1 << 30;

/// The test guest's controller: the one controller over a [`TestGuest`].
pub(crate) type Controller = crate::controller::Controller<TestGuest>;

/// A running test guest, as the controller asks it.
#[derive(Debug)]
pub(crate) struct TestGuest {
    vm: TestVm,
    vcpus: Option<Vcpus>,
    /// The VM's run state, as the controller passed it with the request being answered.
    state: RunState,
    hotplug: Option<HotplugArea>,
    /// Set when the VMM is asked to stop while a request runs (SIGINT/SIGTERM): long requests
    /// stop at their next safe point.
    interrupt: &'static AtomicBool,
    /// Deferred requests waiting for guest commands to end.
    waiters: Vec<Waiter>,
    /// The next deferred request's ticket.
    next_ticket: u64,
    /// Why the guest failed, once a vCPU stopped on an error: sticky, said once on stderr.
    failure: Option<VmFailure>,
    /// The VMM is stopping: no new command starts.
    stopping: bool,
}

impl Controller {
    /// A controller for `vm`, whose guest runs on `vcpus`.
    pub(crate) fn new(vm: TestVm, vcpus: Vcpus) -> Self {
        let guest = TestGuest {
            vm,
            vcpus: Some(vcpus),
            state: RunState::Running,
            hotplug: None,
            interrupt: crate::lifecycle::termination_signal(),
            waiters: Vec::new(),
            next_ticket: 0,
            failure: None,
            stopping: false,
        };
        Self::over(guest, false, Arc::new(AtomicBool::new(false)))
    }

    /// Lets restored vCPUs that were saved mid-command (a write loop) run on; the others wait
    /// for their next command.
    pub(crate) fn resume_unfinished(&mut self) {
        self.guest_mut().resume_unfinished();
    }

    /// Why the guest failed, if it has: the VMM should exit with [`FAILED_EXIT_STATUS`] once
    /// stopped.
    pub(crate) fn failure(&self) -> Option<&VmFailure> {
        self.guest().failure.as_ref()
    }

    /// Stops the vCPUs (a migration or a live snapshot under way is cancelled first); returns
    /// the first error one of them stopped with.
    pub(crate) fn shut_down(&mut self) -> Result<(), GuestError> {
        self.end_copies();
        match self.guest_mut().vcpus.take() {
            Some(vcpus) => vcpus.shut_down(),
            None => Ok(()),
        }
    }
}

impl TestGuest {
    fn resume_unfinished(&mut self) {
        if let Some(vcpus) = &mut self.vcpus {
            vcpus.resume_unfinished();
        }
    }

    fn interrupted(&self) -> bool {
        self.interrupt.load(Ordering::Acquire)
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
}

impl Guest for TestGuest {
    type Vcpu = VcpuHandle;

    // The test guest answers every request; nothing is said.
    const LACKS: &'static str = "is not answered by the test guest";

    fn memory(&self) -> &Arc<Memory> {
        self.vm.memory()
    }

    fn loader(&self) -> Option<&LazyLoader> {
        self.vm.loader()
    }

    fn vcpu_count(&self) -> usize {
        self.vcpus.as_ref().map_or(0, |v| v.count())
    }

    fn failure(&self) -> Option<&VmFailure> {
        self.failure.as_ref()
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

    fn answer(&mut self, request: GuestRequest, state: RunState) -> Option<Outcome> {
        self.state = state;
        Some(match request {
            GuestRequest::AddRegion(add) => self.add_region(add).map(Reply::RegionAdded),
            GuestRequest::RemoveRegion(id) => self.remove_region(id).map(|()| Reply::Done),
            GuestRequest::PatchRegion(id, patch) => {
                self.patch_region(id, patch).map(|()| Reply::Done)
            }
            GuestRequest::GetHotplug => self
                .hotplug
                .as_ref()
                .map(|h| Reply::Hotplug(h.info()))
                .ok_or_else(no_hotplug_area),
            GuestRequest::ConfigureHotplug(config) => {
                self.configure_hotplug(config).map(|()| Reply::Done)
            }
            GuestRequest::RequestHotplug(request) => {
                self.request_hotplug(request).map(|()| Reply::Done)
            }
            GuestRequest::Command(command) => self.guest_command(command),
        })
    }

    fn pause(&mut self, _state: RunState) -> Result<Reply, ControllerError> {
        self.state = RunState::Paused;
        // A write or verify under way ends where it is; the answer waits for it (write loops
        // go on: stop_loop ends them).
        let cut = self.cut_commands(false);
        if cut.is_empty() {
            return Ok(Reply::Done);
        }
        Ok(self.defer(cut, Answer::Done))
    }

    fn resume(&mut self, held: &mut MigrationSlot<VcpuHandle>) {
        held.resume_held();
        // A restored VM's vCPUs take up the commands they were saved on.
        self.resume_unfinished();
        self.state = RunState::Running;
    }

    fn moving_vcpus(
        &self,
        what: Moving,
        _paused: bool,
    ) -> Result<Vec<VcpuHandle>, ControllerError> {
        self.moving(what)
    }

    fn save_vcpus(&mut self) -> Result<Vec<VcpuState>, ControllerError> {
        self.save()
    }

    fn state_writer(&self) -> StateWriter {
        self.writer()
    }

    fn migration_record(&self, paused: bool) -> Box<dyn StateRecord> {
        self.record(paused)
    }

    fn notifier(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.vcpus.as_ref().map(|v| v.notifier().as_raw_fd())
    }

    /// The answers of guest commands that ended since the last call, and of requests that
    /// waited for them.
    fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        self.collect_commands()
    }

    /// The VMM is stopping: every command someone waits for is cut short (its answer comes
    /// from [`settle`](Guest::settle)), and no new one starts.
    fn cut_short(&mut self) {
        self.stopping = true;
        self.cut_commands(true);
    }
}
