//! The stress mode, after the kernel's `memslot_modification_stress_test`: vCPUs write their
//! memory continuously while the host changes the slots around it, and nothing may be lost.
//!
//! Each writer vCPU runs a write loop over its own part of a test area (pass `k` writes
//! `a ^ (seed + k)` at every `stride`-th address `a`). Meanwhile a host thread, iteration after
//! iteration, adds and removes a one-page region just below the area (the kernel test's dummy
//! slot) and a region of one-page slots just above it, moves a two-slot region around a window
//! next to it, toggles a region read-only and back, and switches dirty logging on the writers'
//! own region on and off (a flags-only update) while harvesting its dirty pages.
//!
//! A verifier vCPU keeps checking the read-only-toggled region, whose pattern the host wrote:
//! KVM deletes and re-creates each of its slots on a toggle, so a read inside that window exits
//! to the VMM, which must wait for the change and finish the read against memory (counted in
//! [`ExitCounters::completed_after_change`](crate::vm::vcpu::ExitCounters)). With 15 writers there is
//! no vCPU left for it, and vCPU 0 verifies in a phase after the writers stop.
//!
//! The run fails if a vCPU stops on an error, a verify finds wrong data, or a write is lost:
//! while the writers run, every scan of a part must find each address holding a pass no older
//! than the one before the last completed pass; between two harvests taken while logging, every
//! address whose value changed must be on a page the second harvest reports (and after a full
//! pass, every page must be); after the loops stop, every address must hold the last pass's
//! pattern.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{
    DirtyPages, KvmMemory, KvmVm, MemoryManager, RegionId, RegionSpec, Target, PAGE_SIZE,
};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::test_guest::area::{AreaError, TestArea, AREA_GPA};
use crate::test_guest::vcpus::{Vcpus, Vm, VmError};
use crate::test_guest::{self, pattern, Command, CommandBlock, Op};
use crate::vm::vcpu::{ExitCounters, VcpuShared};

/// Where the region the verifier reads (and the host toggles read-only) starts.
pub const VERIFY_GPA: u64 = 128 << 20;
/// Size of the verifier's region.
pub const VERIFY_SIZE: u64 = 1 << 20;
/// KVM slots of the verifier's region (each is deleted and re-created on a toggle).
const VERIFY_SLOTS: u64 = 8;
/// The verifier checks every u64 of its region.
const VERIFY_STRIDE: u64 = 8;
const VERIFY_SEED: u64 = 0x5eed_0000_7e51_0003;
/// Writer `i` starts its passes at `WRITE_SEED + (i << 32)`.
const WRITE_SEED: u64 = 0x5eed_1000_0000_0000;
/// One-page slots of the region added and removed just above the area.
const ABOVE_PAGES: u64 = 4;
/// One-page slots of the region that moves around.
const MOVER_PAGES: u64 = 2;
/// Pages of the window (right above the area's neighbour) the mover moves within.
const MOVE_WINDOW_PAGES: u64 = 64;
const MOVER_STAMP: u64 = 0x5eed_0000_0000_ab0e;
/// Harvests checked in each period of dirty logging.
const ROUNDS_PER_LOGGING: u32 = 3;
/// How long the host waits for the writers to make progress before calling them stalled.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What to run.
#[derive(Debug, Clone)]
pub struct StressConfig {
    /// Writer vCPUs (1 to 15); a verifier vCPU runs beside them when there is room for it.
    pub vcpus: usize,
    /// Bytes of the test area per writer (trimmed to whole slots).
    pub part_size: u64,
    /// KVM slots of the test area per writer.
    pub slots_per_vcpu: u64,
    /// Distance between the addresses the writers write (a multiple of 8).
    pub stride: u64,
    /// Iterations of changes (each: every kind of change once, one dirty-logging step); at
    /// least one runs.
    pub iterations: u64,
    /// Changes stop after about this long even if iterations are left (the last round of
    /// dirty logging and the checks follow; without a verifier alongside the writers, half
    /// goes to them and half to the verifier's phase).
    pub duration: Duration,
    /// For testing the checker: after the loops stop, the host puts back what the pass before
    /// the last wrote at the start of this page (an index into the test area), as if the last
    /// pass's write there had been lost; the final check must then fail naming its address.
    pub corrupt_page: Option<u64>,
}

impl Default for StressConfig {
    fn default() -> Self {
        StressConfig {
            vcpus: 2,
            part_size: 4 << 20,
            slots_per_vcpu: 2,
            stride: PAGE_SIZE,
            iterations: 1000,
            duration: Duration::from_secs(10),
            corrupt_page: None,
        }
    }
}

/// Why a stress run failed.
#[derive(Debug, thiserror::Error)]
pub enum StressError {
    /// The VM failed, or a vCPU stopped on an error, or the verifier found wrong data.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The manager refused a change.
    #[error("{what} failed: {source}")]
    Change {
        /// The change.
        what: &'static str,
        /// The manager's error.
        source: kvm_memslots::Error,
    },
    /// A writer count the test guest has no room for.
    #[error("{0} writer vCPUs asked for; the stress mode runs 1 to {max}", max = test_guest::MAX_VCPUS)]
    VcpuCount(usize),
    /// A stride that is no multiple of 8 or does not fit a part.
    #[error("stride {stride:#x} must be a non-zero multiple of 8 and at most a part ({part_size:#x} bytes)")]
    Stride {
        /// The stride asked for.
        stride: u64,
        /// Bytes per writer.
        part_size: u64,
    },
    /// The writers' memory (and the regions above it) would not fit in what the guest maps.
    #[error("{size:#x} bytes of writers' memory asked for; the guest's page tables leave room for {limit:#x}")]
    AreaSize {
        /// Bytes asked for.
        size: u64,
        /// Bytes that fit.
        limit: u64,
    },
    /// The page to corrupt is not in the test area.
    #[error("page {page} is outside the test area of {pages} pages")]
    CorruptPage {
        /// The page asked for.
        page: u64,
        /// Pages in the area.
        pages: u64,
    },
    /// An address holds an older pass's pattern than the writer has since written there.
    #[error("lost write at {gpa:#x} (vCPU {vcpu}): found {found:#x}, but pass {pass} (pattern {expected:#x}) or a later one had been written there")]
    LostWrite {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// What it holds.
        found: u64,
        /// The oldest pass it may hold.
        pass: u64,
        /// That pass's pattern.
        expected: u64,
    },
    /// An address holds something no pass of its writer has written (yet).
    #[error("wrong data at {gpa:#x} (vCPU {vcpu}): found {found:#x}, which none of the {passes} passes it had started writes there")]
    WrongData {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// What it holds.
        found: u64,
        /// Passes the writer had started.
        passes: u64,
    },
    /// The guest wrote an address while dirty logging was on, but no harvest reported its page.
    #[error("dirty page missed at {gpa:#x} (vCPU {vcpu}): it changed from {before:#x} to {after:#x} between two harvests while logging, but the second did not report it")]
    DirtyPageMissed {
        /// The writer.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// Its value after the first harvest.
        before: u64,
        /// Its value before the second.
        after: u64,
    },
    /// The first harvest after logging started missed a page, though KVM's logs start all set.
    #[error("the first harvest after dirty logging started did not report page {gpa:#x}, though KVM's logs start all set")]
    FirstHarvest {
        /// The page.
        gpa: u64,
    },
    /// A harvest of the test area did not come back as one region's pages.
    #[error("harvesting the test area returned {0} regions' pages instead of one")]
    Harvest(usize),
    /// Memory of the moving region holds something else after a move.
    #[error("after moving a region to {gpa:#x}, the host found {found:#x} at {at:#x} instead of its stamp {expected:#x}")]
    MovedData {
        /// The region's new base.
        gpa: u64,
        /// The address read.
        at: u64,
        /// What it holds.
        found: u64,
        /// What the host had written there before the move.
        expected: u64,
    },
    /// A writer completed no pass for too long.
    #[error("vCPU {vcpu} completed no write pass in {waited:?} (stuck at {passes} passes)")]
    Stalled {
        /// The writer.
        vcpu: usize,
        /// Its passes.
        passes: u64,
        /// How long the host waited.
        waited: Duration,
    },
    /// The eventfd that tells the job a vCPU stopped could not be made.
    #[error("creating an eventfd failed: {0}")]
    EventFd(std::io::Error),
    /// A vCPU stopped during the run without an error the host could collect.
    #[error("a vCPU stopped during the run")]
    VcpuStopped,
    /// Reading or writing guest memory from the host failed.
    #[error("host access at {gpa:#x} failed: {source}")]
    Access {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// The run was interrupted (a signal).
    #[error("interrupted")]
    Interrupted,
}

/// How many changes of each kind the host made.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChangeCounts {
    /// Iterations run.
    pub iterations: u64,
    /// One-page regions added and removed just below the test area.
    pub below_add_removes: u64,
    /// Regions of one-page slots added and removed just above the test area.
    pub above_add_removes: u64,
    /// Moves of the two-slot region.
    pub moves: u64,
    /// Read-only toggles of the verifier's region (each way counts).
    pub read_only_toggles: u64,
    /// Dirty logging started on the test area.
    pub dirty_log_starts: u64,
    /// Dirty logging stopped on the test area.
    pub dirty_log_stops: u64,
    /// Harvests of the test area.
    pub harvests: u64,
    /// Pages those harvests reported.
    pub dirty_pages_harvested: u64,
    /// Harvests checked against what the writers changed since the one before.
    pub dirty_rounds_checked: u64,
    /// Scans of the writers' parts for lost writes while they ran.
    pub scans: u64,
}

/// What a stress run did.
#[derive(Debug, Clone, Serialize)]
pub struct StressReport {
    /// Writer vCPUs.
    pub vcpus: usize,
    /// The verifier's vCPU.
    pub verifier_vcpu: usize,
    /// Whether the verifier ran beside the writers (otherwise in a phase after them).
    pub verifier_alongside: bool,
    /// The test area's base.
    pub area_gpa: u64,
    /// Bytes of test area.
    pub area_size: u64,
    /// Its KVM slots.
    pub area_slots: u64,
    /// The writers' stride.
    pub stride: u64,
    /// Changes the host made (both phases).
    pub changes: ChangeCounts,
    /// Write passes each writer completed.
    pub passes: Vec<u64>,
    /// Verify commands the verifier completed.
    pub verifies: u64,
    /// Exits of every vCPU.
    pub exits: u64,
    /// Accesses to slots that were away during a change, finished against memory, per vCPU.
    pub completed_after_change: Vec<u64>,
    /// Writes to read-only memory dropped (none expected).
    pub read_only_writes: u64,
    /// From starting the write loops to the end of the last check.
    pub duration: Duration,
}

impl StressReport {
    /// Accesses completed after a change, all vCPUs together.
    pub fn total_completed_after_change(&self) -> u64 {
        self.completed_after_change.iter().sum()
    }
}

/// One writer's part of the test area.
#[derive(Debug, Clone)]
struct Part {
    range: Range<u64>,
    seed: u64,
}

/// What the writers do, as the host checks it.
#[derive(Debug, Clone)]
struct Writers {
    area: TestArea,
    parts: Vec<Part>,
    stride: u64,
}

impl Writers {
    fn addresses(&self, vcpu: usize) -> impl Iterator<Item = u64> {
        self.parts[vcpu].range.clone().step_by(self.stride as usize)
    }

    fn passes(&self, memory: &MemoryManager<KvmVm>, vcpu: usize) -> u64 {
        CommandBlock::new(vcpu).passes(&*memory.snapshot())
    }
}

/// The pass index `k` whose pattern `found` is at `gpa` for writer seed `seed`.
fn pass_of(gpa: u64, found: u64, seed: u64) -> u64 {
    (found ^ gpa).wrapping_sub(seed)
}

/// Whether a harvest reported page `page` of its region.
fn is_set(dirty: &DirtyPages, page: u64) -> bool {
    dirty
        .bitmap
        .get((page / 64) as usize)
        .is_some_and(|word| word & (1 << (page % 64)) != 0)
}

fn read(memory: &impl GuestMemory, gpa: u64) -> Result<u64, StressError> {
    memory
        .read_obj(GuestAddress(gpa))
        .map_err(|source| StressError::Access { gpa, source })
}

/// Checks that every `stride`-th address of `part` holds what pass `passes - 1` of a write loop
/// with `seed` wrote there: the final check of writer `vcpu` once its loop has stopped after
/// `passes` passes (with none, there is nothing to check).
pub fn check_part(
    memory: &impl GuestMemory,
    vcpu: usize,
    part: Range<u64>,
    stride: u64,
    seed: u64,
    passes: u64,
) -> Result<(), StressError> {
    if stride == 0 || stride % 8 != 0 {
        return Err(StressError::Stride {
            stride,
            part_size: part.end.saturating_sub(part.start),
        });
    }
    if passes == 0 {
        return Ok(());
    }
    let last = passes - 1;
    for gpa in part.step_by(stride as usize) {
        let found = read(memory, gpa)?;
        let expected = pattern(gpa, seed.wrapping_add(last));
        if found != expected {
            let k = pass_of(gpa, found, seed);
            return Err(if k > last {
                StressError::WrongData {
                    vcpu,
                    gpa,
                    found,
                    passes,
                }
            } else {
                StressError::LostWrite {
                    vcpu,
                    gpa,
                    found,
                    pass: last,
                    expected,
                }
            });
        }
    }
    Ok(())
}

/// Which kinds of change an iteration makes.
#[derive(Debug, Clone, Copy)]
struct Kinds {
    neighbours: bool,
    read_only: bool,
    dirty: bool,
}

/// A period of dirty logging: values read after the last harvest, and each writer's passes then.
struct Logging {
    round: u32,
    before: Vec<Vec<u64>>,
    passes: Vec<u64>,
}

/// The host thread that changes slots while the vCPUs run.
struct Changer<'a> {
    memory: &'a MemoryManager<KvmVm>,
    writers: &'a Writers,
    verify_region: RegionId,
    mover: RegionId,
    mover_gpa: u64,
    finish: &'a AtomicBool,
    counts: ChangeCounts,
    rng: u64,
    logging: Option<Logging>,
}

fn change<T>(what: &'static str, result: Result<T, kvm_memslots::Error>) -> Result<T, StressError> {
    result.map_err(|source| StressError::Change { what, source })
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
    fn run(&mut self, kinds: Kinds, iterations: u64, deadline: Instant) -> Result<(), StressError> {
        if kinds.dirty {
            // The lost-write checks assume every address was written at least once.
            self.wait_for_passes(&vec![0; self.writers.parts.len()])?;
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
        if self.logging.is_some() && !self.finishing() {
            self.dirty_round(true)?;
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
            if self.logging.is_none() {
                self.start_logging()?;
            } else {
                self.dirty_round(false)?;
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
        let snapshot = self.memory.snapshot();
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

    /// Waits until every writer completed more passes than `passes` says.
    fn wait_for_passes(&self, passes: &[u64]) -> Result<(), StressError> {
        for (vcpu, &since) in passes.iter().enumerate() {
            let start = Instant::now();
            loop {
                let now = self.writers.passes(self.memory, vcpu);
                if now > since || self.finishing() {
                    break;
                }
                if start.elapsed() > STALL_TIMEOUT {
                    return Err(StressError::Stalled {
                        vcpu,
                        passes: now,
                        waited: STALL_TIMEOUT,
                    });
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }

    /// Reads writer `vcpu`'s part, checking that no address holds a pass older than the one
    /// before the last pass completed before the read (a lost write) or newer than the one in
    /// progress after it. Returns the values and the passes completed after the read.
    fn scan(&mut self, vcpu: usize) -> Result<(Vec<u64>, u64), StressError> {
        let seed = self.writers.parts[vcpu].seed;
        let before = self.writers.passes(self.memory, vcpu);
        let snapshot = self.memory.snapshot();
        let values = self
            .writers
            .addresses(vcpu)
            .map(|gpa| read(&*snapshot, gpa))
            .collect::<Result<Vec<u64>, _>>()?;
        let after = self.writers.passes(self.memory, vcpu);
        self.counts.scans += 1;
        let oldest = before.saturating_sub(1);
        for (gpa, &found) in self.writers.addresses(vcpu).zip(&values) {
            // A value no pass wrote decodes to a huge "pass" (wrapping below 0, or garbage).
            let k = pass_of(gpa, found, seed);
            if k > after {
                return Err(StressError::WrongData {
                    vcpu,
                    gpa,
                    found,
                    passes: after + 1,
                });
            }
            if k < oldest {
                return Err(StressError::LostWrite {
                    vcpu,
                    gpa,
                    found,
                    pass: oldest,
                    expected: pattern(gpa, seed.wrapping_add(oldest)),
                });
            }
        }
        Ok((values, after))
    }

    fn scan_all(&mut self) -> Result<(Vec<Vec<u64>>, Vec<u64>), StressError> {
        let mut values = Vec::new();
        let mut passes = Vec::new();
        for vcpu in 0..self.writers.parts.len() {
            let (v, p) = self.scan(vcpu)?;
            values.push(v);
            passes.push(p);
        }
        Ok((values, passes))
    }

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
    fn start_logging(&mut self) -> Result<(), StressError> {
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
            if let Some(page) = (0..area.size() / PAGE_SIZE).find(|&p| !is_set(&first, p)) {
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
    fn dirty_round(&mut self, last: bool) -> Result<(), StressError> {
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
        let area = self.writers.area;
        let is_dirty = |gpa: u64| is_set(&dirty, (gpa - area.gpa) / PAGE_SIZE);
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

/// Runs the stress mode; `stop` ends it early (as interrupted); `stopped` is woken whenever a
/// vCPU stops.
pub fn run_stress(
    config: StressConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
) -> Result<StressReport, StressError> {
    if config.vcpus == 0 || config.vcpus > test_guest::MAX_VCPUS {
        return Err(StressError::VcpuCount(config.vcpus));
    }
    if config.stride == 0 || config.stride % 8 != 0 || config.stride > config.part_size {
        return Err(StressError::Stride {
            stride: config.stride,
            part_size: config.part_size,
        });
    }
    let writers = config.vcpus as u64;
    let area_size = config.part_size.saturating_mul(writers);
    let limit =
        test_guest::IDENTITY_MAPPED - AREA_GPA - (ABOVE_PAGES + MOVE_WINDOW_PAGES) * PAGE_SIZE;
    if area_size > limit {
        return Err(StressError::AreaSize {
            size: area_size,
            limit,
        });
    }
    let vm = Vm::new()?;
    let area = TestArea::add(
        vm.memory(),
        AREA_GPA,
        area_size,
        config.slots_per_vcpu.max(1) * writers,
    )?;
    let parts = (0..config.vcpus)
        .map(|vcpu| {
            let (first, last) = area.share(vcpu, config.vcpus);
            Part {
                range: area.slot_gpa(first)..area.slot_gpa(last),
                seed: WRITE_SEED + ((vcpu as u64) << 32),
            }
        })
        .collect();
    let writers = Writers {
        area,
        parts,
        stride: config.stride,
    };
    if let Some(page) = config.corrupt_page {
        let pages = area.size() / PAGE_SIZE;
        if page >= pages {
            return Err(StressError::CorruptPage { page, pages });
        }
    }
    let memory = vm.memory();
    let verify_spec = RegionSpec::new(GuestAddress(VERIFY_GPA), VERIFY_SIZE)
        .with_slot_size(VERIFY_SIZE / VERIFY_SLOTS);
    let verify_region = change(
        "adding the verifier's region",
        memory.add_region(verify_spec),
    )?;
    let snapshot = memory.snapshot();
    for gpa in (VERIFY_GPA..VERIFY_GPA + VERIFY_SIZE).step_by(VERIFY_STRIDE as usize) {
        snapshot
            .write_obj(pattern(gpa, VERIFY_SEED), GuestAddress(gpa))
            .map_err(|source| StressError::Access { gpa, source })?;
    }
    let mover_gpa = area.end() + ABOVE_PAGES * PAGE_SIZE;
    let mover_spec =
        RegionSpec::new(GuestAddress(mover_gpa), MOVER_PAGES * PAGE_SIZE).with_slot_size(PAGE_SIZE);
    let mover = change("adding the two-slot region", memory.add_region(mover_spec))?;
    let snapshot = memory.snapshot();
    for page in 0..MOVER_PAGES {
        let gpa = mover_gpa + page * PAGE_SIZE;
        snapshot
            .write_obj(MOVER_STAMP ^ page, GuestAddress(gpa))
            .map_err(|source| StressError::Access { gpa, source })?;
    }
    drop(snapshot);

    let alongside = config.vcpus < test_guest::MAX_VCPUS;
    let count = config.vcpus + usize::from(alongside);
    // The VMM's loop only wakes up on `stopped`; the job watches its own eventfd to notice a
    // vCPU that stops while it should be running.
    let down = EventFd::new(EFD_NONBLOCK).map_err(StressError::EventFd)?;
    let down = Arc::new(down);
    let mut vcpus = vm.start_vcpus(count, &down)?;
    let shared: Vec<Arc<VcpuShared>> = (0..count).map(|v| Arc::clone(vcpus.shared(v))).collect();
    let finish = AtomicBool::new(false);
    let mut changer = Changer {
        memory,
        writers: &writers,
        verify_region,
        mover,
        mover_gpa,
        finish: &finish,
        counts: ChangeCounts::default(),
        rng: 0x9e37_79b9_7f4a_7c15,
        logging: None,
    };
    let watch = Watch {
        stop,
        stopped,
        down: &down,
    };
    let result = stress(&config, &mut vcpus, &mut changer, &watch);
    let shutdown = vcpus.shut_down();
    let (passes, verifies, duration) = result?;
    shutdown?;
    let count_of = |f: fn(&ExitCounters) -> &AtomicU64| {
        shared
            .iter()
            .map(|s| f(&s.counters).load(Ordering::Relaxed))
            .collect::<Vec<u64>>()
    };
    Ok(StressReport {
        vcpus: config.vcpus,
        verifier_vcpu: if alongside { config.vcpus } else { 0 },
        verifier_alongside: alongside,
        area_gpa: area.gpa,
        area_size: area.size(),
        area_slots: area.slots,
        stride: config.stride,
        changes: changer.counts,
        passes,
        verifies,
        exits: count_of(|c| &c.exits).iter().sum(),
        completed_after_change: count_of(|c| &c.completed_after_change),
        read_only_writes: count_of(|c| &c.read_only_writes).iter().sum(),
        duration,
    })
}

/// What the job watches while the vCPUs run.
struct Watch<'a> {
    stop: &'a AtomicBool,
    stopped: &'a Arc<EventFd>,
    down: &'a EventFd,
}

impl Watch<'_> {
    fn interrupted(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Whether a vCPU stopped since the last call; wakes the VMM's loop if so.
    fn vcpu_down(&self) -> bool {
        if self.down.read().is_ok() {
            let _ = self.stopped.write(1);
            true
        } else {
            false
        }
    }
}

fn verify_command() -> Command {
    Command {
        op: Op::Verify,
        start: VERIFY_GPA,
        end: VERIFY_GPA + VERIFY_SIZE,
        stride: VERIFY_STRIDE,
        seed: VERIFY_SEED,
    }
}

/// Runs the changer on its own thread while this one keeps `verifier` (if any) verifying and
/// watches for a signal or a vCPU that stops; returns the verify commands completed.
fn with_changes(
    vcpus: &mut Vcpus,
    changer: &mut Changer<'_>,
    kinds: Kinds,
    iterations: u64,
    deadline: Instant,
    verifier: Option<usize>,
    watch: &Watch<'_>,
) -> Result<u64, StressError> {
    let finish = changer.finish;
    let mut verifies = 0;
    let mut verifier_error = None;
    let mut down = false;
    let changed = std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("changes".into())
            .spawn_scoped(scope, || changer.run(kinds, iterations, deadline))
            .expect("spawning the host's change thread");
        while !thread.is_finished() {
            if watch.interrupted() {
                finish.store(true, Ordering::Release);
            }
            if !down && watch.vcpu_down() {
                down = true;
                finish.store(true, Ordering::Release);
            }
            match verifier {
                Some(v) if verifier_error.is_none() && !finish.load(Ordering::Acquire) => {
                    match vcpus.run(v, verify_command()) {
                        Ok(_) => verifies += 1,
                        Err(e) => {
                            verifier_error = Some(e);
                            finish.store(true, Ordering::Release);
                        }
                    }
                }
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    if let Some(e) = verifier_error {
        return Err(e.into());
    }
    changed?;
    if down {
        return Err(StressError::VcpuStopped);
    }
    if let Some(v) = verifier {
        // Once more with every toggle done: the region still holds what the host wrote.
        vcpus.run(v, verify_command())?;
        verifies += 1;
    }
    Ok(verifies)
}

/// The run proper: write loops, changes beside them, the final check, and the verifier's phase
/// if it did not run beside the writers. Returns the passes, the verifies and the duration.
fn stress(
    config: &StressConfig,
    vcpus: &mut Vcpus,
    changer: &mut Changer<'_>,
    watch: &Watch<'_>,
) -> Result<(Vec<u64>, u64, Duration), StressError> {
    let writers = changer.writers;
    let alongside = config.vcpus < vcpus.count();
    let started = Instant::now();
    for (vcpu, part) in writers.parts.iter().enumerate() {
        vcpus.start(
            vcpu,
            Command {
                op: Op::WriteLoop,
                start: part.range.start,
                end: part.range.end,
                stride: writers.stride,
                seed: part.seed,
            },
        );
    }
    let kinds = Kinds {
        neighbours: true,
        read_only: alongside,
        dirty: true,
    };
    // Without a verifier alongside, the writers get half the time and the verifier the rest.
    let first_deadline = if alongside {
        started + config.duration
    } else {
        started + config.duration / 2
    };
    let verifier = alongside.then_some(config.vcpus);
    let changed = with_changes(
        vcpus,
        changer,
        kinds,
        config.iterations,
        first_deadline,
        verifier,
        watch,
    );
    // Stop the loops whatever happened: a writer that stopped on an error says why here.
    for vcpu in 0..writers.parts.len() {
        vcpus.stop_loop(vcpu);
    }
    let mut passes = Vec::new();
    let mut writer_error = None;
    for vcpu in 0..writers.parts.len() {
        match vcpus.wait(vcpu) {
            Ok(outcome) => passes.push(outcome.passes),
            Err(e) => {
                writer_error.get_or_insert(e);
                passes.push(0);
            }
        }
    }
    if let Some(e) = writer_error {
        return Err(e.into());
    }
    let mut verifies = changed?;
    if watch.interrupted() {
        return Err(StressError::Interrupted);
    }
    let snapshot = changer.memory.snapshot();
    if let Some(page) = config.corrupt_page {
        // Undo the last pass's write there, as if it had been lost.
        let gpa = writers.area.gpa + page * PAGE_SIZE;
        if let Some(vcpu) = writers.parts.iter().position(|p| p.range.contains(&gpa)) {
            let seed = writers.parts[vcpu].seed;
            let older = match passes[vcpu] {
                0 | 1 => 0,
                n => pattern(gpa, seed.wrapping_add(n - 2)),
            };
            snapshot
                .write_obj(older, GuestAddress(gpa))
                .map_err(|source| StressError::Access { gpa, source })?;
        }
    }
    for (vcpu, part) in writers.parts.iter().enumerate() {
        check_part(
            &*snapshot,
            vcpu,
            part.range.clone(),
            writers.stride,
            part.seed,
            passes[vcpu],
        )?;
    }
    if !alongside {
        // No vCPU was free for the verifier: vCPU 0 verifies while the host toggles.
        let kinds = Kinds {
            neighbours: false,
            read_only: true,
            dirty: false,
        };
        verifies += with_changes(
            vcpus,
            changer,
            kinds,
            config.iterations,
            Instant::now() + config.duration / 2,
            Some(0),
            watch,
        )?;
        if watch.interrupted() {
            return Err(StressError::Interrupted);
        }
    }
    Ok((passes, verifies, started.elapsed()))
}

impl std::fmt::Display for StressReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.changes;
        writeln!(
            f,
            "stress: {} writer vCPU(s) over {} KiB at {:#x} ({} slots, stride {}); verifier: vCPU {} {}",
            self.vcpus,
            self.area_size / 1024,
            self.area_gpa,
            self.area_slots,
            self.stride,
            self.verifier_vcpu,
            if self.verifier_alongside {
                "alongside the writers"
            } else {
                "after the writers stopped"
            }
        )?;
        writeln!(f, "  iterations          {:8}", c.iterations)?;
        writeln!(
            f,
            "  below add+remove    {:8}  (a one-page region right under the area)",
            c.below_add_removes
        )?;
        writeln!(
            f,
            "  above add+remove    {:8}  ({ABOVE_PAGES} one-page slots right over the area)",
            c.above_add_removes
        )?;
        writeln!(
            f,
            "  moves               {:8}  (a region of {MOVER_PAGES} one-page slots)",
            c.moves
        )?;
        writeln!(
            f,
            "  read-only toggles   {:8}  ({VERIFY_SLOTS} slots deleted and re-created each)",
            c.read_only_toggles
        )?;
        writeln!(
            f,
            "  dirty logging       {:8} starts, {} stops (flags-only), {} harvests",
            c.dirty_log_starts, c.dirty_log_stops, c.harvests
        )?;
        writeln!(
            f,
            "  dirty pages         {:8} harvested; {} harvests checked against the writers",
            c.dirty_pages_harvested, c.dirty_rounds_checked
        )?;
        writeln!(
            f,
            "  lost-write scans    {:8}  (of one writer's part while it ran)",
            c.scans
        )?;
        writeln!(f, "  passes per writer   {:?}", self.passes)?;
        writeln!(f, "  verifies            {:8}", self.verifies)?;
        writeln!(
            f,
            "  exits               {:8}; completed after a change: {} (per vCPU {:?})",
            self.exits,
            self.total_completed_after_change(),
            self.completed_after_change
        )?;
        write!(
            f,
            "  duration            {:8.3} s",
            self.duration.as_secs_f64()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots::fake::FakeKvm;

    const BASE: u64 = 0x10_0000;
    const SEED: u64 = WRITE_SEED + (3 << 32);

    fn memory_after_passes(passes: u64) -> MemoryManager<FakeKvm> {
        let m = MemoryManager::new(FakeKvm::new(8, false));
        m.add_region(RegionSpec::new(GuestAddress(BASE), 4 * PAGE_SIZE))
            .unwrap();
        let snapshot = m.snapshot();
        for k in 0..passes {
            for gpa in (BASE..BASE + 4 * PAGE_SIZE).step_by(PAGE_SIZE as usize) {
                snapshot
                    .write_obj(pattern(gpa, SEED + k), GuestAddress(gpa))
                    .unwrap();
            }
        }
        m
    }

    fn check(m: &MemoryManager<FakeKvm>, passes: u64) -> Result<(), StressError> {
        let part = BASE..BASE + 4 * PAGE_SIZE;
        check_part(&*m.snapshot(), 3, part, PAGE_SIZE, SEED, passes)
    }

    #[test]
    fn the_final_check_accepts_the_last_pass_everywhere() {
        let m = memory_after_passes(5);
        check(&m, 5).unwrap();
        assert_eq!(pass_of(BASE + 8, pattern(BASE + 8, SEED + 4), SEED), 4);
    }

    #[test]
    fn the_final_check_names_a_lost_write_and_wrong_data() {
        let m = memory_after_passes(5);
        let lost = BASE + 2 * PAGE_SIZE;
        m.snapshot()
            .write_obj(pattern(lost, SEED + 3), GuestAddress(lost))
            .unwrap();
        let err = check(&m, 5).unwrap_err();
        assert!(
            matches!(err, StressError::LostWrite { vcpu: 3, gpa, pass: 4, .. } if gpa == lost),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("lost write at 0x102000 (vCPU 3)"),
            "{err}"
        );
        m.snapshot()
            .write_obj(0xdead_beef_u64, GuestAddress(lost))
            .unwrap();
        let err = check(&m, 5).unwrap_err();
        assert!(
            matches!(err, StressError::WrongData { gpa, passes: 5, .. } if gpa == lost),
            "{err:?}"
        );
        // A pass the writer never got to is wrong too, not "lost".
        let m = memory_after_passes(5);
        let err = check(&m, 4).unwrap_err();
        assert!(
            matches!(err, StressError::WrongData { gpa: BASE, .. }),
            "{err:?}"
        );
    }
}
