//! The manager against a raw loop of the same KVM ioctls over the same slots, in one run.
//!
//! `cargo bench -p kvm-memslots --bench mirror -- [--slots N] [--runs R] [--json PATH]`
//! (JSON by default in the workspace's `target/bench/`)
//!
//! Each run makes two fresh VMs with manual dirty-log protection, maps one region of N 4 KiB
//! slots in each, and times five phases on both: create every slot, start dirty logging on all,
//! harvest all (the first harvest after logging starts finds every page dirty and clears it),
//! stop logging, delete all. The raw loop issues the ioctls the manager issues and nothing
//! else; an untimed warm-up of both sides comes first; stopping is also timed against a loop that only flips the flag, because the manager
//! reads each log first so that no dirty page is lost. Runs alternate which side goes first.
//! Prints the medians and writes them as JSON.
//!
//! Kernel time dominates every phase (mostly SRCU grace periods, whose length swings with the
//! rest of the machine's load), so the bench also times the manager against a KVM that does
//! nothing: the manager's own cost, without the kernel's noise.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use kvm_memslots::{
    KvmMemory, KvmSlot, KvmVm, MemoryManager, RegionMemory, RegionSpec, Target, PAGE_SIZE,
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

/// The raw loop: the same requests, with nothing around them.
fn raw_run(kvm: &Kvm, n: u32) -> [Duration; 6] {
    let memory = RegionMemory::new(u64::from(n) * PAGE_SIZE, &kvm_memslots::Backing::Anonymous)
        .expect("map");
    let vm = new_vm(kvm);
    let slot = |i: u32, log_dirty: bool| KvmSlot {
        slot: i,
        gpa: BASE + u64::from(i) * PAGE_SIZE,
        size: PAGE_SIZE,
        hva: memory.host_address() + u64::from(i) * PAGE_SIZE,
        flags: SlotFlags {
            log_dirty,
            read_only: false,
        },
    };
    let set = |s: &KvmSlot| {
        // SAFETY: every slot maps a page of `memory`, which outlives the VM (declared before
        // `vm`, so dropped after it; and every slot is deleted before the function returns).
        unsafe { vm.set_user_memory_region(s) }.expect("KVM_SET_USER_MEMORY_REGION");
    };
    let mut t = [Duration::ZERO; 6];
    t[0] = timed(|| (0..n).for_each(|i| set(&slot(i, false))));
    t[1] = timed(|| (0..n).for_each(|i| set(&slot(i, true))));
    let mut log = [0u64; 1];
    t[2] = timed(|| {
        for i in 0..n {
            vm.get_dirty_log(i, &mut log).expect("KVM_GET_DIRTY_LOG");
            if log[0] != 0 {
                vm.clear_dirty_log(i, 0, 1, &log)
                    .expect("KVM_CLEAR_DIRTY_LOG");
            }
        }
    });
    // As the manager does: read each slot's log (so no dirty page is lost), then flip its flag.
    t[3] = timed(|| {
        for i in 0..n {
            vm.get_dirty_log(i, &mut log).expect("KVM_GET_DIRTY_LOG");
            set(&slot(i, false));
        }
    });
    t[4] = timed(|| (0..n).for_each(|i| set(&slot(i, false).deleted())));
    // Flag-only stop, on slots created and logging again (not timed).
    (0..n).for_each(|i| set(&slot(i, true)));
    t[5] = timed(|| (0..n).for_each(|i| set(&slot(i, false))));
    (0..n).for_each(|i| set(&slot(i, false).deleted()));
    t
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

fn manager_run<K: KvmMemory>(kvm: K, n: u32) -> ([Duration; 6], f64) {
    let m = MemoryManager::new(kvm);
    let spec =
        RegionSpec::new(GuestAddress(BASE), u64::from(n) * PAGE_SIZE).with_slot_size(PAGE_SIZE);
    let mut t = [Duration::ZERO; 6];
    let mut region = None;
    t[0] = timed(|| region = Some(m.add_region(spec).expect("add")));
    let region = region.expect("added");
    let bytes_per_slot = m.bytes_per_slot();
    t[1] = timed(|| m.start_dirty_log(Target::All).expect("start logging"));
    t[2] = timed(|| {
        m.harvest_dirty(Target::All).expect("harvest");
    });
    t[3] = timed(|| m.stop_dirty_log(Target::All).expect("stop logging"));
    t[4] = timed(|| m.remove_region(region).expect("remove"));
    t[5] = t[3];
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
    raw_run(&kvm, n.min(1024));
    manager_run(new_vm(&kvm), n.min(1024));
    let mut raw = vec![Vec::new(); PHASES.len()];
    let mut managed = vec![Vec::new(); PHASES.len()];
    let mut own = vec![Vec::new(); PHASES.len()];
    let mut bytes_per_slot = 0.0;
    for run in 0..o.runs {
        let do_raw = || raw_run(&kvm, n);
        let (r, (m, b)) = if run % 2 == 0 {
            let r = do_raw();
            (r, manager_run(new_vm(&kvm), n))
        } else {
            let m = manager_run(new_vm(&kvm), n);
            (do_raw(), m)
        };
        let (alone, _) = manager_run(NullKvm(n + 1), n);
        bytes_per_slot = b;
        for p in 0..PHASES.len() {
            raw[p].push(r[p]);
            managed[p].push(m[p]);
            own[p].push(alone[p]);
        }
        eprintln!("run {}/{} done", run + 1, o.runs);
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
