//! The manager against a raw loop of the same KVM ioctls over the same slots, in one run.
//!
//! `cargo bench -p kvm-memslots --bench mirror -- [--slots N] [--runs R] [--json PATH]`
//! (JSON by default in the workspace's `target/bench/`)
//!
//! Each run makes two fresh VMs with manual dirty-log protection and takes both through five
//! phases over N 4 KiB slots: create every slot, start dirty logging on all, harvest all (the
//! first harvest after logging starts finds every page dirty and clears it), stop logging (read
//! each slot's log, then flip its flag), delete all. The raw loop issues the ioctls the manager
//! issues and nothing else. Kernel time dominates every phase (mostly SRCU grace periods, whose
//! length swings with the machine's state from one second to the next), so the two sides do not
//! take turns by phase but by batch: within each phase, the raw loop and the manager alternate
//! on batches of 1024 slots (one region each on the manager's side), so that both see the same
//! kernel conditions. A third side runs the manager against a KVM that does nothing: its own
//! cost. Stopping is also compared with a raw loop that only flips the flag (without reading
//! the logs, so losing the pages dirtied since the last harvest). An untimed warm-up comes
//! first. Prints the medians over the runs and writes them as JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use kvm_memslots::{
    KvmMemory, KvmSlot, KvmVm, MemoryManager, RegionId, RegionMemory, RegionSpec, Target, PAGE_SIZE,
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
    runs: usize,
    json: String,
}

fn options() -> Options {
    let mut o = Options {
        slots: 0,
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
            "--runs" => o.runs = value().parse().expect("--runs takes a number"),
            "--json" => o.json = value(),
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
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

/// Slots per batch: the manager's side adds one region of this many slots per batch.
const BATCH: u32 = 1024;

/// The phases, in order; the last is "stop logging" again, against the raw flag-only loop.
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
    vm: KvmVm,
    /// One mapping per batch, laid out as the manager's side has them (one region a batch).
    memory: Vec<RegionMemory>,
}

impl Raw {
    fn new(kvm: &Kvm, n: u32) -> Self {
        let memory = (0..n)
            .step_by(BATCH as usize)
            .map(|first| {
                let pages = u64::from(BATCH.min(n - first));
                RegionMemory::new(pages * PAGE_SIZE, &kvm_memslots::Backing::Anonymous)
                    .expect("map")
            })
            .collect();
        Raw {
            vm: new_vm(kvm),
            memory,
        }
    }

    fn slot(&self, i: u32, log_dirty: bool) -> KvmSlot {
        KvmSlot {
            slot: i,
            gpa: BASE + u64::from(i) * PAGE_SIZE,
            size: PAGE_SIZE,
            hva: self.memory[(i / BATCH) as usize].host_address()
                + u64::from(i % BATCH) * PAGE_SIZE,
            flags: SlotFlags {
                log_dirty,
                read_only: false,
            },
        }
    }

    fn set(&self, s: &KvmSlot) {
        // SAFETY: every slot maps a page of `self.memory`'s mappings, which outlive the VM (`vm` is
        // dropped first), and KVM frees the VM's slots with it.
        unsafe { self.vm.set_user_memory_region(s) }.expect("KVM_SET_USER_MEMORY_REGION");
    }

    /// Phase `phase` on slots `range`; `read_logs` says whether a stop reads the logs first.
    fn run(&self, phase: Phase, range: std::ops::Range<u32>, read_logs: bool) {
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
    }
}

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
}

/// The manager, with one region per batch.
struct Managed<K: KvmMemory> {
    m: MemoryManager<K>,
    regions: Vec<RegionId>,
}

impl<K: KvmMemory> Managed<K> {
    fn new(kvm: K) -> Self {
        Managed {
            m: MemoryManager::new(kvm),
            regions: Vec::new(),
        }
    }

    fn run(&mut self, phase: Phase, batch: usize, range: std::ops::Range<u32>) {
        let m = &self.m;
        match phase {
            Phase::Create => {
                let spec = RegionSpec::new(
                    GuestAddress(BASE + u64::from(range.start) * PAGE_SIZE),
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

/// One run: per phase, the time the raw loop, the manager and the manager alone took, plus the
/// raw flag-only stop (last). The manager's memory per slot.
fn run(kvm: &Kvm, n: u32) -> ([[Duration; 3]; 6], f64) {
    let raw = Raw::new(kvm, n);
    let mut managed = Managed::new(new_vm(kvm));
    let mut alone = Managed::new(NullKvm(n + 1));
    let batches: Vec<std::ops::Range<u32>> = (0..n)
        .step_by(BATCH as usize)
        .map(|s| s..(s + BATCH).min(n))
        .collect();
    let mut t = [[Duration::ZERO; 3]; 6];
    let mut bytes_per_slot = 0.0;
    let phases = [Phase::Create, Phase::Start, Phase::Harvest, Phase::Stop];
    for (p, phase) in phases.into_iter().enumerate() {
        for (b, range) in batches.iter().enumerate() {
            // Alternate which side goes first, batch by batch.
            let raw_time = || timed(|| raw.run(phase, range.clone(), true));
            if b % 2 == 0 {
                t[p][0] += raw_time();
                t[p][1] += timed(|| managed.run(phase, b, range.clone()));
            } else {
                t[p][1] += timed(|| managed.run(phase, b, range.clone()));
                t[p][0] += raw_time();
            }
            t[p][2] += timed(|| alone.run(phase, b, range.clone()));
        }
        if p == 0 {
            bytes_per_slot = managed.m.bytes_per_slot();
        }
    }
    // Stop again, against a raw stop that does not read the logs (logging back on, untimed).
    for (b, range) in batches.iter().enumerate() {
        raw.run(Phase::Start, range.clone(), true);
        managed.run(Phase::Start, b, range.clone());
    }
    for (b, range) in batches.iter().enumerate() {
        t[5][0] += timed(|| raw.run(Phase::Stop, range.clone(), false));
        t[5][1] += timed(|| managed.run(Phase::Stop, b, range.clone()));
    }
    t[5][2] = t[3][2];
    for (b, range) in batches.iter().enumerate() {
        let raw_time = || timed(|| raw.run(Phase::Delete, range.clone(), true));
        if b % 2 == 0 {
            t[4][0] += raw_time();
            t[4][1] += timed(|| managed.run(Phase::Delete, b, range.clone()));
        } else {
            t[4][1] += timed(|| managed.run(Phase::Delete, b, range.clone()));
            t[4][0] += raw_time();
        }
        t[4][2] += timed(|| alone.run(Phase::Delete, b, range.clone()));
    }
    (t, bytes_per_slot)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
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
    eprintln!(
        "{n} slots of 4 KiB, {} runs (two fresh VMs per run)",
        o.runs
    );
    // The first VMs of a process pay one-time kernel and allocator costs: pay them untimed.
    run(&kvm, n.min(2048));
    let mut raw = vec![Vec::new(); PHASES.len()];
    let mut managed = vec![Vec::new(); PHASES.len()];
    let mut own = vec![Vec::new(); PHASES.len()];
    let mut bytes_per_slot = 0.0;
    for r in 0..o.runs {
        let (t, b) = run(&kvm, n);
        bytes_per_slot = b;
        for p in 0..PHASES.len() {
            raw[p].push(t[p][0]);
            managed[p].push(t[p][1]);
            own[p].push(t[p][2]);
        }
        eprintln!("run {}/{} done", r + 1, o.runs);
    }
    println!("| phase ({n} slots) | raw ioctl loop | manager | manager / raw | manager alone (no-op KVM) | (raw + alone) / raw |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for (p, name) in PHASES.iter().enumerate() {
        let r = median(raw[p].clone());
        let m = median(managed[p].clone());
        let a = median(own[p].clone());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let ratio = m.as_secs_f64() / r.as_secs_f64();
        let own_ratio = (r + a).as_secs_f64() / r.as_secs_f64();
        println!(
            "| {name} | {:.1} ms | {:.1} ms | {ratio:.3} | {:.2} ms | {own_ratio:.3} |",
            ms(r),
            ms(m),
            ms(a)
        );
        rows.push(serde_json::json!({
            "phase": name, "raw_ms": ms(r), "manager_ms": ms(m), "ratio": ratio,
            "manager_alone_ms": ms(a), "raw_plus_alone_ratio": own_ratio,
        }));
    }
    println!("manager memory: {bytes_per_slot:.0} bytes per slot");
    let json = serde_json::json!({
        "slots": n, "runs": o.runs, "phases": rows, "manager_bytes_per_slot": bytes_per_slot,
    });
    if let Some(dir) = std::path::Path::new(&o.json).parent() {
        std::fs::create_dir_all(dir).expect("create the JSON directory");
    }
    std::fs::write(&o.json, serde_json::to_string_pretty(&json).expect("JSON"))
        .expect("write JSON");
    eprintln!("wrote {}", o.json);
}
