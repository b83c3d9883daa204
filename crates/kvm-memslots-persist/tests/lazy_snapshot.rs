//! Snapshots and migrations of memory under a lazy restore: the pages the userfaultfd loader
//! has not filled yet have no page table entry, yet they hold the restored snapshot's data, so
//! a Full, a chain of Full and Diff, and a migration's first round must carry them.

mod support;
use support::TempFile;

use std::fs::File;

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Backing, MemoryManager, RegionSpec, SlotFlags, Target, PAGE_SIZE};
use kvm_memslots_persist::stream::{apply_pages, Record, StreamReader, StreamWriter};
use kvm_memslots_persist::{
    data_runs, load_memory_file, merge_memory_files, write_dirty_pages, write_memory_file,
    LazyLoader, MemoryLayout,
};
use kvm_test_support::files::{maps_memfd, memfd_at};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

fn manager() -> MemoryManager<FakeKvm> {
    MemoryManager::new(FakeKvm::new(512, true))
}

/// An anonymous region and a memfd one, both logging.
fn source() -> MemoryManager<FakeKvm> {
    let m = manager();
    let logging = SlotFlags {
        log_dirty: true,
        read_only: false,
    };
    m.add_region(
        RegionSpec::new(GuestAddress(MIB), 2 * MIB)
            .with_slot_size(64 << 10)
            .with_flags(logging),
    )
    .expect("the fake takes it");
    m.add_region(
        RegionSpec::new(GuestAddress(8 * MIB), MIB)
            .with_backing(Backing::Memfd)
            .with_flags(logging),
    )
    .expect("the fake takes it");
    m
}

/// The eight pages the first VM writes: five of the anonymous region, three of the memfd.
const PAGES: [u64; 8] = [
    MIB,
    MIB + 5 * PAGE_SIZE,
    MIB + 6 * PAGE_SIZE,
    MIB + 300 * PAGE_SIZE,
    3 * MIB - PAGE_SIZE,
    8 * MIB,
    8 * MIB + 17 * PAGE_SIZE,
    9 * MIB - PAGE_SIZE,
];

/// What page `i` of [`PAGES`] holds in the first VM: every byte of it `0x10 + i`.
fn first_byte(i: usize) -> u8 {
    0x10 + i as u8
}

/// Writes every byte of the page at `gpa` as the guest would: through the mapping (which,
/// under the loader, fills the page first), and in KVM's log.
fn guest_write_page(m: &MemoryManager<FakeKvm>, gpa: u64, byte: u8) {
    m.handle()
        .memory()
        .write_slice(&[byte; PAGE_SIZE as usize], GuestAddress(gpa))
        .expect("guest memory");
    m.kvm().guest_write(gpa);
}

fn page(m: &MemoryManager<FakeKvm>, gpa: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; PAGE_SIZE as usize];
    m.handle()
        .memory()
        .read_slice(&mut bytes, GuestAddress(gpa))
        .expect("guest memory");
    bytes
}

/// The first VM with its eight pages, snapshotted; the snapshot's layout and memory file.
fn first_snapshot(name: &str) -> (MemoryLayout, TempFile, File) {
    let a = source();
    for (i, gpa) in PAGES.iter().enumerate() {
        guest_write_page(&a, *gpa, first_byte(i));
    }
    let layout = MemoryLayout::of(&a);
    let (path, file) = TempFile::new(name);
    write_memory_file(&a, &layout, &file).expect("written");
    (layout, path, file)
}

/// A manager restored lazily from the first snapshot, in which the "guest" has read page 0
/// and rewritten page 5 (the memfd's first): two of the eight pages filled, six not.
fn lazy_restore(layout: &MemoryLayout, file: &File) -> (MemoryManager<FakeKvm>, LazyLoader) {
    let b = manager();
    layout.build(&b).expect("built");
    b.start_dirty_log(Target::All).expect("logging");
    b.harvest_dirty(Target::All).expect("harvested");
    let loader = LazyLoader::start(&b, layout, file).expect("userfaultfd");
    assert_eq!(page(&b, PAGES[0]), vec![first_byte(0); PAGE_SIZE as usize]);
    guest_write_page(&b, PAGES[5], 0xee);
    (b, loader)
}

/// What each of the eight pages must hold once the lazy restore touched two of them.
fn expected(i: usize) -> Vec<u8> {
    vec![if i == 5 { 0xee } else { first_byte(i) }; PAGE_SIZE as usize]
}

/// Checks every one of the eight pages of `m`, naming those that do not hold their data.
fn check_all(m: &MemoryManager<FakeKvm>, what: &str) {
    let wrong: Vec<String> = PAGES
        .iter()
        .enumerate()
        .filter(|(i, gpa)| page(m, **gpa) != expected(*i))
        .map(|(i, gpa)| format!("page {i} at {gpa:#x} reads {:#x}", page(m, *gpa)[0]))
        .collect();
    assert!(
        wrong.is_empty(),
        "{what}: {} of 8 pages lost: {wrong:?}",
        wrong.len()
    );
}

/// A fresh manager with `layout`, loaded by copying `file`.
fn copy_restore(layout: &MemoryLayout, file: &File) -> MemoryManager<FakeKvm> {
    let c = manager();
    layout.build(&c).expect("built");
    load_memory_file(&c, layout, file).expect("loaded");
    c
}

#[test]
fn a_full_snapshot_of_a_lazy_restore_has_the_pages_not_filled_yet() {
    let (layout, _path, file) = first_snapshot("full-1");
    let (b, loader) = lazy_restore(&layout, &file);
    // The data runs name every page that holds data, filled or not.
    let listed: u64 = b
        .regions()
        .iter()
        .map(|r| {
            data_runs(&b.region_memory(r.id).expect("mapped"))
                .expect("data runs")
                .iter()
                .map(|run| run.end - run.start)
                .sum::<u64>()
        })
        .sum();
    assert!(
        listed >= 8 * PAGE_SIZE,
        "the data runs list {} pages, not the 8 with data",
        listed / PAGE_SIZE
    );
    let (_again_path, again) = TempFile::new("full-2");
    let stats = write_memory_file(&b, &layout, &again).expect("written");
    assert_eq!(stats.bytes, 8 * PAGE_SIZE, "every page with data, once");
    drop(loader);
    check_all(&copy_restore(&layout, &again), "a copy restore of the Full");
}

#[test]
fn a_chain_taken_on_a_lazy_restore_merges_into_every_page() {
    let (layout, _path, file) = first_snapshot("chain-1");
    let (b, loader) = lazy_restore(&layout, &file);
    // A Full of the lazy restore, then a Diff of one more page rewritten.
    let (_full_path, full) = TempFile::new("chain-full");
    write_memory_file(&b, &layout, &full).expect("the Full");
    b.harvest_dirty(Target::All).expect("harvested");
    guest_write_page(&b, PAGES[3], 0x33);
    let dirty = b.harvest_dirty(Target::All).expect("harvested");
    let (_diff_path, diff) = TempFile::new("chain-diff");
    write_dirty_pages(&b, &layout, &dirty, &diff).expect("the Diff");
    drop(loader);
    merge_memory_files(&layout, &full, &[diff]).expect("merged");
    let c = copy_restore(&layout, &full);
    assert_eq!(page(&c, PAGES[3]), vec![0x33; PAGE_SIZE as usize]);
    guest_write_page(&c, PAGES[3], first_byte(3)); // Back to what `check_all` expects.
    check_all(&c, "the chain merged");
}

#[test]
fn a_migration_of_a_lazy_restore_sends_the_pages_not_filled_yet() {
    let (layout, _path, file) = first_snapshot("migrate-1");
    let (b, loader) = lazy_restore(&layout, &file);
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).expect("Hello");
    let sent = writer.send_all(&b).expect("round 1");
    writer.end_round().expect("round end");
    writer.done().expect("Done");
    assert_eq!(sent.bytes, 8 * PAGE_SIZE, "every page with data, once");
    drop(loader);

    let c = manager();
    let mut reader = StreamReader::new(writer.get_ref().as_slice());
    let Some(Record::Hello { layout, .. }) = reader.next_record().expect("Hello") else {
        panic!("Hello comes first");
    };
    layout.build(&c).expect("built");
    while let Some(record) = reader.next_record().expect("a record") {
        if let Record::Pages { offset, data } = record {
            apply_pages(&c, &layout, offset, &data).expect("applied");
        }
    }
    check_all(&c, "the migrated VM");
}

/// A page discarded under the loader before anything touched it reads zeros: a snapshot must
/// not bring the restored file's page back.
#[test]
fn a_page_discarded_before_its_fill_stays_a_hole_in_a_snapshot_of_a_lazy_restore() {
    let (layout, _path, file) = first_snapshot("discard-1");
    let (b, loader) = lazy_restore(&layout, &file);
    b.discard(GuestAddress(PAGES[1]), PAGE_SIZE)
        .expect("discarded");
    let (_again_path, again) = TempFile::new("discard-2");
    let stats = write_memory_file(&b, &layout, &again).expect("written");
    assert_eq!(stats.bytes, 7 * PAGE_SIZE);
    drop(loader);
    let c = copy_restore(&layout, &again);
    assert_eq!(page(&c, PAGES[1]), vec![0; PAGE_SIZE as usize]);
    guest_write_page(&c, PAGES[1], first_byte(1)); // Back to what `check_all` expects.
    check_all(&c, "a copy restore of the Full");
}

/// A local migration hands a memfd over instead of sending its pages: the receiver maps the
/// file and has no loader, so the pages not filled yet must be in the file by then.
#[test]
fn a_memfd_handed_over_from_a_lazy_restore_holds_the_pages_not_filled_yet() {
    use kvm_memslots_persist::stream::shared_files;
    use std::os::unix::fs::FileExt;
    let (layout, _path, file) = first_snapshot("handover-1");
    let (b, loader) = lazy_restore(&layout, &file);
    let files = shared_files(&b, &layout).expect("the memfd");
    assert_eq!(files.len(), 1);
    let (index, memfd) = &files[0];
    let region = &layout.regions[*index as usize];
    for (i, gpa) in PAGES.iter().enumerate().filter(|(_, gpa)| **gpa >= 8 * MIB) {
        let mut bytes = vec![0u8; PAGE_SIZE as usize];
        memfd
            .file()
            .read_exact_at(&mut bytes, memfd.start() + (gpa - region.gpa))
            .expect("read");
        assert_eq!(bytes, expected(i), "page {i} at {gpa:#x} in the memfd");
    }
    drop(loader);
}

/// A loader that stopped at an error (its file cut under it) fills nothing more: a snapshot
/// fails with the reason rather than wait for ever on a page, or write one without it.
#[test]
fn a_snapshot_of_a_lazy_restore_whose_loader_failed_is_refused() {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let (layout, _path, file) = first_snapshot("failed-1");
    let (b, loader) = lazy_restore(&layout, &file);
    file.set_len(0).expect("cut");
    // A toucher of a page not filled yet: the handler fails on it.
    let memory = b.handle();
    let toucher = std::thread::spawn(move || {
        memory
            .memory()
            .read_obj::<u64>(GuestAddress(PAGES[2]))
            .expect("read")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !loader.stats().failed.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the loader never failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_again_path, again) = TempFile::new("failed-2");
    let err = write_memory_file(&b, &layout, &again).expect_err("refused");
    assert!(
        err.to_string()
            .contains("fault handler stopped at an error"),
        "{err}"
    );
    drop(loader);
    toucher.join().expect("the toucher");
}

/// A region removed from a lazily restored manager is unmapped as it would be without the
/// loader (which must not hold it), and the loader no longer owes anything there: what is left
/// snapshots whole, and a region later mapped at the same address is not taken for the old.
/// (Its memfd is what tells its mapping from another made where it was: the tests of this
/// binary map memory concurrently.)
#[test]
fn a_region_removed_under_a_lazy_restore_is_unmapped_and_forgotten() {
    let (layout, _path, file) = first_snapshot("removed-1");
    let (b, loader) = lazy_restore(&layout, &file);
    let region = b
        .regions()
        .into_iter()
        .find(|r| r.gpa == GuestAddress(8 * MIB))
        .expect("the memfd region");
    let memfd = memfd_at("self", region.hva.0).expect("a memfd mapped before the remove");
    b.remove_region(region.id).expect("removed");
    assert!(
        !maps_memfd("self", &memfd),
        "the removed region's memory ({memfd}, at {:#x}) is still mapped under the loader",
        region.hva.0
    );
    // The anonymous region left still holds its five pages, filled or not.
    for (i, gpa) in PAGES.iter().enumerate().filter(|(_, gpa)| **gpa < 8 * MIB) {
        assert_eq!(page(&b, *gpa), expected(i), "page {i} at {gpa:#x}");
    }
    let left = MemoryLayout::of(&b);
    let (_again_path, again) = TempFile::new("removed-2");
    let stats = write_memory_file(&b, &left, &again).expect("written");
    assert_eq!(stats.bytes, 5 * PAGE_SIZE, "the region left's pages, once");
    // A new region, maybe where the removed one was mapped: nothing there is owed.
    let new = b
        .add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB).with_backing(Backing::Memfd))
        .expect("added");
    let runs = data_runs(&b.region_memory(new).expect("mapped")).expect("data runs");
    assert!(runs.is_empty(), "a fresh region has data at {runs:?}");
    assert_eq!(page(&b, 8 * MIB), vec![0; PAGE_SIZE as usize]);
    drop(loader);
    for (i, gpa) in PAGES.iter().enumerate().filter(|(_, gpa)| **gpa < 8 * MIB) {
        assert_eq!(
            page(&b, *gpa),
            expected(i),
            "page {i} at {gpa:#x} after the loader"
        );
    }
}

/// A lazily restored region whose range holding a page not filled yet is made unreachable and
/// discarded (a virtio-mem restore puts back its unplugged blocks' protection this way): a Full
/// and a migration of it neither fault nor hang on that range, carry zeros for it, and carry
/// every other page.
#[test]
fn an_unreachable_range_under_a_lazy_restore_is_zeros_in_its_snapshots_and_migrations() {
    let (layout, _path, file) = first_snapshot("unreachable-1");
    let (b, loader) = lazy_restore(&layout, &file);
    let region = b.regions()[0].id;
    // Page 1 and 2 (at 5 and 6 pages into the anonymous region), not filled yet.
    let gone = 4 * PAGE_SIZE..8 * PAGE_SIZE;
    b.set_accessible(region, std::slice::from_ref(&gone), false)
        .expect("protected");
    b.discard_region(region, gone.clone()).expect("discarded");
    let (_again_path, again) = TempFile::new("unreachable-2");
    let stats = write_memory_file(&b, &layout, &again).expect("written");
    assert_eq!(stats.bytes, 6 * PAGE_SIZE, "{stats:?}");
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).expect("Hello");
    let sent = writer.send_all(&b).expect("round 1");
    writer.end_round().expect("round end");
    writer.done().expect("Done");
    assert_eq!(sent.bytes, 6 * PAGE_SIZE, "{sent:?}");
    drop(loader);
    let c = copy_restore(&layout, &again);
    for i in [1, 2] {
        assert_eq!(page(&c, PAGES[i]), vec![0; PAGE_SIZE as usize], "page {i}");
        guest_write_page(&c, PAGES[i], first_byte(i)); // Back to what `check_all` expects.
    }
    check_all(&c, "a copy restore of the Full");
}
