//! Periods of dirty logging on the writers' region: starting and stopping it, harvesting, and
//! checking every harvest against what the writers changed since the one before.

use kvm_memslots::{DirtyPages, KvmMemory, Target, PAGE_SIZE};
use vm_memory::GuestAddress;

use super::changer::Changer;
use super::config::{change, StressError, ROUNDS_PER_LOGGING};
use crate::test_guest::pattern;

/// A period of dirty logging: values read after the last harvest, and each writer's passes then.
pub(super) struct Logging {
    round: u32,
    before: Vec<Vec<u64>>,
    passes: Vec<u64>,
}

impl Changer<'_> {
    fn harvest(&mut self) -> Result<DirtyPages, StressError> {
        let mut harvested = change(
            "harvesting the test area's dirty pages",
            self.memory
                .harvest_dirty(Target::Region(self.writers.area.region)),
        )?;
        if harvested.len() != 1 {
            return Err(StressError::Harvest(harvested.len()));
        }
        let pages = harvested.remove(0);
        self.counts.harvests += 1;
        self.counts.dirty_pages_harvested += pages.count();
        Ok(pages)
    }

    /// Starts logging on the writers' region, takes the first harvest (every page, with
    /// initially-set logs) and reads what the writers' memory holds after it.
    pub(super) fn start_logging(&mut self) -> Result<(), StressError> {
        let target = Target::Region(self.writers.area.region);
        change(
            "starting dirty logging on the test area",
            self.memory.start_dirty_log(target),
        )?;
        self.counts.dirty_log_starts += 1;
        let first = self.harvest()?;
        if self.memory.kvm().manual_dirty_log() {
            // Logs start all set: the first harvest has every page, written or not.
            let area = self.writers.area;
            if let Some(page) = (0..area.size() / PAGE_SIZE).find(|&p| !first.is_dirty(p)) {
                return Err(StressError::FirstHarvest {
                    gpa: area.gpa + page * PAGE_SIZE,
                });
            }
        }
        self.after_harvest(0)
    }

    fn after_harvest(&mut self, round: u32) -> Result<(), StressError> {
        let (before, passes) = self.scan_all()?;
        self.logging = Some(Logging {
            round,
            before,
            passes,
        });
        Ok(())
    }

    /// Once every writer completed a pass that started after the last harvest (at the end of
    /// the run, `last`: after waiting for that), reads their memory again, harvests (stopping
    /// logging first at the end of the period) and checks that every address changed, each
    /// on a reported page. Before that, does nothing: the other changes go on meanwhile.
    pub(super) fn dirty_round(&mut self, last: bool) -> Result<(), StressError> {
        let Some(logging) = self.logging.take() else {
            return Ok(());
        };
        // `passes` were read after the scan: pass `passes + 1` started after it (and after the
        // harvest), so it changes every address, and KVM logs each of its writes.
        let since: Vec<u64> = logging.passes.iter().map(|p| p + 1).collect();
        let ready = |changer: &Self| {
            since
                .iter()
                .enumerate()
                .all(|(vcpu, &p)| changer.writers.passes(changer.memory, vcpu) > p)
        };
        if last {
            self.wait_for_passes(&since)?;
        }
        if !ready(self) || self.finishing() {
            self.logging = Some(logging);
            return Ok(());
        }
        let (after, _) = self.scan_all()?;
        let stop = last || logging.round + 1 >= ROUNDS_PER_LOGGING;
        if stop {
            // Stopping keeps KVM's log for the next harvest: writes made while logging are
            // still reported.
            change(
                "stopping dirty logging on the test area",
                self.memory
                    .stop_dirty_log(Target::Region(self.writers.area.region)),
            )?;
            self.counts.dirty_log_stops += 1;
        }
        let dirty = self.harvest()?;
        let is_dirty = |gpa: u64| dirty.is_dirty_at(GuestAddress(gpa));
        for (vcpu, (before, after)) in logging.before.iter().zip(&after).enumerate() {
            for ((gpa, &before), &after) in self.writers.addresses(vcpu).zip(before).zip(after) {
                if before != after && !is_dirty(gpa) {
                    return Err(StressError::DirtyPageMissed {
                        vcpu,
                        gpa,
                        before,
                        after,
                    });
                }
                if before == after {
                    // A whole pass ran between the two reads and wrote another pattern.
                    let seed = self.writers.parts[vcpu].seed;
                    let pass = logging.passes[vcpu] + 1;
                    return Err(StressError::LostWrite {
                        vcpu,
                        gpa,
                        found: after,
                        pass,
                        expected: pattern(gpa, seed.wrapping_add(pass)),
                    });
                }
            }
        }
        self.counts.dirty_rounds_checked += 1;
        if !stop {
            self.after_harvest(logging.round + 1)?;
        }
        Ok(())
    }
}
