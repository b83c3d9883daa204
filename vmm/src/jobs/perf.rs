//! The memslot performance suite, after the kernel's `memslot_perf_test`
//! (`tools/testing/selftests/kvm/memslot_perf_test.c`): the same six scenarios, run on the test
//! guest through kvm-memslots instead of raw ioctls.
//!
//! Every test gets a fresh VM: the system region at 0 and a test area at [`AREA_GPA`] split over
//! `slots - 1` KVM slots, laid out as the kernel lays it out: every test slot has
//! `pages / (slots - 1)` pages, and the last one also holds the remainder. The last slot is a
//! one-slot region of its own (the others are one [`TestArea`] region), so that the move tests can
//! move it alone. Adding both regions is the *slot setup* time. Then one vCPU runs the guest
//! while the host repeats the scenario's iteration for the given time; the result is the number
//! of iterations and the average time of one.
//!
//! | scenario | area | iteration |
//! |---|---|---|
//! | map | 32 MiB | the guest writes 8 bytes to every page of one half while the host discards (`MADV_DONTNEED`) the other half; the halves swap every iteration |
//! | unmap | 128 MiB | the host discards one 64 MiB half page by page while the guest keeps touching the first page of each half |
//! | unmap chunked | 128 MiB | the same in 2 MiB chunks |
//! | move active area | `area_size` | the host moves the last slot far away and back while the guest writes a 192 KiB window whose upper half is in that slot |
//! | move inactive area | `area_size` | the same with the window just below the moved slot |
//! | RW | `area_size` | the guest writes every page, the host checks and writes every page, the guest checks |

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{RegionId, RegionSpec, PAGE_SIZE};
use serde::{Serialize, Serializer};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::test_guest::area::{AreaError, TestArea, AREA_GPA};
use crate::test_guest::vcpus::{expect_pattern, Vcpus, Vm, VmError};
use crate::test_guest::{self, pattern, Command, Op};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The map test's area (the kernel's `MEM_TEST_MAP_SIZE`): at most 8192 test slots of one page.
pub const MAP_AREA_SIZE: u64 = 32 * MIB;
/// The unmap tests' area (the kernel's `MEM_TEST_UNMAP_SIZE`), discarded in two halves.
pub const UNMAP_AREA_SIZE: u64 = 128 * MIB;
/// The chunk of the chunked unmap test (a typical huge page).
pub const UNMAP_CHUNK: u64 = 2 * MIB;
/// The window the guest writes in the move tests.
pub const MOVE_WINDOW: u64 = 192 * KIB;

/// How long the host waits for a write loop to make progress before it stops it.
const LOOP_PROGRESS_TIMEOUT: Duration = Duration::from_secs(10);

/// One scenario of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Guest writes fault in one half of a 32 MiB area while the host discards the other.
    Map,
    /// The host discards 64 MiB halves page by page.
    Unmap,
    /// The host discards 64 MiB halves in 2 MiB chunks.
    UnmapChunked,
    /// The host moves the last slot away and back while the guest writes into it.
    MoveActive,
    /// The host moves the last slot away and back while the guest writes just below it.
    MoveInactive,
    /// Guest and host write and check every page of the area in turn.
    Rw,
}

impl Scenario {
    /// Every scenario, in the kernel's order.
    pub const ALL: [Scenario; 6] = [
        Scenario::Map,
        Scenario::Unmap,
        Scenario::UnmapChunked,
        Scenario::MoveActive,
        Scenario::MoveInactive,
        Scenario::Rw,
    ];

    /// The name on the command line and in the JSON (`move-active`).
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Map => "map",
            Scenario::Unmap => "unmap",
            Scenario::UnmapChunked => "unmap-chunked",
            Scenario::MoveActive => "move-active",
            Scenario::MoveInactive => "move-inactive",
            Scenario::Rw => "rw",
        }
    }

    /// The kernel test's name for it (`move active area`).
    pub fn title(self) -> &'static str {
        match self {
            Scenario::Map => "map",
            Scenario::Unmap => "unmap",
            Scenario::UnmapChunked => "unmap chunked",
            Scenario::MoveActive => "move active area",
            Scenario::MoveInactive => "move inactive area",
            Scenario::Rw => "RW",
        }
    }

    /// The size of the test area this scenario uses, given the suite's `area_size`: map and
    /// unmap have fixed areas, as in the kernel.
    pub fn area_size(self, area_size: u64) -> u64 {
        match self {
            Scenario::Map => MAP_AREA_SIZE,
            Scenario::Unmap | Scenario::UnmapChunked => UNMAP_AREA_SIZE,
            Scenario::MoveActive | Scenario::MoveInactive | Scenario::Rw => area_size,
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A test name that is none of the suite's.
#[derive(Debug, thiserror::Error)]
#[error("unknown test {name:?}; the tests are map, unmap, unmap-chunked, move-active, move-inactive, rw")]
pub struct UnknownScenario {
    /// The name given.
    pub name: String,
}

impl FromStr for Scenario {
    type Err = UnknownScenario;

    /// Accepts the name (`move-active`) or the kernel's title (`move active area`), in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Scenario::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s) || t.title().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownScenario { name: s.into() })
    }
}

/// What the suite runs.
#[derive(Debug, Clone)]
pub struct PerfConfig {
    /// KVM slot counts (system slot included), each 2 to KVM's maximum; empty: KVM's maximum.
    pub slots: Vec<usize>,
    /// Bytes of test area for the move and RW tests (map and unmap use their own sizes).
    pub area_size: u64,
    /// Seconds each test runs its iterations (fractions allowed).
    pub seconds: f64,
    /// Runs of each test at each slot count.
    pub runs: usize,
    /// The scenarios, in the order given; empty: all of them.
    pub scenarios: Vec<Scenario>,
}

impl Default for PerfConfig {
    fn default() -> Self {
        PerfConfig {
            slots: Vec::new(),
            area_size: 512 * MIB,
            seconds: 5.0,
            runs: 1,
            scenarios: Scenario::ALL.to_vec(),
        }
    }
}

/// Why the suite could not run (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The memory manager refused a change or a discard.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// A slot count outside what KVM offers.
    #[error("{asked} slots asked for; KVM offers 2 to {max} (one is the system region's)")]
    SlotCount {
        /// Slots asked for.
        asked: usize,
        /// KVM's limit.
        max: usize,
    },
    /// The test time is not a positive number of seconds.
    #[error("the time per test must be a positive number of seconds, not {0}")]
    Seconds(f64),
    /// No runs.
    #[error("the number of runs must be at least 1")]
    NoRuns,
    /// A test area the guest cannot reach, or no area at all.
    #[error("a test area of {size:#x} bytes at {gpa:#x} is empty or outside the guest's identity map (below {limit:#x})")]
    AreaSize {
        /// Its size.
        size: u64,
        /// Where it starts.
        gpa: u64,
        /// The end of the guest's identity map.
        limit: u64,
    },
    /// Reading or writing guest memory from the host failed.
    #[error("host access at {gpa:#x} failed: {source}")]
    Access {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// The guest's write loop made no progress once the host had stopped changing memory.
    #[error(
        "{scenario}: the guest's write loop made no progress within {timeout:?} (passes: {passes})"
    )]
    LoopStalled {
        /// The test.
        scenario: Scenario,
        /// Passes the guest had completed.
        passes: u64,
        /// How long the host waited.
        timeout: Duration,
    },
    /// A signal stopped the test.
    #[error("interrupted")]
    Interrupted,
}

/// Why a test does not run at a slot count (the kernel's test skips these too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// The area has fewer pages than test slots.
    TooManySlots {
        /// The area's size.
        area_size: u64,
        /// Test slots (slots - 1).
        test_slots: u64,
    },
    /// The last slot cannot hold the upper half of the move window.
    LastSlotTooSmall {
        /// Its size.
        last_slot: u64,
        /// The size needed.
        needed: u64,
    },
    /// The slots below the last cannot hold the window's part below it.
    BelowTooSmall {
        /// Bytes of area below the last slot.
        below: u64,
        /// The size needed.
        needed: u64,
    },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SkipReason::TooManySlots {
                area_size,
                test_slots,
            } => write!(
                f,
                "the {} area has {} pages, fewer than its {test_slots} test slots (at most {} slots)",
                size(area_size),
                area_size / PAGE_SIZE,
                area_size / PAGE_SIZE + 1
            ),
            SkipReason::LastSlotTooSmall { last_slot, needed } => write!(
                f,
                "the last slot ({}) is smaller than the window's upper half ({})",
                size(last_slot),
                size(needed)
            ),
            SkipReason::BelowTooSmall { below, needed } => write!(
                f,
                "the slots below the last hold {}, less than the window's {} below it",
                size(below),
                size(needed)
            ),
        }
    }
}

/// A size in the largest binary unit that divides it.
fn size(bytes: u64) -> String {
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} bytes"),
    }
}

/// The exits of a move test's vCPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MoveExits {
    /// MMIO exits on the moved slot's home range while it was away, counted (the write is
    /// dropped, as the kernel's test ignores it): `ExitCounters::expected`.
    pub mmio_counted: u64,
    /// Exits on the moved slot whose handling found the move under way and finished the access
    /// against memory once the slot was back: `ExitCounters::completed_after_change`.
    pub completed_after_move: u64,
    /// Every exit of the vCPU during the test (the above, write-loop kicks, command ports).
    pub all: u64,
}

impl MoveExits {
    /// Exits caused by the moves (counted and completed).
    pub fn on_moved_slot(&self) -> u64 {
        self.mmio_counted + self.completed_after_move
    }
}

fn millis<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

/// What one run of one test measured.
#[derive(Debug, Clone, Serialize)]
pub struct TestResult {
    /// The test.
    pub test: Scenario,
    /// KVM slots in use (system slot included).
    pub slots: usize,
    /// Which run (1-based).
    pub run: usize,
    /// Bytes of test area.
    pub area_size: u64,
    /// Bytes in each test slot but the last.
    pub slot_size: u64,
    /// Bytes in the last test slot (the remainder included).
    pub last_slot_size: u64,
    /// Adding the test area: every KVM slot of it created.
    #[serde(rename = "slot_setup_ms", serialize_with = "millis")]
    pub slot_setup: Duration,
    /// Iterations completed.
    pub iterations: u64,
    /// Time of all iterations.
    #[serde(rename = "elapsed_ms", serialize_with = "millis")]
    pub elapsed: Duration,
    /// Average time of one iteration.
    #[serde(rename = "per_iteration_ms", serialize_with = "millis")]
    pub per_iteration: Duration,
    /// Time of the first iteration alone (for map and RW it includes faulting the memory in).
    #[serde(rename = "first_iteration_ms", serialize_with = "millis")]
    pub first_iteration: Duration,
    /// For the move tests: the vCPU's exits.
    pub exits: Option<MoveExits>,
    /// Guest addresses whose contents the host or the guest checked (each check passed).
    pub data_checks: u64,
}

/// A test that did not run.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The test.
    pub test: Scenario,
    /// KVM slots asked for.
    pub slots: usize,
    /// Why it did not run.
    #[serde(serialize_with = "display")]
    pub reason: SkipReason,
}

fn display<S: Serializer, T: fmt::Display>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(value)
}

/// How one test ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// It ran.
    Ran(TestResult),
    /// It cannot run at this slot count.
    Skipped(Skipped),
}

/// The whole suite's results.
#[derive(Debug, Clone, Serialize)]
pub struct PerfReport {
    /// KVM's number of slots.
    pub kvm_max_slots: usize,
    /// Slot counts run.
    pub slot_counts: Vec<usize>,
    /// Tests run at each slot count.
    pub tests: Vec<Scenario>,
    /// Bytes of test area for the move and RW tests.
    pub area_size: u64,
    /// Seconds per test.
    pub seconds: f64,
    /// Runs per test.
    pub runs: usize,
    /// Tests that ran, in order.
    pub results: Vec<TestResult>,
    /// Tests that could not run.
    pub skipped: Vec<Skipped>,
    /// A signal stopped the suite; the test running then is not in the results.
    pub interrupted: bool,
}

/// What the suite is doing, for a progress display.
#[derive(Debug)]
pub enum Progress<'a> {
    /// A test is starting (its VM and test area are being set up).
    Starting {
        /// 1-based position in the suite.
        index: usize,
        /// Tests in the suite.
        total: usize,
        /// The test.
        test: Scenario,
        /// KVM slots.
        slots: usize,
        /// Which run.
        run: usize,
    },
    /// The test area is in place; the iterations start.
    Running {
        /// Slot setup time.
        slot_setup: Duration,
        /// How long the iterations will run.
        duration: Duration,
    },
    /// A test ended.
    Finished(&'a Outcome),
}

impl fmt::Display for Progress<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Starting {
                index,
                total,
                test,
                slots,
                run,
            } => write!(
                f,
                "[{index}/{total}] {slots} slots, {}, run {run}: setting up",
                test.title()
            ),
            Progress::Running {
                slot_setup,
                duration,
            } => write!(
                f,
                "    slot setup {}; running for {}",
                time(*slot_setup),
                time(*duration)
            ),
            Progress::Finished(Outcome::Ran(r)) => {
                write!(
                    f,
                    "    {} iterations, {} each",
                    r.iterations,
                    time(r.per_iteration)
                )?;
                match r.exits {
                    Some(e) => write!(f, "; exits: {}", exits(&e)),
                    None => Ok(()),
                }
            }
            Progress::Finished(Outcome::Skipped(s)) => write!(f, "    skipped: {}", s.reason),
        }
    }
}

/// A duration in a unit that suits it.
fn time(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

fn exits(e: &MoveExits) -> String {
    format!(
        "{} MMIO counted + {} completed after the move",
        e.mmio_counted, e.completed_after_move
    )
}

impl PerfConfig {
    /// The time each test runs, or why the configuration is refused.
    fn duration(&self) -> Result<Duration, PerfError> {
        if self.runs == 0 {
            return Err(PerfError::NoRuns);
        }
        let limit = test_guest::IDENTITY_MAPPED;
        if self.area_size < PAGE_SIZE || self.area_size > limit - AREA_GPA {
            return Err(PerfError::AreaSize {
                size: self.area_size,
                gpa: AREA_GPA,
                limit,
            });
        }
        match Duration::try_from_secs_f64(self.seconds) {
            Ok(d) if !d.is_zero() => Ok(d),
            _ => Err(PerfError::Seconds(self.seconds)),
        }
    }
}

/// Runs the suite; `stop` ends it early (the results so far are returned, marked interrupted).
/// `progress` hears of every step.
pub fn run_perf(
    config: &PerfConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PerfReport, PerfError> {
    let duration = config.duration()?;
    let max = kvm_ioctls::Kvm::new()
        .map_err(VmError::Kvm)?
        .get_nr_memslots();
    let slot_counts = if config.slots.is_empty() {
        vec![max]
    } else {
        config.slots.clone()
    };
    if let Some(&asked) = slot_counts.iter().find(|&&s| s < 2 || s > max) {
        return Err(PerfError::SlotCount { asked, max });
    }
    let scenarios = if config.scenarios.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        config.scenarios.clone()
    };
    let mut report = PerfReport {
        kvm_max_slots: max,
        slot_counts: slot_counts.clone(),
        tests: scenarios.clone(),
        area_size: config.area_size,
        seconds: duration.as_secs_f64(),
        runs: config.runs,
        results: Vec::new(),
        skipped: Vec::new(),
        interrupted: false,
    };
    let total = slot_counts.len() * scenarios.len() * config.runs;
    let mut index = 0;
    for &slots in &slot_counts {
        for &test in &scenarios {
            for run in 1..=config.runs {
                index += 1;
                if stop.load(Ordering::Acquire) {
                    report.interrupted = true;
                    return Ok(report);
                }
                progress(Progress::Starting {
                    index,
                    total,
                    test,
                    slots,
                    run,
                });
                let spec = TestSpec {
                    test,
                    slots,
                    area_size: config.area_size,
                    duration,
                };
                let outcome = match run_test(&spec, stop, stopped, progress) {
                    Err(PerfError::Interrupted) => {
                        report.interrupted = true;
                        return Ok(report);
                    }
                    outcome => outcome?,
                };
                progress(Progress::Finished(&outcome));
                match outcome {
                    Outcome::Ran(mut result) => {
                        result.run = run;
                        report.results.push(result);
                    }
                    Outcome::Skipped(skipped) => {
                        // A skip does not depend on the run.
                        report.skipped.push(skipped);
                        index += config.runs - run;
                        break;
                    }
                }
            }
        }
    }
    Ok(report)
}

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
}

/// The test area as the kernel lays it out (see the module's documentation).
struct Layout {
    gpa: u64,
    test_slots: u64,
    slot_size: u64,
    last_slot_size: u64,
}

impl Layout {
    fn plan(area_size: u64, test_slots: u64) -> Result<Self, SkipReason> {
        let pages = area_size / PAGE_SIZE;
        let per_slot = pages / test_slots;
        if per_slot == 0 {
            return Err(SkipReason::TooManySlots {
                area_size,
                test_slots,
            });
        }
        Ok(Layout {
            gpa: AREA_GPA,
            test_slots,
            slot_size: per_slot * PAGE_SIZE,
            last_slot_size: (per_slot + pages % test_slots) * PAGE_SIZE,
        })
    }

    /// Bytes below the last slot.
    fn below_last(&self) -> u64 {
        (self.test_slots - 1) * self.slot_size
    }

    fn last_gpa(&self) -> u64 {
        self.gpa + self.below_last()
    }

    fn size(&self) -> u64 {
        self.below_last() + self.last_slot_size
    }

    fn end(&self) -> u64 {
        self.gpa + self.size()
    }

    /// Adds the slots below the last as one [`TestArea`] and the last as a one-slot region;
    /// returns the last one's region.
    fn add(&self, vm: &Vm) -> Result<RegionId, PerfError> {
        if self.test_slots > 1 {
            TestArea::add(
                vm.memory(),
                self.gpa,
                self.below_last(),
                self.test_slots - 1,
            )?;
        }
        let last = RegionSpec::new(GuestAddress(self.last_gpa()), self.last_slot_size);
        Ok(vm.memory().add_region(last)?)
    }
}

/// The move tests' window: where it starts, given the layout, or why it does not fit.
fn move_window(test: Scenario, layout: &Layout) -> Result<u64, SkipReason> {
    let (below, above) = match test {
        Scenario::MoveActive => (MOVE_WINDOW / 2, MOVE_WINDOW / 2),
        _ => (MOVE_WINDOW, 0),
    };
    if layout.last_slot_size < above {
        return Err(SkipReason::LastSlotTooSmall {
            last_slot: layout.last_slot_size,
            needed: above,
        });
    }
    if layout.below_last() < below {
        return Err(SkipReason::BelowTooSmall {
            below: layout.below_last(),
            needed: below,
        });
    }
    Ok(layout.last_gpa() - below)
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

/// The VM of one test, with its vCPU running.
struct Bench<'a> {
    vm: &'a Vm,
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
    let vm = Vm::new()?;
    let max = vm.max_slots();
    if spec.slots < 2 || spec.slots > max {
        return Err(PerfError::SlotCount {
            asked: spec.slots,
            max,
        });
    }
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

/// `total / count`, or zero for no count.
fn average(total: Duration, count: u64) -> Duration {
    match total.as_nanos().checked_div(u128::from(count)) {
        Some(nanos) => Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)),
        None => Duration::ZERO,
    }
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
        Ok(expect_pattern(&*self.vm.memory().snapshot(), gpa, seed)?)
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
        Ok(Measured {
            iterations: timed.iterations,
            elapsed: timed.elapsed,
            first: timed.first,
            exits: None,
            data_checks,
        })
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
        Ok(Measured {
            iterations: timed.iterations,
            elapsed: timed.elapsed,
            first: timed.first,
            exits: None,
            data_checks: 2,
        })
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
                &counters.expected,
                &counters.completed_after_change,
                &counters.exits,
            ]
            .map(|c| c.load(Ordering::Relaxed))
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
        Ok(Measured {
            iterations: timed.iterations,
            elapsed: timed.elapsed,
            first: timed.first,
            exits: Some(MoveExits {
                mmio_counted: after[0] - before[0],
                completed_after_move: after[1] - before[1],
                all: after[2] - before[2],
            }),
            data_checks: MOVE_WINDOW / PAGE_SIZE,
        })
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
            let memory = b.vm.memory().snapshot();
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
        Ok(Measured {
            iterations: timed.iterations,
            elapsed: timed.elapsed,
            first: timed.first,
            exits: None,
            data_checks: 2 * pages * timed.iterations,
        })
    }
}

impl fmt::Display for PerfReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tinyvmm perf suite: {} s per test, {} run(s), move/RW area {} at {:#x}, map area {}, unmap area {} (KVM offers {} slots)",
            self.seconds,
            self.runs,
            size(self.area_size),
            AREA_GPA,
            size(MAP_AREA_SIZE),
            size(UNMAP_AREA_SIZE),
            self.kvm_max_slots
        )?;
        let runs = self.runs > 1;
        write!(f, "{:>6}  {:<19}", "slots", "test")?;
        if runs {
            write!(f, " {:>3}", "run")?;
        }
        writeln!(
            f,
            " {:>11} {:>10} {:>14} {:>14}  exits (move tests)",
            "slot setup", "iterations", "per iteration", "first one"
        )?;
        for slots in unique(&self.slot_counts) {
            for test in unique(&self.tests) {
                let at = |t: Scenario, n: usize| t == test && n == slots;
                for r in self.results.iter().filter(|r| at(r.test, r.slots)) {
                    write!(f, "{:>6}  {:<19}", r.slots, r.test.title())?;
                    if runs {
                        write!(f, " {:>3}", r.run)?;
                    }
                    write!(
                        f,
                        " {:>11} {:>10} {:>14} {:>14}",
                        time(r.slot_setup),
                        r.iterations,
                        time(r.per_iteration),
                        time(r.first_iteration)
                    )?;
                    if let Some(e) = &r.exits {
                        write!(f, "  {}", exits(e))?;
                    }
                    writeln!(f)?;
                }
                for s in self.skipped.iter().filter(|s| at(s.test, s.slots)) {
                    writeln!(f, "{slots:>6}  {:<19} skipped: {}", test.title(), s.reason)?;
                }
            }
        }
        if self.interrupted {
            write!(f, "interrupted: the test running then is not listed")?;
        }
        Ok(())
    }
}

/// The distinct items of `items`, in their first order.
fn unique<T: PartialEq + Copy>(items: &[T]) -> Vec<T> {
    let mut out = Vec::new();
    for &item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_are_named_as_on_the_command_line_or_as_in_the_kernel() {
        for test in Scenario::ALL {
            assert_eq!(test.name().parse::<Scenario>().unwrap(), test);
            assert_eq!(test.title().parse::<Scenario>().unwrap(), test);
        }
        assert_eq!(
            " Move Active Area".parse::<Scenario>().unwrap(),
            Scenario::MoveActive
        );
        assert_eq!(
            "unmap chunks".parse::<Scenario>().unwrap_err().to_string(),
            "unknown test \"unmap chunks\"; the tests are map, unmap, unmap-chunked, move-active, move-inactive, rw"
        );
        assert_eq!(
            serde_json::to_string(&Scenario::UnmapChunked).unwrap(),
            "\"unmap-chunked\""
        );
    }

    #[test]
    fn the_last_slot_holds_the_remainder_as_in_the_kernel() {
        // 512 MiB over 32763 test slots: 4 pages each, the last 4 + 20.
        let layout = Layout::plan(512 * MIB, 32763).unwrap();
        assert_eq!(
            (layout.slot_size, layout.last_slot_size),
            (16 * KIB, 96 * KIB)
        );
        assert_eq!(layout.size(), 512 * MIB);
        assert_eq!(layout.last_gpa(), AREA_GPA + 32762 * 16 * KIB);
        // Exactly the upper half of the active window fits; the inactive one is below.
        assert_eq!(
            move_window(Scenario::MoveActive, &layout),
            Ok(layout.last_gpa() - 96 * KIB)
        );
        assert_eq!(
            move_window(Scenario::MoveInactive, &layout),
            Ok(layout.last_gpa() - 192 * KIB)
        );
        // 128 MiB over 32763 slots: one page each, the last 1 + 5; the area stays whole.
        let unmap = Layout::plan(UNMAP_AREA_SIZE, 32763).unwrap();
        assert_eq!((unmap.slot_size, unmap.last_slot_size), (4 * KIB, 24 * KIB));
        assert_eq!(unmap.size(), UNMAP_AREA_SIZE);
    }

    #[test]
    fn tests_that_cannot_run_say_why() {
        assert_eq!(
            Layout::plan(MAP_AREA_SIZE, 8193).err().unwrap().to_string(),
            "the 32 MiB area has 8192 pages, fewer than its 8193 test slots (at most 8193 slots)"
        );
        assert!(Layout::plan(MAP_AREA_SIZE, 8192).is_ok());
        // 512 MiB over 32768 test slots (more than KVM has here): 4 pages each, no remainder.
        let layout = Layout::plan(512 * MIB, 32768).unwrap();
        assert_eq!(
            move_window(Scenario::MoveActive, &layout)
                .unwrap_err()
                .to_string(),
            "the last slot (16 KiB) is smaller than the window's upper half (96 KiB)"
        );
        let one = Layout::plan(512 * MIB, 1).unwrap();
        assert_eq!(
            move_window(Scenario::MoveInactive, &one)
                .unwrap_err()
                .to_string(),
            "the slots below the last hold 0 bytes, less than the window's 192 KiB below it"
        );
    }

    #[test]
    fn averages_and_times_read_well() {
        assert_eq!(
            average(Duration::from_millis(10), 4),
            Duration::from_micros(2500)
        );
        assert_eq!(average(Duration::from_millis(10), 0), Duration::ZERO);
        assert_eq!(time(Duration::from_micros(1500)), "1.50 ms");
        assert_eq!(time(Duration::from_nanos(78_200)), "78.2 µs");
        assert_eq!(time(Duration::from_millis(2500)), "2.50 s");
    }
}
