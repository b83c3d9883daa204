//! ACPI tables for a Linux guest: how a stock kernel finds the vCPUs, the I/O APIC, the serial
//! port and the virtio-mmio devices without command-line help.
//!
//! A hardware-reduced ACPI 6.5 platform, as microVMs have (Firecracker, Cloud Hypervisor and
//! QEMU's `microvm` machine do the same): no PM1 blocks, SCI or PM timer to emulate. The kernel
//! then finds its devices in the DSDT alone:
//!
//! - `COM1` (`PNP0501`): the 16550 at 0x3f8 on IRQ 4. In a hardware-reduced platform Linux sets
//!   up no legacy PIC and maps no ISA interrupt by identity, so the serial port's interrupt
//!   must be described for the tty to get it.
//! - one `LNRO0005` device per virtio-mmio window (the id Linux's `virtio_mmio` driver matches),
//!   with its window and its interrupt (edge, active high: an irqfd on an I/O APIC pin).
//!
//! The MADT lists one local APIC per vCPU and the I/O APIC (its id and the GSIs from 0); the
//! MP table stays for kernels without ACPI. Everything sits between [`layout::ACPI_TABLES`]
//! and the end of the low reserved area, the RSDP first (where Linux scans for it when the
//! boot parameters do not carry its address).

use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{Aml, AmlSink};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::devices::legacy::{SERIAL_IRQ, SERIAL_PORT};
use crate::linux::layout;

const OEM_ID: [u8; 6] = *b"TINYVM";
const OEM_REVISION: u32 = 1;
/// `IAPC_BOOT_ARCH`: no VGA (bit 2), no MSI (bit 3), no PCIe ASPM controls (bit 4), no CMOS RTC
/// (bit 5). The serial port and the i8042 are what the VMM has; the i8042 is only a reset line.
const IAPC_BOOT_ARCH: u16 = (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5);

/// A virtio-mmio device as the guest finds it in the DSDT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmioDevice {
    /// The window's guest-physical address (below 4 GiB).
    pub(crate) base: u32,
    /// The window's size.
    pub(crate) size: u32,
    /// Its interrupt: an I/O APIC pin.
    pub(crate) gsi: u32,
}

/// Why the tables could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// They do not fit their room.
    #[error("the ACPI tables take {size} bytes, more than the {room} bytes of room for them")]
    TooLarge {
        /// Their size.
        size: usize,
        /// The room.
        room: usize,
    },
    /// Writing them failed.
    #[error("writing the ACPI tables failed: {0}")]
    Write(vm_memory::GuestMemoryError),
}

/// The tables, each with its guest-physical address, the RSDP first.
#[derive(Debug)]
pub(crate) struct Tables {
    /// (address, bytes) per table.
    tables: Vec<(GuestAddress, Vec<u8>)>,
}

impl Tables {
    /// The RSDP's address (for the zero page and the PVH start info).
    pub(super) fn rsdp(&self) -> GuestAddress {
        self.tables[0].0
    }

    /// The table with `signature`, if there is one.
    #[cfg(test)]
    fn find(&self, signature: &[u8; 4]) -> Option<&[u8]> {
        self.tables
            .iter()
            .map(|(_, bytes)| bytes.as_slice())
            .find(|bytes| bytes.starts_with(signature))
    }

    /// The end of the last table.
    fn end(&self) -> u64 {
        self.tables
            .last()
            .map_or(0, |(at, bytes)| at.0 + bytes.len() as u64)
    }
}

/// An ISA interrupt as `IRQNoFlags` (the small IRQ descriptor: edge, active high, exclusive).
struct IrqNoFlags(u32);

impl Aml for IrqNoFlags {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.byte(0x22);
        sink.word(1 << self.0);
    }
}

fn bytes_of(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

/// The DSDT's definition block: `\_SB.COM1` and one `\_SB.Vnnn` per virtio-mmio device.
fn dsdt(devices: &[MmioDevice]) -> Vec<u8> {
    // Each device is serialised in one statement: the AML builders borrow their parts.
    let mut body = Vec::new();
    aml::Device::new(
        "COM1".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
            &aml::Name::new("_UID".into(), &aml::ONE),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::IO::new(SERIAL_PORT, SERIAL_PORT, 1, 8),
                    &IrqNoFlags(SERIAL_IRQ),
                ]),
            ),
        ],
    )
    .to_aml_bytes(&mut body);
    for (index, device) in devices.iter().enumerate() {
        let name = format!("V{index:03X}");
        aml::Device::new(
            name.as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &"LNRO0005"),
                &aml::Name::new("_UID".into(), &(index as u64)),
                // Cache-coherent DMA.
                &aml::Name::new("_CCA".into(), &aml::ONE),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![
                        &aml::Memory32Fixed::new(true, device.base, device.size),
                        &aml::Interrupt::new(true, true, false, false, device.gsi),
                    ]),
                ),
            ],
        )
        .to_aml_bytes(&mut body);
    }
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, *b"TINYDSDT", OEM_REVISION);
    dsdt.append_slice(&bytes_of(&aml::Scope::new("_SB_".into(), vec![&Raw(body)])));
    dsdt.as_slice().to_vec()
}

/// AML already serialised.
struct Raw(Vec<u8>);

impl Aml for Raw {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(&self.0);
    }
}

/// Lays the tables out from [`layout::ACPI_TABLES`] for `vcpus` vCPUs and `devices`.
fn build(vcpus: u8, devices: &[MmioDevice]) -> Tables {
    let align = |at: u64| at.next_multiple_of(16);
    let rsdp_at = layout::ACPI_TABLES.0;
    let xsdt_at = align(rsdp_at + Rsdp::len() as u64);
    // The XSDT lists the FADT and the MADT (8 bytes each after its 36-byte header).
    let fadt_at = align(xsdt_at + 36 + 2 * 8);

    let mut madt = MADT::new(
        OEM_ID,
        *b"TINYMADT",
        OEM_REVISION,
        LocalInterruptController::Address(layout::LAPIC as u32),
    );
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    // The I/O APIC's id follows the vCPUs' (as in the MP table); its pins are GSIs 0-23.
    madt.add_structure(IoApic::new(vcpus, layout::IOAPIC as u32, 0));
    let madt = bytes_of(&madt);

    let madt_at = align(fadt_at + acpi_tables::fadt::FADT::len() as u64);
    let dsdt_at = align(madt_at + madt.len() as u64);
    let mut fadt = FADTBuilder::new(OEM_ID, *b"TINYFACP", OEM_REVISION)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .dsdt_64(dsdt_at);
    fadt.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    let fadt = bytes_of(&fadt.finalize());

    let mut xsdt = XSDT::new(OEM_ID, *b"TINYXSDT", OEM_REVISION);
    xsdt.add_entry(fadt_at);
    xsdt.add_entry(madt_at);
    let xsdt = bytes_of(&xsdt);
    debug_assert_eq!(xsdt.len(), 36 + 2 * 8);

    Tables {
        tables: vec![
            (GuestAddress(rsdp_at), bytes_of(&Rsdp::new(OEM_ID, xsdt_at))),
            (GuestAddress(xsdt_at), xsdt),
            (GuestAddress(fadt_at), fadt),
            (GuestAddress(madt_at), madt),
            (GuestAddress(dsdt_at), dsdt(devices)),
        ],
    }
}

/// Writes the tables for `vcpus` vCPUs and `devices` into `memory`; returns them (the RSDP's
/// address is what the boot parameters carry).
pub(crate) fn write<M: GuestMemoryBackend>(
    memory: &M,
    vcpus: u8,
    devices: &[MmioDevice],
) -> Result<Tables, AcpiError> {
    let tables = build(vcpus, devices);
    if tables.end() > layout::LOW_RESERVED_END {
        return Err(AcpiError::TooLarge {
            size: (tables.end() - layout::ACPI_TABLES.0) as usize,
            room: (layout::LOW_RESERVED_END - layout::ACPI_TABLES.0) as usize,
        });
    }
    for (at, bytes) in &tables.tables {
        memory.write_slice(bytes, *at).map_err(AcpiError::Write)?;
    }
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    fn u32_at(bytes: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
    }

    fn u64_at(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    }

    fn device() -> MmioDevice {
        MmioDevice {
            base: 0xd000_0000,
            size: 0x200,
            gsi: 5,
        }
    }

    #[test]
    fn every_table_sums_to_zero_and_states_its_length() {
        let tables = build(crate::linux::config::MAX_VCPUS, &[device(), device()]);
        let (rsdp_at, rsdp) = &tables.tables[0];
        assert_eq!(
            rsdp_at.0 % 16,
            0,
            "Linux scans for the RSDP on 16-byte boundaries"
        );
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0, "ACPI 1.0 checksum");
        assert_eq!(sum(rsdp), 0, "extended checksum");
        for (_, table) in &tables.tables[1..] {
            assert_eq!(u32_at(table, 4) as usize, table.len());
            assert_eq!(sum(table), 0, "{:?}", std::str::from_utf8(&table[..4]));
        }
        assert!(tables.end() <= layout::LOW_RESERVED_END);
    }

    #[test]
    fn pointers_lead_from_the_rsdp_to_every_table() {
        let tables = build(2, &[device()]);
        let at = |addr: u64| {
            tables
                .tables
                .iter()
                .find(|(a, _)| a.0 == addr)
                .map(|(_, b)| b.as_slice())
                .unwrap_or_else(|| panic!("nothing at {addr:#x}"))
        };
        let xsdt = at(u64_at(&tables.tables[0].1, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        let listed: Vec<&[u8]> = (36..xsdt.len())
            .step_by(8)
            .map(|o| &at(u64_at(xsdt, o))[..4])
            .collect();
        assert_eq!(listed, [b"FACP", b"APIC"]);
        let fadt = tables.find(b"FACP").unwrap();
        assert_eq!(u32_at(fadt, 112) & (1 << 20), 1 << 20, "HW_REDUCED_ACPI");
        assert_eq!(&at(u64_at(fadt, 140))[..4], b"DSDT", "X_DSDT");
        assert_eq!(u32_at(fadt, 40), 0, "no 32-bit DSDT beside X_DSDT");
    }

    #[test]
    fn the_madt_has_a_local_apic_per_vcpu_and_the_io_apic() {
        let tables = build(3, &[]);
        let madt = tables.find(b"APIC").unwrap();
        assert_eq!(u32_at(madt, 36), layout::LAPIC as u32);
        let mut entries = Vec::new();
        let mut at = 44;
        while at < madt.len() {
            let (kind, len) = (madt[at], usize::from(madt[at + 1]));
            entries.push((kind, madt[at + 2..at + len].to_vec()));
            at += len;
        }
        assert_eq!(at, madt.len());
        let lapics: Vec<(u8, u8)> = entries
            .iter()
            .filter(|(k, _)| *k == 0)
            .map(|(_, e)| (e[0], e[1]))
            .collect();
        assert_eq!(lapics, [(0, 0), (1, 1), (2, 2)]);
        let ioapics: Vec<&Vec<u8>> = entries
            .iter()
            .filter(|(k, _)| *k == 1)
            .map(|(_, e)| e)
            .collect();
        assert_eq!(ioapics.len(), 1);
        assert_eq!(ioapics[0][0], 3, "its id follows the vCPUs'");
        assert_eq!(u32_at(ioapics[0], 2), layout::IOAPIC as u32);
        assert_eq!(u32_at(ioapics[0], 6), 0, "GSI base");
    }

    #[test]
    fn the_dsdt_names_each_virtio_mmio_window_and_its_interrupt() {
        let second = MmioDevice {
            base: 0xd000_1000,
            size: 0x200,
            gsi: 6,
        };
        let dsdt = dsdt(&[device(), second]);
        let contains = |needle: &[u8]| dsdt.windows(needle.len()).any(|w| w == needle);
        assert_eq!(dsdt.windows(9).filter(|w| w == b"LNRO0005\0").count(), 2);
        assert!(contains(b"V000") && contains(b"V001") && contains(b"COM1"));
        // Memory32Fixed (0x86, length 9, read-write, base, size) per window.
        for d in [device(), second] {
            let mut window = vec![0x86, 9, 0, 1];
            window.extend_from_slice(&d.base.to_le_bytes());
            window.extend_from_slice(&d.size.to_le_bytes());
            assert!(contains(&window), "{d:?}");
            // Extended interrupt (0x89, length 6, consumer + edge, one GSI).
            let mut irq = vec![0x89, 6, 0, 0b11, 1];
            irq.extend_from_slice(&d.gsi.to_le_bytes());
            assert!(contains(&irq), "{d:?}");
        }
        // COM1: IO(Decode16, 0x3f8, 0x3f8, 1, 8) and IRQNoFlags {4}.
        assert!(contains(&[0x47, 1, 0xf8, 3, 0xf8, 3, 1, 8]));
        assert!(contains(&[0x22, 1 << 4, 0]));
    }

    /// ACPICA (the ACPI code Linux runs) reads every table back: `iasl -d` checks the
    /// checksums and disassembles the DSDT's AML.
    #[test]
    fn acpica_disassembles_every_table_as_built() {
        let Ok(status) = std::process::Command::new("iasl").arg("-v").output() else {
            eprintln!(
                "SKIPPED acpica_disassembles_every_table_as_built: iasl is missing \
                 (resources/setup-host.sh installs acpica-tools)"
            );
            return;
        };
        assert!(status.status.success());
        let dir = std::env::temp_dir().join(format!("tinyvmm-acpi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tables = build(2, &[device()]);
        let mut names = Vec::new();
        // The RSDP is no table iasl takes alone; its checksums are checked above.
        for (_, bytes) in &tables.tables[1..] {
            let name = std::str::from_utf8(&bytes[..4]).unwrap().replace(' ', "_");
            std::fs::write(dir.join(format!("{name}.dat")), bytes).unwrap();
            names.push(name);
        }
        let mut text = String::new();
        for name in &names {
            let out = std::process::Command::new("iasl")
                .current_dir(&dir)
                .args(["-d", &format!("{name}.dat")])
                .output()
                .unwrap();
            assert!(out.status.success(), "{name}: {out:?}");
            text.push_str(&std::fs::read_to_string(dir.join(format!("{name}.dsl"))).unwrap());
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!text.contains("Incorrect checksum"), "{text}");
        for expected in [
            "Hardware Reduced (V5) : 1",
            "Local Apic ID : 01",
            "Subtable Type : 01 [I/O APIC]",
            "Address : FEC00000",
            "Scope (_SB)",
            "Name (_HID, EisaId (\"PNP0501\")",
            "Name (_HID, \"LNRO0005\")",
            "0xD0000000,         // Address Base",
            "0x00000200,         // Address Length",
            "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, )",
            "0x00000005,",
            "IRQNoFlags ()",
        ] {
            assert!(text.contains(expected), "no {expected:?} in\n{text}");
        }
    }
}
