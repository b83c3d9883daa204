//! Ring mode: collecting the vCPUs' dirty rings into the regions' pending bits, and resetting
//! them so that KVM reports the pages again.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use memslot_map::SlotId;

use super::MemoryManager;
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::memory::GuestSlotData;
use crate::GuestMemoryMap;
use crate::PAGE_SIZE;

impl<K: KvmMemory> MemoryManager<K> {
    /// Ring mode: moves every vCPU's published entries into the pending bits of the regions
    /// they name (slot ids resolved in the latest version), then resets
    /// the rings so that KVM reports those pages again. The entries are taken and attributed
    /// under the rings lock, so that no slot number is released (and maybe reused) in between:
    /// a change releases numbers only after its own drain, which waits for this one. A failed
    /// collection still attributes what it took; a failed reset keeps every entry (in pending).
    pub(super) fn collect_rings(&self) -> Result<(), Error> {
        let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let mut entries = Vec::new();
        let collected = self
            .kvm
            .collect_dirty_rings(&mut |slot, offset| entries.push((slot, offset)));
        // Loaded after the entries were taken: every slot an entry can name (one that existed
        // when the guest wrote, and whose number is not released yet) is in it, but for a
        // slot being added, whose region's pages are all pending already. (A change's drain
        // runs under the writer lock: this is then the version it is replacing.)
        // The version a change is making is read first: if it is gone by the time the
        // published one is read, that one holds its slots. A slot a re-slot is creating is in
        // it alone; no number names two slots across the two (a change's new slots take numbers
        // no published slot has).
        let making = self.in_flight().clone();
        let map = self.published();
        for &(number, offset) in &entries {
            let found = ring_slot(&map, number, offset)
                .or_else(|| making.as_deref().and_then(|m| ring_slot(m, number, offset)));
            match found {
                Some(slot) => {
                    let first = slot.payload().offset() / PAGE_SIZE;
                    slot.payload().pending().mark(first + offset, 1);
                }
                None => {
                    self.stray_ring_entries.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let lost = collected.as_ref().is_ok_and(|c| c.lost);
        if lost {
            self.ring_overflows.fetch_add(1, Ordering::Relaxed);
        }
        if lost || self.ring_overflows.load(Ordering::Relaxed) > 0 {
            // Entries were written over: which pages they named is unknown, and KVM will not
            // report those pages again (they stay unprotected), so from now on every page of
            // every logging slot counts as dirty in every collection, for every consumer.
            for slot in map.iter().filter(|s| s.flags().log_dirty) {
                let first = slot.payload().offset() / PAGE_SIZE;
                slot.payload()
                    .pending()
                    .mark(first, slot.size() / PAGE_SIZE);
            }
        }
        drop(rings);
        let collected = collected.map_err(|source| Error::DirtyRing {
            op: "collecting",
            source,
        })?;
        // With nothing collected there is nothing to reset, unless an earlier reset failed (or
        // another collector's is still to come, which that collector does itself).
        if collected.entries == 0 && !self.ring_reset_owed.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.ring_reset_owed.store(true, Ordering::SeqCst);
        self.kvm
            .reset_dirty_rings()
            .map_err(|source| Error::DirtyRing {
                op: "resetting",
                source,
            })?;
        self.ring_reset_owed.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Ring mode: how many collections found a dirty ring overflowed. KVM keeps a ring from
    /// filling by asking for a ring-full exit (`KVM_EXIT_DIRTY_RING_FULL`) at a soft limit
    /// below its size, and the vCPU pushes on until that exit; a host whose instruction
    /// emulator pushes a batch of guest writes without exiting (this project's kvm_pvm host,
    /// for guest kernel code) can push past the ring's end and write over entries. Entries past
    /// the soft limit that still fit are no overflow. The manager notices a wrap (as many
    /// entries since the last reset as the ring holds, or entries out of step with its fetch
    /// index, which it then follows again so that the vCPU does not livelock on ring-full
    /// exits), and from the first overflow on reports
    /// every page of every logging slot in every harvest, for every consumer: pages whose
    /// entries were lost stay unprotected in KVM and would never be reported again. Never a
    /// lost page; a VMM seeing this count grow should stop using ring mode for that guest.
    pub fn dirty_ring_overflows(&self) -> u64 {
        self.ring_overflows.load(Ordering::Relaxed)
    }

    /// Ring mode: collects the vCPUs' dirty rings into the regions' pending bits and resets
    /// them, as a vCPU's `KVM_EXIT_DIRTY_RING_FULL` asks; the next harvest reports the pages.
    /// Nothing to do in bitmap mode. Takes neither the writer lock nor the harvests' lock.
    ///
    /// # KVM calls
    ///
    /// Bitmap mode: none. Ring mode: a ring drain (see [`MemoryManager`]): every vCPU's ring
    /// read from its mapping and each entry handed back (no syscall), then one
    /// `KVM_RESET_DIRTY_RINGS`, unless nothing was collected and no earlier reset failed.
    /// Nothing to undo: what was collected stays in the pending bits; a failed collection
    /// skips the reset.
    pub fn collect_dirty_rings(&self) -> Result<(), Error> {
        if !self.kvm.dirty_ring() {
            return Ok(());
        }
        self.collect_rings()
    }
}

/// The slot a ring entry names in `map`, if the page it names is inside it.
fn ring_slot(map: &GuestMemoryMap, number: u32, offset: u64) -> Option<&Arc<GuestSlotData>> {
    // The high half of the slot field is the address space, always 0 here.
    map.get(SlotId(number))
        .filter(|s| number >> 16 == 0 && offset < s.size() / PAGE_SIZE)
}
