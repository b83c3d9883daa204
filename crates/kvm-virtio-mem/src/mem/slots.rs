//! Which KVM slots plugged memory gets: the one planner for blocks that share slots.

use std::ops::Range;

use kvm_memslots::{RegionChange, RegionId, RegionSpec, Reslot};
use vm_memory::GuestAddress;

/// The slots of one piece of a hotplug region (a run of blocks no slot crosses, at most the
/// maximum slot size long) whose blocks are plugged as `plugged` says, block by block: one
/// slot per maximal run of plugged blocks, as byte ranges of the piece, lowest first.
/// Unplugged blocks get none.
///
/// ```
/// use kvm_virtio_mem::mem::plugged_runs;
///
/// let plugged = [true, true, false, true, false, false, true, true];
/// assert_eq!(plugged_runs(plugged, 0x1000), vec![0..0x2000, 0x3000..0x4000, 0x6000..0x8000]);
/// ```
pub fn plugged_runs(plugged: impl IntoIterator<Item = bool>, block_size: u64) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    let mut open = false;
    for (i, plugged) in plugged.into_iter().enumerate() {
        let start = i as u64 * block_size;
        match (plugged, open) {
            (true, true) => runs.last_mut().expect("a run is open").end = start + block_size,
            (true, false) => runs.push(start..start + block_size),
            (false, _) => {}
        }
        open = plugged;
    }
    runs
}

/// The one change of the manager that gives the piece of `size` bytes at `gpa` the slots
/// `slots` ([`plugged_runs`] of its blocks after a plug or an unplug), given `region`, the
/// region behind it now: a piece with no region is added (its memory mapped, slots over the
/// runs only), one left with no slot is removed (its memory unmapped), and any other is
/// re-slotted over its whole range, its memory untouched.
///
/// ```
/// use kvm_memslots::{RegionChange, RegionId};
/// use kvm_virtio_mem::mem::piece_change;
/// use vm_memory::GuestAddress;
///
/// let change = piece_change(Some(RegionId(7)), GuestAddress(1 << 30), 0x8000, vec![]);
/// assert!(matches!(change, RegionChange::Remove(RegionId(7))));
/// ```
pub fn piece_change(
    region: Option<RegionId>,
    gpa: GuestAddress,
    size: u64,
    slots: Vec<Range<u64>>,
) -> RegionChange {
    match (region, slots.is_empty()) {
        (None, _) => RegionChange::Add(RegionSpec::new(gpa, size).with_slot_ranges(slots)),
        (Some(region), true) => RegionChange::Remove(region),
        (Some(region), false) => RegionChange::Reslot(Reslot {
            region,
            range: 0..size,
            slots,
        }),
    }
}

/// The most slots a piece of `blocks` blocks can need: every other block plugged.
pub(super) fn most_runs(blocks: u64) -> u64 {
    blocks.div_ceil(2)
}
