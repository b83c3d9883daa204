//! Plugging and unplugging 1 GiB in 2 MiB blocks on real KVM with ~32k slots already in use:
//! this crate's scheme with 128 MiB pieces (the default: one slot over a piece while a block of
//! it is plugged, its unplugged blocks protected `PROT_NONE` through the manager), the same
//! with one KVM slot per plugged block (`max_slot_size` = the block size), and a model of
//! Firecracker's (128 MiB slots, unplugged blocks inside a mapped slot protected `PROT_NONE`),
//! side by side in one run.
//!
//! `cargo bench -p kvm-virtio-mem --bench plug -- [--rounds R]` (default 10 rounds)
//!
//! Setup: one VM whose manager holds a 1 MiB region for the driver's queue and one region of
//! 4 KiB slots filling KVM's slot numbers up to 512 + 4 short of `KVM_CAP_NR_MEMSLOTS`, and a
//! virtio-mem device of 1 GiB in 2 MiB blocks with 1 GiB requested for each of this crate's two
//! schemes (each with its own queue).
//!
//! Each round plugs all 512 blocks, lowest first, and unplugs them again, highest first, as
//! Linux's driver does, in requests of 1 block, of 16 and of 64 (a whole 128 MiB memory block,
//! what Linux's driver asks for when it can), under each
//! scheme; the schemes take turns (the order rotates between rounds), so all meet the same
//! kernel conditions.
//!
//! - This crate's schemes go through the device: the driver model (`tests/support/driver.rs`)
//!   puts each request in the virtqueue and notifies through the MMIO registers; a request's
//!   latency runs from writing it to seeing the response in the used ring (the memory is
//!   usable then: its slot exists and its mapping is in place).
//! - Firecracker's scheme is modelled on the same manager, without a virtqueue: the first
//!   plugged block of a 128 MiB chunk adds a 128 MiB region (one slot) and `mprotect`s the
//!   chunk `PROT_NONE`; each plug `mprotect`s its blocks read-write; each unplug `madvise`s
//!   (`MADV_DONTNEED`) and `mprotect`s its blocks `PROT_NONE`; the last unplug in a chunk
//!   removes its region. Its latency is the time of those calls. A STATE request's latency is
//!   printed as the cost of the queue and MMIO path, which the model leaves out.
//! - The same model with that path in: each request's time also covers one STATE request of
//!   the same blocks through the shared-slot device's driver, virtqueue and MMIO registers
//!   (changing nothing), the round trip a request to Firecracker's device makes too. The
//!   table's last two columns are each scheme's total against the model and against the
//!   model with the queue.
//!
//! KVM ioctl timings on a nested host swing by 10x between runs: compare the schemes only
//! within a run (the ratios), never across runs. Prints a table and writes JSON to
//! `$CARGO_TARGET_DIR/bench-results/virtio-mem.json` (`target/bench-results/…` if unset).

#[path = "../tests/support/driver.rs"]
mod driver;

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{Driver, Layout, REQ_STATE, RESP_ACK};
use kvm_memslots::testing::{Hooked, KvmCall, Stopwatch};
use kvm_memslots::{KvmMemory, KvmVm, MemoryLimits, MemoryManager, RegionId, RegionSpec};
use kvm_virtio_mem::{VirtioMem, VirtioMemOptions};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 2 * MIB;
const REGION: u64 = 1 << 30;
const BLOCKS: u64 = REGION / BLOCK;
const CHUNK: u64 = 128 * MIB;
const QUEUE_RAM: u64 = 0;
const FILLER: u64 = 16 * MIB;
const DEVICE: u64 = 4 << 30;
/// Where the device with shared slots goes (the per-block one and the model use `DEVICE`).
const SHARED_DEVICE: u64 = 8 << 30;

/// KVM, counting its calls and their time.
type Counting<K> = Hooked<K, Stopwatch>;

type Manager = MemoryManager<Counting<KvmVm>>;

/// What one scheme did over one request sequence (plugging or unplugging).
#[derive(Default, Clone)]
struct Phase {
    latencies: Vec<Duration>,
    kvm_calls: u64,
    kvm_time: Duration,
    /// mmap + munmap + mprotect + madvise calls beyond those of adding/removing regions.
    other_syscalls: u64,
    peak_slots: usize,
}

impl Phase {
    fn total(&self) -> Duration {
        self.latencies.iter().sum()
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut v = self.latencies.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
}

/// `KVM_SET_USER_MEMORY_REGION` calls so far, and their time.
fn kvm_counters(m: &Manager) -> (u64, Duration) {
    let stopwatch = m.kvm().hook();
    (
        stopwatch.calls(KvmCall::SetRegion),
        stopwatch.time(KvmCall::SetRegion),
    )
}

fn finish(phase: &mut Phase, m: &Manager, before: (u64, Duration)) {
    let after = kvm_counters(m);
    phase.kvm_calls = after.0 - before.0;
    phase.kvm_time = after.1 - before.1;
}

/// Slots the device region at `base` uses now.
fn device_slots(m: &Manager, base: u64) -> usize {
    m.regions()
        .iter()
        .filter(|r| (base..base + REGION).contains(&r.gpa.0))
        .map(|r| r.slots)
        .sum()
}

/// This crate's scheme through the device at `base`: plug everything, then unplug it, in
/// requests of `per` blocks. With `max_slot_size` = the block size each request adds (removes)
/// one region per block; otherwise it adds or removes the 128 MiB pieces it empties or starts
/// and flips the protection of its blocks inside a live piece (no KVM call).
fn ours(driver: &mut Driver<Counting<KvmVm>>, base: u64, per: u64) -> (Phase, Phase) {
    let m = Arc::clone(&driver.memory);
    let piece = driver.device.device().max_slot_size() / BLOCK;
    let mut plug = Phase::default();
    let before = kvm_counters(&m);
    for first in (0..BLOCKS).step_by(per as usize) {
        let start = Instant::now();
        let answer = driver.plug(base + first * BLOCK, per as u16);
        plug.latencies.push(start.elapsed());
        assert_eq!(answer, RESP_ACK, "plug at block {first}");
        plug.peak_slots = plug.peak_slots.max(device_slots(&m, base));
    }
    finish(&mut plug, &m, before);
    // Per-block: an mmap per block. Shared: the first plug in a piece maps it (one mmap) and
    // protects the rest of it (one mprotect, none for a whole piece); a plug inside a live
    // piece is one mprotect.
    plug.other_syscalls = if piece == 1 {
        BLOCKS
    } else {
        (0..BLOCKS)
            .step_by(per as usize)
            .map(|first| match (first % piece == 0, per == piece) {
                (true, true) => 1,
                _ => {
                    if first % piece == 0 {
                        2
                    } else {
                        1
                    }
                }
            })
            .sum()
    };
    assert_eq!(driver.device.device().plugged_size(), REGION);

    let mut unplug = Phase::default();
    let before = kvm_counters(&m);
    for first in (0..BLOCKS / per).rev().map(|i| i * per) {
        let start = Instant::now();
        let answer = driver.unplug(base + first * BLOCK, per as u16);
        unplug.latencies.push(start.elapsed());
        assert_eq!(answer, RESP_ACK, "unplug at block {first}");
        // Per-block: a munmap per block. Shared: a munmap where the piece empties, else an
        // mprotect and a madvise of the blocks (one run in one piece).
        unplug.other_syscalls += match (piece == 1, first % piece == 0) {
            (true, _) => per,
            (false, true) => 1,
            (false, false) => 2,
        };
    }
    finish(&mut unplug, &m, before);
    unplug.peak_slots = plug.peak_slots;
    assert_eq!(device_slots(&m, base), 0);
    (plug, unplug)
}

/// Firecracker's scheme, modelled on the same manager.
struct Chunked {
    chunks: Vec<Option<(RegionId, u64)>>,
    plugged: Vec<u32>,
}

fn protect(hva: u64, len: u64, prot: i32) {
    // SAFETY: `[hva, hva + len)` lies inside a region mapping the manager made and keeps
    // mapped while the region exists; nothing in this process touches it while it is
    // protected, and the guest (no vCPU runs) does not either.
    let r = unsafe { libc::mprotect(hva as *mut libc::c_void, len as usize, prot) };
    assert_eq!(r, 0, "mprotect: {}", std::io::Error::last_os_error());
}

impl Chunked {
    fn new() -> Self {
        let n = (REGION / CHUNK) as usize;
        Chunked {
            chunks: vec![None; n],
            plugged: vec![0; n],
        }
    }

    /// Plugs blocks `first..first + n` (inside one chunk); returns the extra syscalls.
    fn plug(&mut self, m: &Manager, first: u64, n: u64) -> u64 {
        let c = (first * BLOCK / CHUNK) as usize;
        let mut calls = 0;
        if self.chunks[c].is_none() {
            let gpa = DEVICE + c as u64 * CHUNK;
            let id = m
                .add_region(RegionSpec::new(GuestAddress(gpa), CHUNK))
                .expect("add a chunk");
            let hva = m
                .regions()
                .iter()
                .find(|r| r.id == id)
                .expect("just added")
                .hva
                .0;
            protect(hva, CHUNK, libc::PROT_NONE);
            calls += 2; // mmap, mprotect
            self.chunks[c] = Some((id, hva));
        }
        let (_, hva) = self.chunks[c].expect("mapped");
        let offset = first * BLOCK - c as u64 * CHUNK;
        protect(hva + offset, n * BLOCK, libc::PROT_READ | libc::PROT_WRITE);
        self.plugged[c] += n as u32;
        calls + 1
    }

    fn unplug(&mut self, m: &Manager, first: u64, n: u64) -> u64 {
        let c = (first * BLOCK / CHUNK) as usize;
        let (id, hva) = self.chunks[c].expect("plugged");
        let offset = first * BLOCK - c as u64 * CHUNK;
        let at = (hva + offset) as *mut libc::c_void;
        // SAFETY: as in `protect`; the pages are given back, and nothing reads them.
        let r = unsafe { libc::madvise(at, (n * BLOCK) as usize, libc::MADV_DONTNEED) };
        assert_eq!(r, 0, "madvise");
        protect(hva + offset, n * BLOCK, libc::PROT_NONE);
        self.plugged[c] -= n as u32;
        if self.plugged[c] == 0 {
            m.remove_region(id).expect("remove a chunk");
            self.chunks[c] = None;
            return 3; // madvise, mprotect, munmap
        }
        2
    }
}

/// Firecracker's scheme, with (`queue`) one STATE request of the same blocks through a
/// device's virtqueue and MMIO registers inside each request's time: the round trip a real
/// device's request makes, which the model alone leaves out.
fn firecracker(
    m: &Manager,
    per: u64,
    mut queue: Option<&mut Driver<Counting<KvmVm>>>,
) -> (Phase, Phase) {
    let mut model = Chunked::new();
    let mut plug = Phase::default();
    let mut round_trip = |first: u64| {
        if let Some(d) = queue.as_deref_mut() {
            let answer = d.request(REQ_STATE, SHARED_DEVICE + first * BLOCK, per as u16);
            assert_eq!(answer.map(|a| a.0), Some(RESP_ACK));
        }
    };
    let before = kvm_counters(m);
    for first in (0..BLOCKS).step_by(per as usize) {
        let start = Instant::now();
        round_trip(first);
        plug.other_syscalls += model.plug(m, first, per);
        plug.latencies.push(start.elapsed());
        plug.peak_slots = plug.peak_slots.max(device_slots(m, DEVICE));
    }
    finish(&mut plug, m, before);
    let mut unplug = Phase::default();
    let before = kvm_counters(m);
    for first in (0..BLOCKS / per).rev().map(|i| i * per) {
        let start = Instant::now();
        round_trip(first);
        unplug.other_syscalls += model.unplug(m, first, per);
        unplug.latencies.push(start.elapsed());
    }
    finish(&mut unplug, m, before);
    unplug.peak_slots = plug.peak_slots;
    assert_eq!(device_slots(m, DEVICE), 0);
    (plug, unplug)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let mut rounds = 10usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--rounds" {
            rounds = args
                .next()
                .and_then(|v| v.parse().ok())
                .expect("--rounds N");
        }
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("SKIPPED: the virtio-mem plug benchmark needs /dev/kvm, which cannot be opened");
        eprintln!("SKIPPED: no figures were measured");
        return;
    }
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let kvm_vm = KvmVm::new(&kvm, Arc::clone(&vm)).expect("set up the VM");
    let max_slots = kvm_vm.max_slots();
    let counting = Counting::new(kvm_vm);
    let memory = Arc::new(MemoryManager::with_limits(
        counting,
        MemoryLimits::unlimited(),
    ));
    memory
        .add_region(RegionSpec::new(GuestAddress(QUEUE_RAM), MIB))
        .expect("queue RAM");
    let filler_slots = u64::from(max_slots) - 1 - BLOCKS - 4;
    let start = Instant::now();
    memory
        .add_region(RegionSpec::new(GuestAddress(FILLER), filler_slots * 4096).with_slot_size(4096))
        .expect("filler slots");
    let fill_time = start.elapsed();
    let usage = memory.slot_usage();
    println!(
        "KVM slots: {} of {} in use before plugging ({} filler slots of 4 KiB made in {:.1} s)",
        usage.used,
        usage.max,
        filler_slots,
        fill_time.as_secs_f64()
    );

    // Each of this crate's schemes: a device and a driver with its own queue.
    let device_driver = |base: u64, max_slot_size: u64, queue: u64| {
        let mut options = VirtioMemOptions::new(GuestAddress(base), REGION, BLOCK)
            .with_max_slot_size(max_slot_size);
        options.requested_size = REGION;
        let device = VirtioMem::new(Arc::clone(&memory), options)
            .expect("the device fits in the free slots")
            .into_mmio(Box::new(EventFd::new(EFD_NONBLOCK).expect("eventfd")));
        let mut driver = Driver::new(
            device,
            Arc::clone(&memory),
            Layout {
                base: queue,
                size: 64,
            },
        );
        driver.init();
        driver
    };
    let mut driver = device_driver(DEVICE, BLOCK, QUEUE_RAM);
    let mut shared = device_driver(SHARED_DEVICE, CHUNK, QUEUE_RAM + MIB / 2);

    // Queue and MMIO path alone: STATE requests change nothing.
    let mut state = Vec::new();
    for i in 0..256u64 {
        let start = Instant::now();
        let answer = driver.request(REQ_STATE, DEVICE + (i % BLOCKS) * BLOCK, 1);
        state.push(start.elapsed());
        assert_eq!(answer.map(|a| a.0), Some(RESP_ACK));
    }
    state.sort();
    let state_median = state[state.len() / 2];

    // results[per][scheme] = phases (plug, unplug) for every round; Firecracker's model is
    // third, the model with a queue round trip per request fourth.
    // 64 blocks (128 MiB, Linux's x86 memory block) is what Linux's driver asks for whole.
    let sizes = [1u64, 16, 64];
    let mut results: Vec<[Vec<(Phase, Phase)>; 4]> = vec![Default::default(); sizes.len()];
    let bench_start = Instant::now();
    for round in 0..rounds {
        for (k, &per) in sizes.iter().enumerate() {
            for turn in 0..4 {
                match (round + turn) % 4 {
                    0 => results[k][0].push(ours(&mut shared, SHARED_DEVICE, per)),
                    1 => results[k][1].push(ours(&mut driver, DEVICE, per)),
                    2 => results[k][2].push(firecracker(&memory, per, None)),
                    _ => results[k][3].push(firecracker(&memory, per, Some(&mut shared))),
                }
            }
        }
    }
    let bench_time = bench_start.elapsed();

    let names = [
        "128 MiB pieces, PROT_NONE (this crate)",
        "per-block slots (this crate, max = block)",
        "128 MiB slots (Firecracker)",
        "128 MiB slots (Firecracker) + queue round trip",
    ];
    let keys = [
        "shared-128MiB",
        "per-block",
        "firecracker-128MiB",
        "firecracker-128MiB-queue",
    ];
    let mut table = String::new();
    let _ = writeln!(
        table,
        "1 GiB in 2 MiB blocks, {} KVM slots in use besides the device's, {rounds} rounds, {:.1} s",
        usage.used,
        bench_time.as_secs_f64()
    );
    let _ = writeln!(
        table,
        "queue + MMIO path alone (STATE request): median {:.1} us\n",
        us(state_median)
    );
    let _ = writeln!(
        table,
        "| blocks/request | phase | scheme | requests | median us | p99 us | total ms | KVM calls | KVM ms | other syscalls | peak slots | total vs Firecracker | total vs Firecracker + queue |"
    );
    let _ = writeln!(
        table,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut json = String::from("{\n  \"rounds\": ");
    let _ = write!(
        json,
        "{rounds},\n  \"kvm_max_slots\": {},\n  \"slots_in_use_before\": {},\n  \"state_request_median_us\": {:.2},\n  \"runs\": [\n",
        usage.max,
        usage.used,
        us(state_median)
    );
    let mut first_json = true;
    for (k, &per) in sizes.iter().enumerate() {
        for (p, phase_name) in ["plug", "unplug"].iter().enumerate() {
            for (s, name) in names.iter().enumerate() {
                // Ratio of this scheme's total to a baseline's, per round, then the median,
                // with the range over rounds.
                let ratio_to = |base: usize| {
                    let mut ratios: Vec<f64> = (0..rounds)
                        .map(|r| {
                            let pick = |s: usize| {
                                let (a, b) = &results[k][s][r];
                                if p == 0 { a } else { b }.total().as_secs_f64()
                            };
                            pick(s) / pick(base)
                        })
                        .collect();
                    ratios.sort_by(f64::total_cmp);
                    let median = ratios[ratios.len() / 2];
                    let cell = if s == base {
                        "1".to_owned()
                    } else {
                        format!(
                            "{median:.2}x (rounds {:.2}–{:.2})",
                            ratios[0],
                            ratios[rounds - 1]
                        )
                    };
                    (median, cell)
                };
                let (ratio, ratio_cell) = ratio_to(2);
                let (ratio_queue, queue_cell) = ratio_to(3);
                // Every round's requests together.
                let mut all = Phase::default();
                for (a, b) in &results[k][s] {
                    let ph = if p == 0 { a } else { b };
                    all.latencies.extend(&ph.latencies);
                    all.kvm_calls += ph.kvm_calls;
                    all.kvm_time += ph.kvm_time;
                    all.other_syscalls += ph.other_syscalls;
                    all.peak_slots = all.peak_slots.max(ph.peak_slots);
                }
                let n = rounds as u64;
                let _ = writeln!(
                    table,
                    "| {per} | {phase_name} | {name} | {} | {:.1} | {:.1} | {:.1} | {} | {:.1} | {} | {} | {ratio_cell} | {queue_cell} |",
                    all.latencies.len() as u64 / n,
                    us(all.percentile(0.5)),
                    us(all.percentile(0.99)),
                    all.total().as_secs_f64() * 1e3 / n as f64,
                    all.kvm_calls / n,
                    all.kvm_time.as_secs_f64() * 1e3 / n as f64,
                    all.other_syscalls / n,
                    all.peak_slots,
                );
                if !first_json {
                    json.push_str(",\n");
                }
                first_json = false;
                let per_round: Vec<String> = results[k][s]
                    .iter()
                    .map(|(a, b)| {
                        let ph = if p == 0 { a } else { b };
                        format!("{:.3}", ph.total().as_secs_f64() * 1e3)
                    })
                    .collect();
                let _ = write!(
                    json,
                    "    {{\"blocks_per_request\": {per}, \"phase\": \"{phase_name}\", \"scheme\": \"{}\", \"requests_per_round\": {}, \"median_us\": {:.2}, \"p99_us\": {:.2}, \"total_ms_per_round\": [{}], \"kvm_calls_per_round\": {}, \"kvm_ms_per_round\": {:.3}, \"other_syscalls_per_round\": {}, \"peak_slots\": {}, \"median_ratio_to_firecracker\": {:.4}, \"median_ratio_to_firecracker_with_queue\": {:.4}}}",
                    keys[s],
                    all.latencies.len() as u64 / n,
                    us(all.percentile(0.5)),
                    us(all.percentile(0.99)),
                    per_round.join(", "),
                    all.kvm_calls / n,
                    all.kvm_time.as_secs_f64() * 1e3 / n as f64,
                    all.other_syscalls / n,
                    all.peak_slots,
                    ratio,
                    ratio_queue,
                );
            }
        }
    }
    json.push_str("\n  ]\n}\n");
    println!("{table}");
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let dir = std::path::Path::new(&dir).join("bench-results");
    std::fs::create_dir_all(&dir).expect("create the results directory");
    let path = dir.join("virtio-mem.json");
    std::fs::write(&path, json).expect("write the JSON");
    println!("JSON: {}", path.display());
}
