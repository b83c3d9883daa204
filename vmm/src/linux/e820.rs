//! The e820 memory map, built from the memory manager's regions.
//!
//! Every RAM region the manager holds becomes usable memory, except the low area the VMM keeps
//! for the firmware tables it writes (the EBDA with the MP table, the VGA hole and the BIOS area
//! with the ACPI tables: 0x9fc00 to 1 MiB), which is reserved. Ranges of the same kind that
//! touch are merged and the map is sorted, so that it reads exactly as the kernel prints it
//! after its own sanitising (`BIOS-e820: [mem 0x…-0x…] usable`).

use std::fmt;

use kvm_memslots::RegionInfo;

use crate::linux::layout;

/// What an e820 range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum E820Kind {
    /// RAM the kernel may use (type 1).
    Usable,
    /// Reserved (type 2).
    Reserved,
}

impl E820Kind {
    /// The type number of the boot protocol.
    pub(super) fn type_number(self) -> u32 {
        match self {
            E820Kind::Usable => 1,
            E820Kind::Reserved => 2,
        }
    }

    /// The word the kernel prints for it.
    fn kernel_word(self) -> &'static str {
        match self {
            E820Kind::Usable => "usable",
            E820Kind::Reserved => "reserved",
        }
    }
}

/// One range of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// First address.
    pub addr: u64,
    /// Size in bytes (never 0).
    pub size: u64,
    /// What it is.
    pub kind: E820Kind,
}

impl E820Entry {
    /// The first address after the range.
    pub fn end(&self) -> u64 {
        self.addr + self.size
    }
}

impl fmt::Display for E820Entry {
    /// As the kernel prints it after its prefix: `[mem 0x0000000000100000-0x000000001fffffff]
    /// usable`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[mem {:#018x}-{:#018x}] {}",
            self.addr,
            self.end() - 1,
            self.kind.kernel_word()
        )
    }
}

/// Builds the map for RAM `regions` (in any order; they never overlap).
pub(super) fn build(regions: &[RegionInfo]) -> Vec<E820Entry> {
    let mut ranges: Vec<(u64, u64)> = regions.iter().map(|r| (r.gpa.0, r.size)).collect();
    ranges.sort_unstable();
    let mut map: Vec<E820Entry> = Vec::new();
    let mut push = |addr: u64, end: u64, kind: E820Kind| {
        if end <= addr {
            return;
        }
        match map.last_mut() {
            Some(last) if last.end() == addr && last.kind == kind => last.size += end - addr,
            _ => map.push(E820Entry {
                addr,
                size: end - addr,
                kind,
            }),
        }
    };
    for (addr, size) in ranges {
        let end = addr + size;
        let ebda = layout::EBDA.0;
        // Below the EBDA: usable; the EBDA to 1 MiB: reserved; above: usable.
        push(addr, end.min(ebda), E820Kind::Usable);
        push(
            addr.max(ebda),
            end.min(layout::LOW_RESERVED_END),
            E820Kind::Reserved,
        );
        push(addr.max(layout::LOW_RESERVED_END), end, E820Kind::Usable);
    }
    map
}

/// The map's lines as the kernel prints them with `prefix` (`BIOS-e820`, `extended`).
pub fn kernel_lines(map: &[E820Entry], prefix: &str) -> Vec<String> {
    map.iter().map(|e| format!("{prefix}: {e}")).collect()
}

/// The e820 lines with `prefix` in a kernel log, in order, without what precedes the prefix on
/// each line (the timestamp).
pub fn lines_in_log(log: &str, prefix: &str) -> Vec<String> {
    let marker = format!("{prefix}: [mem ");
    log.lines()
        .filter_map(|line| {
            line.find(&marker)
                .map(|at| line[at..].trim_end().to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots::RegionId;
    use kvm_memslots::{HostAddress, SlotFlags};
    use vm_memory::GuestAddress;

    fn region(gpa: u64, size: u64) -> RegionInfo {
        RegionInfo {
            id: RegionId(gpa),
            gpa: GuestAddress(gpa),
            size,
            hva: HostAddress(0),
            slots: 1,
            slot_size: size,
            flags: SlotFlags::default(),
            shared: false,
            page_size: kvm_memslots::PageSize::Base,
        }
    }

    #[test]
    fn low_memory_is_carved_and_the_rest_is_usable() {
        let map = build(&[region(0, 512 << 20)]);
        assert_eq!(
            kernel_lines(&map, "BIOS-e820"),
            [
                "BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable",
                "BIOS-e820: [mem 0x000000000009fc00-0x00000000000fffff] reserved",
                "BIOS-e820: [mem 0x0000000000100000-0x000000001fffffff] usable",
            ]
        );
    }

    #[test]
    fn touching_regions_merge_and_holes_stay() {
        let map = build(&[
            region(0x20_0000, 0x10_0000),
            region(0, 0x20_0000),
            region(0x40_0000, 0x1000),
        ]);
        assert_eq!(map.len(), 4);
        assert_eq!(map[2].addr, 0x10_0000);
        assert_eq!(map[2].end(), 0x30_0000);
        assert_eq!(
            map[3],
            E820Entry {
                addr: 0x40_0000,
                size: 0x1000,
                kind: E820Kind::Usable
            }
        );
    }

    #[test]
    fn log_lines_are_found_after_their_timestamps() {
        let log = "[    0.000000] BIOS-provided physical RAM map:\r\n\
                   [    0.000000] BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable\r\n\
                   [    0.000000] extended: [mem 0x0000000000000000-0x000000000009fbff] usable\n";
        assert_eq!(
            lines_in_log(log, "BIOS-e820"),
            ["BIOS-e820: [mem 0x0000000000000000-0x000000000009fbff] usable"]
        );
        assert_eq!(lines_in_log(log, "extended").len(), 1);
    }
}
