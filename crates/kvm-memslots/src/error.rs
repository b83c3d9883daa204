//! Why a memory operation failed. A failed operation leaves the map, KVM's slots and the
//! guest's memory as they were, except where [`Error::UndoFailed`] says otherwise.

use memslot_map::{AddressRange, MapError};
use vmm_sys_util::errno::Error as Errno;

use crate::memory::{MemoryError, RegionId};

/// A memory operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No region has this id.
    #[error("region {0} does not exist")]
    UnknownRegion(RegionId),
    /// A region must hold memory.
    #[error("region size is zero")]
    ZeroSize,
    /// An address or size is not a multiple of the 4 KiB page size.
    #[error("{what} {value:#x} is not a multiple of the page size (0x1000)")]
    Unaligned {
        /// Which value: "guest address", "size", "slot size", "length".
        what: &'static str,
        /// The value.
        value: u64,
    },
    /// The guest range does not fit below 2^64.
    #[error("guest range at {gpa:#x} of size {size:#x} wraps around the address space")]
    WrapAround {
        /// Base of the range.
        gpa: u64,
        /// Its size.
        size: u64,
    },
    /// A slot size outside what KVM accepts.
    #[error("slot size {slot_size:#x} is zero or above the per-slot limit {limit:#x}")]
    SlotSize {
        /// The slot size asked for.
        slot_size: u64,
        /// The largest slot the manager makes.
        limit: u64,
    },
    /// The guest range overlaps a region already there.
    #[error("guest range {range} overlaps region {other} at {other_range}")]
    Overlap {
        /// The range asked for.
        range: AddressRange,
        /// The region in the way.
        other: RegionId,
        /// The part of it that is in the way (one of its slots).
        other_range: AddressRange,
    },
    /// Not enough free KVM slot numbers.
    #[error("out of KVM memory slots: {needed} needed, {free} of {limit} free")]
    OutOfSlots {
        /// Slots the operation needs.
        needed: usize,
        /// Slots free.
        free: usize,
        /// KVM's number of slots.
        limit: u32,
    },
    /// The region's memory could not be mapped.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// KVM refused a slot change; everything the operation had done was undone.
    #[error("region {region}: KVM refused to {op} slot {slot} (guest {gpa:#x}, size {size:#x}): {source}")]
    Kvm {
        /// The region being changed.
        region: RegionId,
        /// What was asked of KVM: "create", "delete", "update".
        op: &'static str,
        /// KVM's slot number.
        slot: u32,
        /// The slot's guest base in the request.
        gpa: u64,
        /// The slot's size in the request.
        size: u64,
        /// The kernel's error.
        source: Errno,
    },
    /// KVM refused a change and then refused to undo an earlier step of the same operation:
    /// KVM's slots no longer match the map. The manager refuses further changes.
    #[error("{failed}; undoing it failed too ({undo_op} slot {slot}: {undo_errno}): KVM's slots no longer match the map")]
    UndoFailed {
        /// The first failure.
        failed: Box<Error>,
        /// The undo step that failed.
        undo_op: &'static str,
        /// Its slot.
        slot: u32,
        /// The kernel's error for it.
        undo_errno: Errno,
    },
    /// An earlier undo failed (see [`Error::UndoFailed`]); changes are refused.
    #[error("changes are refused since undoing a failed change of slot {slot} failed: {errno}")]
    Broken {
        /// The slot whose undo failed.
        slot: u32,
        /// The kernel's error.
        errno: Errno,
    },
    /// Reading a slot's dirty log failed. Dirty pages read before the failure are kept and
    /// reported by the next harvest.
    #[error("region {region}: reading the dirty log of slot {slot} failed: {source}")]
    GetDirtyLog {
        /// The region.
        region: RegionId,
        /// KVM's slot number.
        slot: u32,
        /// The kernel's error.
        source: Errno,
    },
    /// Clearing a slot's dirty log failed. The pages read are kept and reported by the next
    /// harvest (possibly twice; never lost).
    #[error("region {region}: clearing the dirty log of slot {slot} failed: {source}")]
    ClearDirtyLog {
        /// The region.
        region: RegionId,
        /// KVM's slot number.
        slot: u32,
        /// The kernel's error.
        source: Errno,
    },
    /// A discard range that is not all guest memory.
    #[error("cannot discard {range}: no memory at {hole:#x}")]
    DiscardHole {
        /// The range asked for.
        range: AddressRange,
        /// The first address in it that no region holds.
        hole: u64,
    },
    /// `madvise` failed.
    #[error("discarding guest range {range} failed: {source}")]
    Discard {
        /// The part of the range being discarded.
        range: AddressRange,
        /// The system's error.
        source: std::io::Error,
    },
    /// The map refused a change for a reason the checks above did not catch.
    #[error("the slot map refused the change: {0}")]
    Map(MapError),
}
