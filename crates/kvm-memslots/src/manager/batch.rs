//! Batches: regions added and removed as one change, under one writer lock, planned as one
//! list of KVM requests, undone as one, and published as one map version.
//!
//! [`MemoryManager::add_region`] and [`MemoryManager::remove_region`] are batches of one change.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memslot_map::{AddressRange, Change, HostAddress, SlotFlags, SlotId};
use vm_memory::GuestAddress;

use super::consumers::{new_stashes, Stash};
use super::plan::{KvmOp, Step};
use super::spec::check_layout;
use super::{
    check_aligned_to, check_range, over_limit, region_in_the_way, region_slots, Harvestable,
    MemoryManager, Region, RegionSpec, Reslot, Writer, KVM_MAX_SLOT_SIZE,
};
use crate::dirty::DirtyConsumer;
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::limits::{Limit, MemoryUse};
use crate::memory::{GuestSlotData, SlotBacking};
use crate::pending::PendingBits;
use crate::region_memory::{
    hugetlb_pages_available, Backing, PageSize, RegionId, RegionMemory, HUGE_PAGE_SIZE,
};
use crate::PAGE_SIZE;

/// One change of a batch ([`MemoryManager::apply`]).
#[derive(Debug, Clone)]
pub enum RegionChange {
    /// Map a new region and give it to the guest.
    Add(RegionSpec),
    /// Take a region away from the guest and unmap it.
    Remove(RegionId),
    /// Give part of a region new KVM slots (merge, split, cover a hole or make one), without
    /// touching its memory.
    Reslot(Reslot),
}

/// A re-slot, once checked: the region's slots in the range before and after.
struct PlannedReslot {
    region: RegionId,
    /// The region's slots in the range as they are, in offset order.
    old: Vec<Arc<GuestSlotData>>,
    /// The slots the range gets, in offset order: offsets, and the number of a slot kept.
    new: Vec<(Range<u64>, Option<SlotId>)>,
    /// Numbers taken for the new slots that are not kept ones.
    fresh: Vec<SlotId>,
    /// The region's slot numbers once the change is made, in offset order.
    slots: Vec<SlotId>,
    /// How many of them come before the range.
    before: usize,
    /// The bytes they cover.
    covered: u64,
}

impl PlannedReslot {
    /// Whether `slot` of the range is kept as it is.
    fn keeps(&self, slot: &GuestSlotData) -> bool {
        self.new.iter().any(|(_, kept)| *kept == Some(slot.id()))
    }

    /// Whether it changes nothing: every slot of the range kept, and none new.
    fn is_none(&self) -> bool {
        self.fresh.is_empty() && self.old.iter().all(|s| self.keeps(s))
    }
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

impl NewRegion {
    /// Its slots as byte ranges of it, in offset order.
    fn slot_ranges(&self) -> Vec<Range<u64>> {
        match &self.spec.slot_ranges {
            Some(ranges) => ranges.clone(),
            None => (0..self.spec.size)
                .step_by(self.slot_size as usize)
                .map(|offset| offset..(offset + self.slot_size).min(self.spec.size))
                .collect(),
        }
    }
}

/// What a batch does once checked: the regions it removes, those it re-slots, those it adds,
/// and the use of the limits it leaves.
struct Checked {
    removed: Vec<RegionId>,
    reslots: Vec<PlannedReslot>,
    added: Vec<NewRegion>,
    used: MemoryUse,
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
    /// Removals come before re-slots, and re-slots before additions, whatever their order in
    /// `changes`: a batch may add a region where one it removes was. Each change is checked as
    /// [`add_region`](Self::add_region), [`remove_region`](Self::remove_region) and
    /// [`reslot`](Self::reslot) check theirs, against the regions in place less those the batch removes plus those it added
    /// before; the limits are checked against what the whole batch leaves in place. A region
    /// named twice, or two additions that overlap, refuse the batch. Region ids are used up
    /// as [`add_region`](Self::add_region) uses them: by every addition of a batch that got
    /// past its checks, even if KVM then refused it. A batch that changes nothing (empty, or
    /// only re-slots to the slots in place) is checked and then makes no call, publishes no
    /// version and leaves [`change_sequence`](Self::change_sequence) as it was.
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
    /// None if the batch changes nothing. Otherwise:
    ///
    /// 1. For each addition, as [`add_region`](Self::add_region)'s steps 1 and 2: the memory
    ///    of every added region is mapped before any KVM request.
    /// 2. Ring mode, if the batch deletes a slot (a removal, a re-slot): a ring drain (see
    ///    [`MemoryManager`]).
    /// 3. For each removal, in the order given, its slots as in
    ///    [`remove_region`](Self::remove_region)'s step 2; then for each re-slot, in the order
    ///    given, its requests as in [`reslot`](Self::reslot)'s step 2; then for each addition,
    ///    in the order given, `KVM_SET_USER_MEMORY_REGION` creating each of its slots, lowest
    ///    guest address first.
    /// 4. Ring mode, if the batch deleted a slot: a second ring drain; its failure is ignored.
    ///    (Also after an undone re-slot that created a slot: its entries are collected before
    ///    its number is free again.)
    /// 5. `munmap` of each removed region's mapping as its last reference goes.
    ///
    /// On a refusal in step 3 (of a request or of a `KVM_GET_DIRTY_LOG`): every request already
    /// made is reversed, last first (a created slot deleted, a deleted one created again with
    /// its ranges and flags; in bitmap mode a re-slot's new logging slot is deleted as
    /// *deleting a logging slot*, its log read first: see [`MemoryManager`]); then the added
    /// regions' mappings are unmapped. If KVM refuses a
    /// reversal, [`Error::UndoFailed`] is returned, the mappings are kept for the process's
    /// lifetime, and later changes are refused. A failure in step 1 unmaps what step 1 mapped
    /// and makes no KVM call.
    pub fn apply(&self, changes: Vec<RegionChange>) -> Result<Vec<RegionId>, Error> {
        let mut state = self.state_for_change()?;
        let current = Arc::clone(state.current());
        let Checked {
            removed,
            reslots,
            added,
            used,
        } = self.check_batch(&mut state, &current, changes)?;
        if removed.is_empty() && added.is_empty() && reslots.iter().all(PlannedReslot::is_none) {
            // Nothing changes (no change at all, or re-slots to the slots in place): no call,
            // no new map version, and no change counted.
            return Ok(Vec::new());
        }
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
            release_ids(&mut state, &added, &reslots);
            return Err(e);
        }

        let mut steps = Vec::new();
        let (mut removes, mut inserts) = (Vec::new(), Vec::new());
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
                removes.push(Change::Remove(s.id()));
            }
        }
        for plan in &reslots {
            let region = &state.regions[&plan.region];
            plan_reslot(plan, region, &mut steps, &mut removes, &mut inserts);
        }
        for (new, m) in added.iter().zip(&mapped) {
            for slot in new_slots(new, m) {
                steps.push(Step {
                    region: m.id,
                    op: KvmOp::Create((&slot).into()),
                    read_log: false,
                });
                inserts.push(Change::Insert(slot));
            }
        }
        state.adding = mapped.iter().map(|m| Arc::clone(&m.memory)).collect();
        // Removals before insertions: a re-slot's new slots take the place of its old ones.
        let committed = self.commit(&mut state, removes.into_iter().chain(inserts), &steps);
        state.adding.clear();
        if let Err(e) = committed {
            if state.broken.is_some() {
                // KVM may still map some of the new memory: keep it mapped for good.
                state
                    .orphans
                    .extend(mapped.iter().map(|m| Arc::clone(&m.memory)));
            } else {
                release_ids(&mut state, &added, &reslots);
            }
            return Err(e);
        }

        let mut freed = false;
        for id in &removed {
            let region = state.regions.remove(id).expect("checked above");
            state.spans.remove(&region.gpa.0);
            state.ids.release(&region.slots);
            freed |= !region.slots.is_empty();
        }
        for plan in reslots {
            let gone: Vec<SlotId> = plan
                .old
                .iter()
                .filter(|s| !plan.keeps(s))
                .map(|s| s.id())
                .collect();
            state.ids.release(&gone);
            freed |= !gone.is_empty();
            let region = state.regions.get_mut(&plan.region).expect("checked above");
            region.shared.set_slots(&plan.slots);
            region.slots = plan.slots;
            region.covered = plan.covered;
        }
        if freed {
            // After the release (and so after the version without the slots was published): a
            // harvest that sees this count move looks the numbers up again (see `leased`).
            self.ids_freed.fetch_add(1, Ordering::SeqCst);
        }
        let mut ids = Vec::with_capacity(added.len());
        let mut directory = self.directory();
        for id in &removed {
            directory.remove(id);
        }
        for (new, m) in added.into_iter().zip(mapped) {
            let shared = Arc::new(Harvestable {
                memory: Arc::clone(&m.memory),
                pending: m.pending,
                slots: Mutex::new(new.ids.clone().into()),
                gpa: AtomicU64::new(new.spec.gpa.0),
                stash: Mutex::new(m.stash),
            });
            directory.insert(m.id, Arc::clone(&shared));
            let covered = new.slot_ranges().iter().map(|r| r.end - r.start).sum();
            state.spans.insert(new.spec.gpa.0, m.id);
            state.regions.insert(
                m.id,
                Region {
                    memory: m.memory,
                    gpa: new.spec.gpa,
                    size: new.spec.size,
                    slots: new.ids,
                    covered,
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
    /// slot numbers of the added regions and of re-slots' new slots.
    fn check_batch(
        &self,
        state: &mut Writer<'_>,
        current: &super::MemslotMap<SlotBacking>,
        changes: Vec<RegionChange>,
    ) -> Result<Checked, Error> {
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
        let mut reslots: Vec<PlannedReslot> = Vec::new();
        for change in &changes {
            if let RegionChange::Reslot(reslot) = change {
                let id = reslot.region;
                let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
                if removed_set.contains(&id) || reslots.iter().any(|p| p.region == id) {
                    return Err(Error::RegionTwice(id));
                }
                reslots.push(check_reslot(current, region, reslot)?);
            }
        }
        let mut ranges: Vec<AddressRange> = Vec::new();
        let mut asked: BTreeSet<RegionId> = BTreeSet::new();
        let mut hugetlb_pages = 0;
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
            let page = spec.page_size.alignment();
            let slot_size = spec.slot_size.unwrap_or(KVM_MAX_SLOT_SIZE & !(page - 1));
            check_range(spec.gpa.0, spec.size)?;
            if slot_size == 0 || slot_size > KVM_MAX_SLOT_SIZE {
                return Err(Error::SlotSize {
                    slot_size,
                    limit: KVM_MAX_SLOT_SIZE,
                });
            }
            check_aligned_to("guest address", spec.gpa.0, page)?;
            check_aligned_to("size", spec.size, page)?;
            check_aligned_to("slot size", slot_size, page)?;
            if let Some(slots) = &spec.slot_ranges {
                check_layout(&(0..spec.size), slots, page)?;
            }
            check_layout(&(0..spec.size), &spec.inaccessible, page)?;
            if !spec.page_size.fits(&spec.backing) {
                return Err(Error::PageSizeBacking {
                    page_size: spec.page_size.name(),
                    backing: spec.backing.kind(),
                });
            }
            // A shared file on hugetlbfs brings its own pages; anything else of 2 MiB pages
            // reserves the whole region in the pool when it is mapped (a private mapping too:
            // the kernel reserves for its copies).
            if spec.page_size == PageSize::Huge2M && !matches!(spec.backing, Backing::File(_)) {
                hugetlb_pages += spec.size / HUGE_PAGE_SIZE;
            }
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
            // A region's holes are its own too.
            if let Some((other, other_range)) =
                region_in_the_way(state, range, |id| removed_set.contains(&id))
            {
                return Err(Error::Overlap {
                    range,
                    other,
                    other_range,
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
        // The pool last among the checks: it is the host's state, read once for the batch.
        if hugetlb_pages > 0 {
            let available = hugetlb_pages_available();
            if hugetlb_pages > available {
                return Err(Error::HugetlbPool {
                    needed: hugetlb_pages,
                    available,
                });
            }
        }
        // The slot budget, on what the batch leaves in use (KVM's count never goes past the
        // larger of before and after: a re-slot deletes the slots a new one replaces first).
        let created = adds
            .iter()
            .map(|(spec, slot_size)| match &spec.slot_ranges {
                Some(slots) => slots.len() as u64,
                None => spec.size.div_ceil(*slot_size),
            })
            .chain(
                reslots
                    .iter()
                    .map(|p| p.new.iter().filter(|n| n.1.is_none()).count() as u64),
            )
            .sum::<u64>();
        let deleted = removed
            .iter()
            .map(|id| state.regions[id].slots.len() as u64)
            .chain(
                reslots
                    .iter()
                    .map(|p| p.old.iter().filter(|s| !p.keeps(s)).count() as u64),
            )
            .sum::<u64>();
        let after = (state.ids.used() as u64 + created).saturating_sub(deleted);
        if created > deleted && after > state.limits.max_slots {
            return Err(over_limit(&state.limits, Limit::Slots, created, after));
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
            let count = match &spec.slot_ranges {
                Some(slots) => slots.len(),
                None => spec.size.div_ceil(slot_size) as usize,
            };
            needed += count;
            let Some(ids) = state.ids.alloc(count, leased) else {
                release_ids(state, &added, &[]);
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
        for i in 0..reslots.len() {
            let count = reslots[i]
                .new
                .iter()
                .filter(|(_, kept)| kept.is_none())
                .count();
            needed += count;
            let Some(fresh) = state.ids.alloc(count, leased) else {
                release_ids(state, &added, &reslots[..i]);
                return Err(Error::OutOfSlots {
                    needed,
                    free,
                    limit: state.ids.limit,
                });
            };
            reslots[i].number(fresh);
        }
        Ok(Checked {
            removed,
            reslots,
            added,
            used,
        })
    }

    /// Maps a new region's memory, its pending bits and, if there is more than one consumer,
    /// their stashes.
    fn map_memory(
        &self,
        id: RegionId,
        spec: &RegionSpec,
        consumers: &BTreeSet<DirtyConsumer>,
    ) -> Result<Mapped, Error> {
        let memory = Arc::new(RegionMemory::new(spec.size, &spec.backing, spec.page_size)?);
        // Unreachable before any slot over it exists; fresh memory has nothing to discard.
        for range in &spec.inaccessible {
            memory
                .set_accessible(range.clone(), false)
                .map_err(|source| Error::Protect {
                    range: AddressRange {
                        start: spec.gpa.0 + range.start,
                        end: spec.gpa.0 + range.end,
                    },
                    source,
                })?;
        }
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
    new.ids
        .iter()
        .zip(new.slot_ranges())
        .map(|(id, range)| {
            GuestSlotData::new(
                *id,
                GuestAddress(new.spec.gpa.0 + range.start),
                range.end - range.start,
                HostAddress(m.memory.host_address() + range.start),
                flags_of(&new.spec),
                SlotBacking::new(
                    m.id,
                    Arc::clone(&m.memory),
                    Arc::clone(&m.pending),
                    range.start,
                ),
            )
        })
        .collect()
}

/// Checks a re-slot against its region: the range inside the region, cutting none of its
/// slots, and the new slots a layout of the range. Numbers are taken later.
fn check_reslot(
    current: &super::MemslotMap<SlotBacking>,
    region: &Region,
    reslot: &Reslot,
) -> Result<PlannedReslot, Error> {
    let range = &reslot.range;
    let bad = |start, end, reason| Error::SlotLayout { start, end, reason };
    if range.start >= range.end || range.end > region.size {
        return Err(bad(
            range.start,
            range.end,
            "is not a range inside the region",
        ));
    }
    let page = region.memory.page_size().alignment();
    if !range.start.is_multiple_of(page) || !range.end.is_multiple_of(page) {
        return Err(bad(
            range.start,
            range.end,
            if page == PAGE_SIZE {
                "is not page-aligned"
            } else {
                "is not aligned to the region's 2 MiB pages"
            },
        ));
    }
    check_layout(range, &reslot.slots, page)?;
    let all = region_slots(current, region);
    let offsets = |s: &GuestSlotData| s.payload().offset()..s.payload().offset() + s.size();
    let mut old = Vec::new();
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for s in all {
        let r = offsets(s);
        if r.end <= range.start {
            before.push(s.id());
        } else if r.start >= range.end {
            after.push(s.id());
        } else if r.start < range.start || r.end > range.end {
            return Err(bad(
                r.start,
                r.end,
                "is a slot of the region that crosses the range's edge",
            ));
        } else {
            old.push(Arc::clone(s));
        }
    }
    let new: Vec<(Range<u64>, Option<SlotId>)> = reslot
        .slots
        .iter()
        .map(|r| {
            let kept = old.iter().find(|s| offsets(s) == *r).map(|s| s.id());
            (r.clone(), kept)
        })
        .collect();
    let covered = region.covered - old.iter().map(|s| s.size()).sum::<u64>()
        + reslot.slots.iter().map(|r| r.end - r.start).sum::<u64>();
    Ok(PlannedReslot {
        region: reslot.region,
        old,
        new,
        fresh: Vec::new(),
        // The numbers in the range go between, once they are taken.
        before: before.len(),
        slots: before.into_iter().chain(after).collect(),
        covered,
    })
}

impl PlannedReslot {
    /// Gives the new slots that are not kept ones the numbers `fresh`, in order, and records
    /// the region's numbers once the change is made.
    fn number(&mut self, fresh: Vec<SlotId>) {
        let mut numbers = fresh.iter();
        for (_, kept) in &mut self.new {
            if kept.is_none() {
                *kept = numbers.next().copied();
            }
        }
        // `slots` holds the numbers before the range and after it: put the range's between.
        let inside = self.new.iter().filter_map(|(_, number)| *number);
        self.slots.splice(self.before..self.before, inside);
        self.fresh = fresh;
    }
}

/// Plans a re-slot's KVM requests and map changes: going up the range, each new slot is
/// created right after the old slots it takes the place of (or that end before it) are
/// deleted, so that a moment without a slot is as short as KVM allows; old slots past the
/// last new one are deleted last. Kept slots are not touched.
fn plan_reslot(
    plan: &PlannedReslot,
    region: &Region,
    steps: &mut Vec<Step>,
    removes: &mut Vec<Change<SlotBacking>>,
    inserts: &mut Vec<Change<SlotBacking>>,
) {
    let mut old = plan.old.iter().filter(|s| !plan.keeps(s)).peekable();
    let mut delete = |s: &Arc<GuestSlotData>, steps: &mut Vec<Step>| {
        steps.push(Step {
            region: plan.region,
            op: KvmOp::Delete(s.as_ref().into()),
            // KVM frees a deleted slot's log: keep its bits first.
            read_log: s.flags().log_dirty,
        });
        removes.push(Change::Remove(s.id()));
    };
    for (range, number) in &plan.new {
        let number = number.expect("numbered by check_batch");
        if plan.old.iter().any(|s| s.id() == number) {
            continue;
        }
        while let Some(s) = old.next_if(|s| s.payload().offset() < range.end) {
            delete(s, steps);
        }
        let slot = GuestSlotData::new(
            number,
            GuestAddress(region.gpa.0 + range.start),
            range.end - range.start,
            HostAddress(region.memory.host_address() + range.start),
            region.flags,
            SlotBacking::new(
                plan.region,
                Arc::clone(&region.memory),
                Arc::clone(&region.shared.pending),
                range.start,
            ),
        );
        steps.push(Step {
            region: plan.region,
            op: KvmOp::Create((&slot).into()),
            read_log: false,
        });
        inserts.push(Change::Insert(slot));
    }
    for s in old {
        delete(s, steps);
    }
}

/// Gives back the slot numbers of regions a batch did not add and of re-slots it did not make.
fn release_ids(state: &mut Writer<'_>, added: &[NewRegion], reslots: &[PlannedReslot]) {
    for new in added {
        state.ids.release(&new.ids);
    }
    for plan in reslots {
        state.ids.release(&plan.fresh);
    }
}
