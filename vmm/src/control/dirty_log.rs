//! Dirty logging: `GET` and `PATCH /dirty-log`, `POST /dirty-log/harvest`.

use serde::{Deserialize, Serialize};

/// `PATCH /dirty-log`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirtyLogSwitch {
    /// Start (true) or stop (false) logging.
    pub enabled: bool,
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Harvest {
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HarvestInfo {
    /// Bytes per page.
    pub page_size: u64,
    /// Each region harvested.
    pub regions: Vec<DirtyRegion>,
}

/// One region in [`HarvestInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirtyRegion {
    /// The region.
    pub id: u64,
    /// Its guest base when harvested.
    pub guest_address: u64,
    /// Its pages.
    pub pages: u64,
    /// How many of them are dirty.
    pub dirty_pages: u64,
    /// The dirty pages as `[start, end)` guest-address ranges.
    pub ranges: Vec<[u64; 2]>,
}

/// `GET /dirty-log`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirtyLogInfo {
    /// `bitmap` (per-slot logs) or `ring` (per-vCPU dirty rings).
    pub mode: &'static str,
    /// Entries per vCPU ring, in ring mode.
    pub ring_entries: Option<u32>,
    /// Regions whose writes are logged (for any reader of the log).
    pub logging_regions: Vec<u64>,
    /// Who keeps each of those logging: `client` (`PATCH /dirty-log`), `snapshot_chain` (every
    /// region from the first Full snapshot on, so that a Diff has every page), `migration`
    /// (while one runs); each with its regions. A client's `PATCH /dirty-log {"enabled":
    /// false}` ends only the client's logging: a region another reader logs goes on logging,
    /// and each reader's harvests get every page dirtied since its own last one.
    pub logging_for: std::collections::BTreeMap<&'static str, Vec<u64>>,
    /// Harvests of every region so far.
    pub harvests: u64,
    /// The dirty rate between the last two harvests of every region, if there were two.
    pub dirty_rate: Option<DirtyRate>,
}

/// Pages dirtied per second over a window: the pages the later of two harvests of every region
/// reported, over the time between them (after QEMU's `calc-dirty-rate`, without consuming
/// dirty bits of its own).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DirtyRate {
    /// Pages reported by the later harvest.
    pub pages: u64,
    /// Milliseconds between the two harvests.
    pub window_ms: f64,
    /// Pages per second.
    pub pages_per_second: f64,
}
