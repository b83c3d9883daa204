//! Where things go in a Linux guest's memory, and how its RAM is cut into regions and slots.
//!
//! Low memory (the first MiB) holds what the VMM writes for the boot: the GDT, the PVH start
//! info, the zero page, the boot stack, the identity page tables, the command line, the
//! `SETUP_E820_EXT` data, in the last KiB below 640 KiB the MP table, and from 896 KiB the ACPI
//! tables. RAM starts at 0 and runs up to the 32-bit MMIO gap at 3 GiB, continuing at 4 GiB
//! (the local and I/O APICs live in the gap).

use vm_memory::GuestAddress;

use crate::linux::config::BootConfig;

const PAGE_SIZE: u64 = 4096;

/// The GDT for the boot (five 8-byte entries).
pub const GDT: GuestAddress = GuestAddress(0x500);
/// The PVH `hvm_start_info`.
pub const PVH_START_INFO: GuestAddress = GuestAddress(0x6000);
/// The PVH module list (the initramfs).
pub const PVH_MODLIST: GuestAddress = GuestAddress(0x6040);
/// The PVH memory map.
pub const PVH_MEMMAP: GuestAddress = GuestAddress(0x6080);
/// The zero page (`boot_params`).
pub const ZERO_PAGE: GuestAddress = GuestAddress(0x7000);
/// The top of the boot stack.
pub const BOOT_STACK_TOP: u64 = 0x8ff0;
/// The identity page tables: PML4, then one PDPT, then one page directory of 2 MiB pages.
pub const PML4: GuestAddress = GuestAddress(0x9000);
/// The page-directory-pointer table.
pub const PDPT: GuestAddress = GuestAddress(0xa000);
/// The page directory (512 × 2 MiB: the first GiB).
pub const PD: GuestAddress = GuestAddress(0xb000);
/// How much the boot page tables identity-map.
pub const IDENTITY_MAPPED: u64 = 1 << 30;
/// The kernel command line (the kernel takes at most 2047 bytes and a NUL).
pub const CMDLINE: GuestAddress = GuestAddress(0x2_0000);
/// The largest command line, NUL included.
pub const CMDLINE_MAX: usize = 0x800;
/// The `SETUP_E820_EXT` setup_data entry (its header, then the entries past the zero page's
/// 128).
pub const SETUP_DATA: GuestAddress = GuestAddress(0x2_1000);
/// The end of the setup_data room.
pub const SETUP_DATA_END: u64 = 0x9_f000;
/// The extended BIOS data area, which holds the MP table: the last KiB below 640 KiB.
pub const EBDA: GuestAddress = GuestAddress(0x9_fc00);
/// The ACPI tables, RSDP first (in the BIOS area, where Linux scans for the RSDP).
pub const ACPI_TABLES: GuestAddress = GuestAddress(0xe_0000);
/// The end of the low area the e820 map calls reserved (EBDA, VGA hole, BIOS).
pub const LOW_RESERVED_END: u64 = 0x10_0000;
/// Where high memory starts: kernels and initramfs go above.
pub const HIGH_MEMORY: GuestAddress = GuestAddress(0x10_0000);
/// The start of the 32-bit MMIO gap (no RAM from here to 4 GiB).
pub const MMIO_GAP_START: u64 = 3 << 30;
/// The end of the 32-bit MMIO gap.
pub const MMIO_GAP_END: u64 = 4 << 30;
/// The I/O APIC's registers.
pub const IOAPIC: u64 = 0xfec0_0000;
/// The local APICs' registers.
pub const LAPIC: u64 = 0xfee0_0000;
/// With holes, the RAM at the bottom that stays contiguous, for the kernel (a bzImage
/// decompresses itself at 16 MiB into about 52 MiB for Debian's) and the initramfs.
pub const BOOT_AREA: u64 = 128 << 20;

/// One region of guest RAM as the VMM asks the manager for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamRegion {
    /// Guest-physical base.
    pub gpa: GuestAddress,
    /// Size in bytes.
    pub size: u64,
    /// Size of its KVM slots (the last one may be smaller).
    pub slot_size: u64,
    /// Size of its last slot when that one is larger (the rest of RAM that `slot_size` does
    /// not divide); `None` when all are `slot_size` but maybe a smaller last one.
    pub larger_last: Option<u64>,
}

impl RamRegion {
    /// How many KVM slots it takes.
    pub fn slots(&self) -> u64 {
        match self.larger_last {
            Some(last) => (self.size - last) / self.slot_size + 1,
            None => self.size.div_ceil(self.slot_size),
        }
    }

    /// Its slots as byte ranges, where the last one is larger (for
    /// `RegionSpec::with_slot_ranges`); `None` where `slot_size` says it all.
    pub fn slot_ranges(&self) -> Option<Vec<std::ops::Range<u64>>> {
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
pub fn ram_regions(config: &BootConfig) -> Vec<RamRegion> {
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
