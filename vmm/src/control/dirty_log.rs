//! Dirty logging: `GET` and `PATCH /dirty-log`, `POST /dirty-log/harvest`.

use serde::{Deserialize, Serialize};

/// `PATCH /dirty-log`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirtyLogSwitch {
    /// Start (true) or stop (false) logging.
    enabled: bool,
    /// One region; all by default.
    region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Harvest {
    /// One region; all by default.
    pub(crate) region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HarvestInfo {
    /// Bytes per page.
    page_size: u64,
    /// Each region harvested.
    regions: Vec<DirtyRegion>,
}

/// One region in [`HarvestInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct DirtyRegion {
    /// The region.
    id: u64,
    /// Its guest base when harvested.
    guest_address: u64,
    /// Its pages.
    pages: u64,
    /// How many of them are dirty.
    dirty_pages: u64,
    /// The dirty pages as `[start, end)` guest-address ranges.
    ranges: Vec<[u64; 2]>,
}

/// `GET /dirty-log`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirtyLogInfo {
    /// `bitmap` (per-slot logs) or `ring` (per-vCPU dirty rings).
    mode: &'static str,
    /// Entries per vCPU ring, in ring mode.
    ring_entries: Option<u32>,
    /// Regions whose writes are logged (for any reader of the log).
    logging_regions: Vec<u64>,
    /// Who keeps each of those logging: `client` (`PATCH /dirty-log`), `snapshot_chain` (every
    /// region from the first Full snapshot on, so that a Diff has every page), `migration`
    /// (while one runs); each with its regions. A client's `PATCH /dirty-log {"enabled":
    /// false}` ends only the client's logging: a region another reader logs goes on logging,
    /// and each reader's harvests get every page dirtied since its own last one.
    logging_for: std::collections::BTreeMap<&'static str, Vec<u64>>,
    /// Harvests of every region so far.
    harvests: u64,
    /// Harvests through the API so far, of one region or every one.
    harvest_requests: u64,
    /// Milliseconds those harvests took, all together.
    harvest_ms_total: f64,
    /// The dirty rate between the last two harvests of every region, if there were two.
    dirty_rate: Option<DirtyRate>,
}

/// Pages dirtied per second over a window: the pages the later of two harvests of every region
/// reported, over the time between them (after QEMU's `calc-dirty-rate`, without consuming
/// dirty bits of its own).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
struct DirtyRate {
    /// Pages reported by the later harvest.
    pages: u64,
    /// Milliseconds between the two harvests.
    window_ms: f64,
    /// Pages per second.
    pages_per_second: f64,
}

/// A client's side of the dirty log, whatever the guest kind: its logging switches and
/// harvests (the manager's default consumer), and the dirty rate between its harvests of
/// every region.
#[derive(Debug, Default)]
pub(crate) struct DirtyLogClient {
    /// Harvests of every region so far.
    harvests: u64,
    /// Harvests so far, of one region or every one.
    harvest_requests: u64,
    /// The time they took, all together.
    harvest_time: std::time::Duration,
    /// The last one's time.
    last_harvest: Option<std::time::Instant>,
    /// The dirty rate between the last two harvests of every region.
    dirty_rate: Option<DirtyRate>,
}

type Memory = kvm_memslots::MemoryManager<kvm_memslots::KvmVm>;

fn target(region: Option<u64>) -> kvm_memslots::Target {
    region.map_or(kvm_memslots::Target::All, |id| {
        kvm_memslots::Target::Region(kvm_memslots::RegionId(id))
    })
}

impl DirtyLogClient {
    /// `PATCH /dirty-log`: the client's logging of one region or all.
    pub(crate) fn switch(
        &mut self,
        memory: &Memory,
        switch: DirtyLogSwitch,
    ) -> Result<(), kvm_memslots::Error> {
        let target = target(switch.region);
        if switch.enabled {
            memory.start_dirty_log(target)
        } else {
            memory.stop_dirty_log(target)
        }
    }

    /// `POST /dirty-log/harvest`: what the client's regions dirtied since its last harvest.
    pub(crate) fn harvest(
        &mut self,
        memory: &Memory,
        harvest: Harvest,
    ) -> Result<HarvestInfo, kvm_memslots::Error> {
        let started = std::time::Instant::now();
        let dirty = memory.harvest_dirty(target(harvest.region))?;
        self.harvest_requests += 1;
        self.harvest_time += started.elapsed();
        if harvest.region.is_none() {
            // Every region: a window for the dirty rate since the last such harvest.
            let now = std::time::Instant::now();
            let pages = dirty.iter().map(|d| d.count()).sum();
            if let Some(last) = self.last_harvest {
                let window = now.duration_since(last).as_secs_f64();
                self.dirty_rate = Some(DirtyRate {
                    pages,
                    window_ms: window * 1e3,
                    pages_per_second: if window > 0.0 {
                        pages as f64 / window
                    } else {
                        0.0
                    },
                });
            }
            self.last_harvest = Some(now);
            self.harvests += 1;
        }
        let regions = dirty
            .iter()
            .map(|d| DirtyRegion {
                id: d.region.0,
                guest_address: d.gpa.0,
                pages: d.pages,
                dirty_pages: d.count(),
                ranges: d.ranges().map(|r| [r.start, r.end]).collect(),
            })
            .collect();
        Ok(HarvestInfo {
            page_size: kvm_memslots::PAGE_SIZE,
            regions,
        })
    }

    /// `GET /dirty-log`; `chain` is the snapshot chain's reader, if there is one (any other
    /// reader but the client's is a migration's).
    pub(crate) fn info(
        &self,
        memory: &Memory,
        chain: Option<kvm_memslots::DirtyConsumer>,
    ) -> DirtyLogInfo {
        let ring_entries = memory.kvm().ring_entries();
        let mut logging_for: std::collections::BTreeMap<&'static str, Vec<u64>> =
            std::collections::BTreeMap::new();
        for region in memory.regions() {
            for consumer in memory.dirty_log_holders(region.id).unwrap_or_default() {
                let name = if consumer == kvm_memslots::DirtyConsumer::DEFAULT {
                    "client"
                } else if Some(consumer) == chain {
                    "snapshot_chain"
                } else {
                    "migration"
                };
                logging_for.entry(name).or_default().push(region.id.0);
            }
        }
        DirtyLogInfo {
            mode: if ring_entries.is_some() {
                "ring"
            } else {
                "bitmap"
            },
            ring_entries,
            logging_regions: memory
                .regions()
                .iter()
                .filter(|r| r.flags.log_dirty)
                .map(|r| r.id.0)
                .collect(),
            logging_for,
            harvests: self.harvests,
            harvest_requests: self.harvest_requests,
            harvest_ms_total: self.harvest_time.as_secs_f64() * 1e3,
            dirty_rate: self.dirty_rate,
        }
    }
}
