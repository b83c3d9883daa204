//! What differs between guest kinds, as the one controller asks it: the [`Guest`] trait, and
//! the requests only a kind answers ([`GuestRequest`]).

use std::os::fd::RawFd;
use std::sync::Arc;

use kvm_memslots::{KvmVm, MemoryManager};
use kvm_memslots_persist::LazyLoader;

use crate::control::guest::GuestCommand;
use crate::control::hotplug::{HotplugConfig, HotplugRequest};
use crate::control::memory::{AddRegion, PatchRegion};
use crate::control::vm::{RunState, VmFailure};
use crate::control::{ControllerError, Outcome, Reply, Ticket};
use crate::migration::sink::StateRecord;
use crate::migration::slot::MigrationSlot;
use crate::precopy::PreCopyVcpu;
use crate::snapshot::live::StateWriter;
use crate::vm::state::VcpuState;

/// The requests whose answer is a guest kind's own: its memory map, its hotplug memory and
/// its commands. Every other request the controller answers itself, for every kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestRequest {
    /// `PUT /memory/regions`.
    AddRegion(AddRegion),
    /// `DELETE /memory/regions/{id}`.
    RemoveRegion(u64),
    /// `PATCH /memory/regions/{id}`.
    PatchRegion(u64, PatchRegion),
    /// `GET /hotplug/memory`.
    GetHotplug,
    /// `PUT /hotplug/memory`.
    ConfigureHotplug(HotplugConfig),
    /// `PATCH /hotplug/memory`.
    RequestHotplug(HotplugRequest),
    /// `PUT /guest/command`.
    Command(GuestCommand),
}

/// Why a guest kind's vCPUs are handed to the pre-copy engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moving {
    /// A live migration.
    Migration,
    /// A live snapshot.
    LiveSnapshot,
}

/// The guest's memory, as every kind has it.
pub(crate) type Memory = MemoryManager<KvmVm>;

/// A guest kind, as the one controller (`controller::Controller`) asks it what differs: its
/// memory, vCPUs, devices, its own requests and its saved state.
pub trait Guest {
    /// Its vCPUs as the pre-copy engine pauses, saves and resumes them.
    type Vcpu: PreCopyVcpu;

    /// What a client is told after a request's route when this kind lacks the request
    /// ([`answer`](Guest::answer) gave `None`).
    const LACKS: &'static str;

    /// Its memory manager.
    fn memory(&self) -> &Arc<Memory>;

    /// The fault handler of a guest restored with userfaultfd, whose working-set recording
    /// `PUT /working-set/stop` ends.
    fn loader(&self) -> Option<&LazyLoader>;

    /// Its number of vCPUs (0 once they stopped).
    fn vcpu_count(&self) -> usize;

    /// Why the guest failed, if it has.
    fn failure(&self) -> Option<&VmFailure> {
        None
    }

    /// Takes note of a vCPU that failed since (said once on stderr).
    fn note_failure(&mut self) {}

    /// Answers one of the kind's own requests, the VM being in `state`; `None` if this kind
    /// lacks it (the controller then refuses it, in one place).
    fn answer(&mut self, request: GuestRequest, state: RunState) -> Option<Outcome>;

    /// Pauses the guest (`state` is the run state before): its reply ([`Reply::Done`], or a
    /// deferred one that waits for what the pause cut short).
    fn pause(&mut self, state: RunState) -> Result<Reply, ControllerError>;

    /// Resumes the guest, and the vCPUs an unconfirmed migration held in `held`.
    fn resume(&mut self, held: &mut MigrationSlot<Self::Vcpu>);

    /// Why it cannot be copied while it runs now (`what` is under way), if it cannot.
    fn refuse_moving(&self, what: Moving) -> Result<(), ControllerError> {
        let _ = what;
        Ok(())
    }

    /// Its vCPUs as the pre-copy engine pauses and resumes them (`paused`: a client paused the
    /// VM, and they stay paused).
    fn moving_vcpus(&self, what: Moving, paused: bool) -> Result<Vec<Self::Vcpu>, ControllerError>;

    /// Every vCPU's state, the VM paused (a snapshot).
    fn save_vcpus(&mut self) -> Result<Vec<VcpuState>, ControllerError>;

    /// Makes a snapshot's state file: what the snapshot is, the vCPUs, the layout and the
    /// kind's own part.
    fn state_writer(&self) -> StateWriter;

    /// The State record a migration sends last (`paused`: the VM stays paused on arrival).
    fn migration_record(&self, paused: bool) -> Box<dyn StateRecord>;

    /// A file descriptor readable when [`settle`](Guest::settle) may have news.
    fn notifier(&self) -> Option<RawFd> {
        None
    }

    /// Deferred answers that are ready.
    fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        Vec::new()
    }

    /// The VMM is stopping: deferred requests are cut short, and no new one starts.
    fn cut_short(&mut self) {}
}
