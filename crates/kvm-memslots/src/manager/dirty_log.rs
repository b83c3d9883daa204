//! Dirty logging: switching KVM's log per region, reading it, and harvesting dirty pages.

use std::sync::Arc;

use memslot_map::{Change, SlotFlags, SlotId};

use super::plan::{KvmOp, Step};
use super::{region_slots, reserve, MemoryManager, Region, State, Target};
use crate::dirty::{mark_range, or_bits, DirtyPages};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::memory::RegionId;
use crate::GuestMemoryMap;
use crate::PAGE_SIZE;

impl<K: KvmMemory> MemoryManager<K> {
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
        // Ring mode: KVM reports only writes from now on; as with an initially-set log in
        // bitmap mode, the first harvest reports every page (room for the bits first).
        let initially_set = on && self.kvm.dirty_ring();
        if initially_set {
            for id in &ids {
                state.regions.get_mut(id).expect("listed above").pending()?;
            }
        }
        self.commit(&mut state, changes, &steps)?;
        if initially_set {
            for id in &ids {
                let region = state.regions.get_mut(id).expect("listed above");
                let pages = region.pages();
                mark_range(region.pending()?, 0, pages);
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
        // Room for the bits first: once KVM's log is read, nothing may fail before they are
        // kept (with manual protection KVM keeps them until cleared, but not without).
        region.pending()?;
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
        let first = (slot.gpa - region.gpa.0) / PAGE_SIZE;
        or_bits(region.pending()?, first, log, pages);
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

    /// Ring mode: moves every vCPU's published entries into the pending bits of the regions
    /// they name (slot ids resolved in `current`), then resets the rings so that KVM reports
    /// those pages again. A failure keeps every entry collected: in pending, or in the backlog
    /// the next collection starts with.
    pub(super) fn collect_rings(
        &self,
        state: &mut State,
        current: &GuestMemoryMap,
    ) -> Result<(), Error> {
        let mut entries = std::mem::take(&mut state.ring_backlog);
        let collected = self
            .kvm
            .collect_dirty_rings(&mut |slot, offset| entries.push((slot, offset)));
        if let Err(source) = collected {
            state.ring_backlog = entries;
            return Err(Error::DirtyRing {
                op: "collecting",
                source,
            });
        }
        for (i, &(number, offset)) in entries.iter().enumerate() {
            // The high half of the slot field is the address space, always 0 here.
            let slot = current
                .get(SlotId(number))
                .filter(|s| number >> 16 == 0 && offset < s.size() / PAGE_SIZE);
            let Some(slot) = slot else {
                state.stray_ring_entries += 1;
                continue;
            };
            let first = slot.payload().offset() / PAGE_SIZE;
            let Some(region) = state.regions.get_mut(&slot.payload().region()) else {
                state.stray_ring_entries += 1;
                continue;
            };
            match region.pending() {
                Ok(bits) => mark_range(bits, first + offset, 1),
                Err(e) => {
                    state.ring_backlog = entries[i..].to_vec();
                    return Err(e);
                }
            }
        }
        self.kvm
            .reset_dirty_rings()
            .map_err(|source| Error::DirtyRing {
                op: "resetting",
                source,
            })
    }

    /// Ring mode: collects the vCPUs' dirty rings into the regions' pending bits and resets
    /// them, as a vCPU's `KVM_EXIT_DIRTY_RING_FULL` asks; the next harvest reports the pages.
    /// Nothing to do in bitmap mode.
    pub fn collect_dirty_rings(&self) -> Result<(), Error> {
        if !self.kvm.dirty_ring() {
            return Ok(());
        }
        let mut state = self.state();
        let current = Arc::clone(state.current());
        self.collect_rings(&mut state, &current)
    }

    /// Keeps the log of the slot that `step` is about to free (no need to clear it in KVM).
    pub(super) fn read_freed_log(
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
        let ring = self.kvm.dirty_ring();
        if ring {
            self.collect_rings(&mut state, &current)?;
        }
        let mut log = Vec::new();
        for id in &ids {
            let region = state.regions.get_mut(id).expect("listed above");
            if region.flags.log_dirty && !ring {
                for slot in region_slots(&current, region) {
                    let slot = KvmSlot::from(slot.as_ref());
                    self.fetch_slot_log(*id, region, &slot, true, &mut log)?;
                }
            }
            region.pending()?;
            let vmm = region.memory.vmm_dirty_bitmap().get_and_reset();
            let pages = region.pages();
            or_bits(region.pending()?, 0, &vmm, pages);
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
                    // Sized by the loop above.
                    bitmap: std::mem::take(&mut region.pending),
                }
            })
            .collect())
    }
}

fn target_regions(state: &State, target: Target) -> Result<Vec<RegionId>, Error> {
    match target {
        Target::All => Ok(state.regions.keys().copied().collect()),
        Target::Region(id) if state.regions.contains_key(&id) => Ok(vec![id]),
        Target::Region(id) => Err(Error::UnknownRegion(id)),
    }
}
