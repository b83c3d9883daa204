//! The control vocabulary every guest kind shares, and no transport: typed [`Request`]s, the
//! [`Reply`] or [`ControllerError`] each gets, and the [`Apply`] trait a guest kind's controller
//! implements. The request and reply bodies are in one file per resource (as Firecracker's
//! `vmm_config/`): [`memory`], `dirty_log`, [`hotplug`], `guest` (the test guest's
//! commands), `vm`, `snapshot` and `migration`. The API socket (`api`) turns HTTP into
//! requests and replies into HTTP; the one controller (`controller::Controller`) carries them
//! out, asking the guest kind (`test_guest::controller`, `linux::controller`) what differs.

pub(crate) mod dirty_log;
mod error;
pub(crate) mod guest;
pub mod hotplug;
pub mod memory;
pub(crate) mod migration;
pub(crate) mod snapshot;
pub(crate) mod vm;

pub use error::{ControllerError, ErrorKind};

use std::os::fd::RawFd;

use dirty_log::{DirtyLogInfo, DirtyLogSwitch, Harvest, HarvestInfo};
use guest::{GuestCommand, GuestCommandResult};
use hotplug::{HotplugConfig, HotplugInfo, HotplugRequest};
use memory::{AddRegion, MemoryInfo, PatchRegion, RegionAdded, RegionInfo};
use migration::{MigrateRequest, MigrationInfo};
use snapshot::{LiveSnapshotInfo, SnapshotCreate};
use vm::{VmAction, VmInfo, VmStatePatch};

/// Everything a client can ask of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// List regions and slots.
    GetMemory,
    /// Add a region.
    AddRegion(AddRegion),
    /// Describe one region.
    GetRegion(u64),
    /// Remove a region.
    RemoveRegion(u64),
    /// Move a region or change whether it is read-only.
    PatchRegion(u64, PatchRegion),
    /// Start or stop dirty logging.
    SwitchDirtyLog(DirtyLogSwitch),
    /// Fetch and clear dirty pages.
    Harvest(Harvest),
    /// Describe dirty logging: the mode, the logging regions, the dirty rate.
    GetDirtyLog,
    /// Describe the hotplug area.
    GetHotplug,
    /// Set the hotplug area up.
    ConfigureHotplug(HotplugConfig),
    /// Plug or unplug memory in the hotplug area.
    RequestHotplug(HotplugRequest),
    /// Run a test-guest command.
    Guest(GuestCommand),
    /// Describe the VM.
    GetVm,
    /// Pause or resume.
    PatchVm(VmStatePatch),
    /// Save the VM's state and memory: of the paused VM, or (live) of the running one.
    CreateSnapshot(SnapshotCreate),
    /// Describe the last live snapshot.
    GetSnapshot,
    /// Cancel the live snapshot under way.
    CancelSnapshot,
    /// End a lazy restore's working-set recording now (its list is written).
    StopRecording,
    /// Stop the VMM.
    Act(VmAction),
    /// Start migrating the VM to a `tinyvmm receive`.
    Migrate(MigrateRequest),
    /// Describe the migration.
    GetMigration,
    /// Cancel the migration under way.
    CancelMigration,
}

impl Request {
    /// The request's route, for messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Request::GetMemory => "GET /memory",
            Request::AddRegion(_) => "PUT /memory/regions",
            Request::GetRegion(_) => "GET /memory/regions/{id}",
            Request::RemoveRegion(_) => "DELETE /memory/regions/{id}",
            Request::PatchRegion(..) => "PATCH /memory/regions/{id}",
            Request::SwitchDirtyLog(_) => "PATCH /dirty-log",
            Request::Harvest(_) => "POST /dirty-log/harvest",
            Request::GetDirtyLog => "GET /dirty-log",
            Request::GetHotplug => "GET /hotplug/memory",
            Request::ConfigureHotplug(_) => "PUT /hotplug/memory",
            Request::RequestHotplug(_) => "PATCH /hotplug/memory",
            Request::Guest(_) => "PUT /guest/command",
            Request::GetVm => "GET /vm",
            Request::PatchVm(_) => "PATCH /vm",
            Request::CreateSnapshot(_) => "PUT /snapshot/create",
            Request::GetSnapshot => "GET /snapshot",
            Request::CancelSnapshot => "PUT /snapshot/cancel",
            Request::StopRecording => "PUT /working-set/stop",
            Request::Act(_) => "PUT /actions",
            Request::Migrate(_) => "PUT /migrate",
            Request::GetMigration => "GET /migrate",
            Request::CancelMigration => "PUT /migrate/cancel",
        }
    }
}

/// What a request produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Done; nothing to report.
    Done,
    /// The regions and slots.
    Memory(MemoryInfo),
    /// One region.
    Region(RegionInfo),
    /// The new region.
    RegionAdded(RegionAdded),
    /// The dirty pages.
    Harvest(HarvestInfo),
    /// Dirty logging.
    DirtyLog(DirtyLogInfo),
    /// The hotplug area.
    Hotplug(HotplugInfo),
    /// The VM.
    Vm(VmInfo),
    /// What the guest's command found.
    Guest(GuestCommandResult),
    /// The migration.
    Migration(MigrationInfo),
    /// The last live snapshot.
    Snapshot(LiveSnapshotInfo),
    /// The answer comes later (a guest command runs on its vCPU meanwhile): the controller
    /// hands it over with this ticket from [`Apply::settle`].
    Deferred(Ticket),
}

/// Names a request whose answer was deferred ([`Reply::Deferred`]), for as long as it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// What a request gets back.
pub(crate) type Outcome = Result<Reply, ControllerError>;

/// What applies requests: the controller. The API server serves any. A request
/// that runs long (a guest command) need not hold the controller: it may answer
/// [`Reply::Deferred`] and hand the outcome over later from [`settle`](Apply::settle), when
/// its [`notifier`](Apply::notifier) says so; other requests are applied meanwhile.
pub trait Apply {
    /// Applies `request`.
    fn apply(&mut self, request: Request) -> Outcome;

    /// A file descriptor that becomes readable when [`settle`](Apply::settle) may have news
    /// (a deferred answer, a vCPU that failed); `None` if nothing is ever deferred.
    fn notifier(&self) -> Option<RawFd> {
        None
    }

    /// The deferred requests whose outcome is ready, with their tickets. Called when the
    /// notifier is readable; it also takes note of what else happened to the VM meanwhile.
    fn settle(&mut self) -> Vec<(Ticket, Outcome)> {
        Vec::new()
    }

    /// The VMM is stopping: cut every deferred request short (its outcome comes through
    /// [`settle`](Apply::settle) soon after) and defer no new one.
    fn cut_short(&mut self) {}
}
