//! What to boot, from the command line or a JSON file.

use std::path::{Path, PathBuf};

use kvm_memslots::MemoryLimits;
use serde::{Deserialize, Serialize};

use crate::control::hotplug::{HotplugConfig, HotplugConfigError, HotplugNames};
use crate::control::memory::RegionPageSize;
use crate::linux::layout;

/// The most vCPUs: the MP table in the EBDA has room for 32 processor entries.
pub(super) const MAX_VCPUS: u8 = 32;

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BootProtocol {
    /// PVH for an ELF with the PVH note whose e820 map fits PVH's 127 ranges; the 64-bit Linux
    /// boot protocol otherwise.
    #[default]
    Auto,
    /// The 64-bit Linux boot protocol (zero page, `SETUP_E820_EXT` past 128 ranges).
    Linux,
    /// PVH (an ELF vmlinux with the PVH note).
    Pvh,
}

/// A Linux guest to boot.
///
/// As JSON (`tinyvmm boot --config FILE`), with every field but `kernel` optional:
///
/// ```json
/// { "kernel": "vmlinuz", "initramfs": "initrd.cpio.gz", "cmdline": "console=ttyS0",
///   "vcpus": 1, "mem_mib": 512, "mem_slots": 4096, "mem_holes": false, "timeout_secs": 30,
///   "protocol": "auto", "hotplug_mib": 1024, "hotplug_block_mib": 2,
///   "hotplug_max_slot_mib": 128, "api_sock": "api.sock", "acpi": true, "page_size": "2m",
///   "hotplug_page_size": "4k" }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BootConfig {
    /// The kernel: a bzImage, or an ELF vmlinux (PVH entry when it has the note).
    pub kernel: PathBuf,
    /// An initramfs to load with it.
    pub initramfs: Option<PathBuf>,
    /// The kernel command line.
    pub cmdline: String,
    /// vCPUs (1 to `MAX_VCPUS`, 32).
    pub vcpus: u8,
    /// MiB of RAM.
    pub mem_mib: u64,
    /// KVM slots the RAM is split into, all of one size (which must be whole pages).
    pub mem_slots: u64,
    /// Leave a hole after every slot above the first 128 MiB, so that the e820 map has one RAM
    /// range per such slot (more than the zero page's 128 with enough slots).
    pub mem_holes: bool,
    /// Stop the VM after this many seconds (none: run until the guest resets or stops).
    pub timeout_secs: Option<f64>,
    /// How to enter the kernel.
    pub protocol: BootProtocol,
    /// MiB of hotpluggable memory behind a virtio-mem device (0: no device): a multiple of the
    /// block size, at most 1 TiB (the rules of `PUT /hotplug/memory`, `Self::hotplug`).
    /// Nothing of it is plugged at boot; `PATCH /hotplug/memory` on the API socket asks the
    /// guest to plug.
    pub hotplug_mib: u64,
    /// The virtio-mem device's block size in MiB (a power of two, at least 2).
    pub hotplug_block_mib: u64,
    /// The largest KVM slot neighbouring plugged blocks share, in MiB: a multiple of the block
    /// size (a smaller one counts as the block size), or 0 for a slot per plugged block.
    pub hotplug_max_slot_mib: u64,
    /// An API socket (`/hotplug/memory`, `/memory`, `/vm`, `/actions`) while the guest runs.
    pub api_sock: Option<PathBuf>,
    /// Give the guest ACPI tables (how a stock kernel finds the virtio-mem device). Without,
    /// it has the MP table alone and finds the device on its command line.
    pub acpi: bool,
    /// Put RAM in memfds (shared memory): a local migration then hands it over to the
    /// destination instead of copying it.
    pub memfd: bool,
    /// The host pages behind RAM: `4k`, `2m` (hugetlb, `MFD_HUGETLB` with `memfd`: RAM and
    /// each slot a multiple of 2 MiB, the pool holding all of RAM) or `thp`.
    pub page_size: RegionPageSize,
    /// The host pages behind the virtio-mem device's plugged blocks, `4k` by default whatever
    /// RAM's are (with `2m` the pool must hold a piece when the guest plugs into it: a plug
    /// it cannot hold is answered BUSY). The block size, at least 2 MiB, is whole huge pages.
    pub hotplug_page_size: RegionPageSize,
    /// Harvest dirty pages from per-vCPU rings of this many entries instead of per-slot
    /// bitmaps (refused on a host that runs guest ring 0 in KVM's emulator, which can overflow
    /// a ring: see `docs/DESIGN.md`).
    pub dirty_ring: Option<u32>,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]). From the command line only (`--max-*`), never from
    /// a configuration file.
    #[serde(skip)]
    pub limits: Option<MemoryLimits>,
}

impl Default for BootConfig {
    fn default() -> Self {
        BootConfig {
            kernel: PathBuf::new(),
            initramfs: None,
            cmdline: "console=ttyS0 reboot=k panic=-1".to_owned(),
            vcpus: 1,
            mem_mib: 512,
            mem_slots: 1,
            mem_holes: false,
            timeout_secs: None,
            protocol: BootProtocol::Auto,
            hotplug_mib: 0,
            hotplug_block_mib: 2,
            hotplug_max_slot_mib: DEFAULT_HOTPLUG_MAX_SLOT_MIB,
            api_sock: None,
            acpi: true,
            memfd: false,
            page_size: RegionPageSize::Base,
            hotplug_page_size: RegionPageSize::Base,
            dirty_ring: None,
            limits: None,
        }
    }
}

/// Why a configuration cannot be booted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The file is no valid configuration.
    #[error("the config file {path} is not a valid boot configuration: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// serde's message.
        source: serde_json::Error,
    },
    /// No kernel given.
    #[error("no kernel given")]
    NoKernel,
    /// vCPU count out of range.
    #[error("{0} vCPUs asked for: 1 to {MAX_VCPUS} are supported")]
    Vcpus(u8),
    /// Too little RAM for a kernel.
    #[error("{0} MiB of RAM is too little: a kernel needs at least {min} MiB", min = MIN_MEM_MIB)]
    TooLittleMemory(u64),
    /// More RAM than guest-physical addresses this VMM lays out.
    #[error("{0} MiB of RAM is more than the {max} MiB this VMM lays out", max = MAX_MEM_MIB)]
    TooMuchMemory(u64),
    /// The RAM cannot be split into equal slots of whole pages.
    #[error("{mem_mib} MiB of RAM cannot be split into {slots} KVM slots of whole 4 KiB pages (of equal size with holes or past 3 GiB)")]
    Slots {
        /// RAM.
        mem_mib: u64,
        /// Slots asked for.
        slots: u64,
    },
    /// With 2 MiB pages, RAM or its slot size is off the 2 MiB grid.
    #[error("with page_size 2m, {what} must be a multiple of 2 MiB: {mem_mib} MiB of RAM in {slots} KVM slots of equal size (of {slot_size:#x} bytes)")]
    HugePageGrid {
        /// Which value: "mem_mib" or "the slot size".
        what: &'static str,
        /// RAM.
        mem_mib: u64,
        /// Slots asked for.
        slots: u64,
        /// The slot size they make (rounded down to bytes).
        slot_size: u64,
    },
    /// With holes, the boot area must itself be whole slots, and RAM must reach past it.
    #[error("with holes, RAM ({mem_mib} MiB) must exceed the {boot} MiB boot area, which must be whole slots of {slot_size} bytes", boot = layout::BOOT_AREA >> 20)]
    Holes {
        /// RAM.
        mem_mib: u64,
        /// The slot size.
        slot_size: u64,
    },
    /// The command line is too long or holds a NUL.
    #[error("the command line ({len} bytes) must be shorter than {max} bytes and hold no NUL", max = layout::CMDLINE_MAX)]
    Cmdline {
        /// Its length.
        len: usize,
    },
    /// A timeout that is no positive number of seconds.
    #[error("timeout {0} is not a positive number of seconds")]
    Timeout(f64),
    /// Dirty rings on a host whose KVM runs guest ring 0 in its emulator.
    #[error(
        "--dirty-ring is refused on this host: its KVM runs the guest kernel in an instruction \
         emulator that writes dirty entries without stopping at a full ring, so entries would be \
         lost (dirty logging uses per-slot bitmaps instead)"
    )]
    RingOnEmulatedHost,
    /// The hotplug sizes break the rules every hotplug area obeys
    /// (`HotplugConfig::validate_as`), named as in a boot configuration.
    #[error(transparent)]
    Hotplug(#[from] HotplugConfigError),
}

/// The least RAM: a bzImage decompresses itself at 16 MiB into some 50 MiB.
const MIN_MEM_MIB: u64 = 128;
/// The most RAM (1 TiB).
const MAX_MEM_MIB: u64 = 1 << 20;
/// The hotplug fields of a boot configuration, as its errors name them.
pub(crate) const HOTPLUG_NAMES: HotplugNames = HotplugNames {
    total: "hotplug_mib",
    block: "hotplug_block_mib",
    slot: "hotplug_max_slot_mib",
    slot_default: "0",
};
/// The hotplug area's maximum slot size by default: 128 MiB, a Linux memory block (what its
/// `virtio_mem` driver plugs when it can), so 1 GiB plugged is 8 KVM slots.
pub const DEFAULT_HOTPLUG_MAX_SLOT_MIB: u64 = 128;

impl BootConfig {
    /// Reads a configuration from a JSON file (unknown fields are refused) and validates it.
    pub(crate) fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config: BootConfig =
            serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.to_owned(),
                source,
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks everything that can be checked without KVM or the files.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.kernel.as_os_str().is_empty() {
            return Err(ConfigError::NoKernel);
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::Vcpus(self.vcpus));
        }
        if self.mem_mib < MIN_MEM_MIB {
            return Err(ConfigError::TooLittleMemory(self.mem_mib));
        }
        if self.mem_mib > MAX_MEM_MIB {
            return Err(ConfigError::TooMuchMemory(self.mem_mib));
        }
        let pages = self.mem_mib << 8;
        // Slots of whole pages; uneven ones (a larger last slot) only for one region: below
        // the MMIO gap and without holes.
        let uneven_allowed = !self.mem_holes && self.mem_mib << 20 <= layout::MMIO_GAP_START;
        if self.mem_slots == 0
            || self.mem_slots > pages
            || (!uneven_allowed && !pages.is_multiple_of(self.mem_slots))
        {
            return Err(ConfigError::Slots {
                mem_mib: self.mem_mib,
                slots: self.mem_slots,
            });
        }
        let slot_size = (self.mem_mib << 20) / self.mem_slots;
        if self.page_size == RegionPageSize::Huge2M {
            let grid = kvm_memslots::HUGE_PAGE_SIZE;
            let off = |what| ConfigError::HugePageGrid {
                what,
                mem_mib: self.mem_mib,
                slots: self.mem_slots,
                slot_size,
            };
            if !(self.mem_mib << 20).is_multiple_of(grid) {
                return Err(off("mem_mib"));
            }
            if slot_size * self.mem_slots != self.mem_mib << 20 || !slot_size.is_multiple_of(grid) {
                return Err(off("the slot size"));
            }
        }
        if self.mem_holes
            && (self.mem_mib << 20 <= layout::BOOT_AREA
                || !layout::BOOT_AREA.is_multiple_of(slot_size))
        {
            return Err(ConfigError::Holes {
                mem_mib: self.mem_mib,
                slot_size,
            });
        }
        if self.cmdline.len() >= layout::CMDLINE_MAX || self.cmdline.contains('\0') {
            return Err(ConfigError::Cmdline {
                len: self.cmdline.len(),
            });
        }
        if let Some(t) = self.timeout_secs {
            if !(t.is_finite() && t > 0.0) {
                return Err(ConfigError::Timeout(t));
            }
        }
        if let Some(hotplug) = self.hotplug() {
            hotplug.validate_as(HOTPLUG_NAMES)?;
        }
        Ok(())
    }

    /// The virtio-mem device's area as the API describes it (`GET /hotplug/memory`'s sizes),
    /// if the guest has one (`hotplug_mib` not 0): `hotplug_max_slot_mib` 0 is a KVM slot
    /// per block (no slot size), and one below the block size counts as the block size.
    pub(crate) fn hotplug(&self) -> Option<HotplugConfig> {
        let (block, max_slot) = (self.hotplug_block_mib, self.hotplug_max_slot_mib);
        (self.hotplug_mib > 0).then_some(HotplugConfig {
            total_size_mib: self.hotplug_mib,
            block_size_mib: block,
            slot_size_mib: (max_slot > 0).then_some(max_slot.max(block)),
            page_size: self.hotplug_page_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::hotplug::MAX_HOTPLUG_MIB;

    fn valid() -> BootConfig {
        BootConfig {
            kernel: "vmlinuz".into(),
            ..BootConfig::default()
        }
    }

    #[test]
    fn json_with_unknown_fields_or_wrong_types_is_refused() {
        let ok: BootConfig =
            serde_json::from_str(r#"{"kernel": "k", "mem_mib": 256, "mem_slots": 64}"#).unwrap();
        assert_eq!(ok.mem_slots, 64);
        assert_eq!(ok.vcpus, 1);
        ok.validate().unwrap();
        let e = serde_json::from_str::<BootConfig>(r#"{"kernel": "k", "mem_size": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `mem_size`"), "{e}");
        assert!(serde_json::from_str::<BootConfig>(r#"{"vcpus": -1}"#).is_err());
        assert!(serde_json::from_str::<BootConfig>(r#"{"vcpus": 300}"#).is_err());
    }

    #[test]
    fn ram_in_2m_pages_must_be_on_the_2m_grid_slots_and_all() {
        let check = |mem_mib, mem_slots| {
            BootConfig {
                mem_mib,
                mem_slots,
                page_size: RegionPageSize::Huge2M,
                ..valid()
            }
            .validate()
        };
        check(512, 1).expect("512 MiB in one slot");
        check(512, 256).expect("512 MiB in 2 MiB slots");
        check(4098, 2049).expect("past the MMIO gap, 2 MiB slots");
        let refused = |mem_mib, mem_slots| check(mem_mib, mem_slots).unwrap_err().to_string();
        let odd = refused(129, 1);
        assert!(
            odd.starts_with("with page_size 2m, mem_mib must be a multiple of 2 MiB: 129 MiB"),
            "{odd}"
        );
        // Slots of 1 MiB, and the larger last slot 4 KiB pages would allow (512 / 3).
        for (mem_mib, slots) in [(512, 512), (512, 3)] {
            let why = refused(mem_mib, slots);
            assert!(
                why.starts_with(&format!(
                    "with page_size 2m, the slot size must be a multiple of 2 MiB: {mem_mib} MiB \
                     of RAM in {slots} KVM slots"
                )),
                "{why}"
            );
        }
        // The same with 4 KiB pages or transparent huge pages: accepted.
        for page_size in [RegionPageSize::Base, RegionPageSize::Transparent] {
            for (mem_mib, slots) in [(129, 1), (512, 512), (512, 3)] {
                BootConfig {
                    mem_mib,
                    mem_slots: slots,
                    page_size,
                    ..valid()
                }
                .validate()
                .expect("4 KiB slots");
            }
        }
        // From a file: both page sizes by name.
        let config: BootConfig = serde_json::from_str(
            r#"{"kernel": "k", "page_size": "2m", "hotplug_page_size": "thp", "hotplug_mib": 64}"#,
        )
        .expect("parsed");
        assert_eq!(
            (config.page_size, config.hotplug_page_size),
            (RegionPageSize::Huge2M, RegionPageSize::Transparent)
        );
        config.validate().expect("valid");
        assert!(serde_json::from_str::<BootConfig>(r#"{"page_size": "1g"}"#).is_err());
    }

    #[test]
    fn the_hotplug_fields_map_onto_the_apis_body() {
        assert_eq!(valid().hotplug(), None, "no hotplug_mib, no area");
        let hotplug = |max_slot| {
            BootConfig {
                hotplug_mib: 1024,
                hotplug_block_mib: 4,
                hotplug_max_slot_mib: max_slot,
                hotplug_page_size: RegionPageSize::Huge2M,
                ..valid()
            }
            .hotplug()
            .expect("an area")
        };
        assert_eq!(
            hotplug(128),
            HotplugConfig {
                total_size_mib: 1024,
                block_size_mib: 4,
                slot_size_mib: Some(128),
                page_size: RegionPageSize::Huge2M,
            }
        );
        assert_eq!(hotplug(0).slot_size_mib, None, "0: a slot per block");
        assert_eq!(
            hotplug(2).slot_size_mib,
            Some(4),
            "less than a block: a block"
        );
    }

    #[test]
    fn validate_names_the_problem() {
        let check = |c: BootConfig| c.validate().unwrap_err().to_string();
        assert_eq!(check(BootConfig::default()), "no kernel given");
        assert!(check(BootConfig {
            vcpus: 0,
            ..valid()
        })
        .contains("0 vCPUs"));
        assert!(check(BootConfig {
            mem_mib: 64,
            ..valid()
        })
        .contains("too little"));
        assert!(check(BootConfig {
            mem_slots: 3,
            mem_holes: true,
            ..valid()
        })
        .contains("cannot be split into 3 KVM slots"));
        // Without holes, below the gap: a larger last slot.
        assert!(BootConfig {
            mem_slots: 3,
            ..valid()
        }
        .validate()
        .is_ok());
        assert!(check(BootConfig {
            mem_slots: (valid().mem_mib << 8) + 1,
            ..valid()
        })
        .contains("KVM slots of whole 4 KiB pages"));
        // The sizes are named as the boot configuration names them (the rules are the API's:
        // `HotplugConfig::validate_as`).
        for (mib, block, named) in [
            (100, 3, "hotplug_block_mib 3 must be a power of two"),
            (
                100,
                64,
                "hotplug_mib 100 must be a multiple of hotplug_block_mib 64",
            ),
            (3, 1, "hotplug_block_mib 1 must be a power of two"),
            (
                MAX_HOTPLUG_MIB * 2,
                2,
                "hotplug_mib 2097152 must be a multiple",
            ),
        ] {
            let why = check(BootConfig {
                hotplug_mib: mib,
                hotplug_block_mib: block,
                ..valid()
            });
            assert!(why.contains(named), "{why}");
        }
        BootConfig {
            hotplug_mib: 1024,
            hotplug_block_mib: 2,
            ..valid()
        }
        .validate()
        .expect("1 GiB in 2 MiB blocks");
        // A total that is no multiple of the slot size: the last piece is shorter.
        BootConfig {
            hotplug_mib: 10,
            hotplug_block_mib: 2,
            hotplug_max_slot_mib: 4,
            ..valid()
        }
        .validate()
        .expect("10 MiB in pieces of 4 MiB, the last of 2");
        // Shared slots: 0 (a slot per block), a multiple of the block, or less than one block
        // (the block size); not a size between multiples.
        for (max_slot, block, ok) in [
            (0, 2, true),
            (128, 2, true),
            (128, 256, true),
            (6, 4, false),
            (MAX_HOTPLUG_MIB * 2, 2, false),
        ] {
            let config = BootConfig {
                hotplug_mib: 1024,
                hotplug_block_mib: block,
                hotplug_max_slot_mib: max_slot,
                ..valid()
            };
            if ok {
                config
                    .validate()
                    .expect("a maximum slot size blocks can share");
            } else {
                let why = check(config);
                assert!(
                    why.contains(&format!(
                        "hotplug_max_slot_mib {max_slot} must be 0 (a KVM slot per block) or a \
                         multiple of hotplug_block_mib {block}"
                    )),
                    "{why}"
                );
            }
        }
        assert!(check(BootConfig {
            mem_mib: 128,
            mem_holes: true,
            ..valid()
        })
        .contains("boot area"));
        assert!(check(BootConfig {
            cmdline: "x".repeat(3000),
            ..valid()
        })
        .contains("3000 bytes"));
        assert!(check(BootConfig {
            timeout_secs: Some(-1.0),
            ..valid()
        })
        .contains("timeout"));
        valid().validate().unwrap();
        BootConfig {
            mem_mib: 256,
            mem_slots: 512,
            mem_holes: true,
            ..valid()
        }
        .validate()
        .unwrap();
    }
}
