//! Guest memory: `GET /memory`, `PUT /memory/regions`, `DELETE` and `PATCH
//! /memory/regions/{id}`. The request and reply bodies, and `memory_info`, which every guest
//! kind answers `GET /memory` with.

use kvm_memslots::{KvmVm, MemoryManager};
use serde::{Deserialize, Serialize};

/// How a new region is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RegionBacking {
    /// Private anonymous memory.
    Anonymous,
    /// A new memfd, mapped shared.
    Memfd,
}

/// The size of the host pages behind a new region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
pub enum RegionPageSize {
    /// 4 KiB pages.
    #[default]
    #[serde(rename = "4k")]
    #[value(name = "4k")]
    Base,
    /// 2 MiB pages from the host's hugetlb pool: the guest address and size (and slot size)
    /// must be multiples of 2 MiB, and the pool must hold the region.
    #[serde(rename = "2m")]
    #[value(name = "2m")]
    Huge2M,
    /// Transparent huge pages (`madvise(MADV_HUGEPAGE)`).
    #[serde(rename = "thp")]
    #[value(name = "thp")]
    Transparent,
}

impl RegionPageSize {
    /// Whether these are 4 KiB pages (what a saved state leaves unsaid, so that it reads in
    /// a build that predates page sizes).
    pub(crate) fn is_base(&self) -> bool {
        *self == RegionPageSize::Base
    }
}

impl From<RegionPageSize> for kvm_memslots::PageSize {
    fn from(page_size: RegionPageSize) -> Self {
        match page_size {
            RegionPageSize::Base => kvm_memslots::PageSize::Base,
            RegionPageSize::Huge2M => kvm_memslots::PageSize::Huge2M,
            RegionPageSize::Transparent => kvm_memslots::PageSize::Transparent,
        }
    }
}

impl From<kvm_memslots::PageSize> for RegionPageSize {
    fn from(page_size: kvm_memslots::PageSize) -> Self {
        match page_size {
            kvm_memslots::PageSize::Base => RegionPageSize::Base,
            kvm_memslots::PageSize::Huge2M => RegionPageSize::Huge2M,
            kvm_memslots::PageSize::Transparent => RegionPageSize::Transparent,
        }
    }
}

/// `PUT /memory/regions`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddRegion {
    /// Size in bytes (a multiple of 4 KiB).
    pub(crate) size: u64,
    /// Guest-physical base; by default the first free place from 1 GiB up.
    pub(crate) guest_address: Option<u64>,
    /// Backing; anonymous by default.
    #[serde(default = "default_backing")]
    pub(crate) backing: RegionBacking,
    /// Host page size; 4 KiB by default.
    #[serde(default)]
    pub(crate) page_size: RegionPageSize,
    /// KVM slot size the region is split into (must divide `size`); one slot by default.
    pub(crate) slot_size: Option<u64>,
    /// Read-only for the guest.
    #[serde(default)]
    pub(crate) read_only: bool,
    /// Log the guest's writes from the start.
    #[serde(default)]
    pub(crate) dirty_log: bool,
    /// Have the test guest write and check both ends of every new slot (default true).
    #[serde(default = "yes")]
    pub(crate) guest_check: bool,
}

fn default_backing() -> RegionBacking {
    RegionBacking::Anonymous
}

fn yes() -> bool {
    true
}

/// `PATCH /memory/regions/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchRegion {
    /// Move the region here.
    pub(crate) guest_address: Option<u64>,
    /// Make it read-only, or writable again.
    pub(crate) read_only: Option<bool>,
}

/// `GET /memory`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryInfo {
    /// KVM slot numbers in use and free.
    slots: SlotCounts,
    /// What new memory is admitted against (`--max-*` on the command line).
    limits: Limits,
    /// What the regions in place use of the limits.
    used: MemoryUse,
    /// The regions, by id.
    pub regions: Vec<RegionInfo>,
    /// Whether KVM drops every vCPU's guest mappings when any slot is deleted or moved
    /// (`KVM_X86_QUIRK_SLOT_ZAP_ALL`, KVM's default), rather than only that slot's: false
    /// where KVM let the VMM turn it off.
    slot_zap_all: bool,
}

/// The admission limits, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
struct Limits {
    /// Most guest memory in all regions.
    max_guest_memory: u64,
    /// Largest single region.
    max_region_size: u64,
    /// Most host memory for guest-memory metadata (KVM's and the VMM's), as estimated.
    max_metadata: u64,
}

/// What the regions use of the limits, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
struct MemoryUse {
    /// Guest memory in all regions.
    guest_memory: u64,
    /// The estimated host memory for its metadata.
    metadata: u64,
}

/// KVM slot numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
struct SlotCounts {
    /// In use.
    used: usize,
    /// Free.
    free: usize,
    /// KVM's number of slots.
    max: usize,
    /// The slot budget below KVM's number (`--max-slots`): changes that would take `used`
    /// past it are refused. None without one.
    budget: Option<u64>,
}

/// One region in [`MemoryInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionInfo {
    /// Its id.
    id: u64,
    /// Guest-physical base.
    pub guest_address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Host address of its mapping.
    host_address: u64,
    /// KVM slots it takes.
    pub slots: usize,
    /// Read-only for the guest.
    read_only: bool,
    /// Its writes are logged.
    dirty_log: bool,
    /// `anonymous` or `memfd`.
    backing: &'static str,
    /// The host page size behind it: `4k`, `2m` (hugetlb) or `thp`.
    page_size: &'static str,
}

/// `PUT /memory/regions` (201).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionAdded {
    /// The new region's id.
    pub(crate) id: u64,
    /// Where it is.
    pub(crate) guest_address: u64,
    /// Its size.
    pub(crate) size: u64,
    /// KVM slots it takes.
    pub(crate) slots: u64,
    /// Whether the test guest checked every slot.
    pub(crate) guest_checked: bool,
}

/// `GET /memory` for any VM's memory.
pub(crate) fn memory_info(memory: &MemoryManager<KvmVm>) -> MemoryInfo {
    let usage = memory.slot_usage();
    let regions = memory.regions().iter().map(region_of).collect();
    let limits = memory.limits();
    let used = memory.memory_use();
    MemoryInfo {
        slots: SlotCounts {
            used: usage.used,
            free: usage.free,
            max: usage.max,
            budget: (limits.max_slots != u64::MAX).then_some(limits.max_slots),
        },
        limits: Limits {
            max_guest_memory: limits.max_guest_memory,
            max_region_size: limits.max_region_size,
            max_metadata: limits.max_metadata,
        },
        used: MemoryUse {
            guest_memory: used.guest_memory,
            metadata: used.metadata,
        },
        regions,
        slot_zap_all: memory.kvm().zaps_all_on_slot_change(),
    }
}

fn region_of(r: &kvm_memslots::RegionInfo) -> RegionInfo {
    RegionInfo {
        id: r.id.0,
        guest_address: r.gpa.0,
        size: r.size,
        host_address: r.hva.0,
        slots: r.slots,
        read_only: r.flags.read_only,
        dirty_log: r.flags.log_dirty,
        backing: if r.shared { "memfd" } else { "anonymous" },
        page_size: r.page_size.name(),
    }
}

/// `GET /memory/regions/{id}`: region `id` as `GET /memory` lists it, or 404.
pub(crate) fn region_info(
    memory: &MemoryManager<KvmVm>,
    id: u64,
) -> Result<RegionInfo, super::ControllerError> {
    memory
        .regions()
        .iter()
        .find(|r| r.id.0 == id)
        .map(region_of)
        .ok_or_else(|| {
            super::ControllerError::not_found(format!("no region {id} (GET /memory lists them)"))
        })
}
