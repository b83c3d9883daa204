//! Where things go in a Linux guest's memory (how its RAM is cut into regions and slots is
//! [`ram`](super::ram)'s).
//!
//! Low memory (the first MiB) holds what the VMM writes for the boot: the GDT, the PVH start
//! info, the zero page, the boot stack, the identity page tables, the command line, the
//! `SETUP_E820_EXT` data, in the last KiB below 640 KiB the MP table, and from 896 KiB the ACPI
//! tables. RAM starts at 0 and runs up to the 32-bit MMIO gap at 3 GiB, continuing at 4 GiB
//! (the local and I/O APICs live in the gap).

use vm_memory::GuestAddress;

/// The GDT for the boot (five 8-byte entries).
pub(super) const GDT: GuestAddress = GuestAddress(0x500);
/// The PVH `hvm_start_info`.
pub(super) const PVH_START_INFO: GuestAddress = GuestAddress(0x6000);
/// The PVH module list (the initramfs).
pub(super) const PVH_MODLIST: GuestAddress = GuestAddress(0x6040);
/// The PVH memory map.
pub(super) const PVH_MEMMAP: GuestAddress = GuestAddress(0x6080);
/// The zero page (`boot_params`).
pub(super) const ZERO_PAGE: GuestAddress = GuestAddress(0x7000);
/// The top of the boot stack.
pub(super) const BOOT_STACK_TOP: u64 = 0x8ff0;
/// The identity page tables: PML4, then one PDPT, then one page directory of 2 MiB pages.
pub(super) const PML4: GuestAddress = GuestAddress(0x9000);
/// The page-directory-pointer table.
pub(super) const PDPT: GuestAddress = GuestAddress(0xa000);
/// The page directory (512 × 2 MiB: the first GiB).
pub(super) const PD: GuestAddress = GuestAddress(0xb000);
/// The kernel command line (the kernel takes at most 2047 bytes and a NUL).
pub(super) const CMDLINE: GuestAddress = GuestAddress(0x2_0000);
/// The largest command line, NUL included.
pub(super) const CMDLINE_MAX: usize = 0x800;
/// The `SETUP_E820_EXT` setup_data entry (its header, then the entries past the zero page's
/// 128).
pub(super) const SETUP_DATA: GuestAddress = GuestAddress(0x2_1000);
/// The end of the setup_data room.
pub(super) const SETUP_DATA_END: u64 = 0x9_f000;
/// The extended BIOS data area, which holds the MP table: the last KiB below 640 KiB.
pub(super) const EBDA: GuestAddress = GuestAddress(0x9_fc00);
/// The ACPI tables, RSDP first (in the BIOS area, where Linux scans for the RSDP).
pub(super) const ACPI_TABLES: GuestAddress = GuestAddress(0xe_0000);
/// The end of the low area the e820 map calls reserved (EBDA, VGA hole, BIOS).
pub(super) const LOW_RESERVED_END: u64 = 0x10_0000;
/// Where high memory starts: kernels and initramfs go above.
pub(super) const HIGH_MEMORY: GuestAddress = GuestAddress(0x10_0000);
/// The start of the 32-bit MMIO gap (no RAM from here to 4 GiB).
pub(super) const MMIO_GAP_START: u64 = 3 << 30;
/// The end of the 32-bit MMIO gap.
pub(super) const MMIO_GAP_END: u64 = 4 << 30;
/// The I/O APIC's registers.
pub(super) const IOAPIC: u64 = 0xfec0_0000;
/// The local APICs' registers.
pub(super) const LAPIC: u64 = 0xfee0_0000;
/// With holes, the RAM at the bottom that stays contiguous, for the kernel (a bzImage
/// decompresses itself at 16 MiB into about 52 MiB for Debian's) and the initramfs.
pub(super) const BOOT_AREA: u64 = 128 << 20;
