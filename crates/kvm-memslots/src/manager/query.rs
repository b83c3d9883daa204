//! Questions that change nothing: host-address lookup, the regions, slot usage, memory use.

use std::ops::Range;
use std::sync::Arc;

use memslot_map::{HostAddress, SlotId};

use super::{region_slots, HvaMatch, MemoryManager, Region, RegionId, RegionInfo, SlotUsage};
use crate::kvm::KvmMemory;
use crate::region_memory::{split_by, RegionMemory};

impl<K: KvmMemory> MemoryManager<K> {
    /// Every guest address that host address `hva` backs (several where slots alias one host
    /// range), through the map's host-address index.
    pub fn find_by_hva(&self, hva: HostAddress) -> Vec<HvaMatch> {
        let current = self.published();
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

    /// The first guest address in `[start, end)` the guest cannot use as memory: one with no
    /// slot (a hole, as `MemslotMap::first_hole` finds) or one a region keeps unreachable under
    /// its slot ([`set_accessible`](Self::set_accessible)); `None` if it is all memory.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec};
    /// use vm_memory::GuestAddress;
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(8, true));
    /// let id = memory.add_region(RegionSpec::new(GuestAddress(0x10_0000), 0x4000)).unwrap();
    /// assert_eq!(memory.first_unreachable(0x10_0000, 0x10_4000), None);
    /// memory.set_accessible(id, &[0x2000..0x3000], false).unwrap();
    /// assert_eq!(memory.first_unreachable(0x10_0000, 0x10_4000), Some(0x10_2000));
    /// assert_eq!(memory.first_unreachable(0x10_3000, 0x10_5000), Some(0x10_4000));
    /// ```
    pub fn first_unreachable(&self, start: u64, end: u64) -> Option<u64> {
        let map = self.load();
        let hole = map.first_hole(start, end);
        let limit = hole.unwrap_or(end);
        for slot in map.iter_from_gpa(vm_memory::GuestAddress(start)) {
            let range = slot.gpa_range();
            if range.start >= limit {
                break;
            }
            let (from, to) = (range.start.max(start), range.end.min(limit));
            let offset = slot.payload().offset() + (from - range.start);
            let access = slot.payload().memory().access();
            let unreachable = split_by(offset..offset + (to - from), access.inaccessible())
                .into_iter()
                .find(|(_, accessible)| !accessible);
            if let Some((part, _)) = unreachable {
                return Some(from + (part.start - offset));
            }
        }
        hole
    }

    /// The regions, by id.
    pub fn regions(&self) -> Vec<RegionInfo> {
        let state = self.state();
        let map = state.current();
        state
            .regions
            .iter()
            .map(|(id, r)| region_info(*id, r, map))
            .collect()
    }

    /// Region `id`, if there is one: [`regions`](Self::regions)' entry for it, found without
    /// listing the others.
    pub fn region(&self, id: RegionId) -> Option<RegionInfo> {
        let state = self.state();
        let map = state.current();
        state.regions.get(&id).map(|r| region_info(id, r, map))
    }

    /// The KVM slot numbers of region `id`, in the order of their offsets in the region (slot
    /// `i` maps bytes `i * slot_size ..` of it, unless the region was given other slots:
    /// [`slot_ranges`](Self::slot_ranges) says which), or `None` if there is no such region. A region
    /// keeps its slot numbers while its slots stay as they are: moves and read-only toggles
    /// re-create its KVM slots under the same numbers; a re-slot
    /// ([`reslot`](Self::reslot)) gives new slots new numbers and keeps those of slots it keeps.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{MemoryManager, RegionSpec, SlotId};
    /// use vm_memory::GuestAddress;
    ///
    /// let manager = MemoryManager::new(FakeKvm::new(16, true));
    /// // 3 MiB in 1 MiB slots: three KVM slots.
    /// let spec = RegionSpec::new(GuestAddress(0), 3 << 20).with_slot_size(1 << 20);
    /// let region = manager.add_region(spec)?;
    /// assert_eq!(manager.region_slots(region), Some(vec![SlotId(0), SlotId(1), SlotId(2)]));
    /// manager.remove_region(region)?;
    /// assert_eq!(manager.region_slots(region), None);
    /// # Ok::<(), kvm_memslots::Error>(())
    /// ```
    pub fn region_slots(&self, id: RegionId) -> Option<Vec<SlotId>> {
        self.state().regions.get(&id).map(|r| r.slots.clone())
    }

    /// The slots of region `id` as byte ranges of it, in offset order (what lies between them
    /// is a hole: no slot, no guest memory), or `None` if there is no such region. Slot `i`
    /// has the `i`-th number of [`region_slots`](Self::region_slots).
    pub fn slot_ranges(&self, id: RegionId) -> Option<Vec<Range<u64>>> {
        let state = self.state();
        let region = state.regions.get(&id)?;
        let slots = region_slots(state.current(), region);
        Some(
            slots
                .iter()
                .map(|s| s.payload().offset()..s.payload().offset() + s.size())
                .collect(),
        )
    }

    /// The host memory of region `id` (its whole mapping, holes included), or `None` if there
    /// is no such region: for a VMM that saves or sends a region's memory whatever its slots.
    pub fn region_memory(&self, id: RegionId) -> Option<Arc<RegionMemory>> {
        self.state().regions.get(&id).map(|r| Arc::clone(&r.memory))
    }

    /// KVM slot numbers in use and free.
    pub fn slot_usage(&self) -> SlotUsage {
        let state = self.state();
        SlotUsage {
            used: state.ids.used(),
            free: state.ids.available(),
            reserved: (self.kvm.max_slots() - state.ids.limit) as usize,
            max: self.kvm.max_slots() as usize,
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

/// Region `r` (id `id`) as [`MemoryManager::regions`] reports it, its slot size read from `map`.
fn region_info(
    id: RegionId,
    r: &Region,
    map: &memslot_map::MemslotMap<super::SlotBacking>,
) -> RegionInfo {
    RegionInfo {
        id,
        gpa: r.gpa,
        size: r.size,
        hva: HostAddress(r.memory.host_address()),
        slots: r.slots.len(),
        // A region's first slot has the full slot size.
        slot_size: r
            .slots
            .first()
            .and_then(|s| map.get(*s))
            .map_or(r.size, |s| s.size()),
        flags: r.flags,
        shared: r.memory.is_shared(),
        page_size: r.memory.page_size(),
    }
}
