//! Periods of dirty logging on the writers' region: starting and stopping it, harvesting, and
//! checking every harvest against what the writers changed since the one before.

use std::sync::atomic::{AtomicBool, Ordering};

use kvm_memslots::{DirtyPages, KvmMemory, KvmVm, MemoryManager, Target, PAGE_SIZE};
use vm_memory::GuestAddress;

use super::check::Writers;
use super::config::{change, StressError, ROUNDS_PER_LOGGING};
use super::report::ChangeCounts;
use tinyvmm::test_guest::pattern;

/// A period of dirty logging: values read after the last harvest, and each writer's passes then.
struct Logging {
    round: u32,
    before: Vec<Vec<u64>>,
    passes: Vec<u64>,
}

/// Dirty logging on the writers' region, period after period: each period starts logging,
/// checks [`ROUNDS_PER_LOGGING`] harvests against what the writers changed, and stops it. Each
/// step counts what it did in the caller's [`ChangeCounts`].
pub(super) struct DirtyLog<'a> {
    memory: &'a MemoryManager<KvmVm>,
    writers: &'a Writers,
    /// Set when the run is finishing: waits end, and no round starts.
    finish: &'a AtomicBool,
    /// The period under way, if logging is on.
    period: Option<Logging>,
}

impl<'a> DirtyLog<'a> {
    /// Logging off, on `writers`' region of `memory`, until [`start`](Self::start).
    pub(super) fn new(
        memory: &'a MemoryManager<KvmVm>,
        writers: &'a Writers,
        finish: &'a AtomicBool,
    ) -> Self {
        DirtyLog {
            memory,
            writers,
            finish,
            period: None,
        }
    }

    /// Whether a period of logging is under way.
    pub(super) fn logging(&self) -> bool {
        self.period.is_some()
    }

    fn finishing(&self) -> bool {
        self.finish.load(Ordering::Acquire)
    }

    fn harvest(&mut self, counts: &mut ChangeCounts) -> Result<DirtyPages, StressError> {
        let mut harvested = change(
            "harvesting the test area's dirty pages",
            self.memory
                .harvest_dirty(Target::Region(self.writers.area.region)),
        )?;
        if harvested.len() != 1 {
            return Err(StressError::Harvest(harvested.len()));
        }
        let pages = harvested.remove(0);
        counts.harvests += 1;
        counts.dirty_pages_harvested += pages.count();
        Ok(pages)
    }

    /// Starts logging on the writers' region, takes the first harvest (every page, with
    /// initially-set logs) and reads what the writers' memory holds after it.
    pub(super) fn start(&mut self, counts: &mut ChangeCounts) -> Result<(), StressError> {
        let target = Target::Region(self.writers.area.region);
        change(
            "starting dirty logging on the test area",
            self.memory.start_dirty_log(target),
        )?;
        counts.dirty_log_starts += 1;
        let first = self.harvest(counts)?;
        if self.memory.kvm().manual_dirty_log() {
            // Logs start all set: the first harvest has every page, written or not.
            let area = self.writers.area;
            if let Some(page) = (0..area.size() / PAGE_SIZE).find(|&p| !first.is_dirty(p)) {
                return Err(StressError::FirstHarvest {
                    gpa: area.gpa + page * PAGE_SIZE,
                });
            }
        }
        self.after_harvest(0, counts)
    }

    fn after_harvest(&mut self, round: u32, counts: &mut ChangeCounts) -> Result<(), StressError> {
        let (before, passes) = self.writers.scan_all(self.memory, &mut counts.scans)?;
        self.period = Some(Logging {
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
    pub(super) fn round(
        &mut self,
        last: bool,
        counts: &mut ChangeCounts,
    ) -> Result<(), StressError> {
        let Some(logging) = self.period.take() else {
            return Ok(());
        };
        // `passes` were read after the scan: pass `passes + 1` started after it (and after the
        // harvest), so it changes every address, and KVM logs each of its writes.
        let since: Vec<u64> = logging.passes.iter().map(|p| p + 1).collect();
        let ready = |log: &Self| {
            since
                .iter()
                .enumerate()
                .all(|(vcpu, &p)| log.writers.passes(log.memory, vcpu) > p)
        };
        if last {
            self.writers
                .wait_for_passes(self.memory, &since, self.finish)?;
        }
        if !ready(self) || self.finishing() {
            self.period = Some(logging);
            return Ok(());
        }
        let (after, _) = self.writers.scan_all(self.memory, &mut counts.scans)?;
        let stop = last || logging.round + 1 >= ROUNDS_PER_LOGGING;
        if stop {
            // Stopping keeps KVM's log for the next harvest: writes made while logging are
            // still reported.
            change(
                "stopping dirty logging on the test area",
                self.memory
                    .stop_dirty_log(Target::Region(self.writers.area.region)),
            )?;
            counts.dirty_log_stops += 1;
        }
        let dirty = self.harvest(counts)?;
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
        counts.dirty_rounds_checked += 1;
        if !stop {
            self.after_harvest(logging.round + 1, counts)?;
        }
        Ok(())
    }
}
