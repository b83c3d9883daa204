//! The test guest's hotplug area (Firecracker's resource: total, block and slot sizes) and its
//! plan: which pieces of it to add and remove, and which blocks to make reachable or
//! unreachable, to reach a requested size. A piece is one slot size of the area; while it has a
//! plugged block it is a region of the manager with one KVM slot over the whole piece, its
//! unplugged blocks unreachable under it (`MemoryManager::set_accessible`, as the virtio-mem
//! device keeps its pieces), so that a plug or unplug inside it changes no slot. The plan is
//! pure; [`HotplugArea::carry_out`] applies it through the memory manager, all or nothing, and
//! the controller (`controller/hotplug.rs`) has the guest check the memory it plugs. The area
//! keeps its own saved state ([`HotplugState`], what a snapshot or a migration carries of it)
//! and checks it against a memory layout.

use std::ops::Range;

use kvm_memslots::{KvmMemory, MemoryManager, RegionChange, RegionId, RegionSpec};
use kvm_memslots_persist::MemoryLayout;
use kvm_virtio_mem::mem::plugged_runs;
use serde::{Deserialize, Serialize};
use vm_memory::GuestAddress;

use crate::control::hotplug::{HotplugConfig, HotplugInfo};
use crate::control::ControllerError;
use crate::test_guest::{HOTPLUG_GPA, IDENTITY_MAPPED};

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

/// One piece of a plan: how many of its bytes are plugged before and after, its slots after
/// (one over the piece, none where nothing stays plugged) and what of it is unreachable then.
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
    /// Its slots then, as byte ranges of the piece: the whole piece while a block of it is
    /// plugged.
    pub slots: Vec<Range<u64>>,
    /// Its unplugged blocks then, as byte ranges of the piece, unreachable under its slot.
    pub unreachable: Vec<Range<u64>>,
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
    /// whole piece, none if it has no plugged block.
    pub fn piece_slots(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        if self.piece_runs(i, blocks).is_empty() {
            return Vec::new();
        }
        std::iter::once(0..self.slot_size).collect()
    }

    /// The runs of piece `i`'s plugged blocks with `blocks` plugged in the area: its slots in
    /// states saved before pieces kept one slot (none if it has no plugged block).
    pub fn piece_runs(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        let per_piece = self.blocks_per_slot();
        let first = i as u64 * per_piece;
        let plugged = (first..first + per_piece).map(|b| b < blocks);
        plugged_runs(plugged, self.block_size())
    }

    /// The byte ranges of piece `i` unreachable under its slot with `blocks` plugged in the
    /// area: its unplugged blocks, if it has a plugged one (none otherwise: no slot at all).
    pub fn piece_unreachable(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        let per_piece = self.blocks_per_slot();
        let first = i as u64 * per_piece;
        if blocks <= first {
            return Vec::new();
        }
        let unplugged = (first..first + per_piece).map(|b| b >= blocks);
        plugged_runs(unplugged, self.block_size())
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
                    unreachable: self.piece_unreachable(i, blocks),
                })
            })
            .collect();
        HotplugPlan { blocks, pieces }
    }

    /// The manager's changes that carry `plan` out, in one batch: a piece's first plugged
    /// block adds it (one slot over it, the rest of it unreachable from the start), its last
    /// unplugged block removes it. A piece that stays changes no slot: see
    /// [`flips`](Self::flips).
    pub fn changes(&self, plan: &HotplugPlan) -> Vec<RegionChange> {
        plan.pieces
            .iter()
            .filter_map(|p| match (p.region, p.after) {
                (None, _) => Some(RegionChange::Add(
                    RegionSpec::new(p.gpa, self.slot_size)
                        .with_slot_ranges(p.slots.clone())
                        .with_inaccessible(p.unreachable.clone())
                        .with_page_size(self.config.page_size.into()),
                )),
                (Some(region), 0) => Some(RegionChange::Remove(region)),
                (Some(_), _) => None,
            })
            .collect()
    }

    /// The reachability changes that carry `plan` out in pieces that stay: each as the region,
    /// the byte range of it, and whether it becomes reachable (a plug) or not (an unplug).
    pub fn flips(&self, plan: &HotplugPlan) -> Vec<(RegionId, Range<u64>, bool)> {
        plan.pieces
            .iter()
            .filter_map(|p| match (p.region, p.after) {
                (Some(region), after) if after > p.before => Some((region, p.before..after, true)),
                (Some(region), after) if after > 0 => Some((region, after..p.before, false)),
                _ => None,
            })
            .collect()
    }

    /// Carries `plan` out through `memory`, all or nothing: the pieces that stay get their
    /// blocks' reachability changed (no KVM call), then the pieces added or removed are one
    /// change of the manager; if either is refused, the reachability changes are put back and
    /// the error returned. Then the blocks it unplugged in pieces that stay are given back to
    /// the host: best effort, whose failures are returned (the blocks are unplugged and
    /// unreachable whatever madvise says).
    pub fn carry_out<K: KvmMemory>(
        &mut self,
        memory: &MemoryManager<K>,
        plan: &HotplugPlan,
    ) -> Result<Vec<kvm_memslots::Error>, kvm_memslots::Error> {
        let flips = self.flips(plan);
        let undo = |done: &[(RegionId, Range<u64>, bool)]| {
            for (region, range, reachable) in done {
                let _ = memory.set_accessible(*region, std::slice::from_ref(range), !reachable);
            }
        };
        for (done, (region, range, reachable)) in flips.iter().enumerate() {
            if let Err(e) = memory.set_accessible(*region, std::slice::from_ref(range), *reachable)
            {
                undo(&flips[..done]);
                return Err(e);
            }
        }
        let changes = self.changes(plan);
        let added = if changes.is_empty() {
            Vec::new()
        } else {
            memory.apply(changes).inspect_err(|_| undo(&flips))?
        };
        self.commit(plan, added);
        let mut failures = Vec::new();
        for piece in &plan.pieces {
            if let (Some(range), Some(region)) = (piece.given_back(), self.pieces[piece.index]) {
                if let Err(e) = memory.discard_region(region, range) {
                    failures.push(e);
                }
            }
        }
        Ok(failures)
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
            page_size: self.config.page_size,
            mapped_slots: self.mapped_slots(),
            last_busy: None,
        }
    }
}

/// The hotplug area's bookkeeping: its configuration, the blocks plugged, and which of its
/// slots are mapped (their regions are in the layout).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugState {
    /// As configured.
    pub config: HotplugConfig,
    /// Plugged blocks, from the area's start.
    pub plugged_blocks: u64,
    /// Whether each slot of the area is mapped.
    pub mapped: Vec<bool>,
}

impl HotplugState {
    /// Checks the area against itself and `layout`: a configuration the API would accept,
    /// one `mapped` entry per piece (slot size) of the area, no more plugged blocks than the
    /// area has, exactly the pieces those blocks need mapped, and each mapped piece (and
    /// nothing else) a region of the layout there with one slot over the whole piece, or (a
    /// version 3 state, written when pieces had holes) slots over its plugged blocks only: the
    /// restore gives it its one slot back and makes its unplugged blocks unreachable.
    pub fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
        let area = HotplugArea::new(self.config, HOTPLUG_GPA, IDENTITY_MAPPED, usize::MAX)
            .map_err(|e| format!("the hotplug area: {e}"))?;
        let slots = area.pieces.len();
        if self.mapped.len() != slots {
            return Err(format!(
                "the hotplug area has {slots} slots, but `mapped` lists {}",
                self.mapped.len()
            ));
        }
        let per_slot = area.blocks_per_slot();
        let blocks = slots as u64 * per_slot;
        if self.plugged_blocks > blocks {
            return Err(format!(
                "the hotplug area's plugged_blocks {} is more than its {blocks} blocks",
                self.plugged_blocks
            ));
        }
        let wanted = self.plugged_blocks.div_ceil(per_slot) as usize;
        if let Some(i) = (0..slots).find(|&i| self.mapped[i] != (i < wanted)) {
            return Err(format!(
                "the hotplug area's slot {i} is {}mapped in `mapped`, but plugged_blocks {} maps \
                 slots 0..{wanted}",
                if self.mapped[i] { "" } else { "not " },
                self.plugged_blocks
            ));
        }
        let end = area.range().end;
        for region in layout
            .regions
            .iter()
            .filter(|r| r.gpa < end && area.gpa < r.gpa.saturating_add(r.size))
        {
            let slot = (region.gpa - area.gpa.min(region.gpa)) / area.slot_size;
            let is_slot = region.gpa >= area.gpa
                && region.gpa == area.slot_gpa(slot as usize).0
                && region.size == area.slot_size;
            if !is_slot || !self.mapped[slot as usize] {
                return Err(format!(
                    "the layout's region at {:#x} ({} bytes) is inside the hotplug area but not \
                     one of its mapped slots",
                    region.gpa, region.size
                ));
            }
            let (slots, wanted, runs) = (
                region.slots(),
                area.piece_slots(slot as usize, self.plugged_blocks),
                area.piece_runs(slot as usize, self.plugged_blocks),
            );
            if slots != wanted && slots != runs {
                return Err(format!(
                    "the layout's region at {:#x} has slots {slots:x?}; the hotplug area's \
                     plugged blocks there need {wanted:x?}",
                    region.gpa
                ));
            }
        }
        if let Some(i) = (0..wanted).find(|&i| {
            let gpa = area.slot_gpa(i).0;
            !layout
                .regions
                .iter()
                .any(|r| r.gpa == gpa && r.size == area.slot_size)
        }) {
            return Err(format!(
                "the hotplug area's mapped slot {i} at {:#x} is not a region of the layout",
                area.slot_gpa(i).0
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
// Slot layouts are lists of ranges, one range long as often as not.
#[allow(clippy::single_range_in_vec_init)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::control::ErrorKind;
    use kvm_memslots::testing::FakeKvm;

    const GPA: u64 = 32 << 30;
    const LIMIT: u64 = 64 << 30;

    fn area(total: u64, block: u64, slot: Option<u64>) -> HotplugArea {
        let config = HotplugConfig {
            total_size_mib: total,
            block_size_mib: block,
            slot_size_mib: slot,
            page_size: Default::default(),
        };
        HotplugArea::new(config, GPA, LIMIT, 1000).unwrap()
    }

    /// A region as the plans see it: its guest address, its slots and its unreachable byte
    /// ranges.
    type Piece = (u64, Vec<Range<u64>>, Vec<Range<u64>>);

    /// The manager as the plans see it.
    #[derive(Default)]
    struct Model {
        regions: BTreeMap<RegionId, Piece>,
        next: u64,
    }

    impl Model {
        /// Carries `plan` out as the manager would its reachability changes and its changes,
        /// then commits it on `area`.
        fn carry_out(&mut self, area: &mut HotplugArea, plan: &HotplugPlan) {
            for (region, range, reachable) in area.flips(plan) {
                let piece = self.regions.get_mut(&region).expect("known");
                let mut bytes: Vec<bool> = (0..area.slot_size / MIB)
                    .map(|mib| piece.2.iter().any(|r| r.contains(&(mib * MIB))))
                    .collect();
                bytes[(range.start / MIB) as usize..(range.end / MIB) as usize].fill(!reachable);
                piece.2 = plugged_runs(bytes, MIB);
            }
            let mut added = Vec::new();
            for change in area.changes(plan) {
                match change {
                    RegionChange::Add(spec) => {
                        assert_eq!(spec.size, area.slot_size, "a piece is one slot size");
                        let id = RegionId(100 + self.next);
                        self.next += 1;
                        let slots = spec.slot_ranges.expect("a piece names its slots");
                        self.regions
                            .insert(id, (spec.gpa.0, slots, spec.inaccessible));
                        added.push(id);
                    }
                    RegionChange::Reslot(_) => panic!("a plug or unplug re-slots nothing"),
                    RegionChange::Remove(id) => {
                        self.regions.remove(&id).expect("known");
                    }
                }
            }
            area.commit(plan, added);
        }

        /// Guest ranges the guest reaches (under a slot and not unreachable), lowest first.
        fn reachable(&self) -> Vec<Range<u64>> {
            let mut all: Vec<Range<u64>> = Vec::new();
            for (gpa, slots, unreachable) in self.regions.values() {
                for slot in slots {
                    let mut at = slot.start;
                    for gone in unreachable.iter().filter(|g| g.start < slot.end) {
                        if gone.start > at {
                            all.push(gpa + at..gpa + gone.start.min(slot.end));
                        }
                        at = at.max(gone.end);
                    }
                    if at < slot.end {
                        all.push(gpa + at..gpa + slot.end);
                    }
                }
            }
            all.sort_by_key(|r| r.start);
            all
        }

        /// KVM slots in all.
        fn slots(&self) -> usize {
            self.regions.values().map(|(_, slots, _)| slots.len()).sum()
        }
    }

    #[test]
    fn configurations_are_checked_with_the_value_named() {
        let config = |total, block, slot| HotplugConfig {
            total_size_mib: total,
            block_size_mib: block,
            slot_size_mib: slot,
            page_size: Default::default(),
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
    fn a_plug_adds_pieces_with_one_slot_and_their_unplugged_blocks_unreachable() {
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
                    unreachable: vec![],
                },
                PieceChange {
                    index: 1,
                    gpa: GuestAddress(GPA + (8 << 20)),
                    region: None,
                    before: 0,
                    after: 2 << 20,
                    slots: vec![0..8 << 20],
                    unreachable: vec![2 << 20..8 << 20],
                },
            ]
        );
        model.carry_out(&mut a, &plan);
        assert_eq!(
            model.reachable(),
            vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
        );
        // More blocks inside piece 1: they become reachable under its slot, which stays; the
        // guest checks them.
        let plan = a.plan(16).unwrap();
        assert_eq!(plan.pieces.len(), 1);
        let grow = &plan.pieces[0];
        assert_eq!((grow.index, grow.region), (1, Some(RegionId(101))));
        assert_eq!(grow.plugged(), Some(GPA + (10 << 20)..GPA + (16 << 20)));
        assert_eq!(grow.given_back(), None);
        assert!(a.changes(&plan).is_empty(), "no slot changes");
        assert_eq!(
            a.flips(&plan),
            vec![(RegionId(101), 2 << 20..8 << 20, true)]
        );
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
        // Blocks 5..8 of piece 1 become unreachable and go back to the host; the piece and its
        // slot stay.
        assert_eq!(plan.pieces[0].given_back(), Some(2 << 20..8 << 20));
        assert_eq!(plan.pieces[0].plugged(), None);
        assert_eq!(
            a.flips(&plan),
            vec![(RegionId(101), 2 << 20..8 << 20, false)]
        );
        let changes = a.changes(&plan);
        assert_eq!(changes.len(), 6);
        assert!(changes.iter().all(|c| matches!(c, RegionChange::Remove(_))));
        assert_eq!(
            plan.pieces[1].given_back(),
            None,
            "a removed piece goes whole"
        );
        model.carry_out(&mut a, &plan);
        assert_eq!(
            model.reachable(),
            vec![GPA..GPA + (8 << 20), GPA + (8 << 20)..GPA + (10 << 20)]
        );
        assert_eq!(model.slots(), 2);
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

    /// A sequence of sizes up and down, with every piece size from the block to the area: what
    /// the guest reaches is exactly the plugged memory (every unplugged block under a slot is
    /// unreachable), one slot per piece with a plugged block, and a plan back undoes a plan
    /// (what a failed check or a signal does).
    #[test]
    fn every_sequence_keeps_the_reachable_memory_exactly_the_plugged_blocks() {
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
                assert_eq!(model.reachable(), wanted, "{context}");
                assert_eq!(model.slots(), wanted.len(), "{context}");
                assert_eq!(a.mapped_slots(), wanted.len(), "{context}");
                assert_eq!(model.regions.len(), wanted.len(), "{context}");
                // Going back and forth again leaves the same slots.
                let back = a.plan_blocks(before);
                model.carry_out(&mut a, &back);
                let again = a.plan(size).unwrap();
                model.carry_out(&mut a, &again);
                assert_eq!(
                    model.reachable(),
                    wanted,
                    "{context}, after an undo and a redo"
                );
            }
        }
    }

    /// A 2 MiB system region at 0, and at the hotplug area the regions of `slots` 8 MiB slots.
    pub(crate) fn layout(slots: &[u64]) -> (MemoryManager<FakeKvm>, MemoryLayout) {
        let memory = MemoryManager::new(FakeKvm::new(64, false));
        memory
            .add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
            .expect("the system region");
        for slot in slots {
            let gpa = GuestAddress(HOTPLUG_GPA + slot * 8 * MIB);
            memory
                .add_region(RegionSpec::new(gpa, 8 * MIB))
                .expect("a slot");
        }
        let layout = MemoryLayout::of(&memory);
        (memory, layout)
    }

    /// 64 MiB in 2 MiB blocks and 8 MiB slots, 5 blocks plugged: slots 0 and 1 mapped.
    pub(crate) fn hotplug() -> HotplugState {
        HotplugState {
            config: HotplugConfig {
                total_size_mib: 64,
                block_size_mib: 2,
                slot_size_mib: Some(8),
                page_size: Default::default(),
            },
            plugged_blocks: 5,
            mapped: [[true; 2].as_slice(), &[false; 6]].concat(),
        }
    }

    #[test]
    fn a_hotplug_area_is_checked_against_itself_and_the_layout() {
        let (_memory, two) = layout(&[0, 1]);
        // Slots of the whole piece (the layout helper's): a piece's one slot.
        assert_eq!(hotplug().validate(&two), Ok(()));
        let refused = |change: fn(&mut HotplugState), layout: &MemoryLayout| {
            let mut state = hotplug();
            change(&mut state);
            state.validate(layout).expect_err("refused")
        };
        let short = refused(|s| s.mapped.truncate(2), &two);
        assert!(short.contains("8 slots, but `mapped` lists 2"), "{short}");
        let absurd = refused(|s| s.plugged_blocks = 1 << 62, &two);
        assert!(absurd.contains("more than its 32 blocks"), "{absurd}");
        let none = refused(|s| s.plugged_blocks = 0, &two);
        assert!(none.contains("slot 0 is mapped"), "{none}");
        let more = refused(|s| s.plugged_blocks = 9, &two);
        assert!(more.contains("slot 2 is not mapped"), "{more}");
        let block = refused(|s| s.config.block_size_mib = 3, &two);
        assert!(block.contains("block_size_mib 3"), "{block}");
        // The layout lacks a mapped slot's region, or has one the map does not list.
        let (_memory, one) = layout(&[0]);
        let missing = hotplug().validate(&one).expect_err("refused");
        assert!(missing.contains("mapped slot 1"), "{missing}");
        let (_memory, three) = layout(&[0, 1, 3]);
        let extra = hotplug().validate(&three).expect_err("refused");
        assert!(extra.contains("inside the hotplug area"), "{extra}");
        // A partly plugged piece's slot covers it whole (or, written when pieces had holes,
        // its plugged block); any other slotting is refused, naming both.
        let with_slots = |piece_1: Vec<Range<u64>>| {
            let (memory, _) = layout(&[0]);
            let gpa = GuestAddress(HOTPLUG_GPA + 8 * MIB);
            memory
                .add_region(RegionSpec::new(gpa, 8 * MIB).with_slot_ranges(piece_1))
                .expect("a piece with a hole");
            MemoryLayout::of(&memory)
        };
        let cut = with_slots(vec![0..2 * MIB]);
        assert_eq!(hotplug().validate(&cut), Ok(()));
        let wrong = hotplug()
            .validate(&with_slots(vec![0..4 * MIB]))
            .expect_err("refused");
        assert!(
            wrong.contains("has slots [0..400000]") && wrong.contains("need [0..800000]"),
            "{wrong}"
        );
        let odd = hotplug()
            .validate(&with_slots(vec![0..2 * MIB, 6 * MIB..8 * MIB]))
            .expect_err("neither the piece nor its plugged blocks");
        assert!(odd.contains("need [0..800000]"), "{odd}");
    }
}
