//! The test guest's dirty-log requests: switching logging, harvests and the dirty rate.

use std::collections::BTreeMap;

use kvm_memslots::{DirtyConsumer, RegionId, Target, PAGE_SIZE};

use super::Controller;
use crate::control::dirty_log::{
    DirtyLogInfo, DirtyLogSwitch, DirtyRate, DirtyRegion, Harvest, HarvestInfo,
};
use crate::control::ControllerError;

impl Controller {
    pub(super) fn switch_dirty_log(
        &mut self,
        switch: DirtyLogSwitch,
    ) -> Result<(), ControllerError> {
        let memory = self.vm.memory();
        let target = target(switch.region);
        if switch.enabled {
            memory.start_dirty_log(target)?;
        } else {
            memory.stop_dirty_log(target)?;
        }
        Ok(())
    }

    pub(super) fn harvest(&mut self, harvest: Harvest) -> Result<HarvestInfo, ControllerError> {
        let dirty = self.vm.memory().harvest_dirty(target(harvest.region))?;
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
            page_size: PAGE_SIZE,
            regions,
        })
    }

    pub(super) fn dirty_log_info(&self) -> DirtyLogInfo {
        let memory = self.vm.memory();
        let ring_entries = memory.kvm().ring_entries();
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
            logging_for: self.logging_for(),
            harvests: self.harvests,
            dirty_rate: self.dirty_rate,
        }
    }
}

impl Controller {
    /// Each reader of the dirty log, by name, with the regions it logs.
    fn logging_for(&self) -> BTreeMap<&'static str, Vec<u64>> {
        let memory = self.vm.memory();
        let mut held: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
        for region in memory.regions() {
            for consumer in memory.dirty_log_holders(region.id).unwrap_or_default() {
                let name = if consumer == DirtyConsumer::DEFAULT {
                    "client"
                } else if Some(consumer) == self.chain.consumer() {
                    "snapshot_chain"
                } else {
                    "migration"
                };
                held.entry(name).or_default().push(region.id.0);
            }
        }
        held
    }
}

fn target(region: Option<u64>) -> Target {
    region.map_or(Target::All, |id| Target::Region(RegionId(id)))
}
