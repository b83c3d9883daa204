//! What callers pass the manager and what it reports: region specs, targets, region and slot
//! reports, host-address matches.

use std::ops::Range;

use memslot_map::{HostAddress, SlotFlags, SlotId};
use vm_memory::GuestAddress;

use crate::error::Error;
use crate::region_memory::{Backing, PageSize, RegionId};
use crate::PAGE_SIZE;

/// The largest slot KVM accepts: 2^31 - 1 pages.
pub const KVM_MAX_SLOT_SIZE: u64 = ((1 << 31) - 1) * PAGE_SIZE;

/// What a new region is.
#[derive(Debug, Clone)]
pub struct RegionSpec {
    /// Guest-physical base.
    pub gpa: GuestAddress,
    /// Size in bytes, a multiple of 4 KiB.
    pub size: u64,
    /// Host memory behind it.
    pub backing: Backing,
    /// The size of the host pages behind it ([`PageSize::Base`] by default).
    pub page_size: PageSize,
    /// Split the region into KVM slots of this size (the last one may be smaller); by default
    /// as few slots as KVM's per-slot limit allows.
    pub slot_size: Option<u64>,
    /// Exactly these slots, as byte ranges of the region (ascending, not overlapping, each at
    /// most [`KVM_MAX_SLOT_SIZE`]); what lies between them has no slot (a *hole*: the guest
    /// sees no memory there, but the region keeps the range and its memory). Overrides
    /// `slot_size`. By default the whole region is slotted.
    pub slot_ranges: Option<Vec<Range<u64>>>,
    /// Byte ranges of the region (ascending, not overlapping, aligned to its pages) that are
    /// unreachable from the start, as [`MemoryManager::set_accessible`](crate::MemoryManager::set_accessible)
    /// makes them, protected before any slot over them exists. None by default.
    pub inaccessible: Vec<Range<u64>>,
    /// The guest can read but not write the region.
    pub read_only: bool,
    /// Log the guest's writes from the start.
    pub log_dirty: bool,
    /// The region's id; by default the manager's next one. A VMM that restores or receives a
    /// VM gives each region the id it had, so that ids stay the API's handle across a
    /// snapshot or a migration ([`with_id`](Self::with_id)).
    pub id: Option<RegionId>,
}

impl RegionSpec {
    /// `size` bytes of anonymous memory at `gpa`, read-write, not logged, in as few slots as
    /// possible.
    pub fn new(gpa: GuestAddress, size: u64) -> Self {
        RegionSpec {
            gpa,
            size,
            backing: Backing::Anonymous,
            page_size: PageSize::Base,
            slot_size: None,
            slot_ranges: None,
            inaccessible: Vec::new(),
            read_only: false,
            log_dirty: false,
            id: None,
        }
    }

    /// Gives the region id `id` (it must not be in use). Later regions without one get ids
    /// above every id in use, so none is ever handed out twice.
    pub fn with_id(self, id: RegionId) -> Self {
        RegionSpec {
            id: Some(id),
            ..self
        }
    }

    /// Splits the region into slots of `slot_size` bytes.
    pub fn with_slot_size(self, slot_size: u64) -> Self {
        RegionSpec {
            slot_size: Some(slot_size),
            ..self
        }
    }

    /// Gives the region exactly these slots (byte ranges of the region), leaving the rest of
    /// it without a slot ([`slot_ranges`](Self::slot_ranges)).
    pub fn with_slot_ranges(self, slots: Vec<Range<u64>>) -> Self {
        RegionSpec {
            slot_ranges: Some(slots),
            ..self
        }
    }

    /// Makes byte ranges `ranges` of the region unreachable from the start
    /// ([`inaccessible`](Self::inaccessible)).
    pub fn with_inaccessible(self, ranges: Vec<Range<u64>>) -> Self {
        RegionSpec {
            inaccessible: ranges,
            ..self
        }
    }

    /// Uses `backing` for the region's memory.
    pub fn with_backing(self, backing: Backing) -> Self {
        RegionSpec { backing, ..self }
    }

    /// Backs the region with pages of `page_size`.
    pub fn with_page_size(self, page_size: PageSize) -> Self {
        RegionSpec { page_size, ..self }
    }

    /// Sets the initial flags.
    pub fn with_flags(self, flags: SlotFlags) -> Self {
        RegionSpec {
            read_only: flags.read_only,
            log_dirty: flags.log_dirty,
            ..self
        }
    }
}

/// New KVM slots for part of a region ([`RegionChange::Reslot`](crate::RegionChange::Reslot),
/// [`MemoryManager::reslot`](crate::MemoryManager::reslot)): the region's slots inside `range`
/// are replaced by `slots`, its memory stays mapped where it is, untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reslot {
    /// The region.
    pub region: RegionId,
    /// The byte range of the region re-slotted (page-aligned). Every slot of the region that
    /// reaches into it must lie inside it.
    pub range: Range<u64>,
    /// The slots `range` gets, as byte ranges of the region inside `range`: ascending, not
    /// overlapping, page-aligned, each at most [`KVM_MAX_SLOT_SIZE`]. What they leave of
    /// `range` has no slot. A slot equal to one the region has keeps its KVM slot untouched.
    pub slots: Vec<Range<u64>>,
}

/// Checks a slot layout: `slots` ascending, not overlapping, aligned to `page` (the region's
/// [page alignment](PageSize::alignment)), none empty or over KVM's per-slot limit, all inside
/// `within`.
pub(super) fn check_layout(
    within: &Range<u64>,
    slots: &[Range<u64>],
    page: u64,
) -> Result<(), Error> {
    let bad = |slot: &Range<u64>, reason: &'static str| Error::SlotLayout {
        start: slot.start,
        end: slot.end,
        reason,
    };
    let mut after = within.start;
    for slot in slots {
        if slot.start >= slot.end {
            return Err(bad(slot, "is empty"));
        }
        if !slot.start.is_multiple_of(page) || !slot.end.is_multiple_of(page) {
            return Err(bad(
                slot,
                if page == PAGE_SIZE {
                    "is not page-aligned"
                } else {
                    "is not aligned to the region's 2 MiB pages"
                },
            ));
        }
        if slot.end - slot.start > KVM_MAX_SLOT_SIZE {
            return Err(bad(slot, "is larger than KVM's per-slot limit"));
        }
        if slot.start < after && slot.start >= within.start {
            return Err(bad(
                slot,
                "overlaps or comes before the slot listed before it",
            ));
        }
        if slot.start < within.start || slot.end > within.end {
            return Err(bad(slot, "lies outside the range being slotted"));
        }
        after = slot.end;
    }
    Ok(())
}

/// Which regions an operation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Every region.
    All,
    /// One region.
    Region(RegionId),
}

/// A region as the manager reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its id.
    pub id: RegionId,
    /// Guest-physical base.
    pub gpa: GuestAddress,
    /// Size in bytes.
    pub size: u64,
    /// Host address of its mapping.
    pub hva: HostAddress,
    /// KVM slots it uses.
    pub slots: usize,
    /// Bytes per slot (the last one may be smaller).
    pub slot_size: u64,
    /// Its flags (the same on all its slots).
    pub flags: SlotFlags,
    /// Whether its memory is a shared (file or memfd) mapping.
    pub shared: bool,
    /// The size of the host pages behind it.
    pub page_size: PageSize,
}

/// How many KVM slot numbers are in use: `used + free + reserved == max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotUsage {
    /// Slots in use.
    pub used: usize,
    /// Slots free.
    pub free: usize,
    /// Slot numbers left to the VMM ([`MemoryManager::with_reserved_slots`](crate::MemoryManager::with_reserved_slots)).
    pub reserved: usize,
    /// KVM's number of slots.
    pub max: usize,
}

/// A guest address that a host address backs, found by [`MemoryManager::find_by_hva`].
///
/// [`MemoryManager::find_by_hva`]: crate::MemoryManager::find_by_hva
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HvaMatch {
    /// The region.
    pub region: RegionId,
    /// KVM's slot number.
    pub slot: SlotId,
    /// The guest address.
    pub gpa: GuestAddress,
}
