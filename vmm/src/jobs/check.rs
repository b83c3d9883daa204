//! The main job: run the test guest across many slots and check every slot both ways.
//!
//! The guest writes a pattern at both ends of every slot and the host reads it back through
//! the memory map; then the host writes a new pattern and the guest checks it. A slot that KVM
//! maps to the wrong host memory, or the map to the wrong guest address, fails the run.

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use vmm_sys_util::eventfd::EventFd;

use super::args::{slot_count, test_guest_vcpus, LimitArgs};
use super::process::{job_report, print_report};
use crate::lifecycle::{log, run_job, LogLevel};
use crate::test_guest::area::{check_area, AreaError, TestArea, AREA_GPA};
use crate::test_guest::vcpus::{GuestError, TestVm};
use crate::vm::VmOptions;
use kvm_memslots::MemoryLimits;

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct CheckConfig {
    /// KVM slots in all (one is the system region's).
    pub slots: usize,
    /// Bytes of test area to split over the other slots.
    pub area_size: u64,
    /// vCPUs sharing the work.
    pub vcpus: usize,
    /// What guest memory is admitted against; `None`: this host's defaults
    /// ([`MemoryLimits::for_this_host`]).
    pub limits: Option<MemoryLimits>,
}

impl CheckConfig {
    /// A test VM made with `options` under these limits, refused (before any slot is made)
    /// where KVM cannot give it this many slots.
    pub fn vm(&self, options: VmOptions) -> Result<TestVm, GuestError> {
        let vm = TestVm::with_options(VmOptions {
            limits: self.limits,
            ..options
        })?;
        vm.check_slot_count(self.slots)?;
        Ok(vm)
    }

    /// The test area in `vm`: its bytes at [`AREA_GPA`], split over every slot but the
    /// system region's.
    pub fn add_area(&self, vm: &TestVm) -> Result<TestArea, AreaError> {
        TestArea::add(vm.memory(), AREA_GPA, self.area_size, self.slots as u64 - 1)
    }
}

/// Why a check run failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] GuestError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
}

/// What a check run did.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// KVM slots in use.
    pub slots: usize,
    /// Slots in the test area.
    pub area_slots: u64,
    /// Bytes per test slot.
    slot_size: u64,
    /// Bytes of test area.
    area_size: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Addresses checked in each direction (both ends of every slot).
    pub addresses_checked: u64,
    /// Adding the test area (every KVM slot created).
    #[serde(rename = "slot_setup_ms", serialize_with = "super::millis")]
    slot_setup: Duration,
    /// The guest writing both ends of every slot.
    #[serde(rename = "guest_write_ms", serialize_with = "super::millis")]
    guest_write: Duration,
    /// The host checking them.
    #[serde(rename = "host_check_ms", serialize_with = "super::millis")]
    host_check: Duration,
    /// The host writing a new pattern.
    #[serde(rename = "host_write_ms", serialize_with = "super::millis")]
    host_write: Duration,
    /// The guest checking it.
    #[serde(rename = "guest_check_ms", serialize_with = "super::millis")]
    guest_check: Duration,
    /// The manager's memory per slot.
    manager_bytes_per_slot: f64,
}

/// Runs the check; `stop` interrupts it between steps.
pub fn run_check(
    config: CheckConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
) -> Result<CheckReport, CheckError> {
    run_check_with_progress(config, stop, stopped, &mut |_| {})
}

/// [`run_check`], telling `progress` what each step is about to do (the slot set-up alone
/// takes seconds at KVM's maximum slot count).
fn run_check_with_progress(
    config: CheckConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
    progress: &mut dyn FnMut(&str),
) -> Result<CheckReport, CheckError> {
    let vm = config.vm(VmOptions::default())?;
    progress(&format!(
        "creating {} test slots in KVM",
        config.slots.saturating_sub(1)
    ));
    let start = Instant::now();
    let area = config.add_area(&vm)?;
    let slot_setup = start.elapsed();
    let mut vcpus = vm.start_vcpus(config.vcpus, stopped)?;
    progress(&format!(
        "checking both ends of every slot, guest then host ({} addresses each way)",
        2 * area.slots
    ));
    let result = check_area(&vm, &mut vcpus, &area, stop);
    let shutdown = vcpus.shut_down();
    let (guest_write, host_check, host_write, guest_check) = result?;
    shutdown?;
    Ok(CheckReport {
        slots: vm.memory().slot_usage().used,
        area_slots: area.slots,
        slot_size: area.slot_size,
        area_size: area.size(),
        vcpus: config.vcpus,
        addresses_checked: 2 * area.slots,
        slot_setup,
        guest_write,
        host_check,
        host_write,
        guest_check,
        manager_bytes_per_slot: vm.memory().bytes_per_slot(),
    })
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        let area_mib = self.area_size as f64 / f64::from(1 << 20);
        writeln!(
            f,
            "{} KVM slots: 1 system slot + {} test slot{} of {} KiB ({} MiB at {:#x}), {} vCPU{}",
            self.slots,
            self.area_slots,
            plural(self.area_slots),
            self.slot_size / 1024,
            // Whole MiB as such; a part of one to two places.
            format!("{area_mib:.2}")
                .trim_end_matches('0')
                .trim_end_matches('.'),
            AREA_GPA,
            self.vcpus,
            plural(self.vcpus as u64)
        )?;
        writeln!(
            f,
            "  slot setup    {:9.1} ms  (every test slot created in KVM)",
            ms(self.slot_setup)
        )?;
        writeln!(
            f,
            "  guest write   {:9.1} ms  ({} addresses: both ends of every slot)",
            ms(self.guest_write),
            self.addresses_checked
        )?;
        writeln!(f, "  host check    {:9.1} ms  ok", ms(self.host_check))?;
        writeln!(f, "  host write    {:9.1} ms", ms(self.host_write))?;
        writeln!(f, "  guest check   {:9.1} ms  ok", ms(self.guest_check))?;
        write!(
            f,
            "  manager memory {:.0} bytes per slot",
            self.manager_bytes_per_slot
        )
    }
}

/// `tinyvmm check`'s arguments.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// KVM slots in all (2 to KVM's maximum; one holds the guest's code and tables).
    #[arg(long, default_value_t = 4096, value_parser = slot_count(2))]
    slots: usize,
    /// MiB of test memory split over the other slots.
    #[arg(long, alias = "area-mib", default_value_t = 512)]
    mem_mib: u64,
    /// vCPUs sharing the work (1 to 15).
    #[arg(long, default_value_t = 1, value_parser = test_guest_vcpus)]
    vcpus: usize,
    /// Print the report as JSON alone on stdout (the human report goes to stderr).
    #[arg(long)]
    json: bool,
    /// The memory limits of the VM it checks.
    #[command(flatten)]
    limits: LimitArgs,
}

impl Default for CheckArgs {
    fn default() -> Self {
        CheckArgs {
            slots: 4096,
            mem_mib: 512,
            vcpus: 1,
            json: false,
            limits: LimitArgs::default(),
        }
    }
}

impl CheckArgs {
    /// Runs `tinyvmm check` on a job thread (progress lines on a terminal) and prints its
    /// report; gives its exit status.
    pub fn run(self) -> ExitCode {
        let config = CheckConfig {
            slots: self.slots,
            area_size: self.mem_mib.saturating_mul(1 << 20),
            vcpus: self.vcpus,
            limits: Some(self.limits.resolve()),
        };
        // Progress lines on a terminal only: a log or a pipe gets the report alone.
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let outcome = run_job(move |ctx| {
            run_check_with_progress(config, &ctx.stop, &ctx.vcpu_stopped, &mut |step| {
                if terminal {
                    log(LogLevel::Info, format_args!("{step}..."));
                }
            })
        });
        match job_report(outcome, "", self.json) {
            Ok(report) => {
                print_report(&report, self.json, true, "all checks passed");
                ExitCode::SUCCESS
            }
            Err(code) => code,
        }
    }
}
