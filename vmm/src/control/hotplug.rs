//! Memory hotplug: `GET`, `PUT` and `PATCH /hotplug/memory`. The test guest's hotplug area
//! and a Linux guest's virtio-mem device answer with the same bodies.

use serde::{Deserialize, Serialize};

use super::memory::RegionPageSize;

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
    /// of this size, and a piece is mapped while any of its blocks is plugged, with one slot
    /// over exactly its plugged blocks. Defaults to the block size.
    pub slot_size_mib: Option<u64>,
    /// The host pages behind plugged blocks: `4k` (the default), `2m` (hugetlb: every block
    /// is whole huge pages, a plug needs the pool to hold its piece, and an unplug gives the
    /// huge pages back to the pool) or `thp`. Left out of a saved state when `4k`.
    #[serde(default, skip_serializing_if = "RegionPageSize::is_base")]
    pub page_size: RegionPageSize,
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
