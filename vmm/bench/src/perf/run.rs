//! One test: its VM and test area, and the scenarios' iterations, timed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{MemoryLimits, RegionId, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::config::{PerfError, Scenario, GIB, MOVE_WINDOW, UNMAP_CHUNK};
use super::layout::{move_window, Layout};
use super::report::{average, MoveExits, Outcome, Progress, Skipped, TestResult};
use tinyvmm::test_guest::vcpus::{expect_pattern, TestVm, Vcpus};
use tinyvmm::test_guest::{pattern, Command, Op};
use tinyvmm::vm::VmOptions;

/// How long the host waits for a write loop to make progress before it stops it.
const LOOP_PROGRESS_TIMEOUT: Duration = Duration::from_secs(10);

/// One test to run.
#[derive(Debug, Clone, Copy)]
pub struct TestSpec {
    /// The scenario.
    pub test: Scenario,
    /// KVM slots in all (one is the system region's).
    pub slots: usize,
    /// Bytes of test area for the move and RW tests.
    pub area_size: u64,
    /// How long to repeat the iteration.
    pub duration: Duration,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
    /// Keep KVM's zap-everything-on-slot-change quirk (`VmOptions::keep_slot_zap_all`).
    pub keep_slot_zap_all: bool,
}

/// What a scenario's loop measured.
struct Measured {
    iterations: u64,
    elapsed: Duration,
    first: Duration,
    exits: Option<MoveExits>,
    data_checks: u64,
}

/// What [`Bench::timed`] measured.
struct Timed {
    iterations: u64,
    elapsed: Duration,
    first: Duration,
}

impl Timed {
    /// What the test measured: this, the exits of a move test and the data checks made.
    fn measured(self, exits: Option<MoveExits>, data_checks: u64) -> Measured {
        Measured {
            iterations: self.iterations,
            elapsed: self.elapsed,
            first: self.first,
            exits,
            data_checks,
        }
    }
}

/// The VM of one test, with its vCPU running.
struct Bench<'a> {
    vm: &'a TestVm,
    vcpus: &'a mut Vcpus,
    layout: &'a Layout,
    last: RegionId,
    duration: Duration,
    stop: &'a AtomicBool,
}

/// Runs one test in a VM of its own (the suite's `run` field of the result is 1).
pub fn run_test(
    spec: &TestSpec,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Outcome, PerfError> {
    let test = spec.test;
    let skipped = |reason| {
        Ok(Outcome::Skipped(Skipped {
            test,
            slots: spec.slots,
            reason,
        }))
    };
    let vm = TestVm::with_options(VmOptions {
        limits: spec.limits,
        keep_slot_zap_all: spec.keep_slot_zap_all,
        ..VmOptions::default()
    })?;
    vm.check_slot_count(spec.slots)?;
    let area_size = test.area_size(spec.area_size);
    let layout = match Layout::plan(area_size, spec.slots as u64 - 1) {
        Ok(layout) => layout,
        Err(reason) => return skipped(reason),
    };
    if matches!(test, Scenario::MoveActive | Scenario::MoveInactive) {
        if let Err(reason) = move_window(test, &layout) {
            return skipped(reason);
        }
    }
    let start = Instant::now();
    let last = layout.add(&vm)?;
    let slot_setup = start.elapsed();
    progress(Progress::Running {
        slot_setup,
        duration: spec.duration,
    });
    let mut vcpus = vm.start_vcpus(1, stopped)?;
    let mut bench = Bench {
        vm: &vm,
        vcpus: &mut vcpus,
        layout: &layout,
        last,
        duration: spec.duration,
        stop,
    };
    let measured = match test {
        Scenario::Map => bench.map(),
        Scenario::Unmap => bench.unmap(test, PAGE_SIZE),
        Scenario::UnmapChunked => bench.unmap(test, UNMAP_CHUNK),
        Scenario::MoveActive | Scenario::MoveInactive => bench.move_last_slot(test),
        Scenario::Rw => bench.rw(),
    };
    let shutdown = vcpus.shut_down();
    let measured = measured?;
    shutdown?;
    Ok(Outcome::Ran(TestResult {
        test,
        slots: spec.slots,
        run: 1,
        area_size: layout.size(),
        slot_size: layout.slot_size,
        last_slot_size: layout.last_slot_size,
        slot_setup,
        iterations: measured.iterations,
        elapsed: measured.elapsed,
        per_iteration: average(measured.elapsed, measured.iterations),
        first_iteration: measured.first,
        exits: measured.exits,
        data_checks: measured.data_checks,
    }))
}

const MAP_SEED: u64 = 0x3a9_0000_0000_0000;
const UNMAP_SEED: u64 = 0x0a3a_9000_0000_0000;
const MOVE_SEED: u64 = 0x30e_0000_0000_0000;
const RW_SEED: u64 = 0x0e3_0000_0000_0000;

impl Bench<'_> {
    /// Repeats `iteration` (given its number) until the test's time is up, as the kernel does:
    /// the time is checked before each iteration, so there is at least one.
    fn timed(
        &mut self,
        mut iteration: impl FnMut(&mut Self, u64) -> Result<(), PerfError>,
    ) -> Result<Timed, PerfError> {
        let start = Instant::now();
        let mut done = 0;
        let mut first = Duration::ZERO;
        while start.elapsed() < self.duration {
            if self.stop.load(Ordering::Acquire) {
                return Err(PerfError::Interrupted);
            }
            iteration(self, done)?;
            if done == 0 {
                first = start.elapsed();
            }
            done += 1;
        }
        Ok(Timed {
            iterations: done,
            elapsed: start.elapsed(),
            first,
        })
    }

    /// Checks that `gpa` holds what the guest wrote there with `seed`.
    fn check(&self, gpa: u64, seed: u64) -> Result<(), PerfError> {
        Ok(expect_pattern(&*self.vm.memory().current(), gpa, seed)?)
    }

    /// Ends the vCPU's write loop once it has run a whole pass after this call (so that no
    /// write of its last pass can have been lost to a discard or a move before it); returns the
    /// passes it made.
    fn end_write_loop(&mut self, test: Scenario) -> Result<u64, PerfError> {
        let seen = self.vcpus.passes(0);
        let deadline = Instant::now() + LOOP_PROGRESS_TIMEOUT;
        while self.vcpus.passes(0) < seen + 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
        let progressed = self.vcpus.passes(0) >= seen + 2;
        self.vcpus.stop_loop(0);
        let passes = self.vcpus.wait(0)?.passes;
        if !progressed {
            return Err(PerfError::LoopStalled {
                scenario: test,
                passes,
                timeout: LOOP_PROGRESS_TIMEOUT,
            });
        }
        Ok(passes)
    }

    /// Map: the guest writes one half while the host discards the other; then they swap.
    fn map(&mut self) -> Result<Measured, PerfError> {
        let half = self.layout.size() / 2 / PAGE_SIZE * PAGE_SIZE;
        let low = self.layout.gpa;
        let mut data_checks = 0;
        let timed = self.timed(|b, i| {
            let (write, discard) = if i % 2 == 0 {
                (low, low + half)
            } else {
                (low + half, low)
            };
            let seed = MAP_SEED + i;
            b.vcpus.start(
                0,
                Command {
                    op: Op::Write,
                    start: write,
                    end: write + half,
                    stride: PAGE_SIZE,
                    seed,
                },
            );
            b.vm.memory().discard(GuestAddress(discard), half)?;
            b.vcpus.wait(0)?;
            // As the kernel's check: the first and last page of the half just written.
            b.check(write, seed)?;
            b.check(write + half - PAGE_SIZE, seed)?;
            data_checks += 2;
            Ok(())
        })?;
        Ok(timed.measured(None, data_checks))
    }

    /// Unmap: the host discards one half in `chunk`s per iteration while the guest keeps
    /// writing the first page of each half.
    fn unmap(&mut self, test: Scenario, chunk: u64) -> Result<Measured, PerfError> {
        let half = self.layout.size() / 2 / chunk * chunk;
        let low = self.layout.gpa;
        self.vcpus.start(
            0,
            Command {
                op: Op::WriteLoop,
                start: low,
                end: low + 2 * half,
                stride: half,
                seed: UNMAP_SEED,
            },
        );
        let timed = self.timed(|b, i| {
            let base = low + (i % 2) * half;
            for offset in (0..half).step_by(chunk as usize) {
                b.vm.memory().discard(GuestAddress(base + offset), chunk)?;
            }
            Ok(())
        })?;
        let passes = self.end_write_loop(test)?;
        let seed = UNMAP_SEED + passes - 1;
        self.check(low, seed)?;
        self.check(low + half, seed)?;
        Ok(timed.measured(None, 2))
    }

    /// Move active / inactive area: the host moves the last slot away and back while the
    /// guest writes a window across (active) or just below (inactive) its start.
    fn move_last_slot(&mut self, test: Scenario) -> Result<Measured, PerfError> {
        let window = move_window(test, self.layout).expect("checked before the VM was made");
        let home = self.layout.last_gpa();
        let home_range = home..home + self.layout.last_slot_size;
        // A free guest address well above the area.
        let away = (self.layout.end() + GIB).next_multiple_of(GIB);
        let shared = Arc::clone(self.vcpus.shared(0));
        let set_window = |w| {
            *shared
                .expected_mmio
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = w;
        };
        let counters = &shared.counters;
        let read = || {
            [
                counters.expected.load(Ordering::Relaxed),
                counters.completed_after_change.load(Ordering::Relaxed),
                counters.exits(),
            ]
        };
        if test == Scenario::MoveActive {
            set_window(Some(home_range));
        }
        let before = read();
        self.vcpus.start(
            0,
            Command {
                op: Op::WriteLoop,
                start: window,
                end: window + MOVE_WINDOW,
                stride: PAGE_SIZE,
                seed: MOVE_SEED,
            },
        );
        let last = self.last;
        let measured = self.timed(|b, _| {
            b.vm.memory().move_region(last, GuestAddress(away))?;
            b.vm.memory().move_region(last, GuestAddress(home))?;
            Ok(())
        });
        let timed = measured?;
        let passes = self.end_write_loop(test)?;
        set_window(None);
        let after = read();
        let seed = MOVE_SEED + passes - 1;
        for gpa in (window..window + MOVE_WINDOW).step_by(PAGE_SIZE as usize) {
            self.check(gpa, seed)?;
        }
        Ok(timed.measured(
            Some(MoveExits {
                mmio_counted: after[0] - before[0],
                completed_after_move: after[1] - before[1],
                all: after[2] - before[2],
            }),
            MOVE_WINDOW / PAGE_SIZE,
        ))
    }

    /// RW: the guest writes every page, the host checks them and writes the middle of every
    /// page, the guest checks that.
    fn rw(&mut self) -> Result<Measured, PerfError> {
        let (start, end) = (self.layout.gpa, self.layout.end());
        let pages = self.layout.size() / PAGE_SIZE;
        let timed = self.timed(|b, i| {
            let guest_seed = RW_SEED + 2 * i;
            let host_seed = guest_seed + 1;
            let command = |op, start, seed| Command {
                op,
                start,
                end,
                stride: PAGE_SIZE,
                seed,
            };
            b.vcpus.run(0, command(Op::Write, start, guest_seed))?;
            let memory = b.vm.memory().current();
            for gpa in (start..end).step_by(PAGE_SIZE as usize) {
                expect_pattern(&*memory, gpa, guest_seed)?;
                let middle = gpa + PAGE_SIZE / 2;
                memory
                    .write_obj(pattern(middle, host_seed), GuestAddress(middle))
                    .map_err(|source| PerfError::Access {
                        gpa: middle,
                        source,
                    })?;
            }
            b.vcpus
                .run(0, command(Op::Verify, start + PAGE_SIZE / 2, host_seed))?;
            Ok(())
        })?;
        let data_checks = 2 * pages * timed.iterations;
        Ok(timed.measured(None, data_checks))
    }
}
