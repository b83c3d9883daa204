//! Working sets with the crate alone: a lazy restore records the pages first touched, in that
//! order; the next lazy restore of the snapshot fetches them ahead of the guest while faults
//! are still served; a list that does not fit is refused before anything is registered.

mod support;
use support::lazy::{prefetching, restored, wait_prefetched};

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Backing, MemoryManager, RegionSpec, PAGE_SIZE};
use kvm_memslots_persist::{
    write_memory_file, LazyLoader, LazyOptions, MemoryLayout, Recording, WorkingSet,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

/// A new memory file: a memfd (it has holes, as a file system's sparse file does).
fn memory_file(name: &str) -> File {
    let name = std::ffi::CString::new(name).expect("a name");
    // SAFETY: memfd_create takes a NUL-terminated name, valid for the call, and flags; it
    // returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a new descriptor nothing else owns.
    unsafe { File::from_raw_fd(fd) }
}

fn manager() -> MemoryManager<FakeKvm> {
    MemoryManager::new(FakeKvm::new(64, true))
}

/// A snapshot of two regions (2 MiB anonymous at 1 MiB, 1 MiB memfd at 8 MiB) whose pages
/// hold their own number (in the memory file) where `written` says, and its memory file.
fn snapshot(name: &str, written: impl Fn(u64) -> bool) -> (MemoryLayout, File) {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(MIB), 2 * MIB))
        .expect("the fake takes it");
    a.add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB).with_backing(Backing::Memfd))
        .expect("the fake takes it");
    for page in (0..768).filter(|p| written(*p)) {
        a.handle()
            .memory()
            .write_obj(page + 1, gpa(page))
            .expect("written");
    }
    let layout = MemoryLayout::of(&a);
    let file = memory_file(name);
    write_memory_file(&a, &layout, &file).expect("written");
    (layout, file)
}

/// The guest address of page `page` of the memory file.
fn gpa(page: u64) -> GuestAddress {
    if page < 512 {
        GuestAddress(MIB + page * PAGE_SIZE)
    } else {
        GuestAddress(8 * MIB + (page - 512) * PAGE_SIZE)
    }
}

/// Loader options that record for `record`.
fn recording(record: Recording) -> LazyOptions {
    LazyOptions {
        record: Some(record),
        ..LazyOptions::default()
    }
}

fn read(m: &MemoryManager<FakeKvm>, page: u64) -> u64 {
    m.handle().memory().read_obj(gpa(page)).expect("read")
}

#[test]
fn a_recorded_working_set_is_prefetched_by_the_next_restore() {
    let (layout, file) = snapshot("record", |p| p % 3 != 0);
    // Recorded in first-touch order, a page touched twice once, a hole too.
    let (tx, rx) = mpsc::channel();
    let record = Recording::new(42, None, move |set| tx.send(set).expect("sent"));
    let (b, loader) = restored(&layout, &file, recording(record));
    let touched = [5, 1, 2, 600, 601, 3, 5, 700, 4];
    for page in touched {
        let expected = if page % 3 == 0 { 0 } else { page + 1 };
        assert_eq!(read(&b, page), expected, "page {page}");
    }
    assert!(loader.stop_recording());
    assert!(!loader.stop_recording(), "once");
    let set = rx.try_recv().expect("handed over");
    assert_eq!(set.runs, [5..6, 1..3, 600..602, 3..4, 700..701, 4..5]);
    assert_eq!(set.snapshot, 42);
    set.check(42, &layout).expect("it fits its snapshot");
    drop(loader);
    drop(b);

    // The next restore fills them ahead of the guest: no fault for them.
    let set = WorkingSet::from_bytes(&set.to_bytes()).expect("the file reads back");
    let (b, loader) = restored(&layout, &file, prefetching(set));
    wait_prefetched(&loader);
    let stats = loader.stats();
    assert_eq!(stats.prefetched.load(Ordering::Acquire), 8);
    for page in touched {
        let expected = if page % 3 == 0 { 0 } else { page + 1 };
        assert_eq!(read(&b, page), expected, "page {page}");
    }
    assert_eq!(stats.copied.load(Ordering::Acquire), 0, "no fault for them");
    // The rest still loads on fault.
    assert_eq!(read(&b, 400), 401);
    assert_eq!(stats.copied.load(Ordering::Acquire), 1);
    // A prefetched page that is discarded reads zeros.
    b.discard(gpa(600), PAGE_SIZE).expect("discarded");
    assert_eq!(read(&b, 600), 0);
    assert!(!stats.failed.load(Ordering::Acquire));
}

#[test]
fn faults_are_served_while_the_prefetch_runs_and_every_page_verifies() {
    let (layout, file) = snapshot("race", |_| true);
    // The whole memory, backwards in runs of 16: the readers below meet it from both ends.
    let mut set = WorkingSet::new(1, &layout);
    for run in (0..768 / 16).rev() {
        for page in run * 16..run * 16 + 16 {
            set.push(page);
        }
    }
    for _ in 0..5 {
        let (b, loader) = restored(&layout, &file, prefetching(set.clone()));
        std::thread::scope(|s| {
            for reader in 0..3u64 {
                let b = &b;
                s.spawn(move || {
                    for i in 0..768 {
                        let page = (i * 7 + reader * 101) % 768;
                        assert_eq!(read(b, page), page + 1, "page {page}");
                    }
                });
            }
        });
        wait_prefetched(&loader);
        let stats = loader.stats();
        let filled =
            stats.prefetched.load(Ordering::Acquire) + stats.copied.load(Ordering::Acquire);
        assert_eq!(filled, 768, "every page filled once, by one or the other");
        assert!(!stats.failed.load(Ordering::Acquire));
    }
}

#[test]
fn a_page_discarded_while_the_prefetch_runs_reads_zeros() {
    let (layout, file) = snapshot("discard", |_| true);
    let mut set = WorkingSet::new(1, &layout);
    for page in 0..768 {
        set.push(page);
    }
    for round in 0..20u64 {
        let (b, loader) = restored(&layout, &file, prefetching(set.clone()));
        // Discards from the front of the list and from its back, in anonymous memory and in
        // the memfd, racing the prefetch: a discarded page reads zeros whoever came first.
        std::thread::scope(|s| {
            for reader in 0..2u64 {
                let b = &b;
                s.spawn(move || {
                    for i in (0..768).filter(|i| i % 5 == (round + reader) % 5) {
                        let page = if reader == 0 { i } else { 767 - i };
                        b.discard(gpa(page), PAGE_SIZE).expect("discarded");
                        assert_eq!(read(b, page), 0, "page {page}");
                    }
                });
            }
        });
        wait_prefetched(&loader);
        for page in 0..768 {
            let discarded = page % 5 == round % 5 || (767 - page) % 5 == (round + 1) % 5;
            let expected = if discarded { 0 } else { page + 1 };
            assert_eq!(read(&b, page), expected, "page {page}");
        }
        assert!(!loader.stats().failed.load(Ordering::Acquire));
    }
}

#[test]
fn a_timed_recording_ends_by_itself() {
    let (layout, file) = snapshot("timed", |p| p < 10);
    let (tx, rx) = mpsc::channel();
    let record = Recording::new(3, Some(Duration::from_millis(100)), move |set| {
        tx.send(set).expect("sent")
    });
    let (b, loader) = restored(&layout, &file, recording(record));
    assert_eq!(read(&b, 7), 8);
    let set = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("handed over when the time is up");
    assert_eq!((set.runs.len(), set.runs[0].clone()), (1, 7..8));
    // Touches after the end are not recorded, and nothing is handed over twice.
    assert_eq!(read(&b, 8), 9);
    assert!(!loader.stop_recording());
    drop(loader);
    assert!(rx.try_recv().is_err());
}

#[test]
fn a_list_of_another_layout_or_past_the_memory_is_refused_before_anything_runs() {
    let (layout, file) = snapshot("refused", |p| p < 10);
    let (other, _) = snapshot("refused-other", |_| false);
    let mut past = WorkingSet::new(1, &layout);
    past.push(3);
    past.push(768);
    let mut foreign = WorkingSet::new(
        1,
        &MemoryLayout {
            regions: other.regions[..1].to_vec(),
            ..other
        },
    );
    foreign.push(3);
    for (list, reason) in [(past, "pages 768..769"), (foreign, "another memory layout")] {
        let b = manager();
        layout.build(&b).expect("built");
        let options = prefetching(list);
        let err = LazyLoader::start_with(&b, &layout, &file, options).expect_err("refused");
        assert!(err.to_string().contains(reason), "{err}");
        // Nothing registered: the memory is ordinary memory, zeros.
        assert_eq!(read(&b, 3), 0);
    }
}

/// The prefetch's rate without a guest (docs/BENCHMARKS.md): 512 MiB with every other page
/// written, its 65536 pages listed one by one (a copy a page), then all 131072 pages
/// listed as one run (a copy a window). Prints the times; run it alone with
/// `cargo test --release -p kvm-memslots-persist --test working_set -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn prefetch_rate() {
    let size = 512 * MIB;
    let a = MemoryManager::new(FakeKvm::new(64, true));
    a.add_region(RegionSpec::new(GuestAddress(0), size))
        .expect("the fake takes it");
    for page in (0..size / PAGE_SIZE).step_by(2) {
        a.handle()
            .memory()
            .write_obj(page + 1, GuestAddress(page * PAGE_SIZE))
            .expect("written");
    }
    let layout = MemoryLayout::of(&a);
    let file = memory_file("rate");
    write_memory_file(&a, &layout, &file).expect("written");
    drop(a);
    for step in [2, 1] {
        let mut set = WorkingSet::new(0, &layout);
        for page in (0..size / PAGE_SIZE).step_by(step) {
            set.push(page);
        }
        let start = Instant::now();
        let (_b, loader) = restored(&layout, &file, prefetching(set));
        wait_prefetched(&loader);
        let pages = loader.stats().prefetched.load(Ordering::Acquire);
        println!(
            "every {step} page(s): {pages} pages prefetched in {:?}",
            start.elapsed()
        );
    }
}
