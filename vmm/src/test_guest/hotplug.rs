//! The test guest's hotplug area (Firecracker's resource: total, block and slot sizes) and its
//! plan: which slots to map, unmap and discard to reach a requested size. Pure: the controller
//! (`controller/hotplug.rs`) carries the plan out through the memory manager and has the guest
//! check what it maps.

use kvm_memslots::RegionId;
use vm_memory::GuestAddress;

use crate::control::hotplug::{HotplugConfig, HotplugInfo};
use crate::control::ControllerError;
use crate::test_guest::snapshot::HotplugState;

const MIB: u64 = 1 << 20;

/// The hotplug area: its configuration and which of its slots are mapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugArea {
    /// As configured.
    pub config: HotplugConfig,
    /// Where the area starts.
    pub gpa: u64,
    /// Bytes per KVM slot.
    pub slot_size: u64,
    /// Plugged blocks, from the area's start.
    pub plugged_blocks: u64,
    /// The region of each mapped slot, by slot index.
    pub slots: Vec<Option<RegionId>>,
}

/// What a hotplug request takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugPlan {
    /// Plugged blocks once it is done.
    pub blocks: u64,
    /// Slots to map (index, guest address), in order.
    pub map: Vec<(usize, GuestAddress)>,
    /// Slots to unmap (index, region), in order.
    pub unmap: Vec<(usize, RegionId)>,
    /// Unplugged blocks inside a slot that stays mapped, to give back to the host.
    pub discard: Option<(GuestAddress, u64)>,
}

impl HotplugArea {
    /// Checks `config` for an area at `gpa` that must end at or below `limit` (where the guest
    /// reaches) and fit in `free_slots` KVM slots; returns the area, nothing plugged.
    pub fn new(
        config: HotplugConfig,
        gpa: u64,
        limit: u64,
        free_slots: usize,
    ) -> Result<Self, ControllerError> {
        let block = config.block_size_mib;
        let slot = config.slot_size_mib.unwrap_or(block);
        if block < 2 || !block.is_power_of_two() {
            return Err(ControllerError::bad(format!(
                "block_size_mib {block} must be a power of two of at least 2"
            )));
        }
        if slot == 0 || !slot.is_multiple_of(block) {
            return Err(ControllerError::bad(format!(
                "slot_size_mib {slot} must be a multiple of block_size_mib {block}"
            )));
        }
        if config.total_size_mib == 0 || !config.total_size_mib.is_multiple_of(slot) {
            return Err(ControllerError::bad(format!(
                "total_size_mib {} must be a non-zero multiple of slot_size_mib {slot}",
                config.total_size_mib
            )));
        }
        let total = config
            .total_size_mib
            .checked_mul(MIB)
            .filter(|t| gpa.checked_add(*t).is_some_and(|end| end <= limit))
            .ok_or_else(|| {
                ControllerError::bad(format!(
                    "total_size_mib {} does not fit below {limit:#x}, where the test guest reaches",
                    config.total_size_mib
                ))
            })?;
        let slots = total / (slot * MIB);
        if slots > free_slots as u64 {
            return Err(ControllerError::conflict(format!(
                "the hotplug area needs {slots} KVM slots; {free_slots} are free"
            )));
        }
        Ok(HotplugArea {
            config,
            gpa,
            slot_size: slot * MIB,
            plugged_blocks: 0,
            slots: vec![None; slots as usize],
        })
    }

    fn block_size(&self) -> u64 {
        self.config.block_size_mib * MIB
    }

    /// Blocks per KVM slot.
    pub fn blocks_per_slot(&self) -> u64 {
        self.slot_size / self.block_size()
    }

    /// Guest address of slot `i`.
    pub fn slot_gpa(&self, i: usize) -> GuestAddress {
        GuestAddress(self.gpa + i as u64 * self.slot_size)
    }

    /// The area's bookkeeping as a snapshot or a migration saves it.
    pub fn state(&self) -> HotplugState {
        HotplugState {
            config: self.config,
            plugged_blocks: self.plugged_blocks,
            mapped: self.slots.iter().map(Option::is_some).collect(),
        }
    }

    /// Slots mapped now.
    pub fn mapped_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// What to do to plug `requested_size_mib` of the area (a multiple of the block size, at
    /// most the total): map the slots that get their first block, unmap the slots left with
    /// none, and discard the unplugged blocks of the last slot that stays.
    pub fn plan(&self, requested_size_mib: u64) -> Result<HotplugPlan, ControllerError> {
        let block = self.config.block_size_mib;
        if !requested_size_mib.is_multiple_of(block)
            || requested_size_mib > self.config.total_size_mib
        {
            return Err(ControllerError::bad(format!(
                "requested_size_mib {requested_size_mib} must be a multiple of block_size_mib {block} no larger than total_size_mib {}",
                self.config.total_size_mib
            )));
        }
        let blocks = requested_size_mib / block;
        let per_slot = self.blocks_per_slot();
        let wanted = blocks.div_ceil(per_slot) as usize;
        let map = (0..wanted)
            .filter(|&i| self.slots[i].is_none())
            .map(|i| (i, self.slot_gpa(i)))
            .collect();
        let unmap = (wanted..self.slots.len())
            .filter_map(|i| self.slots[i].map(|id| (i, id)))
            .collect();
        let discard =
            (blocks < self.plugged_blocks && !blocks.is_multiple_of(per_slot)).then(|| {
                let from = self.gpa + blocks * self.block_size();
                let to = self.slot_gpa(wanted).0;
                (GuestAddress(from), to - from)
            });
        Ok(HotplugPlan {
            blocks,
            map,
            unmap,
            discard,
        })
    }

    /// After a plug or unplug stopped part-way (a failure, or a signal): plugged are the blocks
    /// of the slots mapped from the area's start, but never more than `limit` (what was
    /// requested on a plug, what was plugged before on an unplug). Returns the blocks plugged.
    pub fn settle(&mut self, limit: u64) -> u64 {
        let mapped = self.slots.iter().take_while(|s| s.is_some()).count() as u64;
        self.plugged_blocks = limit.min(mapped * self.blocks_per_slot());
        self.plugged_blocks
    }

    /// The area as `GET /hotplug/memory` reports it.
    pub fn info(&self) -> HotplugInfo {
        let block = self.config.block_size_mib;
        HotplugInfo {
            total_size_mib: self.config.total_size_mib,
            block_size_mib: block,
            slot_size_mib: self.slot_size / MIB,
            plugged_size_mib: self.plugged_blocks * block,
            requested_size_mib: self.plugged_blocks * block,
            guest_address: self.gpa,
            mapped_slots: self.mapped_slots(),
            last_busy: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ErrorKind;

    const GPA: u64 = 32 << 30;
    const LIMIT: u64 = 64 << 30;

    fn area(total: u64, block: u64, slot: Option<u64>) -> HotplugArea {
        let config = HotplugConfig {
            total_size_mib: total,
            block_size_mib: block,
            slot_size_mib: slot,
        };
        HotplugArea::new(config, GPA, LIMIT, 1000).unwrap()
    }

    /// Carries a plan out on the area as the controller does, with made-up region ids.
    fn apply(area: &mut HotplugArea, plan: &HotplugPlan) {
        for &(i, _) in &plan.map {
            area.slots[i] = Some(RegionId(100 + i as u64));
        }
        for &(i, _) in &plan.unmap {
            area.slots[i] = None;
        }
        area.plugged_blocks = plan.blocks;
    }

    #[test]
    fn configurations_are_checked_with_the_value_named() {
        let config = |total, block, slot| HotplugConfig {
            total_size_mib: total,
            block_size_mib: block,
            slot_size_mib: slot,
        };
        let refuse = |c, free| HotplugArea::new(c, GPA, LIMIT, free).unwrap_err();
        let e = refuse(config(64, 3, None), 100);
        assert_eq!(e.kind, ErrorKind::BadRequest);
        assert!(e.message.contains("block_size_mib 3"), "{e}");
        assert!(refuse(config(64, 1, None), 100)
            .message
            .contains("at least 2"));
        let e = refuse(config(64, 2, Some(5)), 100);
        assert!(e.message.contains("slot_size_mib 5"), "{e}");
        let e = refuse(config(30, 2, Some(8)), 100);
        assert!(e.message.contains("total_size_mib 30"), "{e}");
        assert!(refuse(config(0, 2, None), 100).message.contains("non-zero"));
        let e = refuse(config(64 << 10, 2, Some(1 << 10)), 100);
        assert!(e.message.contains("does not fit below 0x1000000000"), "{e}");
        let e = refuse(config(u64::MAX / 2 * 2, 2, None), u32::MAX as usize);
        assert_eq!(e.kind, ErrorKind::BadRequest, "{e}");
        let e = refuse(config(64, 2, None), 31);
        assert_eq!(e.kind, ErrorKind::Conflict);
        assert_eq!(
            e.message,
            "the hotplug area needs 32 KVM slots; 31 are free"
        );
        let a = HotplugArea::new(config(64, 2, Some(8)), GPA, LIMIT, 8).unwrap();
        assert_eq!(
            (a.slots.len(), a.slot_size, a.blocks_per_slot()),
            (8, 8 << 20, 4)
        );
        assert_eq!(
            area(64, 4, None).slot_size,
            4 << 20,
            "slots default to blocks"
        );
    }

    #[test]
    fn plugging_maps_only_slots_that_get_their_first_block() {
        let mut a = area(64, 2, Some(8));
        let plan = a.plan(10).unwrap();
        assert_eq!(plan.blocks, 5);
        assert_eq!(
            plan.map,
            vec![(0, GuestAddress(GPA)), (1, GuestAddress(GPA + (8 << 20)))]
        );
        assert!(plan.unmap.is_empty() && plan.discard.is_none());
        apply(&mut a, &plan);
        // More blocks inside slot 1: nothing to map.
        let plan = a.plan(16).unwrap();
        assert!(plan.map.is_empty() && plan.unmap.is_empty() && plan.discard.is_none());
        apply(&mut a, &plan);
        assert_eq!(a.info().plugged_size_mib, 16);
        assert_eq!(a.info().mapped_slots, 2);
        // The same size again: nothing at all.
        let same = a.plan(16).unwrap();
        assert_eq!(
            (same.map.len(), same.unmap.len(), same.discard),
            (0, 0, None)
        );
    }

    #[test]
    fn unplugging_unmaps_empty_slots_and_discards_the_rest_of_a_partial_one() {
        let mut a = area(64, 2, Some(8));
        let all = a.plan(64).unwrap();
        assert_eq!(all.map.len(), 8);
        apply(&mut a, &all);
        let plan = a.plan(10).unwrap();
        assert!(plan.map.is_empty());
        let unmapped: Vec<usize> = plan.unmap.iter().map(|&(i, _)| i).collect();
        assert_eq!(unmapped, vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(plan.unmap[0].1, RegionId(102));
        // Blocks 5..8 of slot 1 go back to the host; slot 1 stays.
        assert_eq!(
            plan.discard,
            Some((GuestAddress(GPA + (10 << 20)), 6 << 20))
        );
        apply(&mut a, &plan);
        // Down to a slot boundary: unmap only.
        let plan = a.plan(8).unwrap();
        assert_eq!(plan.unmap, vec![(1, RegionId(101))]);
        assert_eq!(plan.discard, None);
        apply(&mut a, &plan);
        let none = a.plan(0).unwrap();
        assert_eq!(none.unmap, vec![(0, RegionId(100))]);
        assert_eq!(none.blocks, 0);
    }

    #[test]
    fn requests_off_the_block_size_or_past_the_area_are_refused() {
        let a = area(64, 4, Some(8));
        for bad in [2, 6, 68] {
            let e = a.plan(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::BadRequest);
            assert!(
                e.message
                    .starts_with(&format!("requested_size_mib {bad} must be")),
                "{e}"
            );
        }
    }

    #[test]
    fn an_unplug_stopped_part_way_counts_only_the_leading_mapped_slots() {
        let mut a = area(32, 2, Some(8));
        let all = a.plan(32).unwrap();
        apply(&mut a, &all);
        // Unplugging to 2 MiB unmapped slots 1 and 2 in the plan's order, then slot 3 failed.
        a.slots[1] = None;
        a.slots[2] = None;
        assert_eq!(a.settle(a.plugged_blocks), 4);
        // Never more than before.
        a.plugged_blocks = 3;
        assert_eq!(a.settle(a.plugged_blocks), 3);
    }

    #[test]
    fn a_plug_stopped_part_way_counts_its_mapped_slots_up_to_the_request() {
        let mut a = area(32, 2, Some(8));
        let plan = a.plan(22).unwrap();
        assert_eq!(plan.map.len(), 3);
        // Two of the three slots were mapped when the signal came.
        for &(i, _) in &plan.map[..2] {
            a.slots[i] = Some(RegionId(i as u64));
        }
        assert_eq!(a.settle(plan.blocks), 8);
        assert_eq!(a.info().plugged_size_mib, 16);
        // All three: the request, not the third slot's last block.
        a.slots[2] = Some(RegionId(2));
        assert_eq!(a.settle(plan.blocks), 11);
    }
}
