//! Loading the kernel, its command line and initramfs (linux-loader), and the boot parameters:
//! the zero page with the e820 map (and a `SETUP_E820_EXT` entry past 128 ranges) for the Linux
//! boot protocol, or the start info with its memory map for PVH.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{
    boot_e820_entry, boot_params, E820_MAX_ENTRIES_ZEROPAGE, SETUP_E820_EXT,
};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info, XEN_HVM_START_MAGIC_VALUE,
};
use linux_loader::loader::{load_cmdline, BzImage, Cmdline, Elf, KernelLoader, PvhBootCapability};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::linux::config::BootProtocol;
use crate::linux::e820::{E820Entry, E820Kind};
use crate::linux::layout;

/// Why the kernel could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be opened or read.
    #[error("cannot read {what} {path}: {source}")]
    File {
        /// Kernel or initramfs.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The kernel is neither a bzImage nor an ELF file.
    #[error("{0} is neither a bzImage (no \"HdrS\" at 0x202) nor an ELF vmlinux")]
    UnknownFormat(PathBuf),
    /// linux-loader refused the kernel.
    #[error("loading the kernel {path} failed: {source}")]
    Kernel {
        /// The file.
        path: PathBuf,
        /// linux-loader's error.
        source: linux_loader::loader::Error,
    },
    /// PVH was asked for but the kernel has no PVH entry.
    #[error(
        "{0} has no PVH entry (PVH needs an ELF vmlinux with the XEN_ELFNOTE_PHYS32_ENTRY note)"
    )]
    NoPvhEntry(PathBuf),
    /// The bzImage cannot be entered in 64-bit mode.
    #[error("the bzImage {path} has no 64-bit entry (boot protocol {version:#x}, xloadflags {xloadflags:#x}): only 64-bit kernels boot here")]
    Not64Bit {
        /// The file.
        path: PathBuf,
        /// Its boot protocol version.
        version: u16,
        /// Its extended load flags.
        xloadflags: u16,
    },
    /// The command line does not fit.
    #[error("the command line ({len} bytes) is longer than the kernel's limit of {max} bytes")]
    CmdlineTooLong {
        /// Its length.
        len: usize,
        /// The kernel's limit.
        max: usize,
    },
    /// linux-loader refused the command line's text.
    #[error("the command line is not valid: {0}")]
    CmdlineInvalid(linux_loader::cmdline::Error),
    /// linux-loader could not write the command line.
    #[error("the command line cannot be written: {0}")]
    Cmdline(linux_loader::loader::Error),
    /// No RAM range can hold the initramfs.
    #[error("no RAM between {low:#x} and {high:#x} holds the initramfs ({size} bytes): give more memory")]
    NoRoomForInitramfs {
        /// Its size.
        size: u64,
        /// The lowest address it may take (the end of the kernel's area).
        low: u64,
        /// The highest address it may end at.
        high: u64,
    },
    /// The e820 map does not fit in the room for setup_data.
    #[error("the e820 map has {entries} ranges; at most {max} fit in the setup_data area")]
    TooManyRanges {
        /// Ranges in the map.
        entries: usize,
        /// The room.
        max: usize,
    },
    /// PVH passes the memory map through the start info, which Linux copies into its zero page.
    #[error("the e820 map has {entries} ranges but a PVH kernel takes at most {max}: boot a bzImage for more")]
    TooManyRangesForPvh {
        /// Ranges in the map.
        entries: usize,
        /// The most PVH takes.
        max: usize,
    },
    /// Writing guest memory failed.
    #[error("writing the {what} to guest memory failed: {source}")]
    Write {
        /// What was written.
        what: &'static str,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// linux-loader's boot configurator failed.
    #[error("writing the boot parameters failed: {0}")]
    BootParams(linux_loader::configurator::Error),
}

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Entry {
    /// The 64-bit Linux boot protocol: long mode, identity paging, `rsi` = the zero page.
    Linux64 {
        /// Where to jump.
        rip: u64,
    },
    /// PVH: 32-bit protected mode, paging off, `ebx` = the start info.
    Pvh {
        /// Where to jump.
        rip: u64,
    },
}

/// What the kernel's format is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFormat {
    /// A bzImage.
    BzImage,
    /// An ELF vmlinux.
    Elf,
}

/// What loading produced.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    /// The kernel's format.
    pub(crate) format: KernelFormat,
    /// How to enter it.
    pub(crate) entry: Entry,
    /// The e820 map the kernel gets, whole.
    pub(crate) e820: Vec<E820Entry>,
    /// How many of its ranges are in the zero page (the rest are in `SETUP_E820_EXT`).
    pub(crate) zero_page_entries: usize,
    /// Where the `SETUP_E820_EXT` entry is and how long it is (header included), if any.
    pub(crate) setup_data: Option<(GuestAddress, u64)>,
    /// The command line as written.
    pub(crate) cmdline: String,
    /// Where the initramfs went and its size.
    pub(crate) initramfs: Option<(GuestAddress, u64)>,
}

/// The most e820 ranges a PVH kernel takes: Linux copies PVH's memory map into its zero page
/// (128 entries) and adds one for the ISA range.
const PVH_MAX_RANGES: usize = E820_MAX_ENTRIES_ZEROPAGE - 1;

const HDRS_MAGIC: u32 = 0x5372_6448;
const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const XLF_KERNEL_64: u16 = 1;
const LOADER_TYPE_UNDEFINED: u8 = 0xff;

fn open(what: &'static str, path: &Path) -> Result<File, LoadError> {
    File::open(path).map_err(|source| LoadError::File {
        what,
        path: path.to_owned(),
        source,
    })
}

fn kernel_format(file: &mut File, path: &Path) -> Result<KernelFormat, LoadError> {
    let io = |source| LoadError::File {
        what: "kernel",
        path: path.to_owned(),
        source,
    };
    let mut head = [0u8; 0x206];
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    let read = file.read(&mut head).map_err(io)?;
    if read >= 4 && head[..4] == ELF_MAGIC {
        return Ok(KernelFormat::Elf);
    }
    if read >= 0x206 && head[0x202..0x206] == HDRS_MAGIC.to_le_bytes() {
        return Ok(KernelFormat::BzImage);
    }
    Err(LoadError::UnknownFormat(path.to_owned()))
}

/// Loads `kernel` (and `initramfs`) into `memory` with `cmdline`, and writes the boot
/// parameters for the e820 map `e820` for `protocol`, with the ACPI RSDP's address `rsdp`
/// when the guest has ACPI tables.
pub(crate) fn load<M: GuestMemoryBackend>(
    memory: &M,
    kernel: &Path,
    initramfs: Option<&Path>,
    cmdline: &str,
    e820: Vec<E820Entry>,
    protocol: BootProtocol,
    rsdp: Option<GuestAddress>,
) -> Result<Loaded, LoadError> {
    let mut file = open("kernel", kernel)?;
    let format = kernel_format(&mut file, kernel)?;
    let loader_error = |source| LoadError::Kernel {
        path: kernel.to_owned(),
        source,
    };
    let result = match format {
        KernelFormat::BzImage => {
            // Load the protected-mode kernel where it prefers to run (protocol 2.10+), so that
            // a relocatable kernel needs not move itself; linux-loader's default is 1 MiB.
            let mut header = [0u8; 0x268];
            file.seek(SeekFrom::Start(0))
                .and_then(|_| file.read_exact(&mut header))
                .map_err(|source| LoadError::File {
                    what: "kernel",
                    path: kernel.to_owned(),
                    source,
                })?;
            let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
            let version = u16_at(0x206);
            let xloadflags = u16_at(0x236);
            if version < 0x20c || xloadflags & XLF_KERNEL_64 == 0 {
                return Err(LoadError::Not64Bit {
                    path: kernel.to_owned(),
                    version,
                    xloadflags,
                });
            }
            let mut pref = [0u8; 8];
            pref.copy_from_slice(&header[0x258..0x260]);
            let pref_address = u64::from_le_bytes(pref);
            BzImage::load(
                memory,
                Some(GuestAddress(pref_address)),
                &mut file,
                Some(layout::HIGH_MEMORY),
            )
            .map_err(loader_error)?
        }
        KernelFormat::Elf => {
            Elf::load(memory, None, &mut file, Some(layout::HIGH_MEMORY)).map_err(loader_error)?
        }
    };
    // The kernel's area: for a bzImage, the load address plus init_size (where it decompresses
    // itself); for an ELF, its segments.
    let kernel_end = match result.setup_header {
        Some(header) => result.kernel_load.0 + u64::from(header.init_size),
        None => result.kernel_end,
    };

    let max_cmdline = match result.setup_header {
        Some(header) if header.cmdline_size > 0 => header.cmdline_size as usize,
        _ => layout::CMDLINE_MAX - 1,
    };
    if cmdline.len() > max_cmdline.min(layout::CMDLINE_MAX - 1) {
        return Err(LoadError::CmdlineTooLong {
            len: cmdline.len(),
            max: max_cmdline,
        });
    }
    let line =
        Cmdline::try_from(cmdline, layout::CMDLINE_MAX).map_err(LoadError::CmdlineInvalid)?;
    load_cmdline(memory, layout::CMDLINE, &line).map_err(LoadError::Cmdline)?;

    let initramfs = match initramfs {
        Some(path) => {
            let max_end = match result.setup_header {
                Some(header) if header.initrd_addr_max != 0 => {
                    u64::from(header.initrd_addr_max) + 1
                }
                _ => 1 << 32,
            };
            Some(load_initramfs(memory, path, &e820, kernel_end, max_end)?)
        }
        None => None,
    };

    let pvh_entry = match result.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(rip) if format == KernelFormat::Elf => Some(rip),
        _ => None,
    };
    let pvh = match (protocol, pvh_entry) {
        (BootProtocol::Linux, _) => None,
        (BootProtocol::Pvh, None) => return Err(LoadError::NoPvhEntry(kernel.to_owned())),
        (BootProtocol::Pvh, Some(rip)) => Some(rip),
        (BootProtocol::Auto, rip) => rip.filter(|_| e820.len() <= PVH_MAX_RANGES),
    };
    let entry;
    let zero_page_entries;
    let mut setup_data = None;
    match (pvh, result.setup_header) {
        (Some(rip), _) => {
            write_pvh(memory, &e820, initramfs, rsdp)?;
            entry = Entry::Pvh { rip: rip.0 };
            zero_page_entries = 0;
        }
        (None, header) => {
            let mut params = boot_params::default();
            if let Some(header) = header {
                params.hdr = header;
            } else {
                params.hdr.boot_flag = 0xaa55;
                params.hdr.header = HDRS_MAGIC;
            }
            params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
            // Read by kernels of boot protocol 2.14 and later; older ones scan for the RSDP.
            params.acpi_rsdp_addr = rsdp.map_or(0, |a| a.0);
            params.hdr.cmd_line_ptr = layout::CMDLINE.0 as u32;
            params.hdr.cmdline_size = cmdline.len() as u32;
            if let Some((addr, size)) = initramfs {
                params.hdr.ramdisk_image = addr.0 as u32;
                params.hdr.ramdisk_size = size as u32;
            }
            zero_page_entries = e820.len().min(E820_MAX_ENTRIES_ZEROPAGE);
            for (slot, entry) in params.e820_table.iter_mut().zip(&e820) {
                *slot = boot_entry(entry);
            }
            params.e820_entries = zero_page_entries as u8;
            if e820.len() > E820_MAX_ENTRIES_ZEROPAGE {
                let written = write_e820_ext(memory, &e820[E820_MAX_ENTRIES_ZEROPAGE..])?;
                params.hdr.setup_data = layout::SETUP_DATA.0;
                setup_data = Some((layout::SETUP_DATA, written));
            }
            LinuxBootConfigurator::write_bootparams(
                &BootParams::new(&params, layout::ZERO_PAGE),
                memory,
            )
            .map_err(LoadError::BootParams)?;
            entry = Entry::Linux64 {
                rip: match format {
                    // startup_64 sits 0x200 bytes into the protected-mode kernel.
                    KernelFormat::BzImage => result.kernel_load.0 + 0x200,
                    KernelFormat::Elf => result.kernel_load.0,
                },
            };
        }
    }
    Ok(Loaded {
        format,
        entry,
        e820,
        zero_page_entries,
        setup_data,
        cmdline: cmdline.to_owned(),
        initramfs,
    })
}

fn boot_entry(entry: &E820Entry) -> boot_e820_entry {
    boot_e820_entry {
        addr: entry.addr,
        size: entry.size,
        r#type: entry.kind.type_number(),
    }
}

/// Writes the `SETUP_E820_EXT` setup_data entry (header: next, type, len; then the ranges as
/// 20-byte e820 entries); returns its length with the header.
fn write_e820_ext<M: GuestMemoryBackend>(memory: &M, rest: &[E820Entry]) -> Result<u64, LoadError> {
    const HEADER: usize = 16;
    const ENTRY: usize = 20;
    let max = (layout::SETUP_DATA_END - layout::SETUP_DATA.0) as usize;
    let max_entries = (max - HEADER) / ENTRY;
    if rest.len() > max_entries {
        return Err(LoadError::TooManyRanges {
            entries: rest.len() + E820_MAX_ENTRIES_ZEROPAGE,
            max: max_entries + E820_MAX_ENTRIES_ZEROPAGE,
        });
    }
    let len = rest.len() * ENTRY;
    let mut bytes = Vec::with_capacity(HEADER + len);
    bytes.extend_from_slice(&0u64.to_le_bytes()); // next: none
    bytes.extend_from_slice(&SETUP_E820_EXT.to_le_bytes());
    bytes.extend_from_slice(&(len as u32).to_le_bytes());
    for entry in rest {
        bytes.extend_from_slice(&entry.addr.to_le_bytes());
        bytes.extend_from_slice(&entry.size.to_le_bytes());
        bytes.extend_from_slice(&entry.kind.type_number().to_le_bytes());
    }
    memory
        .write_slice(&bytes, layout::SETUP_DATA)
        .map_err(|source| LoadError::Write {
            what: "SETUP_E820_EXT setup_data",
            source,
        })?;
    Ok(bytes.len() as u64)
}

/// Puts the initramfs as high as it can go in a usable range, above the kernel's area and
/// ending at or below `max_end`.
fn load_initramfs<M: GuestMemoryBackend>(
    memory: &M,
    path: &Path,
    e820: &[E820Entry],
    low: u64,
    max_end: u64,
) -> Result<(GuestAddress, u64), LoadError> {
    let mut file = open("initramfs", path)?;
    let io = |source| LoadError::File {
        what: "initramfs",
        path: path.to_owned(),
        source,
    };
    let size = file.seek(SeekFrom::End(0)).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    let page = 4096;
    let addr = e820
        .iter()
        .rev()
        .filter(|e| e.kind == E820Kind::Usable)
        .find_map(|e| {
            let end = e.end().min(max_end);
            let start = end.checked_sub(size)? & !(page - 1);
            (start >= e.addr.max(low)).then_some(start)
        })
        .ok_or(LoadError::NoRoomForInitramfs {
            size,
            low,
            high: max_end,
        })?;
    memory
        .read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|source| LoadError::Write {
            what: "initramfs",
            source,
        })?;
    Ok((GuestAddress(addr), size))
}

fn write_pvh<M: GuestMemoryBackend>(
    memory: &M,
    e820: &[E820Entry],
    initramfs: Option<(GuestAddress, u64)>,
    rsdp: Option<GuestAddress>,
) -> Result<(), LoadError> {
    let max = PVH_MAX_RANGES;
    if e820.len() > max {
        return Err(LoadError::TooManyRangesForPvh {
            entries: e820.len(),
            max,
        });
    }
    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: 1,
        cmdline_paddr: layout::CMDLINE.0,
        memmap_paddr: layout::PVH_MEMMAP.0,
        memmap_entries: e820.len() as u32,
        rsdp_paddr: rsdp.map_or(0, |a| a.0),
        ..Default::default()
    };
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind.type_number(),
            reserved: 0,
        })
        .collect();
    let mut params = BootParams::new(&start_info, layout::PVH_START_INFO);
    params.set_sections(&memmap, layout::PVH_MEMMAP);
    if let Some((addr, size)) = initramfs {
        start_info.nr_modules = 1;
        start_info.modlist_paddr = layout::PVH_MODLIST.0;
        params = BootParams::new(&start_info, layout::PVH_START_INFO);
        params.set_sections(&memmap, layout::PVH_MEMMAP);
        params.set_modules(
            &[hvm_modlist_entry {
                paddr: addr.0,
                size,
                ..Default::default()
            }],
            layout::PVH_MODLIST,
        );
    }
    PvhBootConfigurator::write_bootparams(&params, memory).map_err(LoadError::BootParams)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linux::config::BootConfig;
    use crate::linux::{e820, layout};
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use vm_memory::ByteValued;

    const PREF_ADDRESS: u64 = 0x100_0000;
    const INIT_SIZE: u32 = 0x200_0000;

    /// A bzImage as far as loaders look: the setup header of protocol 2.15 (64-bit, relocatable)
    /// after one setup sector, then a payload.
    fn fake_bzimage(payload: &[u8]) -> Vec<u8> {
        let mut image = vec![0u8; 2 * 512];
        image[0x1f1] = 1; // setup_sects
        image[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        image[0x202..0x206].copy_from_slice(&HDRS_MAGIC.to_le_bytes());
        image[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes());
        image[0x211] = 1; // loadflags: LOADED_HIGH
        image[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
        image[0x22c..0x230].copy_from_slice(&0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
        image[0x236..0x238].copy_from_slice(&XLF_KERNEL_64.to_le_bytes());
        image[0x238..0x23c].copy_from_slice(&0x7ffu32.to_le_bytes()); // cmdline_size
        image[0x258..0x260].copy_from_slice(&PREF_ADDRESS.to_le_bytes());
        image[0x260..0x264].copy_from_slice(&INIT_SIZE.to_le_bytes());
        image.extend_from_slice(payload);
        image
    }

    fn guest(config: &BootConfig) -> (MemoryManager<FakeKvm>, Vec<E820Entry>) {
        let memory = MemoryManager::new(FakeKvm::new(4096, false));
        for r in crate::linux::ram::ram_regions(config) {
            memory
                .add_region(RegionSpec::new(r.gpa, r.size).with_slot_size(r.slot_size))
                .unwrap();
        }
        let map = e820::build(&memory.regions());
        (memory, map)
    }

    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("tinyvmm-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn a_bzimage_gets_a_zero_page_with_the_map_and_setup_e820_ext_past_128_ranges() {
        let config = BootConfig {
            mem_mib: 256,
            mem_slots: 512,
            mem_holes: true,
            ..BootConfig::default()
        };
        let (memory, map) = guest(&config);
        assert_eq!(map.len(), 258);
        let kernel = temp_file("bzimage", &fake_bzimage(b"payload!"));
        let initrd = temp_file("initrd", &[7u8; 5000]);
        let loaded = load(
            &*memory.current(),
            &kernel,
            Some(&initrd),
            "console=ttyS0",
            map.clone(),
            BootProtocol::Auto,
            Some(layout::ACPI_TABLES),
        )
        .unwrap();
        std::fs::remove_file(kernel).unwrap();
        std::fs::remove_file(initrd).unwrap();
        let snapshot = memory.current();
        assert_eq!(loaded.format, KernelFormat::BzImage);
        assert_eq!(
            loaded.entry,
            Entry::Linux64 {
                rip: PREF_ADDRESS + 0x200
            }
        );
        let mut payload = [0u8; 8];
        snapshot
            .read_slice(&mut payload, GuestAddress(PREF_ADDRESS))
            .unwrap();
        assert_eq!(&payload, b"payload!");

        let params: boot_params = snapshot.read_obj(layout::ZERO_PAGE).unwrap();
        assert_eq!(params.e820_entries, 128);
        for (entry, expected) in params.e820_table.iter().zip(&map) {
            let (addr, size, kind) = (entry.addr, entry.size, entry.r#type);
            assert_eq!(
                (addr, size, kind),
                (expected.addr, expected.size, expected.kind.type_number())
            );
        }
        let (cmd_line_ptr, loader, setup_data) = (
            params.hdr.cmd_line_ptr,
            params.hdr.type_of_loader,
            params.hdr.setup_data,
        );
        assert_eq!(cmd_line_ptr as u64, layout::CMDLINE.0);
        assert_eq!(loader, 0xff);
        assert_eq!(setup_data, layout::SETUP_DATA.0);
        let rsdp = params.acpi_rsdp_addr;
        assert_eq!(rsdp, layout::ACPI_TABLES.0);
        let mut cmdline = [0u8; 14];
        snapshot.read_slice(&mut cmdline, layout::CMDLINE).unwrap();
        assert_eq!(&cmdline, b"console=ttyS0\0");

        // The initramfs: as high as it goes in the contiguous RAM below initrd_addr_max, past
        // the kernel's area.
        let (ramdisk, ramdisk_size) = (params.hdr.ramdisk_image, params.hdr.ramdisk_size);
        assert_eq!(ramdisk_size, 5000);
        assert!(u64::from(ramdisk) >= PREF_ADDRESS + u64::from(INIT_SIZE));
        assert_eq!(loaded.initramfs, Some((GuestAddress(ramdisk.into()), 5000)));
        let usable = map
            .iter()
            .any(|e| e.addr <= ramdisk.into() && u64::from(ramdisk) + 5000 <= e.end());
        assert!(usable, "{ramdisk:#x}");

        // SETUP_E820_EXT: next, type, len, then the other 130 ranges.
        let header: [u32; 4] = snapshot.read_obj(layout::SETUP_DATA).unwrap();
        assert_eq!(header, [0, 0, SETUP_E820_EXT, 130 * 20]);
        let mut rest = vec![0u8; 130 * 20];
        snapshot
            .read_slice(&mut rest, GuestAddress(layout::SETUP_DATA.0 + 16))
            .unwrap();
        for (raw, expected) in rest.chunks(20).zip(&map[128..]) {
            let addr = u64::from_le_bytes(raw[..8].try_into().unwrap());
            let size = u64::from_le_bytes(raw[8..16].try_into().unwrap());
            assert_eq!((addr, size), (expected.addr, expected.size));
        }
        assert_eq!(loaded.setup_data, Some((layout::SETUP_DATA, 16 + 130 * 20)));
        assert_eq!(boot_params::default().as_slice().len(), 4096);
    }

    #[test]
    fn pvh_refuses_a_map_it_cannot_pass_and_a_kernel_without_the_note() {
        let config = BootConfig {
            mem_mib: 256,
            mem_slots: 512,
            mem_holes: true,
            ..BootConfig::default()
        };
        let (memory, map) = guest(&config);
        let kernel = temp_file("bzimage-pvh", &fake_bzimage(b"x"));
        let e = load(
            &*memory.current(),
            &kernel,
            None,
            "",
            map,
            BootProtocol::Pvh,
            None,
        )
        .unwrap_err();
        std::fs::remove_file(&kernel).unwrap();
        assert!(e.to_string().contains("has no PVH entry"), "{e}");
        let junk = temp_file("junk", b"not a kernel at all");
        let e = load(
            &*memory.current(),
            &junk,
            None,
            "",
            Vec::new(),
            BootProtocol::Auto,
            None,
        )
        .unwrap_err();
        std::fs::remove_file(&junk).unwrap();
        assert!(e.to_string().contains("neither a bzImage"), "{e}");
    }
}
