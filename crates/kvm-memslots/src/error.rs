//! Why a memory operation failed. A failed operation leaves the map, KVM's slots and the
//! guest's memory as they were, except where [`Error::UndoFailed`] says otherwise.

use memslot_map::{AddressRange, MapError};
use vm_memory::mmap::MmapRegionError;
use vmm_sys_util::errno::Error as Errno;

use crate::dirty::DirtyConsumer;
use crate::limits::Limit;
use crate::region_memory::{MappingError, RegionId};

/// The message of [`Error::OverLimit`]: which limit, the figure, and the limit's value.
fn over_limit(limit: Limit, size: u64, figure: u64, max: u64) -> String {
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    match limit {
        Limit::RegionSize => format!(
            "a region of {size:#x} bytes ({:.1} GiB) is over the limit {} = {max:#x} bytes ({:.1} GiB)",
            gib(size), limit.name(), gib(max)
        ),
        Limit::GuestMemory => format!(
            "a region of {size:#x} bytes would bring guest memory to {figure:#x} bytes ({:.1} GiB), over the limit {} = {max:#x} bytes ({:.1} GiB)",
            gib(figure), limit.name(), gib(max)
        ),
        Limit::Slots => format!(
            "the change creates {size} KVM slots and would bring the slots in use to {figure}, over the limit {} = {max}",
            limit.name()
        ),
        Limit::Metadata => format!(
            "a region of {size:#x} bytes would bring the host memory KVM and the manager spend on guest-memory metadata to an estimated {figure} bytes ({:.1} GiB), over the limit {} = {max} bytes ({:.1} GiB)",
            gib(figure), limit.name(), gib(max)
        ),
    }
}

/// A memory operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No region has this id.
    #[error("region {0} does not exist")]
    UnknownRegion(RegionId),
    /// A region must hold memory.
    #[error("region size is zero")]
    ZeroSize,
    /// An address or size is not a multiple of the page size: 4 KiB, or 2 MiB in a region
    /// of hugetlb pages.
    #[error("{what} {value:#x} is not a multiple of the page size ({page_size:#x})")]
    Unaligned {
        /// Which value: "guest address", "size", "slot size", "length".
        what: &'static str,
        /// The value.
        value: u64,
        /// The page size it must be a multiple of.
        page_size: u64,
    },
    /// The page size cannot back that kind of memory.
    #[error("{page_size} pages cannot back {backing} memory (transparent huge pages are for anonymous memory and memfds)")]
    PageSizeBacking {
        /// The page size asked for.
        page_size: &'static str,
        /// The kind of backing.
        backing: &'static str,
    },
    /// The host's hugetlb pool has too few free 2 MiB pages for the regions asked for.
    #[error("the hugetlb pool has {available} free 2 MiB pages; the regions need {needed} (raise /proc/sys/vm/nr_hugepages)")]
    HugetlbPool {
        /// Pages the batch's regions need.
        needed: u64,
        /// Pages free and not reserved in the pool when it was asked.
        available: u64,
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
    /// A slot layout asked for ([`RegionSpec::slot_ranges`](crate::RegionSpec::slot_ranges) or a
    /// [`Reslot`](crate::Reslot)) that is not one; offsets are in the region.
    #[error("slot layout: the slot at offsets [{start:#x}, {end:#x}) {reason}")]
    SlotLayout {
        /// The slot's first byte in the region.
        start: u64,
        /// The byte after its last.
        end: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A batch names one region in two changes (re-slots it twice, or re-slots and removes it).
    #[error("region {0} is named by two changes of one batch")]
    RegionTwice(RegionId),
    /// Two regions added by one batch ([`MemoryManager::apply`](crate::MemoryManager::apply))
    /// overlap.
    #[error(
        "guest range {range} overlaps {other_range}, added by addition {other} of the same batch"
    )]
    BatchOverlap {
        /// The range asked for.
        range: AddressRange,
        /// The other addition, by its position among the batch's additions (from 0).
        other: usize,
        /// Its range.
        other_range: AddressRange,
    },
    /// A region was asked for with an id that a region in place (or another of the same
    /// batch) has.
    #[error("region id {0} is in use")]
    RegionIdInUse(RegionId),
    /// Not enough free KVM slot numbers.
    #[error("out of KVM memory slots: {needed} needed, {free} of {limit} free")]
    OutOfSlots {
        /// Slots the operation needs.
        needed: usize,
        /// Slots free.
        free: usize,
        /// The slot numbers the manager may use: KVM's number, less those reserved for the
        /// VMM ([`MemoryManager::with_reserved_slots`](crate::MemoryManager::with_reserved_slots)).
        limit: u32,
    },
    /// The region's memory could not be mapped.
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// KVM refused a slot change; everything the operation had done was undone.
    #[error("region {region}: KVM refused to {op} slot {slot} (guest {gpa:#x}, size {size:#x}): {source}")]
    Kvm {
        /// The region being changed.
        region: RegionId,
        /// What was asked of KVM: "create", "delete", "update", or "park" (a logging slot
        /// moved out of the guest's way before its delete, see `MemoryManager::reslot`).
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
    /// No such dirty-log consumer (never added, or removed; the default one cannot be removed).
    #[error("{0} does not exist")]
    UnknownConsumer(DirtyConsumer),
    /// A KVM call panicked during an earlier change (a bug in the [`KvmMemory`] in use): the
    /// change was undone as far as KVM let it, but what the call did is unknown and KVM and the
    /// map may disagree, so changes are refused (harvests go on). Memory KVM may still map
    /// stays mapped.
    ///
    /// [`KvmMemory`]: crate::KvmMemory
    #[error("changes are refused since a KVM call on slot {slot} panicked during a change")]
    BrokenByPanic {
        /// The slot the panicking call was for.
        slot: u32,
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
    /// A byte range that is not a range inside the region named.
    #[error("offsets [{start:#x}, {end:#x}) are not a range inside region {region}")]
    OutsideRegion {
        /// The region.
        region: RegionId,
        /// The range's first byte.
        start: u64,
        /// The byte after its last.
        end: u64,
    },
    /// `madvise` failed.
    #[error("discarding guest range {range} failed: {source}")]
    Discard {
        /// The part of the range being discarded.
        range: AddressRange,
        /// The system's error.
        source: std::io::Error,
    },
    /// Changing whether a range of a region is reachable (`mprotect`) failed; the ranges of the
    /// same call before it got their protection back.
    #[error("changing the protection of guest range {range} failed: {source}")]
    Protect {
        /// The range.
        range: AddressRange,
        /// The system's error.
        source: std::io::Error,
    },
    /// A new region (or, for [`Limit::Slots`], a change's new slots) is over one of the
    /// manager's [`MemoryLimits`](crate::MemoryLimits); nothing was allocated or changed.
    #[error("{}", over_limit(*.limit, *.size, *.figure, *.max))]
    OverLimit {
        /// The limit.
        limit: Limit,
        /// The region's size (for [`Limit::Slots`], the slots the change creates).
        size: u64,
        /// What the limited quantity would reach with the region (its size, for the per-region
        /// limit; the slots in use, for the slot limit).
        figure: u64,
        /// The limit's value.
        max: u64,
    },
    /// Collecting or resetting the dirty rings failed. Every entry collected is kept for the
    /// next harvest.
    #[error("{op} the dirty rings failed: {source}")]
    DirtyRing {
        /// "collecting" or "resetting".
        op: &'static str,
        /// The kernel's error.
        source: Errno,
    },
    /// The host had no memory for a buffer the operation needs; nothing was changed.
    #[error("out of host memory: {bytes} bytes for {what} could not be allocated")]
    OutOfMemory {
        /// What the buffer is for.
        what: &'static str,
        /// Its size.
        bytes: u64,
    },
    /// The map refused a change for a reason the manager's own checks did not catch.
    ///
    /// The manager checks everything a caller can get wrong before it asks the map (size,
    /// alignment, wrap-around, overlap, free slot numbers), and an overlap the map finds is
    /// reported as [`Error::Overlap`]; the slot ids, host addresses and slot counts it hands
    /// the map are its own. So this error means that the manager's records and its map
    /// disagree: a bug in the manager, never the caller's mistake. Nothing was changed.
    /// Its [`kind`](Error::kind) is [`ErrorKind::Broken`].
    #[error("the slot map refused the change: {0}")]
    Map(MapError),
}

/// What kind of failure an [`Error`] is, for callers that react to the kind rather than to each
/// variant (an API that answers "bad request" or "conflict", say). See [`Error::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or impossible whatever the state: a zero size, an unaligned
    /// address or size, a range that wraps around the address space, a slot size KVM does not
    /// take, a discard of a range that is not all memory.
    Invalid,
    /// The request names a region that does not exist.
    NotFound,
    /// The request collides with the current state: its range overlaps a region already there,
    /// or there are not enough free KVM slot numbers. It may succeed once the state changes.
    Conflict,
    /// The manager refuses changes: undoing a failed change failed, so KVM's slots and the map
    /// may disagree ([`Error::UndoFailed`], [`Error::Broken`]); or the manager found its own
    /// records inconsistent ([`Error::Map`]).
    Broken,
    /// KVM or the operating system failed: mapping memory (mmap, memfd), KVM refusing a slot
    /// change, reading or clearing a dirty log, madvise. The request itself was acceptable.
    Host,
}

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::ZeroSize
            | Error::Unaligned { .. }
            | Error::PageSizeBacking { .. }
            | Error::WrapAround { .. }
            | Error::SlotSize { .. }
            | Error::SlotLayout { .. }
            | Error::RegionTwice(_)
            | Error::OutsideRegion { .. }
            | Error::DiscardHole { .. } => ErrorKind::Invalid,
            Error::UnknownRegion(_) | Error::UnknownConsumer(_) => ErrorKind::NotFound,
            Error::OverLimit {
                limit: Limit::RegionSize,
                ..
            } => ErrorKind::Invalid,
            Error::Overlap { .. }
            | Error::BatchOverlap { .. }
            | Error::RegionIdInUse(_)
            | Error::OutOfSlots { .. }
            | Error::HugetlbPool { .. }
            | Error::OverLimit { .. } => ErrorKind::Conflict,
            Error::UndoFailed { .. }
            | Error::Broken { .. }
            | Error::BrokenByPanic { .. }
            | Error::Map(_) => ErrorKind::Broken,
            Error::Mapping(_)
            | Error::Kvm { .. }
            | Error::GetDirtyLog { .. }
            | Error::ClearDirtyLog { .. }
            | Error::Discard { .. }
            | Error::Protect { .. }
            | Error::DirtyRing { .. }
            | Error::OutOfMemory { .. } => ErrorKind::Host,
        }
    }

    /// The system's error number (`errno`) behind this failure, where there is one: KVM's or
    /// the kernel's for a refused ioctl, `madvise`, `memfd_create` or `mmap`; for
    /// [`Error::UndoFailed`], that of the first failure. `None` for errors the manager found
    /// itself (bad requests, limits, its own records).
    ///
    /// ```
    /// # use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};
    /// # use kvm_memslots::{MemoryManager, RegionSpec};
    /// # use vm_memory::GuestAddress;
    /// let memory = MemoryManager::new(Faulty::new(FakeKvm::new(32, true)));
    /// memory.kvm().fail(KvmCall::SetRegion, 0, libc::EEXIST);
    /// let err = memory.add_region(RegionSpec::new(GuestAddress(0), 0x1000)).unwrap_err();
    /// assert_eq!(err.errno(), Some(libc::EEXIST));
    /// let err = memory.add_region(RegionSpec::new(GuestAddress(0x10), 0x1000)).unwrap_err();
    /// assert_eq!(err.errno(), None);
    /// ```
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Kvm { source, .. }
            | Error::GetDirtyLog { source, .. }
            | Error::ClearDirtyLog { source, .. }
            | Error::DirtyRing { source, .. } => Some(source.errno()),
            Error::Broken { errno, .. } => Some(errno.errno()),
            Error::UndoFailed { failed, .. } => failed.errno(),
            Error::Discard { source, .. }
            | Error::Protect { source, .. }
            | Error::Mapping(MappingError::Memfd { source, .. }) => source.raw_os_error(),
            Error::Mapping(MappingError::Mmap {
                source: MmapRegionError::Mmap(source),
                ..
            }) => source.raw_os_error(),
            _ => None,
        }
    }

    /// Whether the caller's request was at fault ([`ErrorKind::Invalid`],
    /// [`ErrorKind::NotFound`] or [`ErrorKind::Conflict`]) rather than the manager or the host.
    pub fn is_caller_error(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::Invalid | ErrorKind::NotFound | ErrorKind::Conflict
        )
    }
}

#[cfg(test)]
mod tests {
    use memslot_map::SlotId;
    use vm_memory::mmap::MmapRegionError;

    use super::*;

    fn range() -> AddressRange {
        AddressRange {
            start: 0x1000,
            end: 0x3000,
        }
    }

    fn kvm_refused() -> Error {
        Error::Kvm {
            region: RegionId(1),
            op: "create",
            slot: 2,
            gpa: 0x1000,
            size: 0x2000,
            source: Errno::new(libc::EEXIST),
        }
    }

    #[test]
    fn every_error_has_the_kind_its_cause_gives_it() {
        use ErrorKind::*;
        let cases = [
            (Error::ZeroSize, Invalid),
            (
                Error::Unaligned {
                    what: "size",
                    value: 0x800,
                    page_size: 0x1000,
                },
                Invalid,
            ),
            (
                Error::PageSizeBacking {
                    page_size: "thp",
                    backing: "file",
                },
                Invalid,
            ),
            (
                Error::HugetlbPool {
                    needed: 2,
                    available: 1,
                },
                Conflict,
            ),
            (Error::WrapAround { gpa: 1, size: 2 }, Invalid),
            (
                Error::SlotSize {
                    slot_size: 0,
                    limit: 1,
                },
                Invalid,
            ),
            (
                Error::DiscardHole {
                    range: range(),
                    hole: 0x2000,
                },
                Invalid,
            ),
            (
                Error::SlotLayout {
                    start: 0,
                    end: 0,
                    reason: "is empty",
                },
                Invalid,
            ),
            (Error::RegionTwice(RegionId(2)), Invalid),
            (
                Error::OutsideRegion {
                    region: RegionId(2),
                    start: 0,
                    end: 0,
                },
                Invalid,
            ),
            (Error::UnknownRegion(RegionId(3)), NotFound),
            (Error::UnknownConsumer(DirtyConsumer(2)), NotFound),
            (Error::RegionIdInUse(RegionId(3)), Conflict),
            (
                Error::Overlap {
                    range: range(),
                    other: RegionId(0),
                    other_range: range(),
                },
                Conflict,
            ),
            (
                Error::BatchOverlap {
                    range: range(),
                    other: 1,
                    other_range: range(),
                },
                Conflict,
            ),
            (
                Error::OutOfSlots {
                    needed: 2,
                    free: 1,
                    limit: 8,
                },
                Conflict,
            ),
            (
                Error::UndoFailed {
                    failed: Box::new(kvm_refused()),
                    undo_op: "delete",
                    slot: 2,
                    undo_errno: Errno::new(libc::EIO),
                },
                Broken,
            ),
            (Error::BrokenByPanic { slot: 3 }, Broken),
            (
                Error::Broken {
                    slot: 2,
                    errno: Errno::new(libc::EIO),
                },
                Broken,
            ),
            (Error::Map(MapError::DuplicateId { id: SlotId(4) }), Broken),
            (
                Error::Mapping(MappingError::Mmap {
                    size: 0x1000,
                    backing: "anonymous",
                    source: MmapRegionError::InvalidOffsetLength,
                }),
                Host,
            ),
            (
                Error::Mapping(MappingError::Memfd {
                    size: 0x1000,
                    source: std::io::Error::from_raw_os_error(libc::EMFILE),
                }),
                Host,
            ),
            (kvm_refused(), Host),
            (
                Error::GetDirtyLog {
                    region: RegionId(1),
                    slot: 2,
                    source: Errno::new(libc::EFAULT),
                },
                Host,
            ),
            (
                Error::ClearDirtyLog {
                    region: RegionId(1),
                    slot: 2,
                    source: Errno::new(libc::EINVAL),
                },
                Host,
            ),
            (
                Error::Discard {
                    range: range(),
                    source: std::io::Error::from_raw_os_error(libc::EINVAL),
                },
                Host,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
            assert_eq!(
                error.is_caller_error(),
                matches!(kind, Invalid | NotFound | Conflict),
                "{error}"
            );
        }
    }
}
