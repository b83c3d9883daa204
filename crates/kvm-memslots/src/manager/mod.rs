//! The guest-memory manager: regions in a memslot map, mirrored to KVM's slots.
//!
//! This module holds [`MemoryManager`], its records ([`State`], behind the map's writer lock)
//! and the handle readers hold ([`GuestMemoryHandle`]); its submodules hold one job each: the
//! types callers pass and get back (`spec`), the KVM slot-number allocator (`slot_ids`),
//! planned KVM requests (`plan`), the change pipeline that applies them, undoes them on a
//! refusal and publishes (`apply`), the change sequence (`sequence`), region operations
//! (`regions`, `batch`), dirty logging (`dirty_log`; ring mode's collection in `rings`,
//! bitmap mode's parking of a logging slot a change deletes in `parking`, and the dirty-log
//! consumers in `consumers`), discard (`discard`) and read-only queries (`query`).

mod apply;
mod batch;
mod consumers;
mod dirty_log;
pub(crate) mod discard;
mod parking;
mod plan;
mod query;
mod regions;
mod rings;
mod sequence;
mod slot_ids;
mod spec;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};

use memslot_map::{AddressRange, MapConfig, MapWriter, MemslotMap, SharedMap, SlotFlags, SlotId};
use vm_memory::{GuestAddress, GuestAddressSpace};
use vmm_sys_util::errno::Error as Errno;

use crate::dirty::DirtyConsumer;
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::limits::{Limit, MemoryLimits, MemoryUse};
use crate::memory::{GuestMemorySlots, GuestMemoryView, GuestSlotData, SlotBacking};
use crate::pending::PendingBits;
use crate::region_memory::{RegionId, RegionMemory};
use crate::{MapGuard, PAGE_SIZE};
pub use batch::RegionChange;
use sequence::ChangeSequence;
use slot_ids::SlotIds;
pub use spec::{HvaMatch, RegionInfo, RegionSpec, Reslot, SlotUsage, Target, KVM_MAX_SLOT_SIZE};

// Names the tests (`use super::*`) need that this module itself no longer uses.
#[cfg(test)]
use crate::region_memory::Backing;
#[cfg(test)]
use memslot_map::HostAddress;
#[cfg(test)]
use std::sync::atomic::Ordering;

struct Region {
    memory: Arc<RegionMemory>,
    gpa: GuestAddress,
    size: u64,
    /// Slot ids in the order of their offsets in the region.
    slots: Vec<SlotId>,
    /// Bytes of the region its slots cover (less than `size` where it has holes).
    covered: u64,
    flags: SlotFlags,
    /// The consumers logging it: `flags.log_dirty` while there is one.
    loggers: BTreeSet<DirtyConsumer>,
    /// What a harvest reaches without the writer lock, among it the region's pending bits.
    shared: Arc<Harvestable>,
}

impl Region {
    /// Dirty bits read from KVM or the VMM's bitmap (or marked) and not yet delivered by a
    /// harvest, one per page of the region.
    fn pending(&self) -> &PendingBits {
        &self.shared.pending
    }
}

/// A region as a harvest sees it, kept in the manager's directory (not behind the writer
/// lock): its memory (for the VMM's write bitmap), its pending bits, and its slot numbers
/// (moves and read-only toggles keep them; a re-slot replaces them after it is published).
struct Harvestable {
    memory: Arc<RegionMemory>,
    pending: Arc<PendingBits>,
    slots: Mutex<Arc<[SlotId]>>,
    /// The region's guest base, updated by moves.
    gpa: AtomicU64,
    /// Each consumer's bits of the region taken by other consumers' harvests; empty while the
    /// default consumer is the only one (see `consumers`).
    stash: Mutex<Vec<consumers::Stash>>,
}

impl Harvestable {
    /// The stashes. Poisoning is ignored: they are changed word by word, and a bit is never
    /// taken from one place before it is in another.
    fn stash(&self) -> MutexGuard<'_, Vec<consumers::Stash>> {
        self.stash.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The region's slot numbers as last published (poisoning ignored: only replaced whole).
    fn slots(&self) -> Arc<[SlotId]> {
        Arc::clone(&self.slots.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn set_slots(&self, slots: &[SlotId]) {
        *self.slots.lock().unwrap_or_else(|p| p.into_inner()) = slots.into();
    }
}

/// `MemoryManager::leased` when no harvest is reading a slot's log.
const NO_LEASE: u32 = u32::MAX;

/// Makes room for `words` words in `buffer` without aborting when the host has none.
fn reserve(buffer: &mut Vec<u64>, words: usize, what: &'static str) -> Result<(), Error> {
    let more = words.saturating_sub(buffer.len());
    buffer
        .try_reserve_exact(more)
        .map_err(|_| Error::OutOfMemory {
            what,
            bytes: (words as u64).saturating_mul(8),
        })
}

/// The manager's records, kept behind the map's writer lock (the manager's one writer lock):
/// a change reads the map, updates these and publishes the next version without letting
/// another writer in.
pub(crate) struct State {
    regions: BTreeMap<RegionId, Region>,
    /// The regions by guest base: their guest ranges, holes included, never overlap.
    spans: BTreeMap<u64, RegionId>,
    ids: SlotIds,
    next_region: u64,
    /// Set when an undo failed or a KVM call panicked: KVM and the map may disagree, so
    /// changes are refused.
    broken: Option<Broken>,
    /// The memory of regions a change is adding, while it is being applied.
    adding: Vec<Arc<RegionMemory>>,
    /// Memory KVM may still map after a failed undo: kept mapped for the process's lifetime.
    orphans: Vec<Arc<RegionMemory>>,
    /// The number the next dirty-log consumer gets.
    next_consumer: u32,
    /// Consumers every new region logs for from the start
    /// ([`MemoryManager::log_new_regions_for`]).
    followers: BTreeSet<DirtyConsumer>,
    /// What regions are admitted against.
    limits: MemoryLimits,
    /// What the regions in place use of it.
    used: MemoryUse,
}

/// Why a manager refuses changes.
#[derive(Debug, Clone, Copy)]
enum Broken {
    /// KVM refused to undo a step of a failed change on this slot.
    UndoFailed { slot: u32, errno: Errno },
    /// A KVM call on this slot panicked mid-change.
    Panicked { slot: u32 },
}

/// The writer lock of a manager's map, held: its [`State`], the current version, and the right
/// to publish.
type Writer<'a> = MapWriter<'a, SlotBacking, State>;

/// Owns a VM's guest memory: regions of host memory split into slots, kept in a memslot map
/// that lock-free readers see through [`GuestMemoryHandle`], and mirrored exactly to KVM's
/// slots.
///
/// Every change is planned as KVM requests, applied, and only then published in the map; if
/// KVM refuses a request, the requests already applied are undone and the map is left as it
/// was. Changes are serialised by one lock, the map's writer lock, which also guards the
/// manager's own records; readers (vCPU and device threads) never wait for it.
///
/// # KVM calls
///
/// Each operation that reaches KVM or the OS lists its calls, in order, under "KVM calls".
/// There:
///
/// - `KVM_SET_USER_MEMORY_REGION` is [`KvmMemory::set_user_memory_region`], which
///   [`KvmVm`](crate::KvmVm) issues as `KVM_SET_USER_MEMORY_REGION2` where KVM has it.
/// - *Bitmap mode* and *ring mode*: KVM reports dirty pages in per-slot logs, or in per-vCPU
///   rings ([`KvmMemory::dirty_ring`]).
/// - *A ring drain* (ring mode): every vCPU's ring is read from its mapping, each entry handed
///   back (no syscall), then one `KVM_RESET_DIRTY_RINGS` if anything was collected (or an
///   earlier reset failed). A failed drain before a change's
///   first request refuses the change.
/// - *Deleting a logging slot* (bitmap mode): `KVM_SET_USER_MEMORY_REGION` *parking* it (a
///   move, which keeps its log, to a guest address no region covers: the highest free one in
///   the host's physical address width, the top itself unless a region lies there; where KVM
///   refuses that, the first GiB boundary above 4 GiB and every region, or if that is past the
///   width, the lowest free place above 4 GiB), `KVM_GET_DIRTY_LOG` into the region's pending
///   bits, and `KVM_SET_USER_MEMORY_REGION` deleting the parked slot; if the read or that
///   delete fails, the slot is moved back. A guest write can no longer land in the log
///   between the read and the delete. Where KVM refuses every parking place (`EEXIST`,
///   `EINVAL`; one `KVM_SET_USER_MEMORY_REGION` each, at most three), the log is read and the
///   slot deleted where it is, and every page of it is marked dirty.
/// - *The undo* of a change: when KVM refuses a request, or a `KVM_GET_DIRTY_LOG` before one
///   fails, the requests already made are reversed, last first. In bitmap mode, a logging slot
///   the change created for a region in place (a read-only toggle's re-created slot, a
///   re-slot's new one) is deleted as *deleting a logging slot* says, so that the guest's
///   writes into it since it was created stay pending (where that fails, it is deleted in place
///   and all its pages are marked dirty). If KVM refuses a reversal, the rest are not
///   attempted: [`Error::UndoFailed`] is returned, and every later change is refused
///   ([`Error::Broken`]) before any call.
///
/// A change refused before its first request (a bad argument, an unknown region, a map change
/// the map refuses) makes no call.
pub struct MemoryManager<K: KvmMemory> {
    kvm: K,
    /// The published versions and, behind their writer lock, the manager's [`State`].
    map: Arc<SharedMap<SlotBacking, State>>,
    /// Even while KVM's slots equal the published map, odd while a change is being applied.
    sequence: ChangeSequence,
    /// The regions a harvest may name, by id (changed by the writer when it adds or removes
    /// a region, after publishing; never held across anything slow).
    directory: Mutex<BTreeMap<RegionId, Arc<Harvestable>>>,
    /// Serialises harvests with one another, never with changes: two harvests never split
    /// one dirty set between them.
    harvests: Mutex<()>,
    /// The dirty-log consumers, the default first. Changed only under both the writer lock and
    /// `harvests`, so a change or a harvest reads it stable under its own lock.
    consumers: Mutex<BTreeSet<DirtyConsumer>>,
    /// Ring mode: held by a collection from taking the entries to attributing them, whether a
    /// harvest's or a change's drain, so that no slot number is released in between.
    rings: Mutex<()>,
    /// Ring mode: entries that named no slot of the map (or a page past their slot).
    stray_ring_entries: AtomicU64,
    /// Ring mode: collections that found a ring overflowed (entries written over).
    ring_overflows: AtomicU64,
    /// Ring mode: a `KVM_RESET_DIRTY_RINGS` failed and none has succeeded since, so KVM holds
    /// collected entries whose pages it does not report again until a reset: the next
    /// collection resets even if it collects nothing.
    ring_reset_owed: AtomicBool,
    /// Bitmap mode: the KVM slot number whose log a harvest is reading (`NO_LEASE` if none).
    /// A new region is never given it, so that the number names a slot of the same region
    /// (and so of the same size) for the whole `KVM_GET_DIRTY_LOG`/`KVM_CLEAR_DIRTY_LOG`.
    leased: AtomicU32,
    /// How many times slot numbers of published slots were released (by removes and
    /// re-slots): a harvest that sees it move re-reads the map before trusting a slot number.
    ids_freed: AtomicU64,
    /// Ring mode: the version a change is making, from before its first KVM request until it
    /// is published, so that a collection meanwhile attributes the entries of slots created
    /// for regions in place (a re-slot) rather than counting them as strays.
    in_flight: Mutex<Option<Arc<MemslotMap<SlotBacking>>>>,
}

/// The handle devices and vCPU threads use to reach guest memory: a vm-memory
/// `GuestAddressSpace` whose `memory()` is a lock-free snapshot of the current version.
#[derive(Debug, Clone)]
pub struct GuestMemoryHandle(pub(crate) Arc<SharedMap<SlotBacking, State>>);

impl GuestAddressSpace for GuestMemoryHandle {
    type M = GuestMemorySlots;
    type T = GuestMemoryView;

    fn memory(&self) -> GuestMemoryView {
        GuestMemoryView(self.0.load_full())
    }
}

impl<K: KvmMemory> MemoryManager<K> {
    /// A manager with no memory, for the VM behind `kvm`, with this host's default limits
    /// ([`MemoryLimits::for_this_host`]).
    pub fn new(kvm: K) -> Self {
        Self::with_limits(kvm, MemoryLimits::for_this_host())
    }

    /// A manager with no memory, for the VM behind `kvm`, that admits regions within `limits`.
    pub fn with_limits(kvm: K, limits: MemoryLimits) -> Self {
        let limit = kvm.max_slots();
        Self::build(kvm, limits, limit)
    }

    /// Like [`with_limits`](Self::with_limits), but the manager leaves KVM's top `reserved`
    /// slot numbers ([`reserved_slots`](Self::reserved_slots)) to the VMM: for slots it makes
    /// itself (a device's MMIO-backed memory, a ROM outside the manager). The manager never
    /// creates, changes or deletes a slot with one of those numbers.
    ///
    /// Fails with [`Error::OutOfSlots`] if KVM has fewer than `reserved` slot numbers.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryLimits, MemoryManager};
    ///
    /// let limits = MemoryLimits::for_this_host();
    /// let memory = MemoryManager::with_reserved_slots(FakeKvm::new(32764, true), limits, 4)?;
    /// assert_eq!(memory.reserved_slots(), 32760..32764);
    /// assert_eq!(memory.slot_usage().free, 32760);
    ///
    /// let err = MemoryManager::with_reserved_slots(FakeKvm::new(8, true), limits, 9).unwrap_err();
    /// assert_eq!(err.to_string(), "out of KVM memory slots: 9 needed, 8 of 8 free");
    /// # Ok::<(), kvm_memslots::Error>(())
    /// ```
    pub fn with_reserved_slots(kvm: K, limits: MemoryLimits, reserved: u32) -> Result<Self, Error> {
        let max = kvm.max_slots();
        let Some(limit) = max.checked_sub(reserved) else {
            return Err(Error::OutOfSlots {
                needed: reserved as usize,
                free: max as usize,
                limit: max,
            });
        };
        Ok(Self::build(kvm, limits, limit))
    }

    /// The KVM slot numbers the manager leaves to the VMM (empty unless made by
    /// [`with_reserved_slots`](Self::with_reserved_slots)).
    pub fn reserved_slots(&self) -> std::ops::Range<u32> {
        self.state().ids.limit..self.kvm.max_slots()
    }

    /// A manager that uses KVM slot numbers `0..limit`.
    fn build(kvm: K, limits: MemoryLimits, limit: u32) -> Self {
        let config =
            MapConfig::new(PAGE_SIZE, limit as usize).expect("the page size is a power of two");
        MemoryManager {
            kvm,
            map: Arc::new(SharedMap::with_writer_state(
                MemslotMap::new(config),
                State {
                    regions: BTreeMap::new(),
                    spans: BTreeMap::new(),
                    ids: SlotIds::new(limit),
                    next_region: 0,
                    broken: None,
                    adding: Vec::new(),
                    next_consumer: 1,
                    followers: BTreeSet::new(),
                    orphans: Vec::new(),
                    limits,
                    used: MemoryUse::default(),
                },
            )),
            sequence: ChangeSequence::default(),
            directory: Mutex::new(BTreeMap::new()),
            harvests: Mutex::new(()),
            consumers: Mutex::new(BTreeSet::from([DirtyConsumer::DEFAULT])),
            rings: Mutex::new(()),
            stray_ring_entries: AtomicU64::new(0),
            ring_overflows: AtomicU64::new(0),
            ring_reset_owed: AtomicBool::new(false),
            leased: AtomicU32::new(NO_LEASE),
            ids_freed: AtomicU64::new(0),
            in_flight: Mutex::new(None),
        }
    }

    /// The KVM side.
    pub fn kvm(&self) -> &K {
        &self.kvm
    }

    /// The handle for readers (a vm-memory `GuestAddressSpace`): what device models,
    /// loaders and vCPU exit handlers hold. Each `memory()` is a lock-free snapshot of the
    /// current map; accesses that cross slot boundaries work as in one mapping.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec};
    /// use linux_loader::cmdline::Cmdline;
    /// use linux_loader::loader::load_cmdline;
    /// use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(64, true));
    /// // 64 KiB in 4 KiB slots: the command line below spans two of them.
    /// memory.add_region(RegionSpec::new(GuestAddress(0x2_0000), 64 << 10).with_slot_size(4096))?;
    /// let mut cmdline = Cmdline::new(4096)?;
    /// cmdline.insert_str("console=ttyS0 reboot=k panic=1")?;
    /// let guest = memory.handle();
    /// load_cmdline(&*guest.memory(), GuestAddress(0x2_0ff0), &cmdline)?;
    /// let mut read = [0u8; 13];
    /// guest.memory().read_slice(&mut read, GuestAddress(0x2_0ff0))?;
    /// assert_eq!(&read, b"console=ttyS0");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn handle(&self) -> GuestMemoryHandle {
        GuestMemoryHandle(Arc::clone(&self.map))
    }

    /// The current version of guest memory, as a vm-memory view to read and write through
    /// (what `handle().memory()` gives).
    pub fn current(&self) -> GuestMemoryView {
        self.handle().memory()
    }

    /// The current map version for a short look (a vCPU exit, say): lock-free, and without
    /// touching the version's shared reference count in the common case (arc-swap's guard).
    /// Do not hold it across long operations; keep a [`current`](Self::current) for that.
    pub fn load(&self) -> MapGuard {
        self.map.load()
    }

    /// Even while KVM's slots match the published map; odd while a change is being applied to
    /// KVM (a vCPU may then exit on an address the map still or already calls memory). Each
    /// change adds 2.
    pub fn change_sequence(&self) -> u64 {
        self.sequence.get()
    }

    /// The change sequence and the current map version, read so that they agree: the map holds
    /// every change an even sequence counts, and no change began or ended between the two
    /// reads. What a vCPU exit handler needs to tell an address that is away for a moment (the
    /// sequence is odd, or moved since the vCPU entered the guest) from one that is not
    /// memory. Lock-free; it retries only while a change publishes.
    pub fn load_consistent(&self) -> (u64, MapGuard) {
        loop {
            // The sequence first, then the map: a map loaded after an even sequence holds every
            // change that sequence counts. A change may publish between the two loads (its odd
            // step comes before its publication), so the sequence is read again.
            let sequence = self.sequence.get();
            let map = self.map.load();
            if self.sequence.get() == sequence {
                return (sequence, map);
            }
        }
    }

    /// Waits until no change is being applied (the change sequence is even) and returns the
    /// sequence, or returns `None` as soon as `give_up` says so (it is asked at least every
    /// millisecond while a change lasts: a vCPU asked to stop, a deadline). The end of a change
    /// wakes the waiter at once; nothing polls KVM.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::MemoryManager;
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(8, true));
    /// assert_eq!(memory.wait_settled(|| false), Some(memory.change_sequence()));
    /// ```
    pub fn wait_settled(&self, give_up: impl Fn() -> bool) -> Option<u64> {
        self.sequence.wait_even(&give_up)
    }

    /// Takes the writer lock. A panic while it was held left the map as the last completed
    /// operation made it (publication is the last step); a panic inside a KVM call also marked
    /// the manager broken (KVM was put back as the map says as far as it could be, but the
    /// call's effect is unknown), so reads and harvests go on and changes are refused.
    fn state(&self) -> Writer<'_> {
        self.map.write()
    }

    /// The harvest directory. Poisoning is ignored: it is changed by single insertions and
    /// removals, never left half-done.
    fn directory(&self) -> MutexGuard<'_, BTreeMap<RegionId, Arc<Harvestable>>> {
        self.directory.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The limits regions are admitted against.
    pub fn limits(&self) -> MemoryLimits {
        self.state().limits
    }

    /// What the regions in place use of the limits.
    pub fn memory_use(&self) -> MemoryUse {
        self.state().used
    }

    /// Admits later regions against `limits`. Regions already in place stay, even if they are
    /// over the new limits.
    pub fn set_limits(&self, limits: MemoryLimits) {
        self.state().limits = limits;
    }

    /// Whether `total` bytes of new regions, none larger than `largest`, would be admitted
    /// now (for a caller planning several regions, such as a hotplug area); nothing is
    /// reserved.
    pub fn admit(&self, total: u64, largest: u64) -> Result<(), Error> {
        let state = self.state();
        admit(&state, largest)?;
        let whole = MemoryLimits {
            max_region_size: u64::MAX,
            ..state.limits
        };
        state
            .used
            .admit(total, &whole)
            .map(drop)
            .map_err(|(limit, figure)| over_limit(&state.limits, limit, total, figure))
    }

    /// The writer lock, for a change: refused once an undo failed.
    fn state_for_change(&self) -> Result<Writer<'_>, Error> {
        let state = self.state();
        match state.broken {
            Some(Broken::UndoFailed { slot, errno }) => Err(Error::Broken { slot, errno }),
            Some(Broken::Panicked { slot }) => Err(Error::BrokenByPanic { slot }),
            None => Ok(state),
        }
    }

    /// The published version, lock-free: for reads that need no writer lock.
    fn published(&self) -> Arc<MemslotMap<SlotBacking>> {
        self.map.load_full()
    }
}

impl<K: KvmMemory> fmt::Debug for MemoryManager<K> {
    /// A summary of the published version: slots in use, KVM's number of slots, regions, and
    /// the change sequence. It does not take the writer lock, so it neither waits for a change
    /// nor deadlocks inside one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let map = self.load();
        // A region's slots follow each other in guest-address order.
        let mut regions = 0;
        let mut last = None;
        for slot in map.iter() {
            let region = slot.payload().region();
            if last != Some(region) {
                regions += 1;
                last = Some(region);
            }
        }
        f.debug_struct("MemoryManager")
            .field("slots", &map.len())
            .field("max_slots", &self.kvm.max_slots())
            .field("regions", &regions)
            .field("change_sequence", &self.change_sequence())
            .finish_non_exhaustive()
    }
}

impl<K: KvmMemory> Drop for MemoryManager<K> {
    /// Deletes every KVM slot before the memory behind it can be unmapped; memory whose slot
    /// KVM refuses to delete is leaked rather than unmapped under the guest.
    ///
    /// # KVM calls
    ///
    /// 1. `KVM_SET_USER_MEMORY_REGION` deleting (size 0) each slot of the published map,
    ///    lowest guest address first. A refusal is not returned: that slot's region mapping is
    ///    leaked (never unmapped) and the next slots are still deleted.
    /// 2. `munmap` of each region's mapping (closing a memfd the manager made) as its last
    ///    reference goes: now, unless a snapshot or handle still holds it. Memory kept after a
    ///    failed undo is leaked instead.
    ///
    /// No dirty log is read and no ring drained.
    fn drop(&mut self) {
        let mut state = self.state();
        for slot in state.current().iter() {
            let request = KvmSlot::from(slot.as_ref()).deleted();
            // SAFETY: a deletion makes KVM stop using the memory; it needs none mapped.
            if unsafe { self.kvm.set_user_memory_region(&request) }.is_err() {
                std::mem::forget(Arc::clone(slot.payload().memory()));
            }
        }
        for memory in state.orphans.drain(..) {
            std::mem::forget(memory);
        }
    }
}

/// Checks a new region of `size` bytes against the limits; the use with it added.
fn admit(state: &State, size: u64) -> Result<MemoryUse, Error> {
    state
        .used
        .admit(size, &state.limits)
        .map_err(|(limit, figure)| over_limit(&state.limits, limit, size, figure))
}

fn over_limit(limits: &MemoryLimits, limit: Limit, size: u64, figure: u64) -> Error {
    Error::OverLimit {
        limit,
        size,
        figure,
        max: match limit {
            Limit::RegionSize => limits.max_region_size,
            Limit::GuestMemory => limits.max_guest_memory,
            Limit::Metadata => limits.max_metadata,
            Limit::Slots => limits.max_slots,
        },
    }
}

fn check_aligned(what: &'static str, value: u64) -> Result<(), Error> {
    check_aligned_to(what, value, PAGE_SIZE)
}

/// Checks that `value` is a multiple of `page_size` (a region's
/// [page alignment](crate::PageSize::alignment)).
fn check_aligned_to(what: &'static str, value: u64, page_size: u64) -> Result<(), Error> {
    if !value.is_multiple_of(page_size) {
        return Err(Error::Unaligned {
            what,
            value,
            page_size,
        });
    }
    Ok(())
}

fn check_range(gpa: u64, size: u64) -> Result<(), Error> {
    if size == 0 {
        return Err(Error::ZeroSize);
    }
    check_aligned("guest address", gpa)?;
    check_aligned("size", size)?;
    if gpa.checked_add(size).is_none() {
        return Err(Error::WrapAround { gpa, size });
    }
    Ok(())
}

/// The first region in place, other than those `skip` names, whose guest range (holes
/// included) overlaps `range`, with that range.
fn region_in_the_way(
    state: &State,
    range: AddressRange,
    skip: impl Fn(RegionId) -> bool,
) -> Option<(RegionId, AddressRange)> {
    // Regions do not overlap: going down from the last one starting below `range.end`, their
    // ends go down too, and the first ending at or below `range.start` ends the search.
    for (&start, &id) in state.spans.range(..range.end).rev() {
        let end = start + state.regions[&id].size;
        if end <= range.start {
            break;
        }
        if !skip(id) {
            return Some((id, AddressRange { start, end }));
        }
    }
    None
}

/// The region's slots in offset order. They are contiguous in guest-address order, so this is
/// one walk along the map's leaves rather than a lookup per slot.
fn region_slots<'a>(
    current: &'a MemslotMap<SlotBacking>,
    region: &Region,
) -> Vec<&'a Arc<GuestSlotData>> {
    let slots: Vec<_> = current
        .iter_from_gpa(region.gpa)
        .take(region.slots.len())
        .collect();
    debug_assert!(slots
        .iter()
        .map(|s| s.id())
        .eq(region.slots.iter().copied()));
    slots
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_huge;
