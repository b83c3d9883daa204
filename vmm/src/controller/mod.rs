//! The one place where requests change a running test-guest VM. It takes typed [`Request`]s and
//! returns a typed [`Reply`] or a [`ControllerError`] whose kind says whose fault it was; it
//! knows no transport (the API socket, `api`, turns HTTP into requests and replies into HTTP).

pub mod hotplug;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::fs::File;
use std::os::unix::fs::FileExt;

use kvm_memslots::snapshot::{write_dirty_pages, write_memory_file, MemoryLayout};
use kvm_memslots::{Backing, DirtyPages, RegionId, RegionSpec, Target, PAGE_SIZE};
use vm_memory::GuestAddress;

use crate::control::dirty_log::{
    DirtyLogInfo, DirtyLogSwitch, DirtyRate, DirtyRegion, Harvest, HarvestInfo,
};
use crate::control::guest::{GuestCommand, GuestCommandResult, GuestOp};
use crate::control::hotplug::{HotplugConfig, HotplugRequest};
use crate::control::memory::{
    memory_info, AddRegion, BackingKind, MemoryInfo, PatchRegion, RegionAdded,
};
use crate::control::migration::{MigrateRequest, MigrationInfo};
use crate::control::snapshot::{SnapshotCreate, SnapshotType};
use crate::control::vm::{RunState, VmAction, VmActionType, VmInfo, VmStateRequest};
use crate::control::{Apply, ControllerError, ErrorKind, Outcome, Reply, Request};
use crate::migration::source::SourceVm;
use crate::migration::{Endpoint, Migration};
use crate::test_guest::area::{check_area, TestArea};
use crate::test_guest::snapshot::{HotplugState, SnapshotState, STATE_VERSION};
use crate::test_guest::vcpus::{GuestError, TestVm, VcpuHandle, Vcpus};
use crate::test_guest::{self, Command, Op};
use hotplug::HotplugArea;

const MIB: u64 = 1 << 20;
/// Where regions added without a guest address go (above the test area).
pub const AUTO_PLACE_BASE: u64 = 1 << 30;
/// Where the hotplug area starts.
pub const HOTPLUG_GPA: u64 = 32 << 30;

impl Apply for Controller {
    fn apply(&mut self, request: Request) -> Outcome {
        Controller::apply(self, request)
    }
}

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
    /// The layout of the last snapshot, and the pages harvested for a diff that failed (kept
    /// for the next one).
    snapshot_base: Option<(MemoryLayout, Vec<DirtyPages>)>,
    /// Set when the VMM is asked to stop while a request runs (SIGINT/SIGTERM): long requests
    /// stop at their next safe point.
    interrupt: &'static AtomicBool,
    /// The last migration, under way or ended.
    migration: Option<Migration>,
    /// vCPUs a migration left paused because the destination may run the VM (its answer did
    /// not come): `PATCH /vm {"state": "Resumed"}` lets them go on.
    held: Vec<VcpuHandle>,
}

fn no_hotplug_area() -> ControllerError {
    ControllerError::not_found("no hotplug area: configure one with PUT /hotplug/memory")
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
            interrupt: crate::lifecycle::termination_signal(),
            migration: None,
            held: Vec::new(),
        }
    }

    /// Takes back a restored VM's hotplug area: its mapped slots are the regions at their guest
    /// addresses in the restored memory.
    pub fn with_hotplug(mut self, saved: Option<&HotplugState>) -> Result<Self, ControllerError> {
        let Some(saved) = saved else {
            return Ok(self);
        };
        let block = saved.config.block_size_mib;
        let slot_size = saved.config.slot_size_mib.unwrap_or(block) * MIB;
        let regions = self.vm.memory().regions();
        let slots = saved
            .mapped
            .iter()
            .enumerate()
            .map(|(i, mapped)| {
                let gpa = HOTPLUG_GPA + i as u64 * slot_size;
                if !mapped {
                    return Ok(None);
                }
                regions
                    .iter()
                    .find(|r| r.gpa.0 == gpa && r.size == slot_size)
                    .map(|r| Some(r.id))
                    .ok_or_else(|| {
                        ControllerError::bad(format!(
                            "the snapshot's hotplug slot {i} at {gpa:#x} is not in its memory layout"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.hotplug = Some(HotplugArea {
            config: saved.config,
            gpa: HOTPLUG_GPA,
            slot_size,
            plugged_blocks: saved.plugged_blocks,
            slots,
        });
        Ok(self)
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

    /// Has long requests stop at their next safe point once `interrupt` is set (by default,
    /// once SIGINT or SIGTERM came).
    pub fn with_interrupt(self, interrupt: &'static AtomicBool) -> Self {
        Controller { interrupt, ..self }
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

    /// Once the migration thread has ended without completing, takes back what it harvested
    /// (a Diff snapshot needs those pages).
    fn settle_migration(&mut self) {
        let Some(migration) = &mut self.migration else {
            return;
        };
        if migration.is_running() || migration.completed() {
            return;
        }
        let ending = migration.join();
        if let Some((_, carried)) = &mut self.snapshot_base {
            carried.extend(ending.harvested);
        }
        if !ending.held.is_empty() {
            // The destination may run the VM: it stays paused here until a client says.
            self.state = RunState::Paused;
            self.held = ending.held;
        }
    }

    /// Why `request` cannot run now: the VM is moving (its layout, run state and guest must
    /// stay as the migration found them) or has moved.
    fn refused_while_migrating(&self, request: &Request) -> Option<ControllerError> {
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

    fn migrate(&mut self, request: MigrateRequest) -> Result<(), ControllerError> {
        if !self.held.is_empty() {
            return Err(ControllerError::conflict(
                "the last migration's outcome is unknown (GET /migrate): the destination may \
                 run the VM; resume it here first (PATCH /vm {\"state\": \"Resumed\"}) if it \
                 does not",
            ));
        }
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
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
            paused: self.state == RunState::Paused,
            keep_harvested: self.snapshot_base.is_some(),
        };
        let migration = Migration::start(&request, endpoint, vm, self.interrupt)
            .map_err(|e| ControllerError::internal(format!("starting the migration: {e}")))?;
        self.migration = Some(migration);
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        memory_info(self.vm.memory())
    }

    /// The first free place for `size` bytes at or above [`AUTO_PLACE_BASE`], aligned to the
    /// size's largest power-of-two factor up to 2 MiB.
    /// Never inside the hotplug area.
    fn auto_place(&self, size: u64) -> Option<u64> {
        let at = self.first_free(AUTO_PLACE_BASE, size)?;
        match self.reserved() {
            Some(area) if at < area.end && area.start < at.checked_add(size)? => {
                self.first_free(area.end, size)
            }
            _ => Some(at),
        }
    }

    /// The first free place for `size` bytes at or above `from`, aligned as `auto_place` says.
    fn first_free(&self, from: u64, size: u64) -> Option<u64> {
        let align = (size & size.wrapping_neg()).clamp(PAGE_SIZE, 2 * MIB);
        let snapshot = self.vm.memory().snapshot();
        let mut at = from.checked_next_multiple_of(align)?;
        for slot in snapshot.map().iter_from_gpa(GuestAddress(at)) {
            if slot.gpa().0 >= at.checked_add(size)? {
                break;
            }
            at = slot.gpa_range().end.checked_next_multiple_of(align)?;
        }
        Some(at)
    }

    /// The hotplug area's guest range, once configured: reserved for its slots.
    fn reserved(&self) -> Option<std::ops::Range<u64>> {
        self.hotplug
            .as_ref()
            .map(|h| h.gpa..h.gpa + h.slots.len() as u64 * h.slot_size)
    }

    /// Refuses `[gpa, gpa + size)` if it reaches into the hotplug area.
    fn outside_hotplug_area(&self, gpa: u64, size: u64) -> Result<(), ControllerError> {
        let end = gpa.saturating_add(size);
        match self.reserved() {
            Some(area) if gpa < area.end && area.start < end => {
                Err(ControllerError::conflict(format!(
                    "guest range [{gpa:#x}, {end:#x}) reaches into the hotplug area [{:#x}, {:#x}), which is reserved for PATCH /hotplug/memory",
                    area.start, area.end
                )))
            }
            _ => Ok(()),
        }
    }

    /// Checks that `[start, end)` is all guest memory the test guest can reach.
    fn reachable(&self, start: u64, end: u64) -> Result<(), ControllerError> {
        if start < test_guest::SYSTEM_SIZE {
            return Err(ControllerError::bad(format!(
                "guest range [{start:#x}, {end:#x}) overlaps the system region [0, {:#x}): the guest's code, tables and command blocks are off limits",
                test_guest::SYSTEM_SIZE
            )));
        }
        if end > test_guest::IDENTITY_MAPPED {
            return Err(ControllerError::bad(format!(
                "the test guest reaches guest addresses below {:#x} only",
                test_guest::IDENTITY_MAPPED
            )));
        }
        if let Some(hole) = self.vm.memory().snapshot().map().first_hole(start, end) {
            return Err(ControllerError::bad(format!(
                "guest range [{start:#x}, {end:#x}) is not all memory: nothing at {hole:#x}"
            )));
        }
        Ok(())
    }

    fn add_region(&mut self, add: AddRegion) -> Result<RegionAdded, ControllerError> {
        let slot_size = add.slot_size.unwrap_or(add.size);
        if add.slot_size.is_some() && (slot_size == 0 || !add.size.is_multiple_of(slot_size)) {
            return Err(ControllerError::bad(format!(
                "size {:#x} is not a multiple of slot_size {slot_size:#x}",
                add.size
            )));
        }
        let gpa = match add.guest_address {
            Some(gpa) => gpa,
            None => self.auto_place(add.size).ok_or_else(|| {
                ControllerError::bad(format!("no free guest range of {:#x} bytes", add.size))
            })?,
        };
        self.outside_hotplug_area(gpa, add.size)?;
        let backing = match add.backing {
            BackingKind::Anonymous => Backing::Anonymous,
            BackingKind::Memfd => Backing::Memfd,
        };
        let mut spec = RegionSpec::new(GuestAddress(gpa), add.size).with_backing(backing);
        spec.slot_size = add.slot_size;
        spec.read_only = add.read_only;
        spec.log_dirty = add.dirty_log;
        let checkable = add.guest_check && !add.read_only;
        if checkable {
            // Refuse a check the guest cannot do before anything is added.
            self.vcpus()?;
            // (A range that wraps is the manager's to refuse, with its own message.)
            if gpa
                .checked_add(add.size)
                .is_some_and(|end| end > test_guest::IDENTITY_MAPPED)
            {
                return Err(ControllerError::bad(format!(
                    "guest_check: the test guest reaches guest addresses below {:#x} only",
                    test_guest::IDENTITY_MAPPED
                )));
            }
        }
        let region = self.add_checked(spec, slot_size, checkable)?;
        Ok(RegionAdded {
            id: region.0,
            guest_address: gpa,
            size: add.size,
            slots: add.size / slot_size,
            guest_checked: checkable,
        })
    }

    /// Has the guest check both ends of every slot of `area` both ways.
    fn check(&mut self, area: &TestArea) -> Result<(), String> {
        let Some(vcpus) = self.vcpus.as_mut() else {
            return Err("the VM is shutting down".into());
        };
        check_area(&self.vm, vcpus, area, self.interrupt)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Adds the region `spec`; with `check`, the test guest then checks both ends of every slot
    /// of `slot_size` both ways, and if that fails the region goes again, so that the memory is
    /// as it was. The error says whether even that removal failed.
    fn add_checked(
        &mut self,
        spec: RegionSpec,
        slot_size: u64,
        check: bool,
    ) -> Result<RegionId, ControllerError> {
        let (gpa, size) = (spec.gpa.0, spec.size);
        let memory = Arc::clone(self.vm.memory());
        let mut spec = spec;
        if self.snapshot_base.is_some() {
            // Once there is a snapshot to diff against, new memory logs from the start, so
            // that the next Diff has every page of it.
            spec.log_dirty = true;
        }
        let region = memory.add_region(spec)?;
        if !check {
            return Ok(region);
        }
        let area = TestArea {
            region,
            gpa,
            slot_size,
            slots: size / slot_size,
        };
        if let Err(e) = self.check(&area) {
            let cleanup = match memory.remove_region(region) {
                Ok(()) => "the memory was removed again".to_owned(),
                Err(r) => format!("removing it again failed too ({r}): region {region} stays"),
            };
            return Err(ControllerError::internal(format!(
                "the guest's check of the new memory at {gpa:#x} failed: {e}; {cleanup}"
            )));
        }
        Ok(region)
    }

    fn protect_system(&self, id: u64) -> Result<RegionId, ControllerError> {
        let id = RegionId(id);
        if id == self.vm.system_region() {
            return Err(ControllerError::conflict(format!(
                "region {id} holds the guest's code and page tables: it stays"
            )));
        }
        if self
            .hotplug
            .as_ref()
            .is_some_and(|h| h.slots.contains(&Some(id)))
        {
            return Err(ControllerError::conflict(format!(
                "region {id} belongs to the hotplug area: change it with PATCH /hotplug/memory"
            )));
        }
        Ok(id)
    }

    fn remove_region(&mut self, id: u64) -> Result<(), ControllerError> {
        let id = self.protect_system(id)?;
        Ok(self.vm.memory().remove_region(id)?)
    }

    fn patch_region(&mut self, id: u64, patch: PatchRegion) -> Result<(), ControllerError> {
        let id = self.protect_system(id)?;
        let memory = Arc::clone(self.vm.memory());
        let Some(gpa) = patch.guest_address else {
            let read_only = patch.read_only.ok_or_else(|| {
                ControllerError::bad("nothing to change: give guest_address and/or read_only")
            })?;
            return Ok(memory.set_read_only(id, read_only)?);
        };
        let old_gpa = memory
            .regions()
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.gpa)
            .ok_or(kvm_memslots::Error::UnknownRegion(id))?;
        let size = memory
            .regions()
            .iter()
            .find(|r| r.id == id)
            .map_or(0, |r| r.size);
        self.outside_hotplug_area(gpa, size)?;
        memory.move_region(id, GuestAddress(gpa))?;
        if let Some(read_only) = patch.read_only {
            if let Err(e) = memory.set_read_only(id, read_only) {
                // Both changes or neither: move it back.
                let undo = match memory.move_region(id, old_gpa) {
                    Ok(()) => "the move was undone".to_owned(),
                    Err(u) => {
                        format!("undoing the move failed too ({u}): the region is at {gpa:#x}")
                    }
                };
                return Err(ControllerError::from(e).and(undo));
            }
        }
        Ok(())
    }

    fn switch_dirty_log(&mut self, switch: DirtyLogSwitch) -> Result<(), ControllerError> {
        let memory = self.vm.memory();
        let target = target(switch.region);
        if switch.enabled {
            memory.start_dirty_log(target)?;
        } else {
            memory.stop_dirty_log(target)?;
        }
        Ok(())
    }

    fn harvest(&mut self, harvest: Harvest) -> Result<HarvestInfo, ControllerError> {
        let dirty = self.vm.memory().harvest_dirty(target(harvest.region))?;
        if harvest.region.is_none() {
            // Every region: a window for the dirty rate since the last such harvest.
            let now = std::time::Instant::now();
            let pages = dirty.iter().map(|d| d.count()).sum();
            if let Some(last) = self.last_harvest {
                let window = now.duration_since(last).as_secs_f64();
                self.dirty_rate = Some(DirtyRate {
                    pages,
                    window_ms: window * 1e3,
                    pages_per_second: if window > 0.0 {
                        pages as f64 / window
                    } else {
                        0.0
                    },
                });
            }
            self.last_harvest = Some(now);
            self.harvests += 1;
        }
        let regions = dirty
            .iter()
            .map(|d| DirtyRegion {
                id: d.region.0,
                guest_address: d.gpa.0,
                pages: d.pages,
                dirty_pages: d.count(),
                ranges: d.ranges().map(|r| [r.start, r.end]).collect(),
            })
            .collect();
        Ok(HarvestInfo {
            page_size: PAGE_SIZE,
            regions,
        })
    }

    fn create_snapshot(&mut self, create: SnapshotCreate) -> Result<(), ControllerError> {
        if self.state != RunState::Paused {
            return Err(ControllerError::bad(
                "the VM is running: pause it first with PATCH /vm {\"state\": \"Paused\"}",
            ));
        }
        let memory = Arc::clone(self.vm.memory());
        if create.snapshot_type == SnapshotType::Diff && self.snapshot_base.is_none() {
            return Err(ControllerError::bad(
                "no snapshot to diff against: take a Full snapshot first",
            ));
        }
        let files = new_files(&[&create.snapshot_path, &create.mem_file_path])?;
        let (state_file, mem_file) = (&files[0].1, &files[1].1);
        let written = self.write_snapshot(&memory, create.snapshot_type, state_file, mem_file);
        if written.is_err() {
            // A failed snapshot leaves no file behind.
            for (path, _) in &files {
                let _ = std::fs::remove_file(path);
            }
        }
        written
    }

    fn write_snapshot(
        &mut self,
        memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>,
        kind: SnapshotType,
        state_file: &File,
        mem_file: &File,
    ) -> Result<(), ControllerError> {
        let failed = |e: &dyn std::fmt::Display| {
            ControllerError::internal(format!("the snapshot failed: {e}"))
        };
        // What a Diff harvested, until the whole snapshot is written: if any step fails, every
        // page of it goes into the next Diff.
        let mut harvested = None;
        let mut layout = MemoryLayout::of(memory);
        match kind {
            SnapshotType::Full => {
                // The harvest below takes the dirty bits a Diff against an earlier base would
                // need: until this Full is written whole, there is no base.
                self.snapshot_base = None;
                // Logging on every region from now on, so that a Diff can follow; what was
                // dirty before is in the full image.
                memory.start_dirty_log(Target::All)?;
                memory.harvest_dirty(Target::All)?;
                // The regions log now: the layout says so.
                layout = MemoryLayout::of(memory);
                write_memory_file(memory, &layout, mem_file).map_err(|e| failed(&e))?;
            }
            SnapshotType::Diff => {
                // The layout may have changed since the last snapshot (regions added, removed,
                // moved): this Diff is laid out as memory is now, and merging follows region
                // ids (`snapshot-merge`).
                let (_, carried) = self.snapshot_base.as_mut().expect("checked by the caller");
                let mut dirty = std::mem::take(carried);
                match memory.harvest_dirty(Target::All) {
                    Ok(now) => dirty.extend(now),
                    Err(e) => {
                        *carried = dirty;
                        return Err(e.into());
                    }
                }
                let written = write_dirty_pages(memory, &layout, &dirty, mem_file);
                harvested = Some(dirty);
                if let Err(e) = written {
                    self.keep_for_next_diff(harvested);
                    return Err(failed(&e));
                }
            }
        }
        let saved = self.write_state(&layout, state_file);
        if let Err(e) = saved {
            self.keep_for_next_diff(harvested);
            return Err(failed(&e));
        }
        match &mut self.snapshot_base {
            Some((base, _)) => *base = layout,
            None => self.snapshot_base = Some((layout, Vec::new())),
        }
        Ok(())
    }

    /// Puts the pages a failed Diff harvested back for the next one.
    fn keep_for_next_diff(&mut self, harvested: Option<Vec<DirtyPages>>) {
        if let (Some(pages), Some((_, carried))) = (harvested, self.snapshot_base.as_mut()) {
            *carried = pages;
        }
    }

    /// Writes every vCPU's state, the layout and the hotplug area into the state file.
    fn write_state(
        &mut self,
        layout: &MemoryLayout,
        state_file: &File,
    ) -> Result<(), ControllerError> {
        let vcpus = self.vcpus.as_mut().ok_or_else(|| {
            ControllerError::new(ErrorKind::Unavailable, "the VM is shutting down")
        })?;
        let states = vcpus
            .save_states()
            .map_err(|e| ControllerError::internal(e.to_string()))?;
        let layout = layout.clone();
        let state = SnapshotState {
            version: STATE_VERSION,
            layout,
            vcpus: states,
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
        };
        state_file
            .write_all_at(&state.to_bytes(), 0)
            .map_err(|e| ControllerError::internal(e.to_string()))
    }

    fn dirty_log_info(&self) -> DirtyLogInfo {
        let memory = self.vm.memory();
        let ring_entries = memory.kvm().ring_entries();
        DirtyLogInfo {
            mode: if ring_entries.is_some() {
                "ring"
            } else {
                "bitmap"
            },
            ring_entries,
            logging_regions: memory
                .regions()
                .iter()
                .filter(|r| r.flags.log_dirty)
                .map(|r| r.id.0)
                .collect(),
            harvests: self.harvests,
            dirty_rate: self.dirty_rate,
        }
    }

    fn configure_hotplug(&mut self, config: HotplugConfig) -> Result<(), ControllerError> {
        if self.hotplug.as_ref().is_some_and(|h| h.plugged_blocks > 0) {
            return Err(ControllerError::conflict(
                "the hotplug area has plugged memory: unplug it all first",
            ));
        }
        let memory = self.vm.memory();
        let area = HotplugArea::new(
            config,
            HOTPLUG_GPA,
            test_guest::IDENTITY_MAPPED,
            memory.slot_usage().free,
        )?;
        // All of it plugged must be admissible now: refuse an area that could only ever be
        // plugged in part.
        let total = area.slots.len() as u64 * area.slot_size;
        // Its range is reserved from now on: nothing else may be there.
        if let Some(other) = memory
            .snapshot()
            .map()
            .first_overlap(area.gpa, area.gpa + total)
        {
            return Err(ControllerError::conflict(format!(
                "region {} at {} is inside the hotplug area [{:#x}, {:#x}): move or remove it first",
                other.payload().region(),
                other.gpa_range(),
                area.gpa,
                area.gpa + total
            )));
        }
        memory
            .admit(total, area.slot_size)
            .map_err(|e| ControllerError::from(e).and("the hotplug area was not configured"))?;
        self.hotplug = Some(area);
        Ok(())
    }

    fn request_hotplug(&mut self, request: HotplugRequest) -> Result<(), ControllerError> {
        let area = self.hotplug.as_ref().ok_or_else(no_hotplug_area)?;
        let plan = area.plan(request.requested_size_mib)?;
        let slot_size = area.slot_size;
        // Plug: map the slots that get a first block, and let the guest check them. If any of
        // that fails, the slots mapped so far go again: the area stays as it was.
        let mut added = Vec::new();
        for &(i, gpa) in &plan.map {
            if self.interrupted() {
                // Stop at a slot boundary: the slots plugged so far stay, each checked.
                return Err(self.stop_hotplug_early(plan.blocks, added.len(), plan.map.len()));
            }
            let spec = RegionSpec::new(gpa, slot_size);
            match self.add_checked(spec, slot_size, true) {
                Ok(id) => {
                    self.area_mut().slots[i] = Some(id);
                    added.push((i, id));
                }
                Err(failed) if self.interrupted() => {
                    // The signal came during this slot's check, which removed the slot again.
                    let stopped = self.stop_hotplug_early(plan.blocks, added.len(), plan.map.len());
                    return Err(stopped.and(failed.message));
                }
                Err(failed) => return Err(self.unplug_after_failure(failed, added)),
            }
        }
        // Unplug: unmap the slots left with no plugged block; give back unplugged blocks
        // inside a slot that stays.
        for (done, &(i, id)) in plan.unmap.iter().enumerate() {
            if self.interrupted() {
                return Err(self.stop_hotplug_early(plan.blocks, done, plan.unmap.len()));
            }
            if let Err(e) = self.vm.memory().remove_region(id) {
                let area = self.area_mut();
                area.settle(area.plugged_blocks);
                return Err(e.into());
            }
            self.area_mut().slots[i] = None;
        }
        if let Some((gpa, len)) = plan.discard {
            self.vm.memory().discard(gpa, len)?;
        }
        self.area_mut().plugged_blocks = plan.blocks;
        Ok(())
    }

    /// A signal stopped a plug or unplug after `done` of `of` slots: the area counts as
    /// plugged what its mapped slots hold (never past the request on a plug, never more than
    /// before on an unplug), which `GET /hotplug/memory` reports.
    fn stop_hotplug_early(&mut self, requested: u64, done: usize, of: usize) -> ControllerError {
        let area = self.area_mut();
        let mib = area.settle(requested.max(area.plugged_blocks)) * area.config.block_size_mib;
        ControllerError::new(
            ErrorKind::Unavailable,
            format!(
                "the VMM is stopping (a signal came): the request stopped after {done} of {of} slots; {mib} MiB are plugged"
            ),
        )
    }

    /// Removes the slots a failed plug mapped, newest first; returns `failed`, or an internal
    /// error naming the slots that could not be removed.
    fn unplug_after_failure(
        &mut self,
        failed: ControllerError,
        added: Vec<(usize, RegionId)>,
    ) -> ControllerError {
        let mut stuck = Vec::new();
        for (i, id) in added.into_iter().rev() {
            match self.vm.memory().remove_region(id) {
                Ok(()) => self.area_mut().slots[i] = None,
                Err(e) => stuck.push(format!("slot {i} (region {id}): {e}")),
            }
        }
        if stuck.is_empty() {
            return failed;
        }
        ControllerError::internal(failed.message).and(format!(
            "undoing the slots plugged before failed too: {}",
            stuck.join("; ")
        ))
    }

    fn area_mut(&mut self) -> &mut HotplugArea {
        self.hotplug
            .as_mut()
            .expect("the hotplug area is configured")
    }

    fn guest_command(
        &mut self,
        command: GuestCommand,
    ) -> Result<GuestCommandResult, ControllerError> {
        if command.op == GuestOp::StopLoop {
            return self.stop_loop(command.vcpu);
        }
        if !command.start.is_multiple_of(8)
            || command.stride == 0
            || !command.stride.is_multiple_of(8)
        {
            return Err(ControllerError::bad(
                "start and stride must be multiples of 8, and stride not 0",
            ));
        }
        if command.end <= command.start {
            return Err(ControllerError::bad("end must be above start"));
        }
        self.reachable(command.start, command.end)?;
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, command.vcpu)?;
        if let Some(running) = vcpus.running(command.vcpu) {
            return Err(ControllerError::conflict(format!(
                "vCPU {} runs a {:?} command: stop it first (op stop_loop)",
                command.vcpu, running.op
            )));
        }
        let op = match command.op {
            GuestOp::Write => Op::Write,
            GuestOp::Verify => Op::Verify,
            GuestOp::WriteLoop => Op::WriteLoop,
            GuestOp::StopLoop => unreachable!("handled above"),
        };
        let guest_command = Command {
            op,
            start: command.start,
            end: command.end,
            stride: command.stride,
            seed: command.seed,
        };
        if op == Op::WriteLoop {
            vcpus.start(command.vcpu, guest_command);
            return Ok(GuestCommandResult::Started);
        }
        guest_outcome(vcpus.run(command.vcpu, guest_command))
    }

    /// Ends vCPU `vcpu`'s write loop and reports its passes.
    fn stop_loop(&mut self, vcpu: usize) -> Result<GuestCommandResult, ControllerError> {
        let vcpus = self.vcpus()?;
        check_vcpu(vcpus, vcpu)?;
        let seed = match vcpus.running(vcpu) {
            Some(command) if command.op == Op::WriteLoop => command.seed,
            _ => {
                return Err(ControllerError::conflict(format!(
                    "vCPU {vcpu} runs no write loop"
                )))
            }
        };
        vcpus.stop_loop(vcpu);
        let outcome = vcpus.wait(vcpu);
        match outcome {
            Ok(outcome) => Ok(GuestCommandResult::Stopped {
                passes: outcome.passes,
                last_seed: outcome.passes.checked_sub(1).map(|k| seed.wrapping_add(k)),
            }),
            Err(e) => guest_outcome(Err(e)),
        }
    }
}

fn check_vcpu(vcpus: &Vcpus, vcpu: usize) -> Result<(), ControllerError> {
    if vcpu >= vcpus.count() {
        return Err(ControllerError::bad(format!(
            "vcpu {vcpu} does not exist (the VM has {})",
            vcpus.count()
        )));
    }
    Ok(())
}

/// What a guest command's run means to a client.
fn guest_outcome(
    run: Result<test_guest::Outcome, GuestError>,
) -> Result<GuestCommandResult, ControllerError> {
    match run {
        Ok(_) => Ok(GuestCommandResult::Ok),
        Err(GuestError::GuestSawWrongData {
            gpa,
            found,
            expected,
        }) => Ok(GuestCommandResult::Mismatch {
            address: gpa,
            found,
            expected,
        }),
        Err(GuestError::Interrupted) => Err(ControllerError::new(
            ErrorKind::Unavailable,
            "the VMM is stopping (a signal came) while the guest ran the command",
        )),
        Err(e) => Err(ControllerError::internal(e)),
    }
}

/// Creates each of `paths` (which must not exist), or none of them.
fn new_files(
    paths: &[&std::path::Path],
) -> Result<Vec<(std::path::PathBuf, File)>, ControllerError> {
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        match File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => files.push((path.to_path_buf(), file)),
            Err(e) => {
                for (made, _) in &files {
                    let _ = std::fs::remove_file(made);
                }
                return Err(ControllerError::bad(format!(
                    "cannot create {}: {e} (snapshot files must not exist)",
                    path.display()
                )));
            }
        }
    }
    Ok(files)
}

fn target(region: Option<u64>) -> Target {
    region.map_or(Target::All, |id| Target::Region(RegionId(id)))
}
