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
//! [`ExitCounters::completed_after_change`](tinyvmm::vm::vcpu::ExitCounters)). With 15 writers there is
//! no vCPU left for it, and vCPU 0 verifies in a phase after the writers stop.
//!
//! The run fails if a vCPU stops on an error, a verify finds wrong data, or a write is lost:
//! while the writers run, every scan of a part must find each address holding a pass no older
//! than the one before the last completed pass; between two harvests taken while logging, every
//! address whose value changed must be on a page the second harvest reports (and after a full
//! pass, every page must be); after the loops stop, every address must hold the last pass's
//! pattern.

mod changer;
mod check;
mod config;
mod dirty;
mod report;
mod run;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvm_memslots::{RegionSpec, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use check::check_part;
pub use config::{StressConfig, StressError, VERIFY_GPA, VERIFY_SIZE};
pub use report::{ChangeCounts, StressReport};

use changer::Changer;
use check::{Part, Writers};
use config::{
    change, ABOVE_PAGES, MOVER_PAGES, MOVER_STAMP, MOVE_WINDOW_PAGES, VERIFY_SEED, VERIFY_SLOTS,
    VERIFY_STRIDE, WRITE_SEED,
};
use dirty::DirtyLog;
use run::{stress, Watch};

use tinyvmm::jobs::args::{positive_seconds, test_guest_vcpus, LimitArgs};
use tinyvmm::jobs::process::{job_report, print_report};
use tinyvmm::lifecycle::run_job;
use tinyvmm::test_guest::area::{TestArea, AREA_GPA};
use tinyvmm::test_guest::vcpus::TestVm;
use tinyvmm::test_guest::{self, pattern};
use tinyvmm::vm::vcpu::{ExitCounters, VcpuShared};
use tinyvmm::vm::VmOptions;

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
    if config.stride == 0 || !config.stride.is_multiple_of(8) || config.stride > config.part_size {
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
    let vm = TestVm::with_options(VmOptions {
        dirty_ring: config.dirty_ring,
        limits: config.limits,
        ..VmOptions::default()
    })?;
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
    let snapshot = memory.current();
    for gpa in (VERIFY_GPA..VERIFY_GPA + VERIFY_SIZE).step_by(VERIFY_STRIDE as usize) {
        snapshot
            .write_obj(pattern(gpa, VERIFY_SEED), GuestAddress(gpa))
            .map_err(|source| StressError::Access { gpa, source })?;
    }
    let mover_gpa = area.end() + ABOVE_PAGES * PAGE_SIZE;
    let mover_spec =
        RegionSpec::new(GuestAddress(mover_gpa), MOVER_PAGES * PAGE_SIZE).with_slot_size(PAGE_SIZE);
    let mover = change("adding the two-slot region", memory.add_region(mover_spec))?;
    let snapshot = memory.current();
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
        dirty: DirtyLog::new(memory, &writers, &finish),
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
        exits: shared.iter().map(|s| s.counters.exits()).sum(),
        completed_after_change: count_of(|c| &c.completed_after_change),
        read_only_writes: count_of(|c| &c.read_only_writes).iter().sum(),
        dirty_ring: config.dirty_ring,
        dirty_ring_full: shared.iter().map(|s| s.counters.dirty_ring_full()).sum(),
        duration,
    })
}

/// `tinyvmm-bench stress`'s arguments.
#[derive(Debug, clap::Args)]
pub struct StressArgs {
    /// Writer vCPUs (1 to 15); with fewer than 15, one more vCPU verifies alongside them.
    #[arg(long, default_value_t = 2, value_parser = test_guest_vcpus)]
    pub vcpus: usize,
    /// KiB of memory each writer writes.
    #[arg(long, default_value_t = 4096)]
    pub kib_per_vcpu: u64,
    /// KVM slots per writer in the writers' region.
    #[arg(long, default_value_t = 2)]
    pub slots_per_vcpu: u64,
    /// Bytes between the addresses the writers write (a multiple of 8; 4096: every page).
    #[arg(long, default_value_t = 4096)]
    pub stride: u64,
    /// Iterations of changes (each makes every kind of change once).
    #[arg(long, default_value_t = 1000)]
    pub iterations: u64,
    /// Stop after this many seconds even if iterations are left (fractions allowed).
    #[arg(long, default_value = "10", value_parser = positive_seconds)]
    pub seconds: std::time::Duration,
    /// Harvest dirty pages from per-vCPU rings of this many entries (a power of two from 256
    /// to KVM's maximum) instead of per-slot bitmaps [default: bitmaps]
    #[arg(long)]
    pub dirty_ring: Option<u32>,
    /// Print the report as JSON alone on stdout (the human report goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// The memory limits of the VM it stresses.
    #[command(flatten)]
    pub limits: LimitArgs,
}

impl StressArgs {
    /// Runs the stress mode on a job thread and prints its report; gives the exit status.
    pub fn run(self) -> ExitCode {
        let config = StressConfig {
            vcpus: self.vcpus,
            part_size: self.kib_per_vcpu.saturating_mul(1024),
            slots_per_vcpu: self.slots_per_vcpu,
            stride: self.stride,
            iterations: self.iterations,
            duration: self.seconds,
            corrupt_page: None,
            dirty_ring: self.dirty_ring,
            limits: Some(self.limits.resolve()),
        };
        let outcome = run_job(move |ctx| run_stress(config, &ctx.stop, &ctx.vcpu_stopped));
        match job_report(outcome, "stress failed: ", self.json) {
            Ok(report) => {
                print_report(
                    &report,
                    self.json,
                    true,
                    "stress passed: no write lost, no dirty page missed, no wrong data",
                );
                ExitCode::SUCCESS
            }
            Err(code) => code,
        }
    }
}
