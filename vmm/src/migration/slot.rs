//! A controller's side of migrations, whatever its guest kind: the last migration and the
//! vCPUs an unconfirmed one left paused, what a request may do while one runs, and starting,
//! watching and cancelling one. The guest kind hands over its vCPUs and State record.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::sink::{StateRecord, StreamSink};
use super::Endpoint;
use crate::control::migration::{MigrateRequest, MigrationInfo};
use crate::control::{ControllerError, Request};
use crate::precopy::{Phase, PreCopy, PreCopyVcpu, Reader, Rounds, SourceVm};

/// How long a source VMM whose VM moved on stays to answer `GET /migrate` for a client that
/// followed the migration (asked its status while it ran) and has not read its outcome yet:
/// `tinyvmm client migrate` asks every 50 ms, so it reads `completed` at once, and tells a
/// source that ended without it (killed, crashed) from one whose VM moved on.
const LINGER_FOR_FOLLOWER: Duration = Duration::from_secs(5);

/// A migration: its pre-copy run, and where it goes.
#[derive(Debug)]
struct Migration<V> {
    run: PreCopy<V>,
    /// `unix:PATH` or `tcp:HOST:PORT`.
    destination: String,
    /// A client asked the status while the migration was under way.
    followed: AtomicBool,
    /// A client was told it completed.
    outcome_read: AtomicBool,
    /// When the VMM first saw it completed.
    completed_at: OnceLock<Instant>,
}

impl<V: PreCopyVcpu> Migration<V> {
    fn info(&self) -> MigrationInfo {
        MigrationInfo::of(self.run.progress(), self.destination.clone())
    }
}

/// The last migration of a VM, and what it left behind.
#[derive(Debug)]
pub struct MigrationSlot<V> {
    /// The last migration, under way or ended.
    migration: Option<Migration<V>>,
    /// vCPUs a migration left paused because the destination may run the VM (its answer did
    /// not come): resuming the VM lets them go on.
    held: Vec<V>,
}

impl<V> Default for MigrationSlot<V> {
    fn default() -> Self {
        MigrationSlot {
            migration: None,
            held: Vec::new(),
        }
    }
}

impl<V: PreCopyVcpu> MigrationSlot<V> {
    /// Once the migration has ended without completing, takes back the vCPUs it held; true
    /// if it held some (the VM is then paused until a client resumes it). It has ended when
    /// its phase is final, and its thread is waited for from there (it only hands the vCPUs
    /// over after that), so that no request sees a final phase beside a VM not yet settled.
    pub(crate) fn settle(&mut self) -> bool {
        let Some(migration) = &mut self.migration else {
            return false;
        };
        let phase = migration.run.phase();
        if phase.under_way() || phase == Phase::Completed {
            return false;
        }
        let ending = migration.run.join();
        if ending.held.is_empty() {
            return false;
        }
        self.held = ending.held;
        true
    }

    /// Lets the vCPUs an unconfirmed migration held go on (a client resumed the VM): the only
    /// way their hold ends.
    pub(crate) fn resume_held(&mut self) {
        for vcpu in self.held.drain(..) {
            vcpu.release();
        }
    }

    /// Whether the VM runs on a migration's destination now and this VMM may end: at once
    /// unless a client followed the migration without reading its outcome yet, then once it
    /// has or after [`LINGER_FOR_FOLLOWER`].
    pub(crate) fn completed(&self) -> bool {
        self.migration.as_ref().is_some_and(|m| {
            m.run.completed()
                && (!m.followed.load(Ordering::Acquire)
                    || m.outcome_read.load(Ordering::Acquire)
                    || m.completed_at.get_or_init(Instant::now).elapsed() >= LINGER_FOR_FOLLOWER)
        })
    }

    /// The last migration's progress, if one was started.
    pub(crate) fn info(&self) -> Option<MigrationInfo> {
        self.migration.as_ref().map(Migration::info)
    }

    /// `GET /migrate`; notes whether the client follows a migration under way or has read
    /// that it completed (see [`MigrationSlot::completed`]).
    pub(crate) fn get(&self) -> Result<MigrationInfo, ControllerError> {
        let migration = self
            .migration
            .as_ref()
            .ok_or_else(|| ControllerError::not_found("no migration has been started"))?;
        let info = migration.info();
        if info.progress.phase.under_way() {
            migration.followed.store(true, Ordering::Release);
        } else if info.progress.phase == Phase::Completed {
            migration.outcome_read.store(true, Ordering::Release);
        }
        Ok(info)
    }

    /// `PUT /migrate/cancel`.
    pub(crate) fn cancel(&self) -> Result<(), ControllerError> {
        match &self.migration {
            Some(m) if m.run.is_running() => {
                m.run.cancel();
                Ok(())
            }
            _ => Err(ControllerError::conflict("no migration is under way")),
        }
    }

    /// Cancels a migration under way and waits for its thread (the VMM is stopping).
    pub(crate) fn shut_down(&mut self) {
        if let Some(migration) = &mut self.migration {
            migration.run.cancel();
            migration.run.join();
        }
    }

    /// Why `request` cannot run now: the VM is moving (its layout, run state and guest must
    /// stay as the migration found them), has moved, or may run on the destination of a
    /// migration that ended unconfirmed (then nothing may run or change the guest here).
    pub(crate) fn refusal(&self, request: &Request) -> Option<ControllerError> {
        let migration = self.migration.as_ref()?;
        let reads = matches!(
            request,
            Request::GetMemory
                | Request::GetRegion(_)
                | Request::GetDirtyLog
                | Request::GetHotplug
                | Request::GetVm
                | Request::GetMigration
                | Request::CancelMigration
                | Request::GetSnapshot
                | Request::StopRecording
                | Request::Act(_)
        );
        if reads {
            return None;
        }
        if !self.held.is_empty() {
            return refused_while_held(request);
        }
        if migration.run.completed() {
            return Some(ControllerError::conflict(format!(
                "the VM has migrated to {}; this VMM is exiting",
                migration.info().destination
            )));
        }
        migration.run.is_running().then(|| {
            ControllerError::conflict(
                "a migration is under way: GET /migrate for its progress, PUT /migrate/cancel to stop it",
            )
        })
    }

    /// Checks `request` and starts migrating `vm` as it says, its State record made by
    /// `state`; `interrupt` is the process's stop flag.
    pub(crate) fn start(
        &mut self,
        request: &MigrateRequest,
        vm: SourceVm<V>,
        state: Box<dyn StateRecord>,
        interrupt: &'static AtomicBool,
    ) -> Result<(), ControllerError> {
        let endpoint = checked_endpoint(request)?;
        let destination = endpoint.to_string();
        let sink = StreamSink::new(endpoint, request.local, state);
        let run = PreCopy::start(rounds(request), Box::new(sink), vm, Reader::Own, interrupt)
            .map_err(|e| ControllerError::internal(format!("starting the migration: {e}")))?;
        self.migration = Some(Migration {
            run,
            destination,
            followed: AtomicBool::new(false),
            outcome_read: AtomicBool::new(false),
            completed_at: OnceLock::new(),
        });
        Ok(())
    }
}

/// The rounds `request` asks for.
fn rounds(request: &MigrateRequest) -> Rounds {
    Rounds {
        downtime: Duration::from_millis(request.downtime_ms),
        timeout: Duration::from_secs(request.timeout_s),
        on_timeout: request.on_timeout,
    }
}

/// The destination `request` names, if the request is one a migration can start with.
pub(crate) fn checked_endpoint(request: &MigrateRequest) -> Result<Endpoint, ControllerError> {
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
    Ok(endpoint)
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
