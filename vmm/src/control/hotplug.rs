//! Memory hotplug: `GET`, `PUT` and `PATCH /hotplug/memory`. The test guest's hotplug area
//! and a Linux guest's virtio-mem device answer with the same bodies, and obey the same size
//! rules: `HotplugConfig::validate`'s (see `docs/decisions/hotplug-validation.md`).

use kvm_virtio_mem::VirtioMemOptions;
use serde::{Deserialize, Serialize};
use vm_memory::GuestAddress;

use super::memory::RegionPageSize;

const MIB: u64 = 1 << 20;

/// The largest hotplug area, and the largest slot size (1 TiB).
pub(crate) const MAX_HOTPLUG_MIB: u64 = 1 << 20;

/// `PUT /hotplug/memory`: the hotplug area, as Firecracker describes it. A snapshot saves it
/// with the area's bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugConfig {
    /// Size of the whole area, in MiB.
    pub total_size_mib: u64,
    /// Plugging granularity in MiB (a power of two, at least 2).
    pub block_size_mib: u64,
    /// The largest KVM slot in MiB (a multiple of the block size): the area is cut into pieces
    /// of this size (the last one what is left, if the total is not a multiple of it), and a
    /// piece is mapped while any of its blocks is plugged, with one slot over it. Defaults to
    /// the block size.
    pub slot_size_mib: Option<u64>,
    /// The host pages behind plugged blocks: `4k` (the default), `2m` (hugetlb: every block
    /// is whole huge pages, a plug needs the pool to hold its piece, and an unplug gives the
    /// huge pages back to the pool) or `thp`. Left out of a saved state when `4k`.
    #[serde(default, skip_serializing_if = "RegionPageSize::is_base")]
    pub page_size: RegionPageSize,
}

/// What the user calls a [`HotplugConfig`]'s sizes, for the messages of its
/// [`HotplugConfigError`]s: the request body's names ([`HotplugNames::API`]) or a boot
/// configuration's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HotplugNames {
    /// The total size's.
    pub(crate) total: &'static str,
    /// The block size's.
    pub(crate) block: &'static str,
    /// The slot size's.
    pub(crate) slot: &'static str,
    /// How the user asks for a slot per block.
    pub(crate) slot_default: &'static str,
}

impl HotplugNames {
    /// `PUT /hotplug/memory`'s fields.
    pub(crate) const API: HotplugNames = HotplugNames {
        total: "total_size_mib",
        block: "block_size_mib",
        slot: "slot_size_mib",
        slot_default: "left out",
    };
}

/// Why a [`HotplugConfig`] is refused, its sizes named as the user typed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugConfigError {
    /// The sizes' names.
    names: HotplugNames,
    /// What is wrong.
    pub(crate) problem: HotplugProblem,
}

/// What is wrong with a [`HotplugConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HotplugProblem {
    /// The block size (MiB) is not a power of two of at least 2.
    Block(u64),
    /// The slot size (MiB) is no multiple of the block size (MiB), or too large.
    Slot(u64, u64),
    /// The total size (MiB) is no multiple of the block size (MiB), zero, or too large.
    Total(u64, u64),
    /// The virtio-mem device's own rules refuse the sizes.
    Device(kvm_virtio_mem::Error),
}

impl std::fmt::Display for HotplugConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let HotplugNames {
            total,
            block,
            slot,
            slot_default,
        } = self.names;
        match &self.problem {
            HotplugProblem::Block(b) => {
                write!(f, "{block} {b} must be a power of two of at least 2")
            }
            HotplugProblem::Slot(s, b) => write!(
                f,
                "{slot} {s} must be {slot_default} (a KVM slot per block) or a multiple of \
                 {block} {b}, at most {MAX_HOTPLUG_MIB} MiB"
            ),
            HotplugProblem::Total(t, b) => write!(
                f,
                "{total} {t} must be a multiple of {block} {b}, non-zero and at most \
                 {MAX_HOTPLUG_MIB} MiB"
            ),
            HotplugProblem::Device(e) => {
                write!(
                    f,
                    "{total}, {block} and {slot}: the virtio-mem device refuses them: {e}"
                )
            }
        }
    }
}

impl std::error::Error for HotplugConfigError {}

impl HotplugConfig {
    /// The slot size in MiB: as given, or the block size.
    pub(crate) fn slot_mib(&self) -> u64 {
        self.slot_size_mib.unwrap_or(self.block_size_mib)
    }

    /// Checks the sizes, naming them as the request body does: see
    /// [`validate_as`](Self::validate_as).
    pub(crate) fn validate(&self) -> Result<(), HotplugConfigError> {
        self.validate_as(HotplugNames::API)
    }

    /// Checks the sizes by the one rule set both guest kinds obey, naming them by `names` in
    /// an error: the block size a power of two of at least 2 MiB; the slot size, if given, a
    /// non-zero multiple of it at most [`MAX_HOTPLUG_MIB`]; the total a non-zero multiple of
    /// the block size, at most [`MAX_HOTPLUG_MIB`] (the last piece may be shorter than a
    /// slot); then the virtio-mem device's own rules on the same sizes
    /// ([`VirtioMemOptions::validate`]). Where the area goes (what fits, the KVM slots free)
    /// is checked where it is placed.
    pub(crate) fn validate_as(&self, names: HotplugNames) -> Result<(), HotplugConfigError> {
        let refuse = |problem| Err(HotplugConfigError { names, problem });
        let block = self.block_size_mib;
        if block < 2 || !block.is_power_of_two() {
            return refuse(HotplugProblem::Block(block));
        }
        if let Some(slot) = self.slot_size_mib {
            if slot == 0 || !slot.is_multiple_of(block) || slot > MAX_HOTPLUG_MIB {
                return refuse(HotplugProblem::Slot(slot, block));
            }
        }
        let total = self.total_size_mib;
        if total == 0 || !total.is_multiple_of(block) || total > MAX_HOTPLUG_MIB {
            return refuse(HotplugProblem::Total(total, block));
        }
        match self.options(GuestAddress(0)).validate() {
            Ok(()) => Ok(()),
            Err(e) => refuse(HotplugProblem::Device(e)),
        }
    }

    /// The virtio-mem device's options for these sizes at `addr`: nothing requested, plugged
    /// blocks sharing KVM slots of up to the slot size, in host pages of the page size.
    pub(crate) fn options(&self, addr: GuestAddress) -> VirtioMemOptions {
        VirtioMemOptions::new(
            addr,
            self.total_size_mib.saturating_mul(MIB),
            self.block_size_mib.saturating_mul(MIB),
        )
        .with_max_slot_size(self.slot_mib().saturating_mul(MIB))
        .with_page_size(self.page_size.into())
    }
}

/// `PATCH /hotplug/memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugRequest {
    /// How much of the area should be plugged, in MiB (a multiple of the block size).
    pub requested_size_mib: u64,
}

/// `GET /hotplug/memory`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HotplugInfo {
    /// Size of the whole area, in MiB.
    pub(crate) total_size_mib: u64,
    /// Plugging granularity, in MiB.
    pub(crate) block_size_mib: u64,
    /// KVM slot size, in MiB.
    pub slot_size_mib: u64,
    /// Plugged, in MiB.
    pub plugged_size_mib: u64,
    /// Requested, in MiB (the same as plugged: the test guest takes every request at once).
    pub requested_size_mib: u64,
    /// Where the area starts.
    pub(crate) guest_address: u64,
    /// The host pages behind plugged blocks.
    pub page_size: RegionPageSize,
    /// KVM slots mapped in it.
    pub mapped_slots: usize,
    /// Why a Linux guest's virtio-mem device last answered the guest BUSY (the memory
    /// manager's refusal: a slot budget, a limit), if it did; the test guest's area refuses
    /// the request itself instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_busy: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(total: u64, block: u64, slot: Option<u64>) -> HotplugConfig {
        HotplugConfig {
            total_size_mib: total,
            block_size_mib: block,
            slot_size_mib: slot,
            page_size: RegionPageSize::Base,
        }
    }

    #[test]
    fn the_sizes_are_checked_once_with_the_fields_named() {
        let refused = |c: HotplugConfig| c.validate().unwrap_err().to_string();
        assert_eq!(
            refused(config(64, 3, None)),
            "block_size_mib 3 must be a power of two of at least 2"
        );
        assert!(refused(config(64, 1, None)).contains("block_size_mib 1"));
        assert_eq!(
            refused(config(64, 2, Some(5))),
            "slot_size_mib 5 must be left out (a KVM slot per block) or a multiple of \
             block_size_mib 2, at most 1048576 MiB"
        );
        assert!(refused(config(64, 2, Some(0))).contains("slot_size_mib 0"));
        assert!(refused(config(64, 2, Some(MAX_HOTPLUG_MIB * 2))).contains("at most"));
        assert_eq!(
            refused(config(31, 2, None)),
            "total_size_mib 31 must be a multiple of block_size_mib 2, non-zero and at most \
             1048576 MiB"
        );
        assert!(refused(config(0, 2, None)).contains("non-zero"));
        assert!(refused(config(MAX_HOTPLUG_MIB + 2, 2, None)).contains("at most"));
        // A partial last piece, a slot larger than the area, the largest area: accepted.
        for ok in [
            config(10, 2, Some(4)),
            config(6, 2, Some(64)),
            config(MAX_HOTPLUG_MIB, 2, Some(MAX_HOTPLUG_MIB)),
        ] {
            ok.validate().expect("valid sizes");
        }
        // Another place names the same rules by its own fields.
        let names = HotplugNames {
            total: "t",
            block: "b",
            slot: "s",
            slot_default: "0",
        };
        let e = config(64, 2, Some(5)).validate_as(names).unwrap_err();
        assert_eq!(e.problem, HotplugProblem::Slot(5, 2));
        assert!(e
            .to_string()
            .starts_with("s 5 must be 0 (a KVM slot per block) or a multiple of b 2"));
    }

    /// The body's rules include the device's: every size they accept, the device's options
    /// accept too, at any block-aligned base and page size.
    #[test]
    fn what_the_body_accepts_the_device_accepts() {
        for total in [2, 6, 10, 64, 1000] {
            for block in [1, 2, 3, 4, 8, 64] {
                for slot in [None, Some(0), Some(2), Some(4), Some(6), Some(128)] {
                    for page_size in [
                        RegionPageSize::Base,
                        RegionPageSize::Huge2M,
                        RegionPageSize::Transparent,
                    ] {
                        let c = HotplugConfig {
                            page_size,
                            ..config(total, block, slot)
                        };
                        if c.validate().is_ok() {
                            let options = c.options(GuestAddress(4 << 30));
                            assert_eq!(options.validate(), Ok(()), "{c:?}");
                            assert_eq!(options.max_slot_size, c.slot_mib() * MIB);
                        }
                    }
                }
            }
        }
        let e = HotplugConfigError {
            names: HotplugNames::API,
            problem: HotplugProblem::Device(kvm_virtio_mem::Error::EmptyRegion),
        };
        assert_eq!(
            e.to_string(),
            "total_size_mib, block_size_mib and slot_size_mib: the virtio-mem device refuses \
             them: the device region is empty"
        );
    }

    #[test]
    fn the_page_size_is_4k_unless_named() {
        let old: HotplugConfig = serde_json::from_str(
            r#"{"total_size_mib": 8, "block_size_mib": 2, "slot_size_mib": null}"#,
        )
        .expect("a body without a page size (and a state saved before it)");
        assert_eq!(old.page_size, RegionPageSize::Base);
        let huge: HotplugConfig = serde_json::from_str(
            r#"{"total_size_mib": 8, "block_size_mib": 2, "slot_size_mib": 4, "page_size": "2m"}"#,
        )
        .expect("2 MiB pages");
        assert_eq!(huge.page_size, RegionPageSize::Huge2M);
        let e = serde_json::from_str::<HotplugConfig>(
            r#"{"total_size_mib": 8, "block_size_mib": 2, "slot_size_mib": 4, "page_size": "1g"}"#,
        )
        .expect_err("no 1 GiB pages")
        .to_string();
        assert!(e.contains("unknown variant `1g`"), "{e}");
        // A state saves the page size only when it is not 4 KiB, so that a 4 KiB area's state
        // reads in a build that predates page sizes (its fields are `deny_unknown_fields`).
        let saved = serde_json::to_string(&old).expect("serialises");
        assert!(!saved.contains("page_size"), "{saved}");
        let saved = serde_json::to_string(&huge).expect("serialises");
        assert!(saved.contains(r#""page_size":"2m""#), "{saved}");
    }
}
