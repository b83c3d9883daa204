//! The host's changes: the thread that adds, removes, moves and toggles slots around the
//! writers while they run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvm_memslots::{KvmVm, MemoryManager, RegionId, RegionSpec, PAGE_SIZE};
use vm_memory::GuestAddress;

use super::check::{read, Writers};
use super::config::{
    change, StressError, ABOVE_PAGES, MOVER_PAGES, MOVER_STAMP, MOVE_WINDOW_PAGES,
};
use super::dirty::DirtyLog;
use super::report::ChangeCounts;

/// Which kinds of change an iteration makes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Kinds {
    pub(super) neighbours: bool,
    pub(super) read_only: bool,
    pub(super) dirty: bool,
}

/// The host thread that changes slots while the vCPUs run.
pub(super) struct Changer<'a> {
    pub(super) memory: &'a MemoryManager<KvmVm>,
    pub(super) writers: &'a Writers,
    pub(super) verify_region: RegionId,
    pub(super) mover: RegionId,
    pub(super) mover_gpa: u64,
    pub(super) finish: &'a AtomicBool,
    pub(super) counts: ChangeCounts,
    pub(super) rng: u64,
    /// Dirty logging on the writers' region, period after period.
    pub(super) dirty: DirtyLog<'a>,
}

impl Changer<'_> {
    fn finishing(&self) -> bool {
        self.finish.load(Ordering::Acquire)
    }

    fn move_window(&self) -> u64 {
        self.writers.area.end() + ABOVE_PAGES * PAGE_SIZE
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: a fixed sequence, so that runs are repeatable.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Runs iterations until `iterations` or `deadline`, or until told to finish.
    pub(super) fn run(
        &mut self,
        kinds: Kinds,
        iterations: u64,
        deadline: Instant,
    ) -> Result<(), StressError> {
        if kinds.dirty {
            // The lost-write checks assume every address was written at least once.
            let none = vec![0; self.writers.parts.len()];
            self.writers
                .wait_for_passes(self.memory, &none, self.finish)?;
        }
        // At least one iteration, however late it is.
        let mut done = 0;
        while done < iterations.max(1)
            && (done == 0 || Instant::now() < deadline)
            && !self.finishing()
        {
            self.iteration(kinds)?;
            done += 1;
            self.counts.iterations += 1;
        }
        if self.dirty.logging() && !self.finishing() {
            self.dirty.round(true, &mut self.counts)?;
        }
        Ok(())
    }

    fn iteration(&mut self, kinds: Kinds) -> Result<(), StressError> {
        let memory = self.memory;
        let area = self.writers.area;
        if kinds.neighbours {
            // The kernel test's dummy slot: one page right below the vCPUs' memory.
            let spec = RegionSpec::new(GuestAddress(area.gpa - PAGE_SIZE), PAGE_SIZE);
            let below = change("adding the page below the area", memory.add_region(spec))?;
            change(
                "removing the page below the area",
                memory.remove_region(below),
            )?;
            self.counts.below_add_removes += 1;
            let spec = RegionSpec::new(GuestAddress(area.end()), ABOVE_PAGES * PAGE_SIZE)
                .with_slot_size(PAGE_SIZE);
            let above = change("adding the slots above the area", memory.add_region(spec))?;
            change(
                "removing the slots above the area",
                memory.remove_region(above),
            )?;
            self.counts.above_add_removes += 1;
            self.move_once()?;
        }
        if kinds.read_only {
            for read_only in [true, false] {
                change(
                    "toggling the verifier's region read-only",
                    memory.set_read_only(self.verify_region, read_only),
                )?;
                self.counts.read_only_toggles += 1;
            }
        }
        if kinds.dirty {
            if self.dirty.logging() {
                self.dirty.round(false, &mut self.counts)?;
            } else {
                self.dirty.start(&mut self.counts)?;
            }
        }
        Ok(())
    }

    /// Moves the two-slot region somewhere else in its window (often overlapping where it was)
    /// and checks that its memory went with it.
    fn move_once(&mut self) -> Result<(), StressError> {
        let positions = MOVE_WINDOW_PAGES - MOVER_PAGES + 1;
        let mut gpa = self.move_window() + self.next_random() % positions * PAGE_SIZE;
        if gpa == self.mover_gpa {
            gpa = self.move_window()
                + (gpa - self.move_window() + PAGE_SIZE) % (positions * PAGE_SIZE);
        }
        change(
            "moving the two-slot region",
            self.memory.move_region(self.mover, GuestAddress(gpa)),
        )?;
        self.mover_gpa = gpa;
        self.counts.moves += 1;
        let snapshot = self.memory.current();
        for page in 0..MOVER_PAGES {
            let at = gpa + page * PAGE_SIZE;
            let found = read(&*snapshot, at)?;
            let expected = MOVER_STAMP ^ page;
            if found != expected {
                return Err(StressError::MovedData {
                    gpa,
                    at,
                    found,
                    expected,
                });
            }
        }
        Ok(())
    }
}
