//! The test area's layout, as the kernel's test lays it out, and the move tests' window in it.

use kvm_memslots::{RegionId, RegionSpec, PAGE_SIZE};
use vm_memory::GuestAddress;

use super::config::{PerfError, Scenario, SkipReason, MOVE_WINDOW};
use tinyvmm::test_guest::area::{TestArea, AREA_GPA};
use tinyvmm::test_guest::vcpus::TestVm;

/// The test area as the kernel lays it out (see the [suite's documentation](super)).
pub(super) struct Layout {
    pub(super) gpa: u64,
    test_slots: u64,
    pub(super) slot_size: u64,
    pub(super) last_slot_size: u64,
}

impl Layout {
    pub(super) fn plan(area_size: u64, test_slots: u64) -> Result<Self, SkipReason> {
        let pages = area_size / PAGE_SIZE;
        let per_slot = pages / test_slots;
        if per_slot == 0 {
            return Err(SkipReason::TooManySlots {
                area_size,
                test_slots,
            });
        }
        Ok(Layout {
            gpa: AREA_GPA,
            test_slots,
            slot_size: per_slot * PAGE_SIZE,
            last_slot_size: (per_slot + pages % test_slots) * PAGE_SIZE,
        })
    }

    /// Bytes below the last slot.
    fn below_last(&self) -> u64 {
        (self.test_slots - 1) * self.slot_size
    }

    pub(super) fn last_gpa(&self) -> u64 {
        self.gpa + self.below_last()
    }

    pub(super) fn size(&self) -> u64 {
        self.below_last() + self.last_slot_size
    }

    pub(super) fn end(&self) -> u64 {
        self.gpa + self.size()
    }

    /// Adds the slots below the last as one [`TestArea`] and the last as a one-slot region;
    /// returns the last one's region.
    pub(super) fn add(&self, vm: &TestVm) -> Result<RegionId, PerfError> {
        if self.test_slots > 1 {
            TestArea::add(
                vm.memory(),
                self.gpa,
                self.below_last(),
                self.test_slots - 1,
            )?;
        }
        let last = RegionSpec::new(GuestAddress(self.last_gpa()), self.last_slot_size);
        Ok(vm.memory().add_region(last)?)
    }
}

/// The move tests' window: where it starts, given the layout, or why it does not fit.
pub(super) fn move_window(test: Scenario, layout: &Layout) -> Result<u64, SkipReason> {
    let (below, above) = match test {
        Scenario::MoveActive => (MOVE_WINDOW / 2, MOVE_WINDOW / 2),
        _ => (MOVE_WINDOW, 0),
    };
    if layout.last_slot_size < above {
        return Err(SkipReason::LastSlotTooSmall {
            last_slot: layout.last_slot_size,
            needed: above,
        });
    }
    if layout.below_last() < below {
        return Err(SkipReason::BelowTooSmall {
            below: layout.below_last(),
            needed: below,
        });
    }
    Ok(layout.last_gpa() - below)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::config::{KIB, MAP_AREA_SIZE, MIB, UNMAP_AREA_SIZE};

    #[test]
    fn the_last_slot_holds_the_remainder_as_in_the_kernel() {
        // 512 MiB over 32763 test slots: 4 pages each, the last 4 + 20.
        let layout = Layout::plan(512 * MIB, 32763).unwrap();
        assert_eq!(
            (layout.slot_size, layout.last_slot_size),
            (16 * KIB, 96 * KIB)
        );
        assert_eq!(layout.size(), 512 * MIB);
        assert_eq!(layout.last_gpa(), AREA_GPA + 32762 * 16 * KIB);
        // Exactly the upper half of the active window fits; the inactive one is below.
        assert_eq!(
            move_window(Scenario::MoveActive, &layout),
            Ok(layout.last_gpa() - 96 * KIB)
        );
        assert_eq!(
            move_window(Scenario::MoveInactive, &layout),
            Ok(layout.last_gpa() - 192 * KIB)
        );
        // 128 MiB over 32763 slots: one page each, the last 1 + 5; the area stays whole.
        let unmap = Layout::plan(UNMAP_AREA_SIZE, 32763).unwrap();
        assert_eq!((unmap.slot_size, unmap.last_slot_size), (4 * KIB, 24 * KIB));
        assert_eq!(unmap.size(), UNMAP_AREA_SIZE);
    }

    #[test]
    fn tests_that_cannot_run_say_why() {
        assert_eq!(
            Layout::plan(MAP_AREA_SIZE, 8193).err().unwrap().to_string(),
            "the 32 MiB area has 8192 pages, fewer than its 8193 test slots (at most 8193 slots)"
        );
        assert!(Layout::plan(MAP_AREA_SIZE, 8192).is_ok());
        // 512 MiB over 32768 test slots (more than KVM has here): 4 pages each, no remainder.
        let layout = Layout::plan(512 * MIB, 32768).unwrap();
        assert_eq!(
            move_window(Scenario::MoveActive, &layout)
                .unwrap_err()
                .to_string(),
            "the last slot (16 KiB) is smaller than the window's upper half (96 KiB)"
        );
        let one = Layout::plan(512 * MIB, 1).unwrap();
        assert_eq!(
            move_window(Scenario::MoveInactive, &one)
                .unwrap_err()
                .to_string(),
            "the slots below the last hold 0 bytes, less than the window's 192 KiB below it"
        );
    }
}
