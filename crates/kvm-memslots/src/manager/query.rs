//! Questions that change nothing: host-address lookup, the regions, slot usage, memory use.

use memslot_map::{HostAddress, SlotId};

use super::{HvaMatch, MemoryManager, Region, RegionInfo, SlotUsage};
use crate::kvm::KvmMemory;

impl<K: KvmMemory> MemoryManager<K> {
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
        let map = state.current();
        state
            .regions
            .iter()
            .map(|(id, r)| RegionInfo {
                id: *id,
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
            })
            .collect()
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
