//! The guest-memory manager: regions in a memslot map, mirrored to KVM's slots.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memslot_map::{
    AddressRange, Change, HostAddress, MapConfig, MapError, MapWriter, MemslotMap, SharedMap,
    SlotFlags, SlotId,
};
use vm_memory::GuestAddress;
use vmm_sys_util::errno::Error as Errno;

use crate::dirty::{mark_range, or_bits, DirtyPages};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::memory::{
    Backing, GuestMemoryHandle, GuestMemorySnapshot, GuestSlotData, RegionId, RegionMemory,
    SlotBacking,
};
use crate::{MapGuard, PAGE_SIZE};

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
    /// Split the region into KVM slots of this size (the last one may be smaller); by default
    /// as few slots as KVM's per-slot limit allows.
    pub slot_size: Option<u64>,
    /// The guest can read but not write the region.
    pub read_only: bool,
    /// Log the guest's writes from the start.
    pub log_dirty: bool,
}

impl RegionSpec {
    /// `size` bytes of anonymous memory at `gpa`, read-write, not logged, in as few slots as
    /// possible.
    pub fn new(gpa: GuestAddress, size: u64) -> Self {
        RegionSpec {
            gpa,
            size,
            backing: Backing::Anonymous,
            slot_size: None,
            read_only: false,
            log_dirty: false,
        }
    }

    /// Splits the region into slots of `slot_size` bytes.
    pub fn with_slot_size(self, slot_size: u64) -> Self {
        RegionSpec {
            slot_size: Some(slot_size),
            ..self
        }
    }

    /// Uses `backing` for the region's memory.
    pub fn with_backing(self, backing: Backing) -> Self {
        RegionSpec { backing, ..self }
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
    /// Its flags (the same on all its slots).
    pub flags: SlotFlags,
    /// Whether its memory is a shared (file or memfd) mapping.
    pub shared: bool,
}

/// How many KVM slot numbers are in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotUsage {
    /// Slots in use.
    pub used: usize,
    /// Slots free.
    pub free: usize,
    /// KVM's number of slots.
    pub max: u32,
}

/// A guest address that a host address backs, found by [`MemoryManager::find_by_hva`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HvaMatch {
    /// The region.
    pub region: RegionId,
    /// KVM's slot number.
    pub slot: SlotId,
    /// The guest address.
    pub gpa: GuestAddress,
}

/// A part of a discard that is one run of one region's mapping.
struct Piece {
    region: RegionId,
    memory: Arc<RegionMemory>,
    /// Offset of the run in the region.
    offset: u64,
    /// Its guest range.
    start: u64,
    end: u64,
}

struct Region {
    memory: Arc<RegionMemory>,
    gpa: GuestAddress,
    size: u64,
    /// Slot ids in the order of their offsets in the region.
    slots: Vec<SlotId>,
    flags: SlotFlags,
    /// Dirty bits read from KVM or the VMM's bitmap and not yet delivered by a harvest, one per
    /// page of the region; empty until needed.
    pending: Vec<u64>,
}

impl Region {
    fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    fn pending(&mut self) -> &mut Vec<u64> {
        let words = self.pages().div_ceil(64) as usize;
        if self.pending.len() != words {
            self.pending.resize(words, 0);
        }
        &mut self.pending
    }
}

/// KVM slot numbers: the lowest free number first, never two live slots with one number.
struct SlotIds {
    limit: u32,
    next: u32,
    free: BTreeSet<u32>,
}

impl SlotIds {
    fn available(&self) -> usize {
        self.free.len() + (self.limit - self.next) as usize
    }

    fn used(&self) -> usize {
        self.next as usize - self.free.len()
    }

    fn alloc(&mut self, n: usize) -> Option<Vec<SlotId>> {
        if n > self.available() {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        while ids.len() < n {
            let id = match self.free.pop_first() {
                Some(id) => id,
                None => {
                    self.next += 1;
                    self.next - 1
                }
            };
            ids.push(SlotId(id));
        }
        Some(ids)
    }

    fn release(&mut self, ids: &[SlotId]) {
        self.free.extend(ids.iter().map(|id| id.0));
        // Keep the free set small: give back the top of the range.
        while self.next > 0 && self.free.remove(&(self.next - 1)) {
            self.next -= 1;
        }
    }
}

/// The manager's records, kept behind the map's writer lock (the manager's one writer lock):
/// a change reads the map, updates these and publishes the next version without letting
/// another writer in.
pub(crate) struct State {
    regions: BTreeMap<RegionId, Region>,
    ids: SlotIds,
    next_region: u64,
    /// Set when an undo failed: KVM and the map may disagree, so changes are refused.
    broken: Option<(u32, Errno)>,
    /// Memory KVM may still map after a failed undo: kept mapped for the process's lifetime.
    orphans: Vec<Arc<RegionMemory>>,
}

/// One KVM request of a planned change, with what undoes it.
#[derive(Debug, Clone, Copy)]
enum KvmOp {
    Create(KvmSlot),
    Delete(KvmSlot),
    /// Same slot number, host range and size: a MOVE (new guest base) or FLAGS_ONLY change.
    Update {
        old: KvmSlot,
        new: KvmSlot,
    },
}

impl KvmOp {
    fn request(&self) -> KvmSlot {
        match *self {
            KvmOp::Create(s) => s,
            KvmOp::Delete(s) => s.deleted(),
            KvmOp::Update { new, .. } => new,
        }
    }

    fn inverse(&self) -> KvmOp {
        match *self {
            KvmOp::Create(s) => KvmOp::Delete(s),
            KvmOp::Delete(s) => KvmOp::Create(s),
            KvmOp::Update { old, new } => KvmOp::Update { old: new, new: old },
        }
    }

    fn verb(&self) -> &'static str {
        match self {
            KvmOp::Create(_) => "create",
            KvmOp::Delete(_) => "delete",
            KvmOp::Update { .. } => "update",
        }
    }
}

struct Step {
    region: RegionId,
    op: KvmOp,
    /// Read the slot's dirty log into the region's pending bits just before this step, which
    /// frees it (logging off, or a delete). Reading it right there, rather than all logs up
    /// front, is also cheaper for the kernel.
    read_log: bool,
}

impl From<&GuestSlotData> for KvmSlot {
    fn from(slot: &GuestSlotData) -> Self {
        KvmSlot {
            slot: slot.id().0,
            gpa: slot.gpa().0,
            size: slot.size(),
            hva: slot.hva().0,
            flags: slot.flags(),
        }
    }
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
pub struct MemoryManager<K: KvmMemory> {
    kvm: K,
    /// The published versions and, behind their writer lock, the manager's [`State`].
    map: Arc<SharedMap<SlotBacking, State>>,
    /// Even while KVM's slots equal the published map, odd while a change is being applied.
    sequence: AtomicU64,
}

impl<K: KvmMemory> MemoryManager<K> {
    /// A manager with no memory, for the VM behind `kvm`.
    pub fn new(kvm: K) -> Self {
        let limit = kvm.max_slots();
        let config =
            MapConfig::new(PAGE_SIZE, limit as usize).expect("the page size is a power of two");
        MemoryManager {
            kvm,
            map: Arc::new(SharedMap::with_writer_state(
                MemslotMap::new(config),
                State {
                    regions: BTreeMap::new(),
                    ids: SlotIds {
                        limit,
                        next: 0,
                        free: BTreeSet::new(),
                    },
                    next_region: 0,
                    broken: None,
                    orphans: Vec::new(),
                },
            )),
            sequence: AtomicU64::new(0),
        }
    }

    /// The KVM side.
    pub fn kvm(&self) -> &K {
        &self.kvm
    }

    /// The handle for readers (a vm-memory `GuestAddressSpace`).
    pub fn handle(&self) -> GuestMemoryHandle {
        GuestMemoryHandle(Arc::clone(&self.map))
    }

    /// The current version of guest memory.
    pub fn snapshot(&self) -> GuestMemorySnapshot {
        use vm_memory::GuestAddressSpace;
        self.handle().memory()
    }

    /// The current map version for a short look (a vCPU exit, say): lock-free, and without
    /// touching the version's shared reference count in the common case (arc-swap's guard).
    /// Do not hold it across long operations; keep a [`snapshot`](Self::snapshot) for that.
    pub fn load(&self) -> MapGuard {
        self.map.load()
    }

    /// Even while KVM's slots match the published map; odd while a change is being applied to
    /// KVM (a vCPU may then exit on an address the map still or already calls memory). Each
    /// change adds 2.
    pub fn change_sequence(&self) -> u64 {
        self.sequence.load(Ordering::Acquire)
    }

    /// Takes the writer lock. A panic while it was held left KVM and the map as the last
    /// completed operation made them (publication is the last step): the state is usable.
    fn state(&self) -> Writer<'_> {
        self.map.write()
    }

    /// The writer lock, for a change: refused once an undo failed.
    fn state_for_change(&self) -> Result<Writer<'_>, Error> {
        let state = self.state();
        match state.broken {
            Some((slot, errno)) => Err(Error::Broken { slot, errno }),
            None => Ok(state),
        }
    }

    /// Applies `steps` to KVM in order; on a refusal, undoes the applied ones in reverse.
    fn run(&self, state: &mut State, steps: &[Step]) -> Result<(), Error> {
        let mut log = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let request = step.op.request();
            let read = if step.read_log {
                self.read_freed_log(state, step, &mut log)
            } else {
                Ok(())
            };
            let applied = read.and_then(|()| {
                // SAFETY: every request that creates or updates a slot describes memory of a
                // `RegionMemory` that the manager keeps mapped for as long as KVM has the slot:
                // the region's entry in `state.regions` holds it (for a region being added, the
                // caller holds it and moves it into `state.regions` on success, or into
                // `state.orphans` if an undo fails), and it is dropped only after KVM's slots
                // in it were deleted.
                unsafe { self.kvm.set_user_memory_region(&request) }.map_err(|source| Error::Kvm {
                    region: step.region,
                    op: step.op.verb(),
                    slot: request.slot,
                    gpa: request.gpa,
                    size: request.size,
                    source,
                })
            });
            if let Err(failed) = applied {
                for done in steps[..i].iter().rev() {
                    let undo = done.op.inverse();
                    // SAFETY: as above; an undo restores a slot KVM had before this operation.
                    let undone = unsafe { self.kvm.set_user_memory_region(&undo.request()) };
                    if let Err(undo_errno) = undone {
                        let slot = undo.request().slot;
                        state.broken = Some((slot, undo_errno));
                        return Err(Error::UndoFailed {
                            failed: Box::new(failed),
                            undo_op: undo.verb(),
                            slot,
                            undo_errno,
                        });
                    }
                }
                return Err(failed);
            }
        }
        Ok(())
    }

    /// Validates `changes` against the current version, applies `steps` to KVM, and publishes
    /// the new map version only if both succeeded, all under the writer lock `state` holds.
    fn commit(
        &self,
        state: &mut Writer<'_>,
        changes: impl IntoIterator<Item = Change<SlotBacking>>,
        steps: &[Step],
    ) -> Result<(), Error> {
        let current = state.current();
        let next = current
            .with_changes(changes)
            .map_err(|e| map_error(current, e.source))?;
        self.sequence.fetch_add(1, Ordering::AcqRel);
        let applied = self.run(state, steps);
        if applied.is_ok() {
            state.publish(next);
        }
        self.sequence.fetch_add(1, Ordering::AcqRel);
        applied
    }

    /// The published version, lock-free: for reads that need no writer lock.
    fn current(&self) -> Arc<MemslotMap<SlotBacking>> {
        self.map.snapshot()
    }

    /// Maps a new region and gives it to the guest. Returns its id.
    pub fn add_region(&self, spec: RegionSpec) -> Result<RegionId, Error> {
        let mut state = self.state_for_change()?;
        let slot_size = spec
            .slot_size
            .unwrap_or(KVM_MAX_SLOT_SIZE & !(PAGE_SIZE - 1));
        check_range(spec.gpa.0, spec.size)?;
        if slot_size == 0 || slot_size > KVM_MAX_SLOT_SIZE {
            return Err(Error::SlotSize {
                slot_size,
                limit: KVM_MAX_SLOT_SIZE,
            });
        }
        check_aligned("slot size", slot_size)?;
        let current = Arc::clone(state.current());
        // Refuse an overlap before mapping anything.
        let range = AddressRange {
            start: spec.gpa.0,
            end: spec.gpa.0 + spec.size,
        };
        if let Some(other) = current.first_overlap(range.start, range.end) {
            return Err(Error::Overlap {
                range,
                other: other.payload().region(),
                other_range: other.gpa_range(),
            });
        }
        let needed = spec.size.div_ceil(slot_size) as usize;
        let ids = state.ids.alloc(needed).ok_or(Error::OutOfSlots {
            needed,
            free: state.ids.available(),
            limit: state.ids.limit,
        })?;
        let region_id = RegionId(state.next_region);
        let result = self.add_slots(&mut state, region_id, &spec, slot_size, &ids);
        match result {
            Ok(memory) => {
                state.next_region += 1;
                state.regions.insert(
                    region_id,
                    Region {
                        memory,
                        gpa: spec.gpa,
                        size: spec.size,
                        slots: ids,
                        flags: SlotFlags {
                            log_dirty: spec.log_dirty,
                            read_only: spec.read_only,
                        },
                        pending: Vec::new(),
                    },
                );
                Ok(region_id)
            }
            Err(e) => {
                if state.broken.is_none() {
                    state.ids.release(&ids);
                }
                Err(e)
            }
        }
    }

    fn add_slots(
        &self,
        state: &mut Writer<'_>,
        region: RegionId,
        spec: &RegionSpec,
        slot_size: u64,
        ids: &[SlotId],
    ) -> Result<Arc<RegionMemory>, Error> {
        let memory = Arc::new(RegionMemory::new(spec.size, &spec.backing)?);
        let flags = SlotFlags {
            log_dirty: spec.log_dirty,
            read_only: spec.read_only,
        };
        let slots: Vec<GuestSlotData> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let offset = i as u64 * slot_size;
                GuestSlotData::new(
                    *id,
                    GuestAddress(spec.gpa.0 + offset),
                    slot_size.min(spec.size - offset),
                    HostAddress(memory.host_address() + offset),
                    flags,
                    SlotBacking::new(region, Arc::clone(&memory), offset),
                )
            })
            .collect();
        let steps: Vec<Step> = slots
            .iter()
            .map(|s| Step {
                region,
                op: KvmOp::Create(s.into()),
                read_log: false,
            })
            .collect();
        let changes = slots.into_iter().map(Change::Insert);
        let committed = self.commit(state, changes, &steps);
        if committed.is_err() && state.broken.is_some() {
            state.orphans.push(Arc::clone(&memory));
        }
        committed.map(|()| memory)
    }

    /// Takes a region away from the guest and unmaps it (once no snapshot holds it).
    pub fn remove_region(&self, id: RegionId) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
        let slots = region_slots(&current, region);
        let steps: Vec<Step> = slots
            .iter()
            .map(|s| Step {
                region: id,
                op: KvmOp::Delete(s.as_ref().into()),
                read_log: false,
            })
            .collect();
        let changes = steps
            .iter()
            .map(|step| Change::Remove(SlotId(step.op.request().slot)));
        self.commit(&mut state, changes, &steps)?;
        let region = state.regions.remove(&id).expect("looked up above");
        state.ids.release(&region.slots);
        Ok(())
    }

    /// Moves a region to a new guest-physical base (KVM moves each slot in place).
    pub fn move_region(&self, id: RegionId, gpa: GuestAddress) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
        check_range(gpa.0, region.size)?;
        if gpa == region.gpa {
            return Ok(());
        }
        // Move the slot at the leading edge first so that no slot lands on one of its own
        // region's slots that has not moved yet.
        let mut slots = region_slots(&current, region);
        if gpa > region.gpa {
            slots.reverse();
        }
        let new_gpa = |s: &GuestSlotData| GuestAddress(gpa.0 + s.payload().offset());
        let steps: Vec<Step> = slots
            .iter()
            .map(|s| {
                let old = KvmSlot::from(s.as_ref());
                let new = KvmSlot {
                    gpa: new_gpa(s).0,
                    ..old
                };
                Step {
                    region: id,
                    op: KvmOp::Update { old, new },
                    read_log: false,
                }
            })
            .collect();
        let changes = slots.iter().map(|s| Change::Move {
            id: s.id(),
            gpa: new_gpa(s),
        });
        self.commit(&mut state, changes, &steps)?;
        state.regions.get_mut(&id).expect("looked up above").gpa = gpa;
        Ok(())
    }

    /// Makes a region read-only for the guest, or writable again.
    ///
    /// KVM cannot change this flag in place: each slot is deleted and created again, and
    /// between the two a vCPU that touches the slot exits to the VMM (see
    /// [`change_sequence`](Self::change_sequence)). Dirty bits KVM had for the slot are kept.
    pub fn set_read_only(&self, id: RegionId, read_only: bool) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let region = state.regions.get_mut(&id).ok_or(Error::UnknownRegion(id))?;
        if region.flags.read_only == read_only {
            return Ok(());
        }
        let slots = region_slots(&current, region);
        let flags = SlotFlags {
            read_only,
            ..region.flags
        };
        let mut steps = Vec::with_capacity(2 * slots.len());
        for s in &slots {
            let old = KvmSlot::from(s.as_ref());
            // Deleting a slot frees its KVM log: keep its bits first.
            steps.push(Step {
                region: id,
                op: KvmOp::Delete(old),
                read_log: old.flags.log_dirty,
            });
            steps.push(Step {
                region: id,
                op: KvmOp::Create(KvmSlot { flags, ..old }),
                read_log: false,
            });
        }
        let changes = slots.iter().map(|s| Change::SetFlags { id: s.id(), flags });
        self.commit(&mut state, changes, &steps)?;
        state.regions.get_mut(&id).expect("looked up above").flags = flags;
        Ok(())
    }

    /// Starts logging the guest's writes to the target regions: a flags-only update of each
    /// slot, never a delete and create. With manual dirty-log protection, every page counts as
    /// dirty in the first harvest after logging starts.
    pub fn start_dirty_log(&self, target: Target) -> Result<(), Error> {
        self.set_dirty_log(target, true)
    }

    /// Stops logging the guest's writes to the target regions. Pages logged so far are kept
    /// for the next harvest.
    pub fn stop_dirty_log(&self, target: Target) -> Result<(), Error> {
        self.set_dirty_log(target, false)
    }

    fn set_dirty_log(&self, target: Target, on: bool) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let ids: Vec<RegionId> = target_regions(&state, target)?
            .into_iter()
            .filter(|id| state.regions[id].flags.log_dirty != on)
            .collect();
        let mut steps =
            Vec::with_capacity(ids.iter().map(|id| state.regions[id].slots.len()).sum());
        for id in &ids {
            let region = &state.regions[id];
            let slots = region_slots(&current, region);
            let flags = SlotFlags {
                log_dirty: on,
                ..region.flags
            };
            for s in &slots {
                let old = KvmSlot::from(s.as_ref());
                steps.push(Step {
                    region: *id,
                    op: KvmOp::Update {
                        old,
                        new: KvmSlot { flags, ..old },
                    },
                    // KVM frees a slot's log when logging stops: keep its bits first.
                    read_log: !on,
                });
            }
        }
        let changes = steps.iter().map(|step| {
            let new = step.op.request();
            Change::SetFlags {
                id: SlotId(new.slot),
                flags: new.flags,
            }
        });
        self.commit(&mut state, changes, &steps)?;
        for id in ids {
            state
                .regions
                .get_mut(&id)
                .expect("listed above")
                .flags
                .log_dirty = on;
        }
        Ok(())
    }

    /// Moves the dirty bits KVM logged for `slot` of region `id` into the region's pending
    /// bits; with `clear` (and manual protection), clears exactly those bits in KVM so that the
    /// pages are logged again. `log` is scratch space, reused from slot to slot.
    fn fetch_slot_log(
        &self,
        id: RegionId,
        region: &mut Region,
        slot: &KvmSlot,
        clear: bool,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let number = slot.slot;
        let pages = slot.size / PAGE_SIZE;
        log.clear();
        log.resize(pages.div_ceil(64) as usize, 0);
        self.kvm
            .get_dirty_log(number, log)
            .map_err(|source| Error::GetDirtyLog {
                region: id,
                slot: number,
                source,
            })?;
        if log.iter().all(|w| *w == 0) {
            return Ok(());
        }
        let first = (slot.gpa - region.gpa.0) / PAGE_SIZE;
        or_bits(region.pending(), first, log, pages);
        if clear && self.kvm.manual_dirty_log() {
            // Clear exactly the pages read: a page dirtied since stays set in KVM.
            let pages = u32::try_from(pages).expect("KVM slots have fewer than 2^31 pages");
            self.kvm
                .clear_dirty_log(number, 0, pages, log)
                .map_err(|source| Error::ClearDirtyLog {
                    region: id,
                    slot: number,
                    source,
                })?;
        }
        Ok(())
    }

    /// Keeps the log of the slot that `step` is about to free (no need to clear it in KVM).
    fn read_freed_log(
        &self,
        state: &mut State,
        step: &Step,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let slot = match step.op {
            KvmOp::Delete(old) | KvmOp::Update { old, .. } => old,
            KvmOp::Create(_) => return Ok(()),
        };
        let region = state
            .regions
            .get_mut(&step.region)
            .expect("a step's region is in the table");
        self.fetch_slot_log(step.region, region, &slot, false, log)
    }

    /// The pages of the target regions written since the last harvest, by the guest (KVM's
    /// log, for regions that log) or by the VMM through vm-memory (`Bytes`), and clears them.
    ///
    /// If reading a log fails, the error is returned and every bit read so far is kept for the
    /// next harvest: no dirty page is ever lost.
    pub fn harvest_dirty(&self, target: Target) -> Result<Vec<DirtyPages>, Error> {
        let mut state = self.state();
        let current = Arc::clone(state.current());
        let ids = target_regions(&state, target)?;
        let mut log = Vec::new();
        for id in &ids {
            let region = state.regions.get_mut(id).expect("listed above");
            if region.flags.log_dirty {
                for slot in region_slots(&current, region) {
                    let slot = KvmSlot::from(slot.as_ref());
                    self.fetch_slot_log(*id, region, &slot, true, &mut log)?;
                }
            }
            let vmm = region.memory.vmm_dirty_bitmap().get_and_reset();
            let pages = region.pages();
            or_bits(region.pending(), 0, &vmm, pages);
        }
        Ok(ids
            .into_iter()
            .map(|id| {
                let region = state.regions.get_mut(&id).expect("listed above");
                let pages = region.pages();
                DirtyPages {
                    region: id,
                    gpa: region.gpa,
                    pages,
                    bitmap: std::mem::take(region.pending()),
                }
            })
            .collect())
    }

    /// Gives the host back the memory behind guest range `[gpa, gpa + len)`, which must be
    /// all memory: private pages read back as zeros, shared ones are freed from their file
    /// (`MADV_DONTNEED` / `MADV_REMOVE`). The slots stay as they are; the pages count as dirty
    /// in the next harvest, since their contents changed.
    pub fn discard(&self, gpa: GuestAddress, len: u64) -> Result<(), Error> {
        check_range(gpa.0, len)?;
        let range = AddressRange {
            start: gpa.0,
            end: gpa.0 + len,
        };
        // Take the writer lock before reading the map, and hold it until the pages are
        // discarded and marked: a change (a move, say) cannot then come between the look-up
        // and the madvise and make the discard hit memory that is no longer at `gpa`.
        let mut state = self.state();
        let current = Arc::clone(state.current());
        // Check the whole range first so that a hole refuses the discard before any of it.
        if let Some(hole) = current.first_hole(range.start, range.end) {
            return Err(Error::DiscardHole { range, hole });
        }
        // Pieces of one mapping that follow each other are merged into one madvise call.
        let mut pieces: Vec<Piece> = Vec::new();
        let mut at = range.start;
        for slot in current.iter_from_gpa(gpa) {
            if at == range.end {
                break;
            }
            let end = slot.gpa_range().end.min(range.end);
            let offset = slot.payload().offset() + (at - slot.gpa().0);
            match pieces.last_mut() {
                Some(last)
                    if Arc::ptr_eq(&last.memory, slot.payload().memory())
                        && last.offset + (last.end - last.start) == offset =>
                {
                    last.end = end;
                }
                _ => pieces.push(Piece {
                    region: slot.payload().region(),
                    memory: Arc::clone(slot.payload().memory()),
                    offset,
                    start: at,
                    end,
                }),
            }
            at = end;
        }
        for piece in pieces {
            let advice = if piece.memory.is_shared() {
                libc::MADV_REMOVE
            } else {
                libc::MADV_DONTNEED
            };
            let hva = piece.memory.host_address() + piece.offset;
            let len = piece.end - piece.start;
            // SAFETY: `[hva, hva + len)` lies inside the region's mapping, which `piece.memory`
            // keeps mapped during the call. Guest memory is only accessed through volatile
            // accesses and raw pointers, never Rust references, so replacing its contents with
            // zeros (or freeing its file pages) breaks no aliasing rule.
            let ret = unsafe { libc::madvise(hva as *mut libc::c_void, len as usize, advice) };
            if ret != 0 {
                return Err(Error::Discard {
                    range: AddressRange {
                        start: piece.start,
                        end: piece.end,
                    },
                    source: std::io::Error::last_os_error(),
                });
            }
            // The guest's memory changed: the next harvest must report these pages.
            if let Some(region) = state.regions.get_mut(&piece.region) {
                mark_range(region.pending(), piece.offset / PAGE_SIZE, len / PAGE_SIZE);
            }
        }
        Ok(())
    }

    /// Every guest address that host address `hva` backs (several where slots alias one host
    /// range), through the map's host-address index.
    pub fn find_by_hva(&self, hva: HostAddress) -> Vec<HvaMatch> {
        let current = self.current();
        let mut out = Vec::new();
        current.for_each_hva_overlap(hva, 1, |slot| {
            if let Some(gpa) = slot.hva_to_gpa(hva) {
                out.push(HvaMatch {
                    region: slot.payload().region(),
                    slot: slot.id(),
                    gpa,
                });
            }
        });
        out
    }

    /// The regions, by id.
    pub fn regions(&self) -> Vec<RegionInfo> {
        let state = self.state();
        state
            .regions
            .iter()
            .map(|(id, r)| RegionInfo {
                id: *id,
                gpa: r.gpa,
                size: r.size,
                hva: HostAddress(r.memory.host_address()),
                slots: r.slots.len(),
                flags: r.flags,
                shared: r.memory.is_shared(),
            })
            .collect()
    }

    /// KVM slot numbers in use and free.
    pub fn slot_usage(&self) -> SlotUsage {
        let state = self.state();
        SlotUsage {
            used: state.ids.used(),
            free: state.ids.available(),
            max: state.ids.limit,
        }
    }

    /// Bytes the manager holds per slot in use: the map version's indexes and slots, plus the
    /// manager's own per-slot records (region slot lists, free slot numbers). Region mappings,
    /// dirty bitmaps and KVM's own memory are not counted.
    pub fn bytes_per_slot(&self) -> f64 {
        let state = self.state();
        let usage = state.current().memory_usage();
        let own: usize = state
            .regions
            .values()
            .map(|r| r.slots.capacity() * size_of::<SlotId>() + size_of::<Region>())
            .sum::<usize>()
            + state.ids.free.len() * 2 * size_of::<u32>();
        if usage.slots == 0 {
            return 0.0;
        }
        usage.bytes_per_slot() + own as f64 / usage.slots as f64
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

fn check_aligned(what: &'static str, value: u64) -> Result<(), Error> {
    if value % PAGE_SIZE != 0 {
        return Err(Error::Unaligned { what, value });
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

fn target_regions(state: &State, target: Target) -> Result<Vec<RegionId>, Error> {
    match target {
        Target::All => Ok(state.regions.keys().copied().collect()),
        Target::Region(id) if state.regions.contains_key(&id) => Ok(vec![id]),
        Target::Region(id) => Err(Error::UnknownRegion(id)),
    }
}

/// Names the region in the way of a refused map change.
fn map_error(current: &MemslotMap<SlotBacking>, error: MapError) -> Error {
    if let MapError::Overlap {
        range,
        other,
        other_range,
        ..
    } = error
    {
        if let Some(slot) = current.get(other) {
            return Error::Overlap {
                range,
                other: slot.payload().region(),
                other_range,
            };
        }
    }
    Error::Map(error)
}

#[cfg(test)]
mod tests;
