//! `tinyvmm-bench harvest-bench`: what a dirty-page harvest costs in bitmap mode and in ring mode,
//! side by side in one run, when the guest dirtied 0 %, 0.1 %, 1 %, 10 % and 100 % of its pages.
//!
//! Two VMs, one per mode, each with the test area split over the same number of slots and
//! dirty logging on. The guest first touches every page (so that later writes cost tracking,
//! not first faults) and a harvest takes the initially-set pages. Then, per dirtied share and
//! repetition, in each VM in turn: the guest writes one u64 in every k-th page (timed), and the
//! host harvests (timed) and checks that exactly the written pages are reported. The result is
//! the median of each, and the ratio bitmap / ring. The same shares are then written clustered:
//! as many pages, but neighbours from the area's start (a guest's usual pattern), which KVM
//! re-protects in fewer, larger steps.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{Target, PAGE_SIZE};
use serde::Serialize;
use vmm_sys_util::eventfd::EventFd;

use tinyvmm::jobs::args::{slot_count, LimitArgs};
use tinyvmm::jobs::check::CheckConfig;
use tinyvmm::jobs::process::{job_report, print_report, write_json};
use tinyvmm::lifecycle::run_job;
use tinyvmm::test_guest::area::{AreaError, TestArea};
use tinyvmm::test_guest::vcpus::{check_slot_count, GuestError, TestVm, Vcpus};
use tinyvmm::test_guest::{Command, Op};
use tinyvmm::vm::VmOptions;

/// The shares of pages dirtied, as one page in `k` (0: none), scattered over the area.
const EVERY_KTH: [u64; 5] = [0, 1000, 100, 10, 1];
/// The shares written again as neighbouring pages.
const CLUSTERED_KTH: [u64; 3] = [1000, 100, 10];

/// What to measure.
#[derive(Debug, Clone, Copy)]
pub struct HarvestConfig {
    /// Each VM and its test area, as `tinyvmm check` makes them (one vCPU).
    pub area: CheckConfig,
    /// Entries per vCPU ring in ring mode.
    pub ring_entries: u32,
    /// Repetitions per share.
    pub runs: usize,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum HarvestError {
    /// The VM or its guest failed.
    #[error(transparent)]
    Guest(#[from] GuestError),
    /// The test area could not be made.
    #[error(transparent)]
    Area(#[from] AreaError),
    /// The manager refused.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// A harvest reported other pages than the guest wrote.
    #[error("{mode} mode: the guest wrote {written} pages, the harvest reported {reported}")]
    Inexact {
        /// The mode.
        mode: &'static str,
        /// Pages written.
        written: u64,
        /// Pages reported.
        reported: u64,
    },
    /// A signal stopped the run.
    #[error("interrupted")]
    Interrupted,
}

/// One share of dirtied pages, both modes.
#[derive(Debug, Clone, Serialize)]
pub struct HarvestRow {
    /// `scattered` (every k-th page) or `clustered` (neighbouring pages).
    pub pattern: &'static str,
    /// Share of the pages dirtied, in percent.
    pub dirtied_percent: f64,
    /// Pages dirtied per round.
    pub dirty_pages: u64,
    /// Median harvest time in bitmap mode, microseconds.
    pub bitmap_harvest_us: f64,
    /// Median harvest time in ring mode, microseconds.
    pub ring_harvest_us: f64,
    /// bitmap / ring.
    pub ratio: f64,
    /// Median time of the guest's write in bitmap mode, microseconds.
    pub bitmap_write_us: f64,
    /// Median time of the guest's write in ring mode, microseconds.
    pub ring_write_us: f64,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct HarvestReport {
    /// KVM slots in all.
    pub slots: usize,
    /// Bytes of test area.
    pub area_size: u64,
    /// Entries per vCPU ring.
    pub ring_entries: u32,
    /// Repetitions per share.
    pub runs: usize,
    /// One row per share.
    pub rows: Vec<HarvestRow>,
    /// Exits on a full ring during the ring VM's writes.
    pub ring_full_exits: u64,
}

struct Side {
    mode: &'static str,
    _vm: TestVm,
    memory: Arc<kvm_memslots::MemoryManager<kvm_memslots::KvmVm>>,
    vcpus: Vcpus,
    area: TestArea,
}

impl Side {
    fn new(
        mode: &'static str,
        config: &HarvestConfig,
        ring: Option<u32>,
        stopped: &Arc<EventFd>,
    ) -> Result<Self, HarvestError> {
        let vm = config.area.vm(VmOptions {
            dirty_ring: ring,
            ..VmOptions::default()
        })?;
        let area = config.area.add_area(&vm)?;
        let mut vcpus = vm.start_vcpus(config.area.vcpus, stopped)?;
        vcpus.set_timeout(Duration::from_secs(600));
        let memory = Arc::clone(vm.memory());
        memory.start_dirty_log(Target::Region(area.region))?;
        let mut side = Side {
            mode,
            _vm: vm,
            memory,
            vcpus,
            area,
        };
        // Every page touched once, and the initially-set pages taken.
        side.write(1, 0, false)?;
        side.memory
            .harvest_dirty(Target::Region(side.area.region))?;
        Ok(side)
    }

    /// The guest writes one u64 in one page of `k`: every `k`-th page, or (`clustered`) as
    /// many neighbouring pages from the area's start. Returns the pages written and the time.
    fn write(
        &mut self,
        k: u64,
        seed: u64,
        clustered: bool,
    ) -> Result<(u64, Duration), HarvestError> {
        if k == 0 {
            return Ok((0, Duration::ZERO));
        }
        let pages = self.area.size().div_ceil(k * PAGE_SIZE);
        let (end, stride) = if clustered {
            (self.area.gpa + pages * PAGE_SIZE, PAGE_SIZE)
        } else {
            (self.area.end(), k * PAGE_SIZE)
        };
        let start = Instant::now();
        self.vcpus.run(
            0,
            Command {
                op: Op::Write,
                start: self.area.gpa,
                end,
                stride,
                seed,
            },
        )?;
        Ok((pages, start.elapsed()))
    }

    /// Harvests and checks that exactly `written` pages are reported.
    fn harvest(&self, written: u64) -> Result<Duration, HarvestError> {
        let start = Instant::now();
        // The area alone: the system region has the host's own writes (command blocks).
        let dirty = self
            .memory
            .harvest_dirty(Target::Region(self.area.region))?;
        let elapsed = start.elapsed();
        let reported: u64 = dirty.iter().map(|d| d.count()).sum();
        if reported != written {
            return Err(HarvestError::Inexact {
                mode: self.mode,
                written,
                reported,
            });
        }
        Ok(elapsed)
    }
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// Runs the benchmark; `stop` ends it between rounds.
pub fn run_harvest_bench(
    config: &HarvestConfig,
    stop: &AtomicBool,
    stopped: &Arc<EventFd>,
) -> Result<HarvestReport, HarvestError> {
    check_slot_count(
        config.area.slots,
        tinyvmm::vm::max_slots().map_err(GuestError::Vm)?,
    )?;
    let mut sides = [
        Side::new("bitmap", config, None, stopped)?,
        Side::new("ring", config, Some(config.ring_entries), stopped)?,
    ];
    let pages = sides[0].area.size() / PAGE_SIZE;
    let mut rows = Vec::new();
    let mut seed = 1;
    let shares = EVERY_KTH
        .iter()
        .map(|&k| (k, false))
        .chain(CLUSTERED_KTH.iter().map(|&k| (k, true)));
    for (k, clustered) in shares {
        let mut harvests = [Vec::new(), Vec::new()];
        let mut writes = [Vec::new(), Vec::new()];
        let mut dirty_pages = 0;
        for _ in 0..config.runs.max(1) {
            for (i, side) in sides.iter_mut().enumerate() {
                if stop.load(Ordering::Acquire) {
                    return Err(HarvestError::Interrupted);
                }
                seed += 1;
                let (written, write_time) = side.write(k, seed, clustered)?;
                harvests[i].push(side.harvest(written)?);
                writes[i].push(write_time);
                dirty_pages = written;
            }
        }
        let [bitmap, ring] = harvests.map(median);
        let [bitmap_write, ring_write] = writes.map(median);
        rows.push(HarvestRow {
            pattern: if clustered { "clustered" } else { "scattered" },
            dirtied_percent: 100.0 * dirty_pages as f64 / pages as f64,
            dirty_pages,
            bitmap_harvest_us: bitmap,
            ring_harvest_us: ring,
            ratio: if ring > 0.0 {
                bitmap / ring
            } else {
                f64::INFINITY
            },
            bitmap_write_us: bitmap_write,
            ring_write_us: ring_write,
        });
    }
    let ring_full_exits = sides[1].vcpus.shared(0).counters.dirty_ring_full();
    for side in sides {
        side.vcpus.shut_down()?;
    }
    Ok(HarvestReport {
        slots: config.area.slots,
        area_size: config.area.area_size,
        ring_entries: config.ring_entries,
        runs: config.runs,
        rows,
        ring_full_exits,
    })
}

impl std::fmt::Display for HarvestReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "harvest: {} KVM slots, {} MiB of logged guest memory, rings of {} entries, median of {} run(s)",
            self.slots,
            self.area_size >> 20,
            self.ring_entries,
            self.runs
        )?;
        writeln!(
            f,
            "| pages written | dirtied | pages | bitmap harvest | ring harvest | bitmap / ring | guest write (bitmap) | guest write (ring) |"
        )?;
        writeln!(f, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {:.1} % | {} | {:.0} µs | {:.0} µs | {:.1}× | {:.0} µs | {:.0} µs |",
                r.pattern,
                r.dirtied_percent,
                r.dirty_pages,
                r.bitmap_harvest_us,
                r.ring_harvest_us,
                r.ratio,
                r.bitmap_write_us,
                r.ring_write_us
            )?;
        }
        write!(
            f,
            "ring-full exits during the ring VM's writes: {}",
            self.ring_full_exits
        )
    }
}

/// `tinyvmm-bench harvest-bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct HarvestArgs {
    /// KVM slots in all (2 to KVM's maximum) [default: KVM's maximum]
    #[arg(long, value_parser = slot_count(2))]
    pub slots: Option<usize>,
    /// MiB of logged guest memory split over the slots.
    #[arg(long, alias = "area-mib", default_value_t = 1024)]
    pub mem_mib: u64,
    /// Entries per vCPU ring in ring mode (a power of two from 256 to KVM's maximum).
    #[arg(long, alias = "ring-entries", default_value_t = 65536)]
    pub dirty_ring: u32,
    /// Repetitions per share of dirtied pages.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tinyvmm-harvest.json")]
    pub out: std::path::PathBuf,
    /// Print the results as JSON alone on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// The memory limits of the VM it measures.
    #[command(flatten)]
    pub limits: LimitArgs,
}

impl HarvestArgs {
    /// Runs the harvest bench on a job thread, prints its table and writes its JSON; gives the
    /// exit status.
    pub fn run(self) -> ExitCode {
        let slots = match self.slots {
            Some(slots) => slots,
            None => match tinyvmm::vm::max_slots() {
                Ok(max) => max,
                Err(e) => {
                    eprintln!("tinyvmm: {e}");
                    return ExitCode::FAILURE;
                }
            },
        };
        let config = HarvestConfig {
            area: CheckConfig {
                slots,
                area_size: self.mem_mib.saturating_mul(1 << 20),
                vcpus: 1,
                limits: Some(self.limits.resolve()),
            },
            ring_entries: self.dirty_ring,
            runs: self.runs,
        };
        let outcome = run_job(move |ctx| run_harvest_bench(&config, &ctx.stop, &ctx.vcpu_stopped));
        let report = match job_report(outcome, "", self.json) {
            Ok(report) => report,
            Err(code) => return code,
        };
        print_report(&report, self.json, true, "");
        write_json(&self.out, &report)
    }
}
