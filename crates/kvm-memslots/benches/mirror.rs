//! The manager against a raw loop of the same KVM ioctls over the same slots, in one run.
//!
//! `cargo bench -p kvm-memslots --bench mirror -- [--slots N] [--batch B] [--runs R]
//! [--shared-vm] [--calibrate] [--json PATH]` (JSON by default in the workspace's `target/bench/`)
//!
//! Each run makes two fresh VMs with manual dirty-log protection and takes both through five
//! phases over N 4 KiB slots (default: KVM's maximum): create every slot, start dirty logging on
//! all, harvest all (the first harvest after logging starts finds every page dirty and clears
//! it), stop logging (read each slot's log, then flip its flag), delete all. The raw loop makes
//! the system calls the manager makes and nothing else: it maps each batch's memory before
//! creating its slots and unmaps it after deleting them, as adding and removing a region do.
//!
//! Kernel time is nearly all of every phase and swings with the machine's state from one second
//! to the next, so the two sides take turns batch by batch within each phase: raw, manager,
//! raw, manager, … on batches of B slots (default 1024; one region each on the manager's side),
//! so that each side's batch always follows one of the other's and both meet the same kernel
//! conditions. (A side that went twice in a row was measured 20–30% faster than one that
//! followed the other, so the order is strict.) Single batches still meet kernel stalls of up to
//! 15× their usual time, which swing a phase's total, so three figures are printed per phase:
//! - the median over every batch pair (all runs) of manager / raw, with its quartiles;
//! - the median over the runs of the ratio of the phase totals;
//! - the manager's own time: its time minus the time inside its KVM ioctls (both sides' ioctls
//!   are timed), as a share of the raw loop's time. KVM does the same work for both sides, so
//!   this is the part of the ratio that is the manager's, without the kernel's noise.
//!
//! `--calibrate` replaces the manager by a second copy of the raw loop: how far two identical
//! sides drift apart in this comparison on this machine. `--shared-vm` gives both sides one VM,
//! each with half of its slot numbers (the manager the lower half: it reserves the upper half for
//! the raw loop) and every other batch of guest addresses (so each side has N/2 slots), to take
//! the differences between two VMs out of the comparison.
//!
//! A third side runs the manager against a KVM that does nothing (its own time with warm
//! caches), in a loop of its own after each phase. Stopping is also compared with a raw loop
//! that only flips the flag (without reading the logs, so losing the pages dirtied since the
//! last harvest). An untimed warm-up run comes first. Prints a table and writes it, with every
//! batch's times, as JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use kvm_memslots::testing::{Hooked, Stopwatch};
use kvm_memslots::{
    KvmMemory, KvmSlot, KvmVm, MemoryLimits, MemoryManager, RegionId, RegionMemory, RegionSpec,
    Target, PAGE_SIZE,
};
use memslot_map::SlotFlags;
use vm_memory::GuestAddress;

const PHASES: [&str; 6] = [
    "create",
    "start logging",
    "harvest",
    "stop logging",
    "delete",
    "stop logging (flag only)",
];
const BASE: u64 = 1 << 32;

struct Options {
    slots: u32,
    shared_vm: bool,
    calibrate: bool,
    batch: u32,
    runs: usize,
    json: String,
}

fn options() -> Options {
    let mut o = Options {
        slots: 0,
        shared_vm: false,
        calibrate: false,
        batch: 1024,
        runs: 3,
        json: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../target/bench/kvm-memslots-mirror.json"
        )
        .into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--slots" => o.slots = value().parse().expect("--slots takes a number"),
            "--shared-vm" => o.shared_vm = true,
            "--calibrate" => o.calibrate = true,
            "--batch" => o.batch = value().parse().expect("--batch takes a number"),
            "--runs" => o.runs = value().parse().expect("--runs takes a number"),
            "--json" => o.json = value(),
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
    assert!(o.batch > 0, "--batch must be at least 1");
    assert!(o.runs > 0, "--runs must be at least 1");
    o
}

fn new_vm(kvm: &Kvm) -> KvmVm {
    KvmVm::new(kvm, Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"))).expect("dirty logging")
}

fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// Where one side's slots go: batch `b` of side `side` is the `(b * sides + side)`-th run of
/// `batch` pages from `BASE`, so that with a shared VM the two sides' batches alternate in
/// guest-physical space; its KVM slot numbers are the side's share of the VM's, the `side`-th
/// run of `numbers` (the manager, side 0, leaves the numbers above its share to the raw loop
/// with `MemoryManager::with_reserved_slots`).
#[derive(Clone, Copy)]
struct Layout {
    batch: u32,
    sides: u32,
    side: u32,
    /// KVM slot numbers per side.
    numbers: u32,
}

impl Layout {
    fn gpa(&self, i: u32) -> u64 {
        let run = u64::from(i / self.batch) * u64::from(self.sides) + u64::from(self.side);
        BASE + (run * u64::from(self.batch) + u64::from(i % self.batch)) * PAGE_SIZE
    }

    /// The KVM slot number of the side's `i`-th slot.
    fn slot(&self, i: u32) -> u32 {
        self.side * self.numbers + i
    }
}

/// What one batch does, on either side.
#[derive(Clone, Copy)]
enum Phase {
    Create,
    Start,
    Harvest,
    Stop,
    Delete,
}

/// The raw loop: the same requests, with nothing around them.
struct Raw {
    // Declared before `memory` so that the VM (and its slots) goes first.
    vm: Clocked,
    layout: Layout,
    /// One mapping per batch, as the manager's side has them (one region a batch), while the
    /// batch's slots exist.
    memory: Vec<Option<RegionMemory>>,
}

impl Raw {
    fn new(vm: Clocked, n: u32, layout: Layout) -> Self {
        Raw {
            vm,
            layout,
            memory: (0..n.div_ceil(layout.batch)).map(|_| None).collect(),
        }
    }

    fn slot(&self, i: u32, log_dirty: bool) -> KvmSlot {
        let batch = self.layout.batch;
        let memory = self.memory[(i / batch) as usize]
            .as_ref()
            .expect("the batch is mapped");
        KvmSlot {
            slot: self.layout.slot(i),
            gpa: self.layout.gpa(i),
            size: PAGE_SIZE,
            hva: memory.host_address() + u64::from(i % batch) * PAGE_SIZE,
            flags: SlotFlags {
                log_dirty,
                read_only: false,
            },
        }
    }

    fn set(&self, s: &KvmSlot) {
        // SAFETY: every slot maps a page of one of `self.memory`'s mappings, which is unmapped
        // only after the batch's slots are deleted, or at the end after the VM is closed (`vm`
        // is declared first, and a manager sharing the VM is dropped before the raw side).
        // KVM frees the VM's slots with it.
        unsafe { self.vm.set_user_memory_region(s) }.expect("KVM_SET_USER_MEMORY_REGION");
    }

    /// [`run`](Self::run), timed.
    fn timed_run(
        &mut self,
        phase: Phase,
        b: usize,
        range: std::ops::Range<u32>,
        read_logs: bool,
    ) -> Batch {
        let before = self.vm.hook().total_time();
        let time = timed(|| self.run(phase, b, range, read_logs));
        Batch {
            time,
            in_kvm: self.vm.hook().total_time() - before,
        }
    }

    /// Phase `phase` on batch `b`; `read_logs` says whether a stop reads the logs first.
    fn run(&mut self, phase: Phase, b: usize, range: std::ops::Range<u32>, read_logs: bool) {
        if let Phase::Create = phase {
            let pages = u64::from(range.end - range.start);
            self.memory[b] = Some(
                RegionMemory::new(
                    pages * PAGE_SIZE,
                    &kvm_memslots::Backing::Anonymous,
                    kvm_memslots::PageSize::Base,
                )
                .expect("map"),
            );
        }
        let mut log = [0u64; 1];
        for i in range {
            match phase {
                Phase::Create => self.set(&self.slot(i, false)),
                Phase::Start => self.set(&self.slot(i, true)),
                Phase::Harvest => {
                    self.vm
                        .get_dirty_log(i, &mut log)
                        .expect("KVM_GET_DIRTY_LOG");
                    if log[0] != 0 {
                        self.vm
                            .clear_dirty_log(i, 0, 1, &log)
                            .expect("KVM_CLEAR_DIRTY_LOG");
                    }
                }
                Phase::Stop => {
                    if read_logs {
                        self.vm
                            .get_dirty_log(i, &mut log)
                            .expect("KVM_GET_DIRTY_LOG");
                    }
                    self.set(&self.slot(i, false));
                }
                Phase::Delete => self.set(&self.slot(i, false).deleted()),
            }
        }
        if let Phase::Delete = phase {
            self.memory[b] = None;
        }
    }
}

/// A VM's ioctls, adding up the time spent in them: what is left of a side's time is its own.
type Clocked = Hooked<Arc<KvmVm>, Stopwatch>;

/// A KVM that accepts every request and logs nothing: what the manager costs by itself.
struct NullKvm(u32);

impl KvmMemory for NullKvm {
    fn max_slots(&self) -> u32 {
        self.0
    }
    unsafe fn set_user_memory_region(&self, _: &KvmSlot) -> Result<(), vmm_sys_util::errno::Error> {
        Ok(())
    }
    fn get_dirty_log(&self, _: u32, _: &mut [u64]) -> Result<(), vmm_sys_util::errno::Error> {
        Ok(())
    }
    fn clear_dirty_log(
        &self,
        _: u32,
        _: u64,
        _: u32,
        _: &[u64],
    ) -> Result<(), vmm_sys_util::errno::Error> {
        Ok(())
    }
    fn manual_dirty_log(&self) -> bool {
        true
    }
    /// As `KvmVm` (the compared side's KVM), which never enables `KVM_DIRTY_LOG_INITIALLY_SET`.
    fn initially_set_logs(&self) -> bool {
        false
    }
    fn dirty_ring(&self) -> bool {
        false
    }
    fn collect_dirty_rings(
        &self,
        _: &mut dyn FnMut(u32, u64),
    ) -> Result<kvm_memslots::RingCollection, vmm_sys_util::errno::Error> {
        Ok(kvm_memslots::RingCollection::default())
    }
    fn reset_dirty_rings(&self) -> Result<(), vmm_sys_util::errno::Error> {
        Ok(())
    }
}

/// The manager, with one region per batch.
struct Managed<K: KvmMemory> {
    m: MemoryManager<K>,
    layout: Layout,
    regions: Vec<RegionId>,
}

impl<K: KvmMemory> Managed<K> {
    /// A manager leaving KVM's top `reserved` slot numbers to the other side.
    fn new(kvm: K, layout: Layout, reserved: u32) -> Self {
        Managed {
            m: MemoryManager::with_reserved_slots(kvm, MemoryLimits::for_this_host(), reserved)
                .expect("KVM has the slot numbers"),
            layout,
            regions: Vec::new(),
        }
    }

    fn run(&mut self, phase: Phase, batch: usize, range: std::ops::Range<u32>) {
        let m = &self.m;
        match phase {
            Phase::Create => {
                let spec = RegionSpec::new(
                    GuestAddress(self.layout.gpa(range.start)),
                    u64::from(range.end - range.start) * PAGE_SIZE,
                )
                .with_slot_size(PAGE_SIZE);
                self.regions.push(m.add_region(spec).expect("add"));
            }
            Phase::Start => m
                .start_dirty_log(Target::Region(self.regions[batch]))
                .expect("start"),
            Phase::Harvest => {
                m.harvest_dirty(Target::Region(self.regions[batch]))
                    .expect("harvest");
            }
            Phase::Stop => m
                .stop_dirty_log(Target::Region(self.regions[batch]))
                .expect("stop"),
            Phase::Delete => m.remove_region(self.regions[batch]).expect("remove"),
        }
    }
}

/// One batch of one side: its time, and the part of it spent in KVM's ioctls.
#[derive(Clone, Copy)]
struct Batch {
    time: Duration,
    in_kvm: Duration,
}

/// What one run measured, per phase (in `PHASES` order): each batch's raw and manager sides,
/// in the order they ran, and the manager alone's total.
struct RunTimes {
    pairs: Vec<Vec<(Batch, Batch)>>,
    alone: Vec<Duration>,
    bytes_per_slot: f64,
}

/// One run: the five phases, then "stop logging" again against the raw flag-only stop (with
/// logging turned back on, untimed, before it), then delete.
/// The side compared with the raw loop: the manager, or (to calibrate the comparison) a second
/// copy of the raw loop.
enum Second {
    Manager(Managed<Clocked>),
    Raw(Raw),
}

impl Second {
    fn run(
        &mut self,
        phase: Phase,
        b: usize,
        range: std::ops::Range<u32>,
        read_logs: bool,
    ) -> Batch {
        match self {
            Second::Manager(managed) => {
                let before = managed.m.kvm().hook().total_time();
                let time = timed(|| managed.run(phase, b, range));
                Batch {
                    time,
                    in_kvm: managed.m.kvm().hook().total_time() - before,
                }
            }
            Second::Raw(raw) => raw.timed_run(phase, b, range, read_logs),
        }
    }
}

fn run(kvm: &Kvm, n: u32, o: &Options) -> RunTimes {
    let (batch, shared_vm) = (o.batch, o.shared_vm);
    let (raw_vm, manager_vm) = if shared_vm {
        let vm = Arc::new(new_vm(kvm));
        (Arc::clone(&vm), vm)
    } else {
        (Arc::new(new_vm(kvm)), Arc::new(new_vm(kvm)))
    };
    let sides = if shared_vm { 2 } else { 1 };
    let n = n / sides;
    let max_slots = manager_vm.max_slots();
    let numbers = max_slots / sides;
    let layout = |side| Layout {
        batch,
        sides,
        side,
        numbers,
    };
    // Declared first, dropped last: the manager deletes its slots first.
    let mut raw = Raw::new(Clocked::new(raw_vm), n, layout(sides - 1));
    let second_kvm = Clocked::new(manager_vm);
    let mut second = if o.calibrate {
        Second::Raw(Raw::new(second_kvm, n, layout(0)))
    } else {
        Second::Manager(Managed::new(second_kvm, layout(0), max_slots - numbers))
    };
    let mut alone = Managed::new(NullKvm(n + 1), layout(0), 0);
    let batches: Vec<std::ops::Range<u32>> = (0..n)
        .step_by(batch as usize)
        .map(|s| s..(s + batch).min(n))
        .collect();
    let mut times = RunTimes {
        pairs: vec![Vec::new(); PHASES.len()],
        alone: vec![Duration::ZERO; PHASES.len()],
        bytes_per_slot: 0.0,
    };
    // (index in PHASES, or None for the untimed restart of logging; phase; whether the raw
    // stop reads the logs)
    let order = [
        (Some(0), Phase::Create, true),
        (Some(1), Phase::Start, true),
        (Some(2), Phase::Harvest, true),
        (Some(3), Phase::Stop, true),
        (None, Phase::Start, true),
        (Some(5), Phase::Stop, false),
        (Some(4), Phase::Delete, true),
    ];
    for (p, phase, read_logs) in order {
        for (b, range) in batches.iter().enumerate() {
            // Strictly raw then manager: each side's batch follows one of the other's.
            let r = raw.timed_run(phase, b, range.clone(), read_logs);
            let m = second.run(phase, b, range.clone(), read_logs);
            if let Some(p) = p {
                times.pairs[p].push((r, m));
            }
        }
        match p {
            // The manager alone stopped logging in phase 3 already.
            Some(5) => times.alone[5] = times.alone[3],
            Some(p) => {
                for (b, range) in batches.iter().enumerate() {
                    times.alone[p] += timed(|| alone.run(phase, b, range.clone()));
                }
                if p == 0 {
                    // The same map and records as the real manager's.
                    times.bytes_per_slot = alone.m.bytes_per_slot();
                }
            }
            None => {}
        }
    }
    times
}

fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let o = options();
    let kvm = match Kvm::new() {
        Ok(kvm) => kvm,
        Err(e) => {
            eprintln!("SKIPPED: cannot open /dev/kvm ({e}); nothing measured");
            return;
        }
    };
    let n = if o.slots == 0 {
        kvm.get_nr_memslots() as u32
    } else {
        o.slots
    };
    let vms = if o.shared_vm {
        "one fresh VM per run, its slots shared between the sides"
    } else {
        "two fresh VMs per run"
    };
    eprintln!(
        "{n} slots of 4 KiB in batches of {}, {} runs ({vms})",
        o.batch, o.runs
    );
    // The first VMs of a process pay one-time kernel and allocator costs: pay them untimed.
    run(&kvm, n.min(2048), &o);
    let runs: Vec<RunTimes> = (0..o.runs)
        .map(|r| {
            let t = run(&kvm, n, &o);
            eprintln!("run {}/{} done", r + 1, o.runs);
            t
        })
        .collect();
    let bytes_per_slot = runs[runs.len() - 1].bytes_per_slot;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let per_side = if o.shared_vm { n / 2 } else { n };
    if o.calibrate {
        println!("CALIBRATION: the \"manager\" columns are a second copy of the raw loop");
    }
    println!(
        "| phase ({per_side} slots a side) | raw ioctl loop | manager | manager / raw: median of batch pairs \
         [quartiles] | ratio of totals | manager's own time (outside KVM) | own / raw | \
         manager alone (no-op KVM) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for (p, name) in PHASES.iter().enumerate() {
        // Per run: the sum of a quantity over the phase's batches.
        let per_run = |f: &dyn Fn(&(Batch, Batch)) -> Duration| -> Vec<Duration> {
            runs.iter()
                .map(|t| t.pairs[p].iter().map(f).sum())
                .collect()
        };
        let raw_totals = per_run(&|x| x.0.time);
        let manager_totals = per_run(&|x| x.1.time);
        let r = median(raw_totals.clone());
        let m = median(manager_totals.clone());
        let own = median(per_run(&|x| x.1.time - x.1.in_kvm));
        let a = median(runs.iter().map(|t| t.alone[p]).collect());
        let totals_ratio = median(
            raw_totals
                .iter()
                .zip(&manager_totals)
                .map(|(r, m)| m.as_secs_f64() / r.as_secs_f64())
                .collect(),
        );
        let mut ratios: Vec<f64> = runs
            .iter()
            .flat_map(|t| &t.pairs[p])
            .map(|(r, m)| m.time.as_secs_f64() / r.time.as_secs_f64())
            .collect();
        ratios.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
        let (q1, mid, q3) = (
            quantile(&ratios, 0.25),
            quantile(&ratios, 0.5),
            quantile(&ratios, 0.75),
        );
        let own_share = own.as_secs_f64() / r.as_secs_f64();
        println!(
            "| {name} | {:.1} ms | {:.1} ms | **{mid:.3}** [{q1:.3}, {q3:.3}] | {totals_ratio:.3} | \
             {:.1} ms | {:.1}% | {:.1} ms |",
            ms(r),
            ms(m),
            ms(own),
            own_share * 100.0,
            ms(a)
        );
        let pairs: Vec<Vec<[f64; 4]>> = runs
            .iter()
            .map(|t| {
                t.pairs[p]
                    .iter()
                    .map(|(r, m)| {
                        let us = |d: Duration| d.as_secs_f64() * 1e6;
                        [us(r.time), us(r.in_kvm), us(m.time), us(m.in_kvm)]
                    })
                    .collect()
            })
            .collect();
        rows.push(serde_json::json!({
            "phase": name, "raw_ms": ms(r), "manager_ms": ms(m),
            "pair_ratio_median": mid, "pair_ratio_q1": q1, "pair_ratio_q3": q3,
            "totals_ratio": totals_ratio, "manager_own_ms": ms(own), "own_over_raw": own_share,
            "manager_alone_ms": ms(a),
            "batches_us": "per run, per batch: [raw, raw in KVM, manager, manager in KVM]",
            "batch_pairs_us": pairs,
        }));
    }
    println!("manager memory: {bytes_per_slot:.0} bytes per slot");
    let json = serde_json::json!({
        "slots": n, "shared_vm": o.shared_vm, "calibration": o.calibrate, "batch": o.batch, "runs": o.runs, "phases": rows,
        "manager_bytes_per_slot": bytes_per_slot,
    });
    if let Some(dir) = std::path::Path::new(&o.json).parent() {
        std::fs::create_dir_all(dir).expect("create the JSON directory");
    }
    std::fs::write(&o.json, serde_json::to_string_pretty(&json).expect("JSON"))
        .expect("write JSON");
    eprintln!("wrote {}", o.json);
}
