//! What the suite measured: the results and the report, how they read and how they serialize.

use std::fmt;
use std::time::Duration;

use serde::{Serialize, Serializer};

use super::config::{size, Scenario, SkipReason, MAP_AREA_SIZE, UNMAP_AREA_SIZE};
use tinyvmm::test_guest::area::AREA_GPA;

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
    #[serde(rename = "slot_setup_ms", serialize_with = "tinyvmm::jobs::millis")]
    pub slot_setup: Duration,
    /// Iterations completed.
    pub iterations: u64,
    /// Time of all iterations.
    #[serde(rename = "elapsed_ms", serialize_with = "tinyvmm::jobs::millis")]
    pub elapsed: Duration,
    /// Average time of one iteration.
    #[serde(rename = "per_iteration_ms", serialize_with = "tinyvmm::jobs::millis")]
    pub per_iteration: Duration,
    /// Time of the first iteration alone (for map and RW it includes faulting the memory in).
    #[serde(
        rename = "first_iteration_ms",
        serialize_with = "tinyvmm::jobs::millis"
    )]
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
    /// KVM's zap-everything-on-slot-change quirk was kept (`--keep-slot-zap-all`); otherwise
    /// turned off where KVM allows.
    pub slot_zap_all_kept: bool,
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

/// `total / count`, or zero for no count.
pub(super) fn average(total: Duration, count: u64) -> Duration {
    match total.as_nanos().checked_div(u128::from(count)) {
        Some(nanos) => Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)),
        None => Duration::ZERO,
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
        if self.slot_zap_all_kept {
            writeln!(
                f,
                "KVM_X86_QUIRK_SLOT_ZAP_ALL kept: every slot change drops every guest mapping"
            )?;
        }
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
