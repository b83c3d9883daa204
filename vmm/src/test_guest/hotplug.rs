//! The test guest's hotplug area (Firecracker's resource: total, block and slot sizes) and its
//! plan: which pieces of it to add and remove, and which blocks to make reachable or
//! unreachable, to reach a requested size. A piece is one slot size of the area (the last one
//! what is left of the total, if that is less); while it has a
//! plugged block it is a region of the manager with one KVM slot over the whole piece, its
//! unplugged blocks unreachable under it (`MemoryManager::set_accessible`, as the virtio-mem
//! device keeps its pieces), so that a plug or unplug inside it changes no slot. The plan is
//! pure; [`HotplugArea::carry_out`] applies it through the memory manager, all or nothing, and
//! the controller (`controller/hotplug.rs`) has the guest check the memory it plugs. The area
//! keeps its own saved state (`HotplugState`, what a snapshot or a migration carries of it)
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
    pub(crate) config: HotplugConfig,
    /// Where the area starts.
    pub(crate) gpa: u64,
    /// Bytes per piece (but the last, which may be shorter): the largest KVM slot the area's
    /// plugged blocks share.
    pub(crate) slot_size: u64,
    /// Plugged blocks, from the area's start.
    pub(crate) plugged_blocks: u64,
    /// The region of each piece that has a plugged block, by piece index.
    pub(crate) pieces: Vec<Option<RegionId>>,
}

/// What a hotplug request takes: the pieces whose plugged blocks change, lowest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugPlan {
    /// Plugged blocks once it is done.
    blocks: u64,
    /// The pieces that change.
    pub(crate) pieces: Vec<PieceChange>,
}

/// One piece of a plan: how many of its bytes are plugged before and after, its slots after
/// (one over the piece, none where nothing stays plugged) and what of it is unreachable then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PieceChange {
    /// The piece's index in the area.
    pub(crate) index: usize,
    /// Its guest address.
    gpa: GuestAddress,
    /// Its region now, if a block of it is plugged.
    region: Option<RegionId>,
    /// Bytes plugged from its start now.
    before: u64,
    /// Bytes plugged from its start once the plan is carried out.
    after: u64,
    /// Its slots then, as byte ranges of the piece: the whole piece while a block of it is
    /// plugged.
    slots: Vec<Range<u64>>,
    /// Its unplugged blocks then, as byte ranges of the piece, unreachable under its slot.
    unreachable: Vec<Range<u64>>,
}

impl PieceChange {
    /// Guest addresses the plan plugs in this piece (on a plug), which the guest checks.
    pub(super) fn plugged(&self) -> Option<Range<u64>> {
        (self.after > self.before).then(|| self.gpa.0 + self.before..self.gpa.0 + self.after)
    }

    /// Bytes of the piece (offsets) the plan unplugs while the piece stays, to give back to
    /// the host.
    fn given_back(&self) -> Option<Range<u64>> {
        (0 < self.after && self.after < self.before).then_some(self.after..self.before)
    }
}

impl HotplugArea {
    /// Checks `config` (`HotplugConfig::validate`, the rules a Linux guest's virtio-mem
    /// device obeys too), then that the area at `gpa` ends at or below `limit` (where the guest
    /// reaches) and fits in `free_slots` KVM slots (KVM's free ones within the slot budget);
    /// returns the area, nothing plugged.
    pub fn new(
        config: HotplugConfig,
        gpa: u64,
        limit: u64,
        free_slots: usize,
    ) -> Result<Self, ControllerError> {
        config
            .validate()
            .map_err(|e| ControllerError::bad(e.to_string()))?;
        let total = config.total_size_mib * MIB;
        if gpa.checked_add(total).is_none_or(|end| end > limit) {
            return Err(ControllerError::bad(format!(
                "total_size_mib {} does not fit below {limit:#x}, where the test guest reaches",
                config.total_size_mib
            )));
        }
        let slot_size = config.slot_mib() * MIB;
        let pieces = total.div_ceil(slot_size);
        if pieces > free_slots as u64 {
            return Err(ControllerError::conflict(format!(
                "the hotplug area needs {pieces} KVM slots; {free_slots} are free (in KVM and \
                 within the slot budget, --max-slots)"
            )));
        }
        Ok(HotplugArea {
            config,
            gpa,
            slot_size,
            plugged_blocks: 0,
            pieces: vec![None; pieces as usize],
        })
    }

    /// Bytes per block.
    pub(super) fn block_size(&self) -> u64 {
        self.config.block_size_mib * MIB
    }

    /// Bytes of the whole area.
    pub(super) fn total_size(&self) -> u64 {
        self.config.total_size_mib * MIB
    }

    /// The guest addresses the area takes.
    pub(super) fn range(&self) -> Range<u64> {
        self.gpa..self.gpa + self.total_size()
    }

    /// Blocks per piece (but the last, which may have fewer).
    fn blocks_per_slot(&self) -> u64 {
        self.slot_size / self.block_size()
    }

    /// Bytes of piece `i`: the slot size, or what is left of the area for its last piece.
    pub(super) fn piece_size(&self, i: usize) -> u64 {
        let start = i as u64 * self.slot_size;
        self.total_size().saturating_sub(start).min(self.slot_size)
    }

    /// Blocks of piece `i`.
    fn piece_blocks(&self, i: usize) -> u64 {
        self.piece_size(i) / self.block_size()
    }

    /// Guest address of piece `i`.
    pub(super) fn slot_gpa(&self, i: usize) -> GuestAddress {
        GuestAddress(self.gpa + i as u64 * self.slot_size)
    }

    /// The slots of piece `i` with `blocks` plugged in the area (from its start): one over the
    /// whole piece, none if it has no plugged block.
    pub(super) fn piece_slots(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        if self.piece_runs(i, blocks).is_empty() {
            return Vec::new();
        }
        std::iter::once(0..self.piece_size(i)).collect()
    }

    /// The runs of piece `i`'s plugged blocks with `blocks` plugged in the area: its slots in
    /// states saved before pieces kept one slot (none if it has no plugged block).
    fn piece_runs(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        let first = i as u64 * self.blocks_per_slot();
        let plugged = (first..first + self.piece_blocks(i)).map(|b| b < blocks);
        plugged_runs(plugged, self.block_size())
    }

    /// The byte ranges of piece `i` unreachable under its slot with `blocks` plugged in the
    /// area: its unplugged blocks, if it has a plugged one (none otherwise: no slot at all).
    pub(super) fn piece_unreachable(&self, i: usize, blocks: u64) -> Vec<Range<u64>> {
        let first = i as u64 * self.blocks_per_slot();
        if blocks <= first {
            return Vec::new();
        }
        let unplugged = (first..first + self.piece_blocks(i)).map(|b| b >= blocks);
        plugged_runs(unplugged, self.block_size())
    }

    /// The area's bookkeeping as a snapshot or a migration saves it.
    pub(super) fn state(&self) -> HotplugState {
        HotplugState {
            config: self.config,
            plugged_blocks: self.plugged_blocks,
            mapped: self.pieces.iter().map(Option::is_some).collect(),
        }
    }

    /// Pieces mapped now: one KVM slot each.
    fn mapped_slots(&self) -> usize {
        self.pieces.iter().filter(|s| s.is_some()).count()
    }

    /// What to do to plug `requested_size_mib` of the area (a multiple of the block size, at
    /// most the total).
    pub(super) fn plan(&self, requested_size_mib: u64) -> Result<HotplugPlan, ControllerError> {
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
            blocks
                .saturating_sub(i as u64 * per_piece)
                .min(self.piece_blocks(i))
                * block
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
    fn changes(&self, plan: &HotplugPlan) -> Vec<RegionChange> {
        plan.pieces
            .iter()
            .filter_map(|p| match (p.region, p.after) {
                (None, _) => Some(RegionChange::Add(
                    RegionSpec::new(p.gpa, self.piece_size(p.index))
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
    fn flips(&self, plan: &HotplugPlan) -> Vec<(RegionId, Range<u64>, bool)> {
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
    fn commit(&mut self, plan: &HotplugPlan, added: Vec<RegionId>) {
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
    pub(super) fn info(&self) -> HotplugInfo {
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
pub(crate) struct HotplugState {
    /// As configured.
    pub(crate) config: HotplugConfig,
    /// Plugged blocks, from the area's start.
    pub(crate) plugged_blocks: u64,
    /// Whether each slot of the area is mapped.
    pub(crate) mapped: Vec<bool>,
}

impl HotplugState {
    /// Checks the area against itself and `layout`: a configuration the API would accept,
    /// one `mapped` entry per piece (slot size, the last one maybe shorter) of the area, no more
    /// plugged blocks than the
    /// area has, exactly the pieces those blocks need mapped, and each mapped piece (and
    /// nothing else) a region of the layout there with one slot over the whole piece, or (a
    /// version 3 state, written when pieces had holes) slots over its plugged blocks only: the
    /// restore gives it its one slot back and makes its unplugged blocks unreachable.
    pub(super) fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
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
        let blocks = area.total_size() / area.block_size();
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
                && region.size == area.piece_size(slot as usize);
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
                .any(|r| r.gpa == gpa && r.size == area.piece_size(i))
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
pub(crate) mod tests;
