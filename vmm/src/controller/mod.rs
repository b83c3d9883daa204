//! The one place where API actions change the VM. The HTTP layer (`api`) only turns requests
//! into [`Action`]s; the controller validates and applies them and says what to answer.

use std::sync::atomic::AtomicBool;

use kvm_memslots::{Backing, Error as MemoryError, RegionId, RegionSpec, Target, PAGE_SIZE};
use serde::Deserialize;
use serde_json::{json, Value};
use vm_memory::GuestAddress;

use crate::api::http::Response;
use crate::jobs::check::{check_area, CheckError};
use crate::test_guest::area::TestArea;
use crate::test_guest::vcpus::{Vcpus, Vm, VmError};
use crate::test_guest::{self, Command, Op};

const MIB: u64 = 1 << 20;
/// Where regions added without a guest address go (above the test area).
pub const AUTO_PLACE_BASE: u64 = 1 << 30;
/// Where the hotplug area starts.
pub const HOTPLUG_GPA: u64 = 32 << 30;

/// How a new region is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackingKind {
    /// Private anonymous memory.
    Anonymous,
    /// A new memfd, mapped shared.
    Memfd,
}

/// `PUT /memory/regions`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddRegion {
    /// Size in bytes (a multiple of 4 KiB).
    pub size: u64,
    /// Guest-physical base; by default the first free place from 1 GiB up.
    pub guest_address: Option<u64>,
    /// Backing; anonymous by default.
    #[serde(default = "default_backing")]
    pub backing: BackingKind,
    /// KVM slot size the region is split into (must divide `size`); one slot by default.
    pub slot_size: Option<u64>,
    /// Read-only for the guest.
    #[serde(default)]
    pub read_only: bool,
    /// Log the guest's writes from the start.
    #[serde(default)]
    pub dirty_log: bool,
    /// Have the test guest write and check both ends of every new slot (default true).
    #[serde(default = "yes")]
    pub guest_check: bool,
}

fn default_backing() -> BackingKind {
    BackingKind::Anonymous
}

fn yes() -> bool {
    true
}

/// `PATCH /memory/regions/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchRegion {
    /// Move the region here.
    pub guest_address: Option<u64>,
    /// Make it read-only, or writable again.
    pub read_only: Option<bool>,
}

/// `PATCH /dirty-log`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirtyLogSwitch {
    /// Start (true) or stop (false) logging.
    pub enabled: bool,
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Harvest {
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `PUT /hotplug/memory`: the hotplug area, as Firecracker describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugConfig {
    /// Size of the whole area, in MiB.
    pub total_size_mib: u64,
    /// Plugging granularity in MiB (a power of two, at least 2).
    pub block_size_mib: u64,
    /// KVM slot size in MiB (a multiple of the block size); a slot is mapped while any of its
    /// blocks is plugged. Defaults to the block size.
    pub slot_size_mib: Option<u64>,
}

/// `PATCH /hotplug/memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugRequest {
    /// How much of the area should be plugged, in MiB (a multiple of the block size).
    pub requested_size_mib: u64,
}

/// The test guest's operations, as the API names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestOp {
    /// Write the pattern.
    Write,
    /// Check the pattern.
    Verify,
}

/// `PUT /guest/command`: run one command of the test guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestCommand {
    /// What to do.
    pub op: GuestOp,
    /// First guest address (a multiple of 8).
    pub start: u64,
    /// First address after the range.
    pub end: u64,
    /// Distance between touched addresses (a non-zero multiple of 8).
    pub stride: u64,
    /// Pattern seed: the value at address `a` is `a ^ seed`.
    pub seed: u64,
    /// The vCPU to run it on (0 by default).
    #[serde(default)]
    pub vcpu: usize,
}

/// The VM's run state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
pub enum RunState {
    /// The guest runs commands.
    Running,
    /// The guest runs no command until resumed.
    Paused,
}

/// `PATCH /vm` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatePatch {
    /// `Paused` or `Resumed`.
    pub state: VmStateRequest,
}

/// The states a client may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmStateRequest {
    /// Pause.
    Paused,
    /// Resume.
    Resumed,
}

/// `PUT /actions` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmAction {
    /// Only `Stop`: shut the VMM down.
    pub action_type: VmActionType,
}

/// Actions on the whole VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmActionType {
    /// Stop the guest and the VMM.
    Stop,
}

/// Everything a client can ask of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// List regions and slots.
    GetMemory,
    /// Add a region.
    AddRegion(AddRegion),
    /// Remove a region.
    RemoveRegion(u64),
    /// Move a region or change whether it is read-only.
    PatchRegion(u64, PatchRegion),
    /// Start or stop dirty logging.
    SwitchDirtyLog(DirtyLogSwitch),
    /// Fetch and clear dirty pages.
    Harvest(Harvest),
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
    /// Stop the VMM.
    Act(VmAction),
}

struct Hotplug {
    config: HotplugConfig,
    slot_size: u64,
    /// Plugged blocks (from the area's start).
    plugged_blocks: u64,
    /// The region of each mapped slot of the area, by slot index.
    slots: Vec<Option<RegionId>>,
}

/// Applies actions to a running test-guest VM.
pub struct Controller {
    vm: Vm,
    vcpus: Option<Vcpus>,
    state: RunState,
    hotplug: Option<Hotplug>,
    stop_requested: bool,
    never: AtomicBool,
}

/// The status an error of the memory manager maps to: the client's mistakes are 4xx, KVM's or
/// the host's failures 5xx.
pub fn memory_status(e: &MemoryError) -> u16 {
    match e {
        MemoryError::UnknownRegion(_) => 404,
        MemoryError::ZeroSize
        | MemoryError::Unaligned { .. }
        | MemoryError::WrapAround { .. }
        | MemoryError::SlotSize { .. }
        | MemoryError::DiscardHole { .. } => 400,
        MemoryError::Overlap { .. } | MemoryError::OutOfSlots { .. } => 409,
        _ => 500,
    }
}

fn memory_fault(e: MemoryError) -> Response {
    Response::fault(memory_status(&e), e)
}

fn bad(message: impl std::fmt::Display) -> Response {
    Response::fault(400, message)
}

impl Controller {
    /// A controller for `vm`, whose guest runs on `vcpus`.
    pub fn new(vm: Vm, vcpus: Vcpus) -> Self {
        Controller {
            vm,
            vcpus: Some(vcpus),
            state: RunState::Running,
            hotplug: None,
            stop_requested: false,
            never: AtomicBool::new(false),
        }
    }

    /// The VM.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Whether a client asked the VMM to stop.
    pub fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    /// Stops the vCPUs; returns the first error one of them stopped with.
    pub fn shut_down(&mut self) -> Result<(), VmError> {
        match self.vcpus.take() {
            Some(vcpus) => vcpus.shut_down(),
            None => Ok(()),
        }
    }

    fn vcpus(&mut self) -> Result<&mut Vcpus, Response> {
        if self.state == RunState::Paused {
            return Err(Response::fault(
                409,
                "the VM is paused: the guest runs no command until it is resumed",
            ));
        }
        self.vcpus
            .as_mut()
            .ok_or_else(|| Response::fault(503, "the VM is shutting down"))
    }

    /// Applies `action`; the response says how it went.
    pub fn apply(&mut self, action: Action) -> Response {
        let result = match action {
            Action::GetMemory => Ok(self.memory_report()),
            Action::AddRegion(add) => self.add_region(add),
            Action::RemoveRegion(id) => self.remove_region(id),
            Action::PatchRegion(id, patch) => self.patch_region(id, patch),
            Action::SwitchDirtyLog(switch) => self.switch_dirty_log(switch),
            Action::Harvest(harvest) => self.harvest(harvest),
            Action::GetHotplug => Ok(self.hotplug_report()),
            Action::ConfigureHotplug(config) => self.configure_hotplug(config),
            Action::RequestHotplug(request) => self.request_hotplug(request),
            Action::Guest(command) => self.guest_command(command),
            Action::GetVm => Ok(Response::json(200, self.vm_report())),
            Action::PatchVm(patch) => {
                self.state = match patch.state {
                    VmStateRequest::Paused => RunState::Paused,
                    VmStateRequest::Resumed => RunState::Running,
                };
                Ok(Response::no_content())
            }
            Action::Act(VmAction {
                action_type: VmActionType::Stop,
            }) => {
                self.stop_requested = true;
                Ok(Response::no_content())
            }
        };
        result.unwrap_or_else(|e| e)
    }

    fn vm_report(&self) -> Value {
        json!({
            "state": self.state,
            "vcpus": self.vcpus.as_ref().map_or(0, |v| v.count()),
        })
    }

    fn memory_report(&self) -> Response {
        let memory = self.vm.memory();
        let usage = memory.slot_usage();
        let regions: Vec<Value> = memory
            .regions()
            .iter()
            .map(|r| {
                json!({
                    "id": r.id.0,
                    "guest_address": r.gpa.0,
                    "size": r.size,
                    "host_address": r.hva.0,
                    "slots": r.slots,
                    "read_only": r.flags.read_only,
                    "dirty_log": r.flags.log_dirty,
                    "backing": if r.shared { "memfd" } else { "anonymous" },
                })
            })
            .collect();
        Response::json(
            200,
            json!({
                "slots": { "used": usage.used, "free": usage.free, "max": usage.max },
                "regions": regions,
            }),
        )
    }

    /// The first free place for `size` bytes at or above [`AUTO_PLACE_BASE`], aligned to the
    /// size's largest power-of-two factor up to 2 MiB.
    fn auto_place(&self, size: u64) -> Option<u64> {
        let align = (size & size.wrapping_neg()).clamp(PAGE_SIZE, 2 * MIB);
        let snapshot = self.vm.memory().snapshot();
        let mut at = AUTO_PLACE_BASE;
        for slot in snapshot.map().iter_from_gpa(GuestAddress(AUTO_PLACE_BASE)) {
            if slot.gpa().0 >= at.checked_add(size)? {
                break;
            }
            at = slot.gpa_range().end.checked_next_multiple_of(align)?;
        }
        Some(at)
    }

    /// Checks that `[start, end)` is all guest memory the test guest can reach.
    fn reachable(&self, start: u64, end: u64) -> Result<(), Response> {
        if start < test_guest::SYSTEM_SIZE {
            return Err(bad(format!(
                "guest range [{start:#x}, {end:#x}) overlaps the system region [0, {:#x}): the guest's code, tables and command blocks are off limits",
                test_guest::SYSTEM_SIZE
            )));
        }
        if end > test_guest::IDENTITY_MAPPED {
            return Err(bad(format!(
                "the test guest reaches guest addresses below {:#x} only",
                test_guest::IDENTITY_MAPPED
            )));
        }
        if let Some(hole) = self.vm.memory().snapshot().map().first_hole(start, end) {
            return Err(bad(format!(
                "guest range [{start:#x}, {end:#x}) is not all memory: nothing at {hole:#x}"
            )));
        }
        Ok(())
    }

    fn add_region(&mut self, add: AddRegion) -> Result<Response, Response> {
        let slot_size = add.slot_size.unwrap_or(add.size);
        if add.slot_size.is_some() && (slot_size == 0 || add.size % slot_size != 0) {
            return Err(bad(format!(
                "size {:#x} is not a multiple of slot_size {slot_size:#x}",
                add.size
            )));
        }
        let gpa = match add.guest_address {
            Some(gpa) => gpa,
            None => self
                .auto_place(add.size)
                .ok_or_else(|| bad(format!("no free guest range of {:#x} bytes", add.size)))?,
        };
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
                return Err(bad(format!(
                    "guest_check: the test guest reaches guest addresses below {:#x} only",
                    test_guest::IDENTITY_MAPPED
                )));
            }
        }
        let region = self.add_checked(spec, slot_size, checkable)?;
        Ok(Response::json(
            201,
            json!({
                "id": region.0,
                "guest_address": gpa,
                "size": add.size,
                "slots": add.size / slot_size,
                "guest_checked": checkable,
            }),
        ))
    }

    fn check(&mut self, area: &TestArea) -> Result<(), CheckError> {
        let Some(vcpus) = self.vcpus.as_mut() else {
            return Err(CheckError::ShuttingDown);
        };
        check_area(&self.vm, vcpus, area, &self.never).map(drop)
    }

    fn protect_system(&self, id: u64) -> Result<RegionId, Response> {
        let id = RegionId(id);
        if id == self.vm.system_region() {
            return Err(Response::fault(
                409,
                format!("region {id} holds the guest's code and page tables: it stays"),
            ));
        }
        if self
            .hotplug
            .as_ref()
            .is_some_and(|h| h.slots.contains(&Some(id)))
        {
            return Err(Response::fault(
                409,
                format!(
                    "region {id} belongs to the hotplug area: change it with PATCH /hotplug/memory"
                ),
            ));
        }
        Ok(id)
    }

    fn remove_region(&mut self, id: u64) -> Result<Response, Response> {
        let id = self.protect_system(id)?;
        self.vm.memory().remove_region(id).map_err(memory_fault)?;
        Ok(Response::no_content())
    }

    fn patch_region(&mut self, id: u64, patch: PatchRegion) -> Result<Response, Response> {
        let id = self.protect_system(id)?;
        if patch.guest_address.is_none() && patch.read_only.is_none() {
            return Err(bad(
                "nothing to change: give guest_address and/or read_only",
            ));
        }
        let memory = std::sync::Arc::clone(self.vm.memory());
        let Some(gpa) = patch.guest_address else {
            let read_only = patch.read_only.expect("one of the two is given");
            memory.set_read_only(id, read_only).map_err(memory_fault)?;
            return Ok(Response::no_content());
        };
        let old_gpa = memory
            .regions()
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.gpa)
            .ok_or_else(|| memory_fault(MemoryError::UnknownRegion(id)))?;
        memory
            .move_region(id, GuestAddress(gpa))
            .map_err(memory_fault)?;
        if let Some(read_only) = patch.read_only {
            if let Err(e) = memory.set_read_only(id, read_only) {
                // Both changes or neither: move it back.
                let status = memory_status(&e);
                let undo = match memory.move_region(id, old_gpa) {
                    Ok(()) => "the move was undone".to_owned(),
                    Err(u) => {
                        format!("undoing the move failed too ({u}): the region is at {gpa:#x}")
                    }
                };
                return Err(Response::fault(status, format!("{e}; {undo}")));
            }
        }
        Ok(Response::no_content())
    }

    fn target(region: Option<u64>) -> Target {
        region.map_or(Target::All, |id| Target::Region(RegionId(id)))
    }

    fn switch_dirty_log(&mut self, switch: DirtyLogSwitch) -> Result<Response, Response> {
        let memory = self.vm.memory();
        let target = Self::target(switch.region);
        let result = if switch.enabled {
            memory.start_dirty_log(target)
        } else {
            memory.stop_dirty_log(target)
        };
        result.map_err(memory_fault)?;
        Ok(Response::no_content())
    }

    fn harvest(&mut self, harvest: Harvest) -> Result<Response, Response> {
        let dirty = self
            .vm
            .memory()
            .harvest_dirty(Self::target(harvest.region))
            .map_err(memory_fault)?;
        let regions: Vec<Value> = dirty
            .iter()
            .map(|d| {
                // Consecutive dirty pages as [start, end) guest-address ranges.
                let mut ranges: Vec<[u64; 2]> = Vec::new();
                for gpa in d.addresses() {
                    match ranges.last_mut() {
                        Some(last) if last[1] == gpa.0 => last[1] += PAGE_SIZE,
                        _ => ranges.push([gpa.0, gpa.0 + PAGE_SIZE]),
                    }
                }
                json!({
                    "id": d.region.0,
                    "guest_address": d.gpa.0,
                    "pages": d.pages,
                    "dirty_pages": d.count(),
                    "ranges": ranges,
                })
            })
            .collect();
        Ok(Response::json(
            200,
            json!({ "page_size": PAGE_SIZE, "regions": regions }),
        ))
    }

    fn hotplug_report(&self) -> Response {
        match &self.hotplug {
            None => Response::fault(
                404,
                "no hotplug area: configure one with PUT /hotplug/memory",
            ),
            Some(h) => {
                let block = h.config.block_size_mib;
                let mapped = h.slots.iter().filter(|s| s.is_some()).count();
                Response::json(
                    200,
                    json!({
                        "total_size_mib": h.config.total_size_mib,
                        "block_size_mib": block,
                        "slot_size_mib": h.slot_size / MIB,
                        "plugged_size_mib": h.plugged_blocks * block,
                        "requested_size_mib": h.plugged_blocks * block,
                        "guest_address": HOTPLUG_GPA,
                        "mapped_slots": mapped,
                    }),
                )
            }
        }
    }

    fn configure_hotplug(&mut self, config: HotplugConfig) -> Result<Response, Response> {
        if self.hotplug.as_ref().is_some_and(|h| h.plugged_blocks > 0) {
            return Err(Response::fault(
                409,
                "the hotplug area has plugged memory: unplug it all first",
            ));
        }
        let block = config.block_size_mib;
        let slot = config.slot_size_mib.unwrap_or(block);
        if block < 2 || !block.is_power_of_two() {
            return Err(bad(format!(
                "block_size_mib {block} must be a power of two of at least 2"
            )));
        }
        if slot == 0 || slot % block != 0 {
            return Err(bad(format!(
                "slot_size_mib {slot} must be a multiple of block_size_mib {block}"
            )));
        }
        if config.total_size_mib == 0 || config.total_size_mib % slot != 0 {
            return Err(bad(format!(
                "total_size_mib {} must be a non-zero multiple of slot_size_mib {slot}",
                config.total_size_mib
            )));
        }
        let total = config
            .total_size_mib
            .checked_mul(MIB)
            .filter(|t| {
                HOTPLUG_GPA
                    .checked_add(*t)
                    .is_some_and(|end| end <= test_guest::IDENTITY_MAPPED)
            })
            .ok_or_else(|| {
                bad(format!(
                    "total_size_mib {} does not fit below {:#x}, where the test guest reaches",
                    config.total_size_mib,
                    test_guest::IDENTITY_MAPPED
                ))
            })?;
        let free = self.vm.memory().slot_usage().free as u64;
        let slots = total / (slot * MIB);
        if slots > free {
            return Err(Response::fault(
                409,
                format!("the hotplug area needs {slots} KVM slots; {free} are free"),
            ));
        }
        self.hotplug = Some(Hotplug {
            config,
            slot_size: slot * MIB,
            plugged_blocks: 0,
            slots: vec![None; slots as usize],
        });
        Ok(Response::no_content())
    }

    fn request_hotplug(&mut self, request: HotplugRequest) -> Result<Response, Response> {
        let Some(h) = &self.hotplug else {
            return Err(Response::fault(
                404,
                "no hotplug area: configure one with PUT /hotplug/memory",
            ));
        };
        let block = h.config.block_size_mib;
        if request.requested_size_mib % block != 0
            || request.requested_size_mib > h.config.total_size_mib
        {
            return Err(bad(format!(
                "requested_size_mib {} must be a multiple of block_size_mib {block} no larger than total_size_mib {}",
                request.requested_size_mib, h.config.total_size_mib
            )));
        }
        let blocks = request.requested_size_mib / block;
        let blocks_per_slot = h.slot_size / (block * MIB);
        let wanted_slots = blocks.div_ceil(blocks_per_slot) as usize;
        let slot_size = h.slot_size;
        let (old_blocks, mapped) = (h.plugged_blocks, h.slots.clone());
        // Plug: map the slots that get a first block, and let the guest check them. If any of
        // that fails, the slots mapped so far go again: the area stays as it was.
        let mut added = Vec::new();
        for (i, region) in mapped.iter().enumerate().take(wanted_slots) {
            if region.is_none() {
                let gpa = HOTPLUG_GPA + i as u64 * slot_size;
                if let Err(response) = self.plug_slot(i, gpa, slot_size) {
                    let mut stuck = Vec::new();
                    for (j, id) in added.drain(..).rev() {
                        match self.vm.memory().remove_region(id) {
                            Ok(()) => self.hotplug.as_mut().expect("configured").slots[j] = None,
                            Err(e) => stuck.push(format!("slot {j} (region {id}): {e}")),
                        }
                    }
                    if stuck.is_empty() {
                        return Err(response);
                    }
                    let first = response
                        .body
                        .as_ref()
                        .and_then(|b| b["fault_message"].as_str())
                        .unwrap_or("plugging failed")
                        .to_owned();
                    return Err(Response::fault(
                        500,
                        format!(
                            "{first}; undoing the slots plugged before failed too: {}",
                            stuck.join("; ")
                        ),
                    ));
                }
                added.push((
                    i,
                    self.hotplug.as_ref().expect("configured").slots[i].expect("plugged"),
                ));
            }
        }
        // Unplug: unmap the slots left with no plugged block; give back unplugged blocks
        // inside a slot that stays.
        for (i, region) in mapped.iter().enumerate().skip(wanted_slots) {
            if let Some(id) = region {
                if let Err(e) = self.vm.memory().remove_region(*id) {
                    // Slots past `i` may be gone already: count as plugged only what stays.
                    let h = self.hotplug.as_mut().expect("configured");
                    let mapped_now = h.slots.iter().take_while(|s| s.is_some()).count() as u64;
                    h.plugged_blocks = old_blocks.min(mapped_now * blocks_per_slot);
                    return Err(memory_fault(e));
                }
                self.hotplug.as_mut().expect("configured").slots[i] = None;
            }
        }
        if blocks < old_blocks && blocks % blocks_per_slot != 0 {
            let from = HOTPLUG_GPA + blocks * block * MIB;
            let to = HOTPLUG_GPA + (wanted_slots as u64) * slot_size;
            self.vm
                .memory()
                .discard(GuestAddress(from), to - from)
                .map_err(memory_fault)?;
        }
        self.hotplug.as_mut().expect("configured").plugged_blocks = blocks;
        Ok(Response::no_content())
    }

    /// Maps hotplug slot `i` at `gpa` and has the guest check it; on failure nothing stays.
    fn plug_slot(&mut self, i: usize, gpa: u64, slot_size: u64) -> Result<(), Response> {
        let id = self.add_checked(
            RegionSpec::new(GuestAddress(gpa), slot_size),
            slot_size,
            true,
        )?;
        self.hotplug.as_mut().expect("configured").slots[i] = Some(id);
        Ok(())
    }

    /// Adds the region `spec`; with `check`, the test guest then checks both ends of every slot
    /// of `slot_size` both ways, and if that fails the region goes again, so that the memory is
    /// as it was. The error says whether even that removal failed.
    fn add_checked(
        &mut self,
        spec: RegionSpec,
        slot_size: u64,
        check: bool,
    ) -> Result<RegionId, Response> {
        let (gpa, size) = (spec.gpa.0, spec.size);
        let memory = std::sync::Arc::clone(self.vm.memory());
        let region = memory.add_region(spec).map_err(memory_fault)?;
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
            return Err(Response::fault(
                500,
                format!("the guest's check of the new memory at {gpa:#x} failed: {e}; {cleanup}"),
            ));
        }
        Ok(region)
    }

    fn guest_command(&mut self, command: GuestCommand) -> Result<Response, Response> {
        if command.start % 8 != 0 || command.stride == 0 || command.stride % 8 != 0 {
            return Err(bad(
                "start and stride must be multiples of 8, and stride not 0",
            ));
        }
        if command.end <= command.start {
            return Err(bad("end must be above start"));
        }
        self.reachable(command.start, command.end)?;
        let vcpus = self.vcpus()?;
        if command.vcpu >= vcpus.count() {
            return Err(bad(format!(
                "vcpu {} does not exist (the VM has {})",
                command.vcpu,
                vcpus.count()
            )));
        }
        let op = match command.op {
            GuestOp::Write => Op::Write,
            GuestOp::Verify => Op::Verify,
        };
        let run = vcpus.run(
            command.vcpu,
            Command {
                op,
                start: command.start,
                end: command.end,
                stride: command.stride,
                seed: command.seed,
            },
        );
        match run {
            Ok(_) => Ok(Response::json(200, json!({ "result": "ok" }))),
            Err(VmError::GuestSawWrongData {
                gpa,
                found,
                expected,
            }) => Ok(Response::json(
                200,
                json!({ "result": "mismatch", "address": gpa, "found": found, "expected": expected }),
            )),
            Err(e) => Err(Response::fault(500, e)),
        }
    }
}
