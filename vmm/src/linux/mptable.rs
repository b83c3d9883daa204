//! The MP table (Intel MultiProcessor Specification 1.4): how a guest without ACPI learns its
//! processors, the I/O APIC and how the ISA interrupts reach it.
//!
//! It sits in the EBDA ([`layout::EBDA`], reserved in the e820 map), where Linux looks for the
//! floating pointer: the pointer, then the configuration table with one processor entry per vCPU,
//! the ISA bus, the I/O APIC, ISA IRQs 0-23 routed to I/O APIC pins 0-23, and LINT0 ExtINT /
//! LINT1 NMI.

use vm_memory::{Bytes, GuestMemoryBackend};

use crate::linux::layout;

/// Why the MP table could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    /// Too many vCPUs for the EBDA.
    #[error("an MP table for {vcpus} vCPUs takes {size} bytes, more than the EBDA's {room}")]
    TooLarge {
        /// vCPUs.
        vcpus: u8,
        /// Its size.
        size: usize,
        /// The room.
        room: usize,
    },
    /// Writing it failed.
    #[error("writing the MP table failed: {0}")]
    Write(vm_memory::GuestMemoryError),
}

const ROOM: usize = 1024;
const IRQS: u8 = 24;
const LAPIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// The table's bytes for `vcpus` vCPUs, to be placed at the EBDA.
fn build(vcpus: u8) -> Vec<u8> {
    let base = layout::EBDA.0 as u32;
    let ioapic_id = vcpus;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..vcpus {
        // Processor: type 0, APIC ID, version, flags (enabled; BSP), signature (family 6),
        // features (FPU, APIC), reserved.
        entries.extend_from_slice(&[0, id, LAPIC_VERSION, 1 | if id == 0 { 2 } else { 0 }]);
        entries.extend_from_slice(&0x600u32.to_le_bytes());
        entries.extend_from_slice(&0x201u32.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // The I/O APIC: type 2, ID, version, enabled, address.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(layout::IOAPIC as u32).to_le_bytes());
    count += 1;
    for irq in 0..IRQS {
        // I/O interrupt: type 3, INT, flags (conforming), bus 0, its IRQ, I/O APIC, pin.
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // Local interrupts: ExtINT on every LAPIC's LINT0, NMI on LINT1.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let header_len = 44;
    let table_len = (header_len + entries.len()) as u16;
    let mut table = Vec::with_capacity(usize::from(table_len));
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&table_len.to_le_bytes());
    table.push(4); // specification 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"TINYVMM ");
    table.extend_from_slice(b"LINUX GUEST ");
    table.extend_from_slice(&0u32.to_le_bytes()); // no OEM table
    table.extend_from_slice(&0u16.to_le_bytes());
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&(layout::LAPIC as u32).to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // no extended table
    table.push(0);
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut out = Vec::with_capacity(16 + table.len());
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&(base + 16).to_le_bytes());
    out.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
    out[10] = checksum(&out);
    out.extend_from_slice(&table);
    out
}

/// Writes the table for `vcpus` vCPUs at the EBDA.
pub(super) fn write<M: GuestMemoryBackend>(memory: &M, vcpus: u8) -> Result<(), MpTableError> {
    let table = build(vcpus);
    if table.len() > ROOM {
        return Err(MpTableError::TooLarge {
            vcpus,
            size: table.len(),
            room: ROOM,
        });
    }
    memory
        .write_slice(&table, layout::EBDA)
        .map_err(MpTableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_hold_and_the_largest_table_fits() {
        let table = build(crate::linux::config::MAX_VCPUS);
        assert!(table.len() <= ROOM, "{}", table.len());
        let sum = |b: &[u8]| b.iter().fold(0u8, |s, x| s.wrapping_add(*x));
        assert_eq!(sum(&table[..16]), 0);
        assert_eq!(sum(&table[16..]), 0);
        assert_eq!(&table[16..20], b"PCMP");
        let len = u16::from_le_bytes([table[20], table[21]]) as usize;
        assert_eq!(len, table.len() - 16);
        let count = u16::from_le_bytes([table[16 + 34], table[16 + 35]]);
        assert_eq!(count, 32 + 1 + 1 + 24 + 2);
    }
}
