//! Benchmarks of [`MemslotMap`] against vm-memory 0.18's `GuestMemoryMmap` holding the same
//! regions.
//!
//! Both sides hold the same 4 KiB regions: every region is its own small anonymous mapping made
//! by vm-memory (`GuestRegionMmap::from_range`), and the slot for it in our map carries that
//! mapping's host address as its hva and an `Arc` of the region as its payload. Guest addresses
//! are spread: region `i` sits at `i * GPA_STRIDE`, which leaves a gap between regions where
//! the one-slot insert/remove scenario puts its extra region.
//!
//! Scenarios, each at 1, 10, 32, 100, 128, 256, 509, 1000, 4096 and 32764 slots (criterion group `memslot-map/NAME`,
//! functions `MemslotMap` and `GuestMemoryMmap`, parameter = slot count):
//!
//! - `build`: start empty and add the regions one at a time, in guest-address order.
//!   vm-memory's `insert_region` copies its `Vec` every time (O(n^2) in all), so this group
//!   takes few samples. Ours is measured twice: `MemslotMap` changes one unshared version in
//!   place, and `MemslotMap-published` makes every insert on a clone of the last published
//!   version, which the result then replaces (so every insert takes the copy-on-write path and
//!   drops the version before it), as `SharedMap`'s writers do and as vm-memory's every
//!   `insert_region` makes a new collection from the last. Each new published version and each
//!   new collection passes through `black_box`, on both sides alike. Dropping the finished map or
//!   collection is not timed. Ours is given each slot as an `Arc` it already has
//!   (`insert_arc`), as vm-memory is given each region.
//! - `insert_remove`: at full occupancy, add one region and remove it again (one iteration is
//!   both changes). Ours: each change is made on a clone of the published version, which then
//!   becomes the published version (the previous one is dropped), so every change copies its
//!   paths; vm-memory: `insert_region` then `remove_region`, each result replacing the published
//!   collection. `MemslotMap` is given the slot as an `Arc` (`insert_arc`), as vm-memory is
//!   given the region; `MemslotMap-owned` is given a `Slot` (`insert`, which allocates the
//!   `Arc`).
//! - `gpa_lookup_random`: guest-address lookup of precomputed random addresses over all slots,
//!   the same sequence for both.
//! - `gpa_lookup_repeated`: the same guest address again and again: ours with
//!   `find_by_gpa_hinted` and a per-reader `LookupHint`, vm-memory with `find_region`.
//! - `hva_lookup_random`: the slot whose host range holds a precomputed random host address.
//!   Ours: `find_by_hva`; vm-memory has no such index, so a linear scan of its regions (stopping
//!   at the first that holds the address) stands in for it.
//!
//! At startup the bench prints to stderr, as `memslot-map memory:` lines, the bytes per slot of
//! our map at each size. `benches/summarize.py` turns criterion's estimates into a table.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode};
use memslot_map::{HostAddress, LookupHint, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
};

/// Slot counts to measure at; 509 and 32764 are KVM's historical and current slot limits. The
/// map changes form past 32 slots (flat to slab) and past 1024 (slab to trees): 32 is the
/// largest flat map (the slot `insert_remove` adds turns it into a slab), 100 to 1000 lie in
/// the slab's range, 4096 and 32764 in the trees'.
const SIZES: [usize; 10] = [1, 10, 32, 100, 128, 256, 509, 1000, 4096, 32764];
/// Size of every region.
const REGION_SIZE: u64 = 0x1000;
/// Guest distance between the bases of consecutive regions.
const GPA_STRIDE: u64 = 0x10_0000;
/// Number of precomputed random addresses per size (a power of two).
const RANDOM_ADDRESSES: usize = 1 << 16;
/// Group name prefix, so that `summarize.py` finds this bench's results among others.
const PREFIX: &str = "memslot-map";

/// The name of our map in every group.
const OURS: &str = "MemslotMap";
/// The name of vm-memory's collection in every group.
const THEIRS: &str = "GuestMemoryMmap";

type Region = GuestRegionMmap;
type Payload = Arc<Region>;
type Map = MemslotMap<Payload>;

/// The regions, shared by every size (size `n` uses the first `n`), and the extra region that
/// `insert_remove` adds and removes.
struct Fixture {
    regions: Vec<Payload>,
    slots: Vec<Arc<Slot<Payload>>>,
}

fn hva_of(region: &Region) -> u64 {
    region.as_ptr() as u64
}

fn slot_for(id: usize, region: &Payload) -> Slot<Payload> {
    Slot::new(
        SlotId(u32::try_from(id).expect("slot ids fit in u32")),
        region.start_addr(),
        region.len(),
        HostAddress(hva_of(region)),
        SlotFlags::default(),
        Arc::clone(region),
    )
}

fn new_region(gpa: u64) -> Payload {
    let size = usize::try_from(REGION_SIZE).expect("region size fits in usize");
    Arc::new(
        GuestRegionMmap::from_range(GuestAddress(gpa), size, None)
            .expect("anonymous 4 KiB mapping for a region"),
    )
}

impl Fixture {
    fn new(max: usize) -> Self {
        let regions: Vec<Payload> = (0..max)
            .map(|i| new_region(i as u64 * GPA_STRIDE))
            .collect();
        let slots = regions
            .iter()
            .enumerate()
            .map(|(i, r)| Arc::new(slot_for(i, r)))
            .collect();
        Fixture { regions, slots }
    }

    /// Our map holding the first `n` regions, built in place.
    fn map(&self, n: usize) -> Map {
        let mut map = MemslotMap::new(MapConfig::default());
        for slot in &self.slots[..n] {
            map.insert_arc(Arc::clone(slot))
                .expect("fixture slots do not overlap");
        }
        map
    }

    /// vm-memory's collection of the first `n` regions, built in one go.
    fn memory(&self, n: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::from_arc_regions(self.regions[..n].to_vec())
            .expect("fixture regions are sorted and disjoint")
    }
}

/// xorshift64: reproducible spread without a dependency.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Random addresses inside the first `n` regions: guest addresses and the host addresses that
/// back them.
fn random_addresses(fixture: &Fixture, n: usize) -> (Vec<GuestAddress>, Vec<HostAddress>) {
    let mut state = 0x9e37_79b9_7f4a_7c15 ^ n as u64;
    (0..RANDOM_ADDRESSES)
        .map(|_| {
            let region = &fixture.regions[(next_random(&mut state) % n as u64) as usize];
            let offset = next_random(&mut state) % REGION_SIZE;
            (
                GuestAddress(region.start_addr().0 + offset),
                HostAddress(hva_of(region) + offset),
            )
        })
        .unzip()
}

/// Identity of a found region, the same for both sides: its host address.
fn found_hva(region: Option<&Region>) -> Option<u64> {
    region.map(hva_of)
}

/// vm-memory has no host-address index: scan its regions for the one that holds `hva`.
/// (Both sides' helpers are marked `#[inline]`, so that neither pays a call the other does not.)
#[inline]
fn scan_for_hva(memory: &GuestMemoryMmap, hva: HostAddress) -> Option<&Region> {
    memory
        .iter()
        .find(|r| hva.0.wrapping_sub(hva_of(r)) < r.len())
}

/// Ours: the slot whose host range holds `hva`.
#[inline]
fn map_find_hva(map: &Map, hva: HostAddress) -> Option<&Arc<Slot<Payload>>> {
    map.find_by_hva(hva)
}

/// Checks, before measuring, that both sides answer every scenario's questions the same way.
fn check_agreement(
    map: &Map,
    memory: &GuestMemoryMmap,
    gpas: &[GuestAddress],
    hvas: &[HostAddress],
) {
    assert_eq!(map.len(), memory.num_regions());
    for (gpa, hva) in gpas.iter().zip(hvas).take(4096) {
        let ours = map.find_by_gpa(*gpa).map(|s| s.hva().0);
        assert_eq!(ours, found_hva(memory.find_region(*gpa)), "gpa {gpa:?}");
        let ours = map_find_hva(map, *hva).map(|s| s.hva().0);
        assert_eq!(ours, found_hva(scan_for_hva(memory, *hva)), "hva {hva:?}");
    }
}

fn new_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(format!("{PREFIX}/{name}"));
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    group
}

fn print_memory(fixture: &Fixture) {
    for &n in &SIZES {
        let usage = fixture.map(n).memory_usage();
        eprintln!(
            "{PREFIX} memory: slots={n} bytes_per_slot={:.1} index_bytes={} slot_bytes={} \
             (vm-memory's own index: {} bytes per region, the Vec of Arc pointers)",
            usage.bytes_per_slot(),
            usage.index_bytes,
            usage.slot_bytes,
            size_of::<Payload>(),
        );
    }
}

/// Builds per reading of the clock in `time_batched`.
const BUILD_BATCH: usize = 64;

/// Runs `build` `iters` times and returns the time it took, reading the clock once per
/// [`BUILD_BATCH`] builds (at one slot, reading it twice took longer than a build) and dropping
/// what was built outside the timed part. The results are kept in one vector reused by every
/// batch, so that no batch writes to fresh pages.
fn time_batched<T>(iters: u64, mut build: impl FnMut() -> T) -> Duration {
    let mut built: Vec<T> = Vec::with_capacity(BUILD_BATCH);
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let batch = left.min(BUILD_BATCH as u64);
        let start = Instant::now();
        for _ in 0..batch {
            built.push(build());
        }
        total += start.elapsed();
        built.clear();
        left -= batch;
    }
    total
}

fn bench_build(c: &mut Criterion, fixture: &Fixture) {
    let mut group = new_group(c, "build");
    group.sampling_mode(SamplingMode::Flat).sample_size(10);
    for &n in &SIZES {
        let slots = &fixture.slots[..n];
        let regions = &fixture.regions[..n];
        group.bench_function(BenchmarkId::new(OURS, n), |b| {
            b.iter_custom(|iters| {
                time_batched(iters, || {
                    let mut map = MemslotMap::new(MapConfig::default());
                    for slot in slots {
                        map.insert_arc(Arc::clone(slot))
                            .expect("fixture slots do not overlap");
                    }
                    map
                })
            });
        });
        group.bench_function(BenchmarkId::new(format!("{OURS}-published"), n), |b| {
            b.iter_custom(|iters| {
                time_batched(iters, || {
                    let mut published = MemslotMap::new(MapConfig::default());
                    for slot in slots {
                        let mut next = published.clone();
                        next.insert_arc(Arc::clone(slot))
                            .expect("fixture slots do not overlap");
                        published = black_box(next);
                    }
                    published
                })
            });
        });
        group.bench_function(BenchmarkId::new(THEIRS, n), |b| {
            b.iter_custom(|iters| {
                time_batched(iters, || {
                    let mut memory = GuestMemoryMmap::new();
                    for region in regions {
                        memory = black_box(
                            memory
                                .insert_region(Arc::clone(region))
                                .expect("fixture regions do not overlap"),
                        );
                    }
                    memory
                })
            });
        });
    }
    group.finish();
}

fn bench_insert_remove(c: &mut Criterion, fixture: &Fixture) {
    let mut group = new_group(c, "insert_remove");
    group.sampling_mode(SamplingMode::Flat).sample_size(30);
    for &n in &SIZES {
        // The extra region sits in the gap after the middle region.
        let extra = new_region((n / 2) as u64 * GPA_STRIDE + GPA_STRIDE / 2);
        let extra_slot = slot_for(n, &extra);
        let extra_id = extra_slot.id();
        let extra_arc = Arc::new(extra_slot.clone());

        let full = fixture.map(n);
        group.bench_function(BenchmarkId::new(OURS, n), |b| {
            // `full` stays alive too, like a reader's snapshot.
            let mut published = full.clone();
            b.iter(|| {
                let mut next = published.clone();
                next.insert_arc(Arc::clone(&extra_arc))
                    .expect("the extra slot fits in a gap");
                published = next;
                let mut next = published.clone();
                next.remove(extra_id).expect("the extra slot is there");
                published = next;
            });
        });
        group.bench_function(BenchmarkId::new(format!("{OURS}-owned"), n), |b| {
            let mut published = full.clone();
            b.iter(|| {
                let mut next = published.clone();
                next.insert(extra_slot.clone())
                    .expect("the extra slot fits in a gap");
                published = next;
                let mut next = published.clone();
                next.remove(extra_id).expect("the extra slot is there");
                published = next;
            });
        });
        drop(full);

        let full = fixture.memory(n);
        group.bench_function(BenchmarkId::new(THEIRS, n), |b| {
            let mut published = full.clone();
            b.iter(|| {
                published = published
                    .insert_region(Arc::clone(&extra))
                    .expect("the extra region fits in a gap");
                published = published
                    .remove_region(extra.start_addr(), extra.len())
                    .expect("the extra region is there")
                    .0;
            });
        });
    }
    group.finish();
}

fn bench_lookups(c: &mut Criterion, fixture: &Fixture) {
    let mask = RANDOM_ADDRESSES - 1;
    let cases: Vec<_> = SIZES
        .iter()
        .map(|&n| {
            let (gpas, hvas) = random_addresses(fixture, n);
            let map = fixture.map(n);
            let memory = fixture.memory(n);
            check_agreement(&map, &memory, &gpas, &hvas);
            (n, map, memory, gpas, hvas)
        })
        .collect();

    let mut group = new_group(c, "gpa_lookup_random");
    for (n, map, memory, gpas, _) in &cases {
        group.bench_function(BenchmarkId::new(OURS, n), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & mask;
                map.find_by_gpa(gpas[i]).map(Arc::as_ptr)
            });
        });
        group.bench_function(BenchmarkId::new(THEIRS, n), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & mask;
                memory.find_region(gpas[i]).map(|r| r as *const Region)
            });
        });
    }
    group.finish();

    let mut group = new_group(c, "gpa_lookup_repeated");
    for (n, map, memory, _, _) in &cases {
        // An address in the middle slot.
        let addr = GuestAddress((n / 2) as u64 * GPA_STRIDE + REGION_SIZE / 2);
        group.bench_function(BenchmarkId::new(OURS, n), |b| {
            let mut hint = LookupHint::default();
            b.iter(|| {
                map.find_by_gpa_hinted(black_box(addr), &mut hint)
                    .map(Arc::as_ptr)
            });
        });
        group.bench_function(BenchmarkId::new(THEIRS, n), |b| {
            b.iter(|| {
                memory
                    .find_region(black_box(addr))
                    .map(|r| r as *const Region)
            });
        });
    }
    group.finish();

    let mut group = new_group(c, "hva_lookup_random");
    for (n, map, memory, _, hvas) in &cases {
        group.bench_function(BenchmarkId::new(OURS, n), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & mask;
                map_find_hva(map, hvas[i]).map(Arc::as_ptr)
            });
        });
        group.bench_function(BenchmarkId::new(THEIRS, n), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & mask;
                scan_for_hva(memory, hvas[i]).map(|r| r as *const Region)
            });
        });
    }
    group.finish();
}

fn main() {
    let max = SIZES[SIZES.len() - 1];
    let setup = Instant::now();
    let fixture = Fixture::new(max);
    eprintln!(
        "{PREFIX}: {max} regions of {REGION_SIZE:#x} bytes mapped in {:.1?}",
        setup.elapsed()
    );
    print_memory(&fixture);

    let mut c = Criterion::default().configure_from_args();
    bench_build(&mut c, &fixture);
    bench_insert_remove(&mut c, &fixture);
    bench_lookups(&mut c, &fixture);
    c.final_summary();
}
