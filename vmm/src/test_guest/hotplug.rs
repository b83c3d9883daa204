//! The test guest's hotplug area (Firecracker's resource: total, block and slot sizes) and its
//! plan: which pieces of it to add, re-slot and remove to reach a requested size. A piece is
//! one slot size of the area; while it has a plugged block it is a region of the manager whose
//! one KVM slot covers exactly its plugged blocks (`kvm_virtio_mem::mem::plugged_runs`, the
//! planner virtio-mem uses), so no slot is ever behind unplugged memory. Pure: the controller
//! (`controller/hotplug.rs`) carries the plan out through the memory manager, as one change,
//! and has the guest check the memory it plugs.

use std::ops::Range;

use kvm_memslots::{RegionChange, RegionId};
use kvm_virtio_mem::mem::{piece_change, plugged_runs};
use vm_memory::GuestAddress;

use crate::control::hotplug::{HotplugConfig, HotplugInfo};
use crate::control::ControllerError;
use crate::test_guest::snapshot::HotplugState;

const MIB: u64 = 1 << 20;

/// The hotplug area: its configuration and the region of each piece with plugged blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugArea {
    /// As configured.
    pub config: HotplugConfig,
    /// Where the area starts.
    pub gpa: u64,
    /// Bytes per piece: the largest KVM slot the area's plugged blocks share.
    pub slot_size: u64,
    /// Plugged blocks, from the area's start.
    pub plugged_blocks: u64,
    /// The region of each piece that has a plugged block, by piece index.
    pub pieces: Vec<Option<RegionId>>,
}

/// What a hotplug request takes: the pieces whose plugged blocks change, lowest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugPlan {
    /// Plugged blocks once it is done.
    pub blocks: u64,
    /// The pieces that change.
    pub pieces: Vec<PieceChange>,
}

/// One piece of a plan: how many of its bytes are plugged before and after, and its slots
/// after (none where nothing stays plugged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceChange {
    /// The piece's index in the area.
    pub index: usize,
    /// Its guest address.
    pub gpa: GuestAddress,
    /// Its region now, if a block of it is plugged.
    pub region: Option<RegionId>,
    /// Bytes plugged from its start now.
    pub before: u64,
    /// Bytes plugged from its start once the plan is carried out.
    pub after: u64,
    /// Its slots then, as byte ranges of the piece: the runs of its plugged blocks.
    pub slots: Vec<Range<u64>>,
}

impl PieceChange {
    /// Guest addresses the plan plugs in this piece (on a plug), which the guest checks.
    pub fn plugged(&self) -> Option<Range<u64>> {
        (self.after > self.before).then(|| self.gpa.0 + self.before..self.gpa.0 + self.after)
    }

    /// Bytes of the piece (offsets) the plan unplugs while the piece stays, to give back to
    /// the host.
    pub fn given_back(&self) -> Option<Range<u64>> {
        (0 < self.after && self.after < self.before).then_some(self.after..self.before)
    }
}

impl HotplugArea {
    /// Checks `config` for an area at `gpa` that must end at or below `limit` (where the guest
    /// reaches) and fit in `free_slots` KVM slots (KVM's free ones within the slot budget);
    /// returns the area, nothing plugged.
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
        let pieces = total / (slot * MIB);
        if pieces > free_slots as u64 {
            return Err(ControllerError::conflict(format!(
                "the hotplug area needs {pieces} KVM slots; {free_slots} are free (in KVM and \
                 within the slot budget, --max-slots)"
            )));
        }
        Ok(HotplugArea {
            config,
            gpa,
            slot_size: slot * MIB,
            plugged_blocks: 0,
            pieces: vec![None; pieces as usize],
        })
    }

    /// Bytes per block.
    pub fn block_size(&self) -> u64 {
        self.config.block_size_mib * MIB
    }

    /// The guest addresses the area takes.
    pub fn range(&self) -> Range<u64> {
        self.gpa..self.gpa + self.pieces.len() as u64 * self.slot_size
    }

    /// Blocks per piece.
    pub fn blocks_per_slot(&self) -> u64 {
        self.slot_size / self.block_size()
    }

    /// Guest address of piece `i`.
    pub fn slot_gpa(&self, i: usize) -> GuestAddress {
        GuestAddress(self.gpa + i as u64 * self.slot_size)
    }

    /// The slots of piece `i` with `blocks` plugged in the area (from its start): one over the
    /// piece's plugged blocks, none if it has none.
    pub fn piece_slots(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        let per_piece = self.blocks_per_slot();
        let first = i as u64 * per_piece;
        let plugged = (first..first + per_piece).map(|b| b < blocks);
        plugged_runs(plugged, self.block_size())
    }

    /// The area's bookkeeping as a snapshot or a migration saves it.
    pub fn state(&self) -> HotplugState {
        HotplugState {
            config: self.config,
            plugged_blocks: self.plugged_blocks,
            mapped: self.pieces.iter().map(Option::is_some).collect(),
        }
    }

    /// Pieces mapped now: one KVM slot each.
    pub fn mapped_slots(&self) -> usize {
        self.pieces.iter().filter(|s| s.is_some()).count()
    }

    /// What to do to plug `requested_size_mib` of the area (a multiple of the block size, at
    /// most the total).
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
        Ok(self.plan_blocks(requested_size_mib / block))
    }

    /// What to do to have `blocks` plugged (at most the area's blocks): every piece whose
    /// plugged bytes change gets the slots of its plugged blocks then.
    pub fn plan_blocks(&self, blocks: u64) -> HotplugPlan {
        let per_piece = self.blocks_per_slot();
        let block = self.block_size();
        let in_piece = |i: usize, blocks: u64| {
            blocks.saturating_sub(i as u64 * per_piece).min(per_piece) * block
        };
        let pieces = (0..self.pieces.len())
            .filter_map(|i| {
                let (before, after) = (in_piece(i, self.plugged_blocks), in_piece(i, blocks));
                (before != after).then(|| PieceChange {
                    index: i,
                    gpa: self.slot_gpa(i),
                    region: self.pieces[i],
                    before,
                    after,
                    slots: self.piece_slots(i, blocks),
                })
            })
            .collect();
        HotplugPlan { blocks, pieces }
    }

    /// The manager's changes that carry `plan` out, in one batch.
    pub fn changes(&self, plan: &HotplugPlan) -> Vec<RegionChange> {
        plan.pieces
            .iter()
            .map(|p| piece_change(p.region, p.gpa, self.slot_size, p.slots.clone()))
            .collect()
    }

    /// Records `plan` as carried out: `added` are the regions the manager gave the pieces
    /// that had none, in order.
    pub fn commit(&mut self, plan: &HotplugPlan, added: Vec<RegionId>) {
        let mut added = added.into_iter();
        for piece in &plan.pieces {
            self.pieces[piece.index] = match (piece.region, piece.after) {
                (_, 0) => None,
                (Some(region), _) => Some(region),
                (None, _) => added.next(),
            };
        }
        self.plugged_blocks = plan.blocks;
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
// Slot layouts are lists of ranges, one range long as often as not.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use std::collections::BTreeMap;

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

    /// The manager as the plans see it: each region's guest address and slots (guest ranges).
    #[derive(Default)]
    struct Model {
        regions: BTreeMap<RegionId, (u64, Vec<Range<u64>>)>,
        next: u64,
    }

    impl Model {
        /// Carries `plan` out as the manager would its changes, then commits it on `area`.
        fn carry_out(&mut self, area: &mut HotplugArea, plan: &HotplugPlan) {
            let mut added = Vec::new();
            for change in area.changes(plan) {
                match change {
                    RegionChange::Add(spec) => {
                        assert_eq!(spec.size, area.slot_size, "a piece is one slot size");
                        let id = RegionId(100 + self.next);
                        self.next += 1;
                        let slots = spec.slot_ranges.expect("a piece names its slots");
                        self.regions.insert(id, (spec.gpa.0, slots));
                        added.push(id);
                    }
                    RegionChange::Reslot(reslot) => {
                        assert_eq!(reslot.range, 0..area.slot_size, "the whole piece");
                        let region = self.regions.get_mut(&reslot.region).expect("known");
                        region.1 = reslot.slots;
                    }
                    RegionChange::Remove(id) => {
                        self.regions.remove(&id).expect("known");
                    }
                }
            }
            area.commit(plan, added);
        }

        /// Guest ranges with a KVM slot, lowest first.
        fn slotted(&self) -> Vec<Range<u64>> {
            let mut all: Vec<Range<u64>> = self
                .regions
                .values()
                .flat_map(|(gpa, slots)| slots.iter().map(move |s| gpa + s.start..gpa + s.end))
                .collect();
            all.sort_by_key(|r| r.start);
            all
        }
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
            "the hotplug area needs 32 KVM slots; 31 are free (in KVM and within the slot \
             budget, --max-slots)"
        );
        let a = HotplugArea::new(config(64, 2, Some(8)), GPA, LIMIT, 8).unwrap();
        assert_eq!(
            (a.pieces.len(), a.slot_size, a.blocks_per_slot()),
            (8, 8 << 20, 4)
        );
        assert_eq!(
            area(64, 4, None).slot_size,
            4 << 20,
            "slots default to blocks"
        );
    }

    #[test]
    fn a_plug_adds_pieces_with_slots_over_their_plugged_blocks_only() {
        let mut a = area(64, 2, Some(8));
        let mut model = Model::default();
        let plan = a.plan(10).unwrap();
        assert_eq!(plan.blocks, 5);
        assert_eq!(
            plan.pieces,
            vec![
                PieceChange {
                    index: 0,
                    gpa: GuestAddress(GPA),
                    region: None,
                    before: 0,
                    after: 8 << 20,
                    slots: vec![0..8 << 20],
                },
                PieceChange {
                    index: 1,
                    gpa: GuestAddress(GPA + (8 << 20)),
                    region: None,
                    before: 0,
                    after: 2 << 20,
                    slots: vec![0..2 << 20],
                },
            ]
        );
        model.carry_out(&mut a, &plan);
        assert_eq!(
            model.slotted(),
            vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
        );
        // More blocks inside piece 1: its slot grows, over the new blocks, which the guest
        // checks.
        let plan = a.plan(16).unwrap();
        assert_eq!(plan.pieces.len(), 1);
        let grow = &plan.pieces[0];
        assert_eq!((grow.index, grow.region), (1, Some(RegionId(101))));
        assert_eq!(grow.plugged(), Some(GPA + (10 << 20)..GPA + (16 << 20)));
        assert_eq!(grow.given_back(), None);
        assert!(matches!(a.changes(&plan)[..], [RegionChange::Reslot(_)]));
        model.carry_out(&mut a, &plan);
        assert_eq!(a.info().plugged_size_mib, 16);
        assert_eq!(a.info().mapped_slots, 2);
        // The same size again: nothing at all.
        assert!(a.plan(16).unwrap().pieces.is_empty());
    }

    #[test]
    fn an_unplug_removes_emptied_pieces_and_shrinks_the_slot_of_a_partial_one() {
        let mut a = area(64, 2, Some(8));
        let mut model = Model::default();
        let all = a.plan(64).unwrap();
        assert_eq!(all.pieces.len(), 8);
        model.carry_out(&mut a, &all);
        let plan = a.plan(10).unwrap();
        let indices: Vec<usize> = plan.pieces.iter().map(|p| p.index).collect();
        assert_eq!(indices, vec![1, 2, 3, 4, 5, 6, 7]);
        // Blocks 5..8 of piece 1 lose their slot and go back to the host; the piece stays.
        assert_eq!(plan.pieces[0].given_back(), Some(2 << 20..8 << 20));
        assert_eq!(plan.pieces[0].plugged(), None);
        let changes = a.changes(&plan);
        assert!(matches!(changes[0], RegionChange::Reslot(ref r) if r.slots == vec![0..2 << 20]));
        assert!(changes[1..]
            .iter()
            .all(|c| matches!(c, RegionChange::Remove(_))));
        assert_eq!(
            plan.pieces[1].given_back(),
            None,
            "a removed piece goes whole"
        );
        model.carry_out(&mut a, &plan);
        assert_eq!(
            model.slotted(),
            vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
        );
        // Down to a piece boundary: piece 1 goes.
        let plan = a.plan(8).unwrap();
        assert!(matches!(
            a.changes(&plan)[..],
            [RegionChange::Remove(RegionId(101))]
        ));
        model.carry_out(&mut a, &plan);
        let none = a.plan(0).unwrap();
        assert!(matches!(
            a.changes(&none)[..],
            [RegionChange::Remove(RegionId(100))]
        ));
        model.carry_out(&mut a, &none);
        assert_eq!((a.plugged_blocks, a.mapped_slots()), (0, 0));
        assert!(model.regions.is_empty());
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

    /// A sequence of sizes up and down, with every piece size from the block to the area: the
    /// slots are exactly the plugged memory (none behind an unplugged block), one per piece
    /// with a plugged block, and a plan back undoes a plan (what a failed check or a signal
    /// does).
    #[test]
    fn every_sequence_keeps_slots_exactly_over_the_plugged_blocks() {
        let block = 2;
        for slot in [2, 4, 8, 16, 32] {
            let mut a = area(32, block, Some(slot));
            let mut model = Model::default();
            let sizes = [6, 32, 0, 2, 30, 14, 16, 18, 4, 32, 10, 0];
            for (step, &size) in sizes.iter().enumerate() {
                let before = a.plugged_blocks;
                let plan = a.plan(size).unwrap();
                model.carry_out(&mut a, &plan);
                let plugged = size << 20;
                let wanted: Vec<Range<u64>> = (0..plugged)
                    .step_by((slot << 20) as usize)
                    .map(|start| GPA + start..GPA + (start + (slot << 20)).min(plugged))
                    .collect();
                let context = format!("slot {slot} MiB, step {step}: {size} MiB");
                assert_eq!(model.slotted(), wanted, "{context}");
                assert_eq!(a.mapped_slots(), wanted.len(), "{context}");
                assert_eq!(model.regions.len(), wanted.len(), "{context}");
                // Going back and forth again leaves the same slots.
                let back = a.plan_blocks(before);
                model.carry_out(&mut a, &back);
                let again = a.plan(size).unwrap();
                model.carry_out(&mut a, &again);
                assert_eq!(
                    model.slotted(),
                    wanted,
                    "{context}, after an undo and a redo"
                );
            }
        }
    }
}
