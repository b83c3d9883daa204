//! How a Linux guest's RAM is cut into regions and KVM slots, from its [`BootConfig`], around
//! the address map of [`layout`](super::layout): the MMIO gap and, with holes, the boot area.

use vm_memory::GuestAddress;

use crate::linux::config::BootConfig;
use crate::linux::layout::{BOOT_AREA, MMIO_GAP_END, MMIO_GAP_START};

const PAGE_SIZE: u64 = 4096;

/// One region of guest RAM as the VMM asks the manager for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RamRegion {
    /// Guest-physical base.
    pub(crate) gpa: GuestAddress,
    /// Size in bytes.
    pub(crate) size: u64,
    /// Size of its KVM slots (the last one may be smaller).
    pub(crate) slot_size: u64,
    /// Size of its last slot when that one is larger (the rest of RAM that `slot_size` does
    /// not divide); `None` when all are `slot_size` but maybe a smaller last one.
    larger_last: Option<u64>,
}

impl RamRegion {
    /// How many KVM slots it takes.
    #[cfg(test)]
    fn slots(&self) -> u64 {
        match self.larger_last {
            Some(last) => (self.size - last) / self.slot_size + 1,
            None => self.size.div_ceil(self.slot_size),
        }
    }

    /// Its slots as byte ranges, where the last one is larger (for
    /// `RegionSpec::with_slot_ranges`); `None` where `slot_size` says it all.
    pub(super) fn slot_ranges(&self) -> Option<Vec<std::ops::Range<u64>>> {
        let last = self.larger_last?;
        let even = self.size - last;
        let mut ranges: Vec<_> = (0..even / self.slot_size)
            .map(|i| i * self.slot_size..(i + 1) * self.slot_size)
            .collect();
        ranges.push(even..self.size);
        Some(ranges)
    }
}

/// The RAM regions for `config`: `mem_slots` slots of equal size over `mem_mib` MiB. Without
/// holes the RAM is one region from 0 (two when it reaches the MMIO gap); with holes the
/// first [`BOOT_AREA`] bytes are one region and every further slot is a region of its own
/// followed by a hole as large as a slot, so that the e820 map gets one RAM range per slot.
/// RAM below the gap and without holes that `mem_slots` does not divide into whole pages gets
/// slots of equal whole pages and a larger last one (KVM's 32764 divides no RAM size in whole
/// pages). `config` must have passed [`BootConfig::validate`].
pub(crate) fn ram_regions(config: &BootConfig) -> Vec<RamRegion> {
    let mem = config.mem_mib << 20;
    let pages = mem / PAGE_SIZE;
    if !config.mem_holes && !pages.is_multiple_of(config.mem_slots) {
        let slot_size = pages / config.mem_slots * PAGE_SIZE;
        return vec![RamRegion {
            gpa: GuestAddress(0),
            size: mem,
            slot_size,
            larger_last: Some(mem - (config.mem_slots - 1) * slot_size),
        }];
    }
    let slot_size = mem / config.mem_slots;
    let mut regions = Vec::new();
    let place = |gpa: u64, size: u64, regions: &mut Vec<RamRegion>| -> u64 {
        // A region never straddles the MMIO gap: the part above goes to 4 GiB.
        let mut gpa = gpa;
        let mut size = size;
        if (MMIO_GAP_START..MMIO_GAP_END).contains(&gpa) {
            gpa = MMIO_GAP_END;
        }
        if gpa < MMIO_GAP_START && gpa + size > MMIO_GAP_START {
            let below = MMIO_GAP_START - gpa;
            regions.push(RamRegion {
                gpa: GuestAddress(gpa),
                size: below,
                slot_size,
                larger_last: None,
            });
            gpa = MMIO_GAP_END;
            size -= below;
        }
        regions.push(RamRegion {
            gpa: GuestAddress(gpa),
            size,
            slot_size,
            larger_last: None,
        });
        gpa + size
    };
    if !config.mem_holes {
        place(0, mem, &mut regions);
        return regions;
    }
    let mut next = place(0, BOOT_AREA, &mut regions);
    for _ in 0..(mem - BOOT_AREA) / slot_size {
        next = place(next, slot_size, &mut regions) + slot_size;
    }
    regions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mem_mib: u64, mem_slots: u64, mem_holes: bool) -> BootConfig {
        BootConfig {
            mem_mib,
            mem_slots,
            mem_holes,
            ..BootConfig::default()
        }
    }

    #[test]
    fn contiguous_ram_is_one_region_split_into_the_slots_asked_for() {
        let regions = ram_regions(&config(512, 4096, false));
        assert_eq!(
            regions,
            vec![RamRegion {
                gpa: GuestAddress(0),
                size: 512 << 20,
                slot_size: 128 << 10,
                larger_last: None,
            }]
        );
        assert_eq!(regions[0].slots(), 4096);
        assert_eq!(regions[0].slot_ranges(), None);
    }

    #[test]
    fn ram_that_the_slots_do_not_divide_gets_a_larger_last_slot() {
        // 131072 pages in 32764 slots: 32763 of 4 pages and one of 20.
        let regions = ram_regions(&config(512, 32764, false));
        assert_eq!(regions.len(), 1);
        let ram = &regions[0];
        assert_eq!((ram.slot_size, ram.larger_last), (16 << 10, Some(80 << 10)));
        assert_eq!(ram.slots(), 32764);
        let ranges = ram.slot_ranges().expect("ranges");
        assert_eq!(ranges.len(), 32764);
        assert_eq!(ranges[0], 0..16 << 10);
        assert_eq!(ranges[32763], (512 << 20) - (80 << 10)..512 << 20);
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
    }

    #[test]
    fn ram_skips_the_mmio_gap() {
        let regions = ram_regions(&config(4096, 4, false));
        assert_eq!(regions.len(), 2);
        assert_eq!(regions[0].size, 3 << 30);
        assert_eq!(regions[1].gpa, GuestAddress(4 << 30));
        assert_eq!(regions[1].size, 1 << 30);
        assert_eq!(regions.iter().map(RamRegion::slots).sum::<u64>(), 4);
    }

    #[test]
    fn holes_give_one_region_per_slot_above_the_boot_area() {
        let regions = ram_regions(&config(256, 512, true));
        let slot = 512 << 10;
        assert_eq!(regions.len(), 1 + 256);
        assert_eq!(regions[0].size, BOOT_AREA);
        assert_eq!(regions[0].slots(), 256);
        for (i, r) in regions[1..].iter().enumerate() {
            assert_eq!(r.gpa.0, BOOT_AREA + 2 * slot * i as u64);
            assert_eq!(r.size, slot);
        }
        let total: u64 = regions.iter().map(|r| r.size).sum();
        assert_eq!(total, 256 << 20);
        assert_eq!(regions.iter().map(RamRegion::slots).sum::<u64>(), 512);
    }
}
