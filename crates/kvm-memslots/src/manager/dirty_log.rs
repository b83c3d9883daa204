//! Dirty logging: switching KVM's log per region, reading it, and harvesting dirty pages.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use memslot_map::{Change, SlotFlags, SlotId};
use vm_memory::GuestAddress;

use super::consumers::share;
use super::plan::{KvmOp, Step};
use super::{region_slots, reserve, Harvestable, MemoryManager, State, Target, NO_LEASE};
use crate::dirty::{DirtyConsumer, DirtyPages};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::memory::GuestSlotData;
use crate::pending::PendingBits;
use crate::region_memory::RegionId;
use crate::GuestMemoryMap;
use crate::PAGE_SIZE;

impl<K: KvmMemory> MemoryManager<K> {
    /// Starts logging the guest's writes to the target regions: a flags-only update of each
    /// slot, never a delete and create. Every page counts as dirty in the first harvest after
    /// logging starts, in every mode.
    ///
    /// # KVM calls
    ///
    /// None if every target region logs already. Otherwise:
    ///
    /// 1. `KVM_SET_USER_MEMORY_REGION` setting `KVM_MEM_LOG_DIRTY_PAGES` on each slot of each
    ///    target region that does not log yet (a flags-only update): region by region in
    ///    region-id order, each region's slots lowest guest address first.
    ///
    /// No log is read and no ring drained. On a refusal: the slots already updated get their
    /// old flags back, last first.
    pub fn start_dirty_log(&self, target: Target) -> Result<(), Error> {
        self.set_dirty_log(DirtyConsumer::DEFAULT, target, true)
    }

    /// Starts logging the target regions for `consumer` ([`add_dirty_consumer`]). KVM logs a
    /// region while any consumer logs it: this makes KVM calls only for regions no consumer
    /// logged, as [`start_dirty_log`](Self::start_dirty_log) does. A region that logged for
    /// another consumer already reports every page in `consumer`'s next harvest, as one whose
    /// logging starts does.
    ///
    /// [`add_dirty_consumer`]: Self::add_dirty_consumer
    pub fn start_dirty_log_for(
        &self,
        consumer: DirtyConsumer,
        target: Target,
    ) -> Result<(), Error> {
        self.set_dirty_log(consumer, target, true)
    }

    /// Stops logging the target regions for `consumer`. KVM stops logging a region (with the
    /// calls of [`stop_dirty_log`](Self::stop_dirty_log)) only where no other consumer logs it;
    /// [`dirty_log_holders`](Self::dirty_log_holders) says which consumers keep it logging.
    pub fn stop_dirty_log_for(&self, consumer: DirtyConsumer, target: Target) -> Result<(), Error> {
        self.set_dirty_log(consumer, target, false)
    }

    /// Stops logging the guest's writes to the target regions. Pages logged so far are kept
    /// for the next harvest.
    ///
    /// # KVM calls
    ///
    /// None if no target region logs. Otherwise:
    ///
    /// 1. Ring mode: a ring drain (see [`MemoryManager`]).
    /// 2. For each slot of each target region that logs (region by region in region-id order,
    ///    each region's slots lowest guest address first): in bitmap mode, `KVM_GET_DIRTY_LOG`
    ///    into the region's pending bits; then `KVM_SET_USER_MEMORY_REGION` clearing
    ///    `KVM_MEM_LOG_DIRTY_PAGES` (a flags-only update).
    /// 3. Ring mode: a second ring drain; its failure is ignored.
    ///
    /// On a refusal in step 2 (of an update or of a `KVM_GET_DIRTY_LOG`): the slots already
    /// updated get logging back, last first (new logs, in bitmap mode); the bits read are
    /// kept, and every page of the target regions is marked dirty: a guest write between a
    /// slot's update and its reversal was not logged, so the next harvest reports them all.
    /// A failed ring drain in step 1 refuses the stop before any update, and marks every page
    /// of the target regions dirty the same way (over-reporting: entries it could not collect
    /// may have been taken from the rings).
    pub fn stop_dirty_log(&self, target: Target) -> Result<(), Error> {
        self.set_dirty_log(DirtyConsumer::DEFAULT, target, false)
    }

    fn set_dirty_log(
        &self,
        consumer: DirtyConsumer,
        target: Target,
        on: bool,
    ) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        self.check_consumer(consumer)?;
        let current = Arc::clone(state.current());
        let targets = target_regions(&state, target)?;
        // Regions whose logging in KVM changes: the first consumer to log one, the last to
        // stop. The others only gain or lose `consumer` among their loggers.
        let ids: Vec<RegionId> = targets
            .iter()
            .copied()
            .filter(|id| {
                let loggers = &state.regions[id].loggers;
                if on {
                    loggers.is_empty()
                } else {
                    loggers.len() == 1 && loggers.contains(&consumer)
                }
            })
            .collect();
        let joined: Vec<RegionId> = targets
            .iter()
            .copied()
            .filter(|id| {
                let loggers = &state.regions[id].loggers;
                on && !loggers.is_empty() && !loggers.contains(&consumer)
            })
            .collect();
        let set_loggers = |state: &mut State| {
            for id in &targets {
                let loggers = &mut state.regions.get_mut(id).expect("listed above").loggers;
                if on {
                    loggers.insert(consumer);
                } else {
                    loggers.remove(&consumer);
                }
            }
        };
        if ids.is_empty() {
            // Nothing changes in KVM: no call, and no new map version for readers to pick up.
            // Logging for others already: `consumer`'s first harvest has every page, as if
            // logging started now.
            mark_all_for(&state, &joined, consumer);
            set_loggers(&mut state);
            return Ok(());
        }
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
        // Where KVM's logs do not start all set (ring mode, or manual protection without
        // KVM_DIRTY_LOG_INITIALLY_SET), KVM reports only writes from now on: mark every page
        // so that the first harvest reports every page in every mode.
        let initially_set = on && self.marks_logging_start();
        if let Err(err) = self.commit(&mut state, changes, &steps) {
            // A refused stop was undone, but between a slot's logging-off update and its undo
            // the guest could write the slot unlogged, and the log KVM starts on the undo does
            // not know: every page of those regions may be dirty.
            if !on && !matches!(err, Error::UndoFailed { .. }) {
                for id in &ids {
                    let region = &state.regions[id];
                    region.pending().mark(0, region.size / PAGE_SIZE);
                }
            }
            return Err(err);
        }
        if initially_set {
            for id in &ids {
                let region = &state.regions[id];
                region.pending().mark(0, region.size / PAGE_SIZE);
            }
        }
        for id in ids {
            state
                .regions
                .get_mut(&id)
                .expect("listed above")
                .flags
                .log_dirty = on;
        }
        mark_all_for(&state, &joined, consumer);
        set_loggers(&mut state);
        Ok(())
    }

    /// Moves the dirty bits KVM logged for `slot` into `pending` (the slot's first page is
    /// page `first` of its region); with `clear` (and manual protection), clears exactly those
    /// bits in KVM so that the pages are logged again. `log` is scratch space, reused from
    /// slot to slot. A bit is cleared in KVM only once it is in `pending`.
    pub(super) fn fetch_slot_log(
        &self,
        id: RegionId,
        pending: &PendingBits,
        slot: &KvmSlot,
        first: u64,
        clear: bool,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let number = slot.slot;
        let pages = slot.size / PAGE_SIZE;
        let words = pages.div_ceil(64) as usize;
        log.clear();
        reserve(log, words, "a slot's dirty log")?;
        log.resize(words, 0);
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
        pending.or_bits(first, log, pages);
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

    /// Whether the manager marks every page of a region whose logging starts (KVM will not).
    pub(super) fn marks_logging_start(&self) -> bool {
        // Without manual protection KVM's new log is empty too (it write-protects the slot and
        // logs only later writes).
        self.kvm.dirty_ring() || !self.kvm.initially_set_logs()
    }

    /// The pages of the target regions written since the last harvest, by the guest (KVM's
    /// log, for regions that log) or by the VMM through vm-memory (`Bytes`), and clears them:
    /// the harvest of the default consumer ([`DirtyConsumer::DEFAULT`]). Other consumers
    /// ([`add_dirty_consumer`](Self::add_dirty_consumer)) still get these pages in their own
    /// harvests ([`harvest_dirty_for`](Self::harvest_dirty_for)). A consumer gets every page
    /// logged in a region, for whichever consumer KVM logged it.
    ///
    /// If reading a log fails, the error is returned and every bit read so far is kept for the
    /// next harvest: no dirty page is ever lost.
    ///
    /// A harvest never takes the writer lock: it runs alongside changes (each waits for
    /// neither), reaching the regions' pending bits from a map version. Harvests wait for one
    /// another, so that two of them never split one dirty set. A page is reported more than
    /// once only where a change re-created a logging slot with all-set logs (see
    /// `set_read_only`), or deleted one where KVM refused to park it (see [`MemoryManager`]).
    ///
    /// # KVM calls
    ///
    /// Ring mode: one ring drain (see [`MemoryManager`]), whatever the target: every vCPU's
    /// ring read from its mapping (no syscall), then one `KVM_RESET_DIRTY_RINGS`. Entries of
    /// regions outside the target stay pending for their own harvest.
    ///
    /// # Example
    ///
    /// Dirty tracking as a snapshot or a migration round uses it (on the fake KVM, whose
    /// `guest_write` stands for a vCPU's store):
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec, Target};
    /// use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(64, true));
    /// let ram = memory.add_region(RegionSpec::new(GuestAddress(0), 1 << 20).with_slot_size(64 << 10))?;
    /// memory.start_dirty_log(Target::Region(ram))?;
    /// // The first harvest reports every page: copy them all.
    /// assert_eq!(memory.harvest_dirty(Target::All)?[0].count(), 256);
    ///
    /// memory.kvm().guest_write(0x2_3000); // the guest writes a page
    /// memory.handle().memory().write_obj(7u64, GuestAddress(0xf_f000))?; // so does the VMM
    /// let dirty = memory.harvest_dirty(Target::Region(ram))?;
    /// let pages: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    /// assert_eq!(pages, [0x2_3000, 0xf_f000]);
    /// assert_eq!(memory.harvest_dirty(Target::All)?[0].count(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Bitmap mode: for each target region in region-id order, for each of its slots that
    /// logs in the current map, lowest guest address first:
    ///
    /// 1. `KVM_GET_DIRTY_LOG`.
    /// 2. Only if a bit is set and logs are cleared manually
    ///    ([`KvmMemory::manual_dirty_log`]): `KVM_CLEAR_DIRTY_LOG` of exactly the bits read,
    ///    over the whole slot.
    ///
    /// Then no call: the VMM's write bitmaps are read in memory. Nothing to undo: on a failure
    /// the harvest stops and returns the error, every bit read kept pending, except that an
    /// `ENOENT`/`EINVAL` from a slot whose log a concurrent change freed is skipped.
    pub fn harvest_dirty(&self, target: Target) -> Result<Vec<DirtyPages>, Error> {
        self.harvest_dirty_for(DirtyConsumer::DEFAULT, target)
    }

    /// The pages of the target regions dirtied since `consumer`'s last harvest, and clears
    /// them for `consumer` only: every other consumer still gets them in its own next
    /// harvest. Otherwise as [`harvest_dirty`](Self::harvest_dirty), with the same KVM calls.
    pub fn harvest_dirty_for(
        &self,
        consumer: DirtyConsumer,
        target: Target,
    ) -> Result<Vec<DirtyPages>, Error> {
        let _serial = self.harvests.lock().unwrap_or_else(|p| p.into_inner());
        self.check_consumer(consumer)?;
        let regions: Vec<(RegionId, Arc<Harvestable>)> = {
            let directory = self.directory();
            match target {
                Target::All => directory
                    .iter()
                    .map(|(id, r)| (*id, Arc::clone(r)))
                    .collect(),
                Target::Region(id) => {
                    let region = directory.get(&id).ok_or(Error::UnknownRegion(id))?;
                    vec![(id, Arc::clone(region))]
                }
            }
        };
        if self.kvm.dirty_ring() {
            self.collect_rings()?;
        } else {
            let mut log = Vec::new();
            let fetched = regions
                .iter()
                .try_for_each(|(id, region)| self.fetch_region_logs(*id, region, &mut log));
            self.leased.store(NO_LEASE, Ordering::SeqCst);
            fetched?;
        }
        // Room for every region's bits before any is handed over: a failure takes none.
        let mut bitmaps = Vec::new();
        reserve_vecs(&mut bitmaps, regions.len())?;
        for (_, region) in &regions {
            let mut bitmap = Vec::new();
            let words = region.pending.pages().div_ceil(64) as usize;
            reserve(&mut bitmap, words, "a region's harvested dirty bits")?;
            bitmaps.push(bitmap);
        }
        Ok(regions
            .into_iter()
            .zip(bitmaps)
            .map(|((id, region), mut bitmap)| {
                let pages = region.pending.pages();
                let vmm = region.memory.vmm_dirty_bitmap().get_and_reset();
                region.pending.or_bits(0, &vmm, pages);
                region
                    .pending
                    .take_into(&mut bitmap)
                    .expect("room was reserved above");
                let mut stashes = region.stash();
                if !stashes.is_empty() {
                    share(&mut stashes, consumer, &mut bitmap);
                }
                DirtyPages {
                    region: id,
                    gpa: GuestAddress(region.gpa.load(Ordering::Acquire)),
                    pages,
                    bitmap,
                }
            })
            .collect())
    }

    /// Bitmap mode: reads (and clears) the log of each logging slot of `region` into its
    /// pending bits, without the writer lock. A slot number is looked up in a map version and
    /// leased (`leased`) for the reads, so that it names a slot of this region, of the size
    /// looked up, throughout: a change may stop its logging or re-create it meanwhile (the
    /// read then fails or sees the new log, both fine), but never give the number to another
    /// region. A read that fails because a change freed the log is skipped: that change read
    /// the log into the region's pending bits before freeing it.
    fn fetch_region_logs(
        &self,
        id: RegionId,
        region: &Harvestable,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let mut freed = self.ids_freed.load(Ordering::SeqCst);
        let mut map = self.published();
        // Numbers a re-slot published since are read by the next harvest; numbers it took
        // away are skipped below (it read their logs into the pending bits before deleting).
        for &number in region.slots().iter() {
            if region_slot(&map, number, region).is_none_or(|s| !s.flags().log_dirty) {
                continue;
            }
            self.leased.store(number.0, Ordering::SeqCst);
            // A number freed since `map` was loaded may name another region's slot by now:
            // look again in a version loaded after the lease (which keeps it from being given
            // out from now on).
            loop {
                let now = self.ids_freed.load(Ordering::SeqCst);
                if now == freed {
                    break;
                }
                freed = now;
                map = self.published();
            }
            let Some(slot) = region_slot(&map, number, region).filter(|s| s.flags().log_dirty)
            else {
                continue;
            };
            let slot = Arc::clone(slot);
            let sequence = self.change_sequence();
            let kvm_slot = KvmSlot::from(slot.as_ref());
            let first = slot.payload().offset() / PAGE_SIZE;
            let fetched = self.fetch_slot_log(id, &region.pending, &kvm_slot, first, true, log);
            self.leased.store(NO_LEASE, Ordering::SeqCst);
            match fetched {
                Err(e) if self.freed_meanwhile(&e, sequence, &slot) => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Whether `error`, from reading or clearing the log of `slot`, came from a change that
    /// freed the log (stopped logging, or deleted the slot) while the harvest was at it: KVM
    /// says the slot or its log is gone, and a change ran since `sequence` was read (or the
    /// published slot is no longer the one read).
    fn freed_meanwhile(&self, error: &Error, sequence: u64, slot: &Arc<GuestSlotData>) -> bool {
        let source = match error {
            Error::GetDirtyLog { source, .. } | Error::ClearDirtyLog { source, .. } => source,
            _ => return false,
        };
        if !matches!(source.errno(), libc::ENOENT | libc::EINVAL) {
            return false;
        }
        let now = self.change_sequence();
        sequence % 2 == 1
            || now != sequence
            || self
                .published()
                .get(slot.id())
                .is_none_or(|latest| !Arc::ptr_eq(latest, slot))
    }
}

/// The slot `number` of `map` if it belongs to `region` (the same pending bits: regions are
/// never re-created, so this is the region's slot and no other region's).
fn region_slot<'a>(
    map: &'a GuestMemoryMap,
    number: SlotId,
    region: &Harvestable,
) -> Option<&'a Arc<GuestSlotData>> {
    map.get(number)
        .filter(|s| Arc::ptr_eq(s.payload().pending(), &region.pending))
}

/// Room for `n` vectors in `v`, fallibly.
fn reserve_vecs(v: &mut Vec<Vec<u64>>, n: usize) -> Result<(), Error> {
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        what: "the harvested regions",
        bytes: (n as u64).saturating_mul(size_of::<Vec<u64>>() as u64),
    })
}

fn target_regions(state: &State, target: Target) -> Result<Vec<RegionId>, Error> {
    match target {
        Target::All => Ok(state.regions.keys().copied().collect()),
        Target::Region(id) if state.regions.contains_key(&id) => Ok(vec![id]),
        Target::Region(id) => Err(Error::UnknownRegion(id)),
    }
}

/// Marks every page of `regions` dirty for `consumer` alone (in its stash: there is one, since a
/// region logging for another consumer means there are two).
fn mark_all_for(state: &State, regions: &[RegionId], consumer: DirtyConsumer) {
    for id in regions {
        let region = &state.regions[id];
        let pages = region.size / PAGE_SIZE;
        let mut stashes = region.shared.stash();
        if let Some(stash) = stashes.iter_mut().find(|s| s.consumer == consumer) {
            for (i, word) in stash.bits.iter_mut().enumerate() {
                let left = pages.saturating_sub(i as u64 * 64);
                *word = if left >= 64 {
                    u64::MAX
                } else {
                    (1 << left) - 1
                };
            }
        }
    }
}
