//! Bitmap mode: a logging slot a change deletes (or whose logging it stops) loses none of its
//! dirty bits: its log is read into the region's pending bits first, and a slot being deleted
//! is *parked* first, moved where the guest does not write, so that no write lands in the log
//! between the read and the delete.

use super::plan::{KvmOp, Step};
use super::{Broken, MemoryManager, State};
use crate::error::Error;
use crate::kvm::{KvmMemory, KvmSlot};
use crate::region_memory::RegionId;
use crate::PAGE_SIZE;

impl<K: KvmMemory> MemoryManager<K> {
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
        self.read_slot_log(state, step.region, &slot, log)
    }

    /// Reads the log of `region`'s slot `slot` (as the map has it; KVM may have it parked)
    /// into the region's pending bits, without clearing it.
    fn read_slot_log(
        &self,
        state: &State,
        region: RegionId,
        slot: &KvmSlot,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let owner = state
            .regions
            .get(&region)
            .expect("a step's region is in the table");
        let first = (slot.gpa - owner.gpa.0) / PAGE_SIZE;
        self.fetch_slot_log(region, owner.pending(), slot, first, false, log)
    }

    /// Bitmap mode: deletes `region`'s logging slot `old` losing none of its dirty bits.
    ///
    /// KVM frees a slot's log when it deletes it, and a guest write between a read of the log
    /// and the delete would set a bit in the freed log (measured on KVM: a re-slot under a
    /// writing vCPU lost a page in about one round in 50). So the slot is first *parked*: moved
    /// (`KVM_MR_MOVE`, which keeps its log) to a guest address where the guest has no memory
    /// and does not write ([`parking_places`]), so that an access at its own address exits as
    /// for any slot away during a change. Its log is then read, complete, and the parked slot
    /// deleted. Where KVM refuses every parking place (`EEXIST`: a slot of the VMM's own is
    /// there; `EINVAL`: past KVM's guest address width) the slot is deleted in place and every
    /// one of its pages marked dirty after the delete: over-reporting, never losing. If the
    /// read or the delete of a parked slot fails, the slot is moved back (a failure to do so
    /// is [`Error::UndoFailed`]), so the step is all or nothing; its undo is a create of
    /// `old`, as for any delete.
    pub(super) fn delete_logging_slot(
        &self,
        state: &mut State,
        region: RegionId,
        old: KvmSlot,
        log: &mut Vec<u64>,
    ) -> Result<(), Error> {
        let mut parked = None;
        for gpa in parking_places(state, old.size) {
            let place = KvmSlot { gpa, ..old };
            match self.request(region, "park", &place) {
                Ok(()) => {
                    parked = Some(place);
                    break;
                }
                Err(Error::Kvm { source, .. })
                    if source.errno() == libc::EEXIST || source.errno() == libc::EINVAL => {}
                Err(e) => return Err(e),
            }
        }
        let Some(parked) = parked else {
            self.read_slot_log(state, region, &old, log)?;
            self.request(region, "delete", &old.deleted())?;
            let owner = &state.regions[&region];
            let first = (old.gpa - owner.gpa.0) / PAGE_SIZE;
            owner.pending().mark(first, old.size / PAGE_SIZE);
            return Ok(());
        };
        let deleted = self
            .read_slot_log(state, region, &old, log)
            .and_then(|()| self.request(region, "delete", &parked.deleted()));
        let Err(failed) = deleted else {
            return Ok(());
        };
        match self.request(region, "move back", &old) {
            Ok(()) => Err(failed),
            Err(Error::Kvm { source, .. }) => {
                state.broken = Some(Broken::UndoFailed {
                    slot: old.slot,
                    errno: source,
                });
                Err(Error::UndoFailed {
                    failed: Box::new(failed),
                    undo_op: "move back",
                    slot: old.slot,
                    undo_errno: source,
                })
            }
            Err(other) => Err(other),
        }
    }
}

/// Where `delete_logging_slot` may park a slot of `size` bytes, best first, each a place no
/// region covers (holes included: a region's range is its own), at or above 4 GiB (x86 KVM's
/// own slots lie below) and, where the host reports its physical address width, inside it
/// (KVM refuses a slot past it):
///
/// 1. the highest such place, on a GiB boundary where one has room (else page-aligned): at
///    the top of the width if it is free, far above anything a VMM gives a guest, so that not
///    even a guest touching unplugged or unassigned addresses meets it; just below the
///    regions that lie there if not;
/// 2. where KVM refuses that (a guest address width narrower than the host's), the first GiB
///    boundary above 4 GiB and every region;
/// 3. where that is past the width (a region lies at its top), the lowest place above 4 GiB.
///
/// At most three places, none twice; none only if no room is free at all.
pub(super) fn parking_places(state: &State, size: u64) -> Vec<u64> {
    const GIB: u64 = 1 << 30;
    const FLOOR: u64 = 4 * GIB;
    let width = host_address_bits().and_then(|bits| 1u64.checked_shl(bits));
    // The end of guest address space a place must stay below.
    let end = width.unwrap_or(!(PAGE_SIZE - 1));
    let regions = || {
        state
            .spans
            .iter()
            .map(|(&start, id)| (start, start.saturating_add(state.regions[id].size)))
    };
    // The highest place in the free range `lo..hi`, on a GiB boundary if one has room.
    let highest = |lo: u64, hi: u64| {
        let lo = lo.max(FLOOR);
        let last = hi.min(end).checked_sub(size).filter(|&last| last >= lo)?;
        let aligned = last & !(GIB - 1);
        Some(if aligned >= lo { aligned } else { last })
    };
    // The lowest place in the free range `lo..hi`, on a GiB boundary if one has room.
    let lowest = |lo: u64, hi: u64| {
        let lo = lo.max(FLOOR);
        let hi = hi.min(end);
        let fits = |place: u64| place.checked_add(size).is_some_and(|e| e <= hi);
        let aligned = lo.checked_next_multiple_of(GIB).filter(|&a| fits(a));
        aligned.or(Some(lo).filter(|&l| fits(l)))
    };
    let mut places: Vec<u64> = Vec::with_capacity(3);
    if width.is_some() {
        // Down from the top, gap by gap, to the first with room.
        let mut hi = end;
        let mut top = None;
        for (start, region_end) in regions().rev() {
            if region_end < hi {
                top = highest(region_end, hi);
                if top.is_some() {
                    break;
                }
            }
            hi = hi.min(start);
            if hi <= FLOOR {
                break;
            }
        }
        places.extend(top.or_else(|| highest(0, hi)));
    }
    let above_all = regions()
        .next_back()
        .map_or(0, |(_, region_end)| region_end);
    let above = lowest(above_all, end);
    let low = above.is_none().then(|| {
        let mut lo = FLOOR;
        for (start, region_end) in regions() {
            if region_end <= lo {
                continue;
            }
            if let Some(place) = lowest(lo, start) {
                return Some(place);
            }
            lo = lo.max(region_end);
        }
        lowest(lo, end)
    });
    for place in above.into_iter().chain(low.flatten()) {
        if !places.contains(&place) {
            places.push(place);
        }
    }
    places
}

/// The host's physical address width (CPUID leaf 0x8000_0008), if the CPU reports it.
pub(super) fn host_address_bits() -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        (__cpuid(0x8000_0000).eax >= 0x8000_0008).then(|| __cpuid(0x8000_0008).eax & 0xff)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}
