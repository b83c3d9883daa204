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
//!
//! [`AREA_GPA`]: tinyvmm::test_guest::area::AREA_GPA
//! [`TestArea`]: tinyvmm::test_guest::area::TestArea

mod config;
mod layout;
mod report;
mod run;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

pub use config::{
    PerfConfig, PerfError, Scenario, SkipReason, UnknownScenario, MAP_AREA_SIZE, MOVE_WINDOW,
    UNMAP_AREA_SIZE, UNMAP_CHUNK,
};
pub use report::{MoveExits, Outcome, PerfReport, Progress, Skipped, TestResult};
pub use run::{run_test, TestSpec};

use tinyvmm::jobs::args::{positive_seconds, slot_count, LimitArgs};
use tinyvmm::jobs::process::{job_report, print_report, write_json};
use tinyvmm::lifecycle::run_job;
use tinyvmm::test_guest::vcpus::{check_slot_count, GuestError};

/// Runs the suite; `stop` ends it early (the results so far are returned, marked interrupted).
/// `progress` hears of every step.
pub fn run_perf(
    config: &PerfConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PerfReport, PerfError> {
    let duration = config.duration()?;
    let max = tinyvmm::vm::max_slots().map_err(GuestError::Vm)?;
    let slot_counts = if config.slots.is_empty() {
        vec![max]
    } else {
        config.slots.clone()
    };
    for &slots in &slot_counts {
        check_slot_count(slots, max)?;
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
        slot_zap_all_kept: config.keep_slot_zap_all,
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
                    limits: config.limits,
                    keep_slot_zap_all: config.keep_slot_zap_all,
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

/// `tinyvmm-bench bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct PerfArgs {
    /// KVM slot counts, comma-separated (each 2 to KVM's maximum) [default: KVM's maximum]
    #[arg(long, value_delimiter = ',', value_parser = slot_count(2))]
    pub slots: Vec<usize>,
    /// MiB of test memory for the move and RW tests (map uses 32 MiB, unmap 128 MiB).
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    pub mem_mib: u64,
    /// Seconds each test repeats its iteration (fractions allowed).
    #[arg(long, default_value = "5", value_parser = positive_seconds)]
    pub seconds: std::time::Duration,
    /// Runs of each test at each slot count.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Tests, comma-separated: map, unmap, unmap-chunked, move-active, move-inactive, rw
    /// [default: all]
    #[arg(long, value_delimiter = ',')]
    pub tests: Vec<Scenario>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-perf.json")]
    pub out: std::path::PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Keep KVM's KVM_X86_QUIRK_SLOT_ZAP_ALL (every guest mapping dropped when any slot is
    /// deleted or moved) instead of turning it off where KVM allows: to compare the two.
    #[arg(long)]
    pub keep_slot_zap_all: bool,
    /// The memory limits of the VMs it creates.
    #[command(flatten)]
    pub limits: LimitArgs,
}

impl PerfArgs {
    /// Runs the suite on a job thread, prints its table and writes its JSON; gives the exit
    /// status (130 when a signal cut it short, its results so far printed).
    pub fn run(self) -> ExitCode {
        let config = PerfConfig {
            slots: self.slots,
            area_size: self.mem_mib.saturating_mul(1 << 20),
            seconds: self.seconds.as_secs_f64(),
            runs: self.runs,
            scenarios: self.tests,
            limits: Some(self.limits.resolve()),
            keep_slot_zap_all: self.keep_slot_zap_all,
        };
        let outcome = run_job(move |ctx| {
            run_perf(&config, &ctx.stop, &ctx.vcpu_stopped, &mut |p| {
                eprintln!("{p}")
            })
        });
        let report = match job_report(outcome, "", self.json) {
            Ok(report) => report,
            Err(code) => return code,
        };
        print_report(&report, self.json, !report.interrupted, "");
        if write_json(&self.out, &report) != ExitCode::SUCCESS {
            return ExitCode::FAILURE;
        }
        if report.interrupted {
            ExitCode::from(130)
        } else {
            ExitCode::SUCCESS
        }
    }
}
