//! Batches: regions added and removed as one change, under one writer lock, planned as one
//! list of KVM requests, undone as one, and published as one map version.
//!
//! [`MemoryManager::add_region`] and [`MemoryManager::remove_region`] are batches of one change.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memslot_map::{AddressRange, Change, HostAddress, SlotFlags, SlotId};
use vm_memory::GuestAddress;

use super::consumers::{new_stashes, Stash};
use super::plan::{KvmOp, Step};
use super::{
    check_aligned, check_range, over_limit, region_slots, Harvestable, MemoryManager, Region,
    RegionSpec, Writer, KVM_MAX_SLOT_SIZE,
};
use crate::dirty::{DirtyConsumer, PendingBits};
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::limits::MemoryUse;
use crate::memory::{GuestSlotData, RegionId, RegionMemory, SlotBacking};
use crate::PAGE_SIZE;

/// One change of a batch ([`MemoryManager::apply`]).
#[derive(Debug, Clone)]
pub enum RegionChange {
    /// Map a new region and give it to the guest.
    Add(RegionSpec),
    /// Take a region away from the guest and unmap it.
    Remove(RegionId),
}

/// A region a batch adds, once its arguments were checked and its slot numbers taken.
struct NewRegion {
    /// As given, except that it logs if a consumer logs every new region.
    spec: RegionSpec,
    /// The consumers it logs for.
    loggers: BTreeSet<DirtyConsumer>,
    slot_size: u64,
    ids: Vec<SlotId>,
}

/// A new region's memory, mapped before any KVM request is made.
struct Mapped {
    id: RegionId,
    memory: Arc<RegionMemory>,
    pending: Arc<PendingBits>,
    stash: Vec<Stash>,
}

impl<K: KvmMemory> MemoryManager<K> {
    /// Adds and removes regions as one change: either all of them are made, or none is and
    /// the map, KVM's slots and the guest's memory stay as they were. Readers see the map
    /// before the batch or after it, never in between (one published version). Returns the
    /// ids of the added regions, in the order of their [`RegionChange::Add`]s.
    ///
    /// Removals come before additions, whatever their order in `changes`: a batch may add a
    /// region where one it removes was. Each change is checked as
    /// [`add_region`](Self::add_region) and [`remove_region`](Self::remove_region) check
    /// theirs, against the regions in place less those the batch removes plus those it added
    /// before; the limits are checked against what the whole batch leaves in place. A region
    /// named twice, or two additions that overlap, refuse the batch. Region ids are used up
    /// as [`add_region`](Self::add_region) uses them: by every addition of a batch that got
    /// past its checks, even if KVM then refused it.
    ///
    /// ```
    /// use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};
    /// use kvm_memslots::{MemoryManager, RegionChange, RegionSpec};
    /// use vm_memory::GuestAddress;
    ///
    /// let memory = MemoryManager::new(Faulty::new(FakeKvm::new(64, true)));
    /// let spec = |mib: u64| RegionSpec::new(GuestAddress(mib << 20), 2 << 20);
    /// let first = memory.add_regions([spec(0), spec(2)])?;
    /// // KVM refuses the third request of the next batch: nothing of it stays.
    /// memory.kvm().fail(KvmCall::SetRegion, 2, libc::EIO);
    /// let batch = vec![
    ///     RegionChange::Remove(first[1]),
    ///     RegionChange::Add(spec(4)),
    ///     RegionChange::Add(spec(6)),
    /// ];
    /// assert!(memory.apply(batch.clone()).is_err());
    /// assert_eq!(memory.regions().len(), 2);
    /// assert_eq!(memory.kvm().inner().slots().len(), 2);
    /// // Once KVM accepts, the batch goes through whole.
    /// let added = memory.apply(batch)?;
    /// assert_eq!(added.len(), 2);
    /// assert_eq!(memory.regions().len(), 3);
    /// # Ok::<(), kvm_memslots::Error>(())
    /// ```
    ///
    /// # KVM calls
    ///
    /// 1. For each addition, as [`add_region`](Self::add_region)'s steps 1 and 2: the memory
    ///    of every added region is mapped before any KVM request.
    /// 2. Ring mode, if the batch removes a region: a ring drain (see [`MemoryManager`]).
    /// 3. For each removal, in the order given, its slots as in
    ///    [`remove_region`](Self::remove_region)'s step 2; then for each addition, in the
    ///    order given, `KVM_SET_USER_MEMORY_REGION` creating each of its slots, lowest guest
    ///    address first.
    /// 4. Ring mode, if the batch removes a region: a second ring drain; its failure is
    ///    ignored.
    /// 5. `munmap` of each removed region's mapping as its last reference goes.
    ///
    /// On a refusal in step 3 (of a request or of a `KVM_GET_DIRTY_LOG`): every request already
    /// made is reversed, last first (a created slot deleted, a deleted one created again with
    /// its ranges and flags); then the added regions' mappings are unmapped. If KVM refuses a
    /// reversal, [`Error::UndoFailed`] is returned, the mappings are kept for the process's
    /// lifetime, and later changes are refused. A failure in step 1 unmaps what step 1 mapped
    /// and makes no KVM call.
    pub fn apply(&self, changes: Vec<RegionChange>) -> Result<Vec<RegionId>, Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let (removed, added, used) = self.check_batch(&mut state, &current, changes)?;
        // Past every check: the new regions' ids are used up from here on, even if mapping
        // their memory or KVM fails (their errors name them).
        let mut mapped = Vec::with_capacity(added.len());
        let mut failed = None;
        let consumers = self.consumers().clone();
        for new in &added {
            let id = match new.spec.id {
                Some(id) => id,
                None => {
                    state.next_region += 1;
                    RegionId(state.next_region - 1)
                }
            };
            // An id asked for is never handed out again.
            state.next_region = state.next_region.max(id.0.saturating_add(1));
            match self.map_memory(id, &new.spec, &consumers) {
                Ok(m) => mapped.push(m),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            release_ids(&mut state, &added);
            return Err(e);
        }

        let mut steps = Vec::new();
        let mut map_changes = Vec::new();
        for id in &removed {
            let region = &state.regions[id];
            for s in region_slots(&current, region) {
                // If KVM refuses a later step, the deleted slots are created again with fresh
                // logs: keep what their logs held, or a rolled-back remove would lose it.
                steps.push(Step {
                    region: *id,
                    op: KvmOp::Delete(s.as_ref().into()),
                    read_log: s.flags().log_dirty,
                });
                map_changes.push(Change::Remove(s.id()));
            }
        }
        for (new, m) in added.iter().zip(&mapped) {
            for slot in new_slots(new, m) {
                steps.push(Step {
                    region: m.id,
                    op: KvmOp::Create((&slot).into()),
                    read_log: false,
                });
                map_changes.push(Change::Insert(slot));
            }
        }
        state.adding = mapped.iter().map(|m| Arc::clone(&m.memory)).collect();
        let committed = self.commit(&mut state, map_changes, &steps);
        state.adding.clear();
        if let Err(e) = committed {
            if state.broken.is_some() {
                // KVM may still map some of the new memory: keep it mapped for good.
                state
                    .orphans
                    .extend(mapped.iter().map(|m| Arc::clone(&m.memory)));
            } else {
                release_ids(&mut state, &added);
            }
            return Err(e);
        }

        for id in &removed {
            let region = state.regions.remove(id).expect("checked above");
            state.ids.release(&region.slots);
        }
        if !removed.is_empty() {
            // After the release (and so after the version without the slots was published): a
            // harvest that sees this count move looks the numbers up again (see `leased`).
            self.ids_freed.fetch_add(1, Ordering::SeqCst);
            let mut directory = self.directory();
            for id in &removed {
                directory.remove(id);
            }
        }
        let mut ids = Vec::with_capacity(added.len());
        let mut directory = self.directory();
        for (new, m) in added.into_iter().zip(mapped) {
            let shared = Arc::new(Harvestable {
                memory: Arc::clone(&m.memory),
                pending: m.pending,
                slots: new.ids.clone().into_boxed_slice(),
                gpa: AtomicU64::new(new.spec.gpa.0),
                stash: Mutex::new(m.stash),
            });
            directory.insert(m.id, Arc::clone(&shared));
            state.regions.insert(
                m.id,
                Region {
                    memory: m.memory,
                    gpa: new.spec.gpa,
                    size: new.spec.size,
                    slots: new.ids,
                    flags: flags_of(&new.spec),
                    loggers: new.loggers,
                    shared,
                },
            );
            ids.push(m.id);
        }
        drop(directory);
        state.used = used;
        Ok(ids)
    }

    /// Adds several regions as one change ([`apply`](Self::apply)): all or none. Returns their
    /// ids in order.
    pub fn add_regions(
        &self,
        specs: impl IntoIterator<Item = RegionSpec>,
    ) -> Result<Vec<RegionId>, Error> {
        self.apply(specs.into_iter().map(RegionChange::Add).collect())
    }

    /// Removes several regions as one change ([`apply`](Self::apply)): all or none.
    pub fn remove_regions(&self, ids: impl IntoIterator<Item = RegionId>) -> Result<(), Error> {
        self.apply(ids.into_iter().map(RegionChange::Remove).collect())
            .map(drop)
    }

    /// Checks a batch's changes before anything is allocated or asked of KVM, and takes the
    /// added regions' slot numbers. Returns the regions to remove, those to add, and the use of
    /// the limits once the batch is made.
    fn check_batch(
        &self,
        state: &mut Writer<'_>,
        current: &super::MemslotMap<SlotBacking>,
        changes: Vec<RegionChange>,
    ) -> Result<(Vec<RegionId>, Vec<NewRegion>, MemoryUse), Error> {
        let (mut removed, mut adds) = (Vec::new(), Vec::new());
        let mut used = state.used;
        for change in &changes {
            if let RegionChange::Remove(id) = change {
                let region = state.regions.get(id).ok_or(Error::UnknownRegion(*id))?;
                if removed.contains(id) {
                    return Err(Error::UnknownRegion(*id));
                }
                used = used.without(region.size);
                removed.push(*id);
            }
        }
        let removed_set: BTreeSet<RegionId> = removed.iter().copied().collect();
        let mut ranges: Vec<AddressRange> = Vec::new();
        let mut asked: BTreeSet<RegionId> = BTreeSet::new();
        for change in changes {
            let RegionChange::Add(spec) = change else {
                continue;
            };
            if let Some(id) = spec.id {
                // A removed region's id is not free until the batch is made.
                if state.regions.contains_key(&id) || !asked.insert(id) {
                    return Err(Error::RegionIdInUse(id));
                }
            }
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
            // Before anything is allocated: a region the host cannot carry is refused here.
            used = used
                .admit(spec.size, &state.limits)
                .map_err(|(limit, figure)| over_limit(&state.limits, limit, spec.size, figure))?;
            let range = AddressRange {
                start: spec.gpa.0,
                end: spec.gpa.0 + spec.size,
            };
            let in_place = current
                .iter_from_gpa(spec.gpa)
                .take_while(|s| s.gpa().0 < range.end)
                .find(|s| !removed_set.contains(&s.payload().region()));
            if let Some(other) = in_place {
                return Err(Error::Overlap {
                    range,
                    other: other.payload().region(),
                    other_range: other.gpa_range(),
                });
            }
            if let Some(other) = ranges
                .iter()
                .position(|r| r.start < range.end && range.start < r.end)
            {
                return Err(Error::BatchOverlap {
                    range,
                    other,
                    other_range: ranges[other],
                });
            }
            ranges.push(range);
            adds.push((spec, slot_size));
        }
        // Slot numbers last, so that a refused batch takes none. Not the number a harvest is
        // reading the log of: it must keep naming that harvest's slot (and its size) until the
        // harvest is done with it.
        let leased = self.leased.load(Ordering::SeqCst);
        let free = state.ids.available_besides(leased);
        let mut added: Vec<NewRegion> = Vec::with_capacity(adds.len());
        let mut needed = 0;
        for (mut spec, slot_size) in adds {
            let mut loggers = state.followers.clone();
            if spec.log_dirty {
                loggers.insert(DirtyConsumer::DEFAULT);
            }
            spec.log_dirty = !loggers.is_empty();
            let count = spec.size.div_ceil(slot_size) as usize;
            needed += count;
            let Some(ids) = state.ids.alloc(count, leased) else {
                release_ids(state, &added);
                return Err(Error::OutOfSlots {
                    needed,
                    free,
                    limit: state.ids.limit,
                });
            };
            added.push(NewRegion {
                spec,
                loggers,
                slot_size,
                ids,
            });
        }
        Ok((removed, added, used))
    }

    /// Maps a new region's memory, its pending bits and, if there is more than one consumer,
    /// their stashes.
    fn map_memory(
        &self,
        id: RegionId,
        spec: &RegionSpec,
        consumers: &BTreeSet<DirtyConsumer>,
    ) -> Result<Mapped, Error> {
        let memory = Arc::new(RegionMemory::new(spec.size, &spec.backing)?);
        // Allocated with the region (fallibly), so that nothing that marks a page dirty can
        // fail for want of room later.
        let pages = spec.size / PAGE_SIZE;
        let pending = Arc::new(PendingBits::new(pages)?);
        let stash = if consumers.len() > 1 {
            new_stashes(consumers, pages.div_ceil(64) as usize)?
        } else {
            Vec::new()
        };
        // A region that logs from the start reports every page in its first harvest, in every
        // mode (where KVM's log does not start all set, the manager marks them).
        if spec.log_dirty && self.marks_logging_start() {
            pending.mark(0, pages);
        }
        Ok(Mapped {
            id,
            memory,
            pending,
            stash,
        })
    }
}

fn flags_of(spec: &RegionSpec) -> SlotFlags {
    SlotFlags {
        log_dirty: spec.log_dirty,
        read_only: spec.read_only,
    }
}

/// A new region's slots, in offset order.
fn new_slots(new: &NewRegion, m: &Mapped) -> Vec<GuestSlotData> {
    let (spec, slot_size) = (&new.spec, new.slot_size);
    new.ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let offset = i as u64 * slot_size;
            GuestSlotData::new(
                *id,
                GuestAddress(spec.gpa.0 + offset),
                slot_size.min(spec.size - offset),
                HostAddress(m.memory.host_address() + offset),
                flags_of(spec),
                SlotBacking::new(m.id, Arc::clone(&m.memory), Arc::clone(&m.pending), offset),
            )
        })
        .collect()
}

/// Gives the slot numbers of regions a batch did not add back.
fn release_ids(state: &mut Writer<'_>, added: &[NewRegion]) {
    for new in added {
        state.ids.release(&new.ids);
    }
}
