//! Snapshot and restore with the crate alone, as another VMM would: the layout file, a sparse
//! full memory file, diffs merged onto it, and a new manager built and loaded from them.

mod support;
use support::{pool_has, TempFile};

use std::fs::File;
use std::os::unix::fs::MetadataExt;

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Backing, MemoryManager, PageSize, RegionSpec, SlotFlags, Target, PAGE_SIZE};
use kvm_memslots_persist::{
    data_runs, load_memory_file, merge_memory_files, write_dirty_pages, write_memory_file,
    LayoutPageSize, MemoryLayout, SnapshotError,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

fn manager() -> MemoryManager<FakeKvm> {
    MemoryManager::new(FakeKvm::new(512, true))
}

/// Three regions: anonymous in 16 KiB slots, a memfd, and a read-only one that logs.
fn source() -> MemoryManager<FakeKvm> {
    let m = manager();
    m.add_region(RegionSpec::new(GuestAddress(MIB), 2 * MIB).with_slot_size(16 << 10))
        .expect("the fake takes it");
    m.add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB).with_backing(Backing::Memfd))
        .expect("the fake takes it");
    m.add_region(
        RegionSpec::new(GuestAddress(16 * MIB), 512 << 10).with_flags(SlotFlags {
            read_only: true,
            log_dirty: true,
        }),
    )
    .expect("the fake takes it");
    m
}

fn write(m: &MemoryManager<FakeKvm>, gpa: u64, byte: u8, len: usize) {
    m.handle()
        .memory()
        .write_slice(&vec![byte; len], GuestAddress(gpa))
        .expect("the fake takes it");
}

/// Every byte of every region of `m`, in guest-address order.
fn contents(m: &MemoryManager<FakeKvm>) -> Vec<u8> {
    let mut regions = m.regions();
    regions.sort_by_key(|r| r.gpa);
    let memory = m.handle().memory();
    let mut out = Vec::new();
    for r in regions {
        let mut bytes = vec![0u8; r.size as usize];
        memory
            .read_slice(&mut bytes, r.gpa)
            .expect("the fake takes it");
        out.extend(bytes);
    }
    out
}

#[test]
fn a_new_manager_restores_the_layout_and_every_byte_and_holes_stay_holes() {
    let a = source();
    write(&a, MIB + 100, 0xa1, 3 * PAGE_SIZE as usize);
    write(&a, 3 * MIB - PAGE_SIZE, 0xa2, PAGE_SIZE as usize);
    write(&a, 8 * MIB + 5 * PAGE_SIZE, 0xb1, 10);
    write(&a, 16 * MIB, 0xc1, 64);
    // Touched, then given back: a hole again.
    write(&a, 2 * MIB, 0xdd, 4 * PAGE_SIZE as usize);
    a.discard(GuestAddress(2 * MIB), 4 * PAGE_SIZE).unwrap();

    let layout = MemoryLayout::of(&a);
    assert_eq!(layout.regions.len(), 3);
    assert_eq!(layout.regions[0].slot_size, 16 << 10);
    assert_eq!(layout.memory_file_size(), 2 * MIB + MIB + (512 << 10));
    let (_path, file) = TempFile::new("full");
    let stats = write_memory_file(&a, &layout, &file).unwrap();
    // 4 + 1 + 1 + 1 pages hold data; the discarded ones and every other page are holes.
    assert_eq!(stats.bytes, 7 * PAGE_SIZE, "{stats:?}");
    let meta = file.metadata().unwrap();
    assert_eq!(meta.len(), layout.memory_file_size());
    assert!(
        meta.blocks() * 512 <= 16 * PAGE_SIZE,
        "sparse: {} blocks",
        meta.blocks()
    );

    // Another manager, from the layout file's bytes and the memory file alone.
    let b = manager();
    let read = MemoryLayout::from_bytes(&layout.to_bytes()).unwrap();
    assert_eq!(read, layout);
    let ids = read.build(&b).unwrap();
    assert_eq!(ids.len(), 3);
    let loaded = load_memory_file(&b, &read, &file).unwrap();
    assert_eq!(loaded, 7 * PAGE_SIZE);
    assert_eq!(contents(&b), contents(&a));
    let shape = |m: &MemoryManager<FakeKvm>| {
        let mut r: Vec<_> = m
            .regions()
            .into_iter()
            .map(|r| (r.gpa, r.size, r.slots, r.slot_size, r.flags, r.shared))
            .collect();
        r.sort_by_key(|r| r.0);
        r
    };
    assert_eq!(shape(&b), shape(&a));
    // The restored manager snapshots to the same pages: the holes stayed holes.
    let (_again_path, again) = TempFile::new("again");
    let stats = write_memory_file(&b, &read, &again).unwrap();
    assert_eq!(stats.bytes, 7 * PAGE_SIZE, "{stats:?}");
    // What the host has of the source's first region: at least the pages written (a
    // transparent huge page may bring its neighbours).
    let map = a.load();
    let first = map.find_by_gpa(GuestAddress(MIB)).unwrap();
    let runs = data_runs(first.payload().memory()).unwrap();
    let present = |offset: u64| runs.iter().any(|r| r.contains(&offset));
    assert!(
        present(0) && present(3 * PAGE_SIZE) && present(2 * MIB - PAGE_SIZE),
        "{runs:?}"
    );
}

#[test]
fn diffs_merged_onto_a_full_snapshot_equal_a_full_snapshot_of_the_same_point() {
    let a = source();
    a.start_dirty_log(Target::All).unwrap();
    write(&a, MIB, 0x11, 2 * PAGE_SIZE as usize);
    write(&a, 8 * MIB, 0x22, 100);
    let layout = MemoryLayout::of(&a);
    let (_base_path, base) = TempFile::new("base");
    write_memory_file(&a, &layout, &base).unwrap();
    // The harvest that ends the full snapshot's period.
    a.harvest_dirty(Target::All).unwrap();

    let mut diffs = Vec::new();
    let mut paths = Vec::new();
    for (round, (gpa, byte)) in [(MIB + PAGE_SIZE, 0x33u8), (8 * MIB + 3 * PAGE_SIZE, 0x44)]
        .into_iter()
        .enumerate()
    {
        write(&a, gpa, byte, 2 * PAGE_SIZE as usize);
        if round == 1 {
            // Discarded pages are part of a diff too: their contents changed to zeros.
            a.discard(GuestAddress(MIB), PAGE_SIZE).unwrap();
        }
        let dirty = a.harvest_dirty(Target::All).unwrap();
        let (path, diff) = TempFile::new(&format!("diff{round}"));
        let stats = write_dirty_pages(&a, &layout, &dirty, &diff).unwrap();
        assert!(stats.bytes >= 2 * PAGE_SIZE, "{stats:?}");
        paths.push(path);
        diffs.push(diff);
    }
    merge_memory_files(&layout, &base, &diffs).unwrap();

    let (_full_path, full) = TempFile::new("now");
    write_memory_file(&a, &layout, &full).unwrap();
    let read = |f: &File| {
        let mut bytes = vec![0u8; layout.memory_file_size() as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut bytes, 0).unwrap();
        bytes
    };
    assert_eq!(
        read(&base),
        read(&full),
        "merged differs from a full snapshot"
    );
    assert_eq!(read(&full), contents(&a));
}

#[test]
fn broken_layout_files_and_memory_files_are_refused_with_the_reason() {
    let a = source();
    let layout = MemoryLayout::of(&a);
    let bytes = layout.to_bytes();
    let refuse = |b: &[u8]| MemoryLayout::from_bytes(b).unwrap_err().to_string();
    // Any byte flipped, anywhere: never accepted.
    for at in 0..bytes.len() {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x40;
        assert!(
            MemoryLayout::from_bytes(&flipped).is_err(),
            "byte {at} flipped was taken"
        );
    }
    let mut flipped = bytes.clone();
    flipped[30] ^= 1;
    assert!(
        refuse(&flipped).contains("checksum"),
        "{}",
        refuse(&flipped)
    );
    assert!(refuse(&bytes[..bytes.len() - 1]).contains("truncated"));
    assert!(refuse(b"GIF89a and more than 24 bytes ...").contains("no KVMSLYT magic"));
    let mut version = bytes.clone();
    version[8] = 9;
    assert!(refuse(&version).contains("format version 9; this build reads version 1"));
    // A well-formed file whose regions overlap.
    let mut overlapping = layout.clone();
    overlapping.regions[1].gpa = layout.regions[0].gpa + PAGE_SIZE;
    assert!(refuse(&overlapping.to_bytes()).contains("overlaps"));

    // A memory file of the wrong size, before anything is loaded.
    let b = manager();
    layout.build(&b).unwrap();
    let (_path, short) = TempFile::new("short");
    short
        .set_len(layout.memory_file_size() - PAGE_SIZE)
        .unwrap();
    let err = load_memory_file(&b, &layout, &short).unwrap_err();
    assert!(matches!(err, SnapshotError::FileSize { .. }), "{err}");
    // Building where regions already are is refused, and nothing stays.
    let before = b.regions();
    assert!(layout.build(&b).is_err());
    assert_eq!(b.regions(), before);
}

#[test]
fn validate_refuses_what_from_bytes_refuses_without_a_round_trip() {
    let layout = MemoryLayout::of(&source());
    layout.validate().expect("a manager's own layout is valid");
    assert!(MemoryLayout {
        version: layout.version,
        regions: Vec::new(),
    }
    .validate()
    .is_ok());

    let broken = |change: &dyn Fn(&mut MemoryLayout), why: &str| {
        let mut bad = layout.clone();
        change(&mut bad);
        let err = bad.validate().expect_err(why).to_string();
        assert!(err.contains(why), "{why}: {err}");
        // from_bytes refuses the same layout for the same reason.
        if bad.version == layout.version {
            let read = MemoryLayout::from_bytes(&bad.to_bytes()).expect_err(why);
            assert_eq!(read.to_string(), err);
        }
    };
    broken(
        &|l| l.version = 7,
        "layout version 7; this build reads version 1",
    );
    broken(&|l| l.regions[0].size = 0, "is empty or not page-aligned");
    broken(&|l| l.regions[1].gpa += 1, "is empty or not page-aligned");
    broken(
        &|l| l.regions[0].slot_size = 100,
        "is empty or not page-aligned",
    );
    broken(
        &|l| l.regions[0].slot_size = kvm_memslots::KVM_MAX_SLOT_SIZE + PAGE_SIZE,
        "over KVM's limit",
    );
    broken(
        &|l| {
            l.regions.swap(0, 2);
            let mut offset = 0;
            for r in &mut l.regions {
                r.file_offset = offset;
                offset += r.size;
            }
        },
        "not in guest-address order",
    );
    broken(
        &|l| l.regions[1].gpa = l.regions[0].gpa + PAGE_SIZE,
        "overlaps the one before",
    );
    broken(
        &|l| l.regions[2].file_offset += PAGE_SIZE,
        "not at 0x300000",
    );
    broken(
        &|l| {
            l.regions.truncate(1);
            l.regions[0].gpa = u64::MAX - PAGE_SIZE + 1;
        },
        "wraps around",
    );
    broken(
        &|l| l.regions[2].id = l.regions[0].id,
        "two regions have id 0",
    );
}

#[test]
fn a_restored_region_keeps_its_id() {
    // Ids with gaps: region 1 goes before the snapshot.
    let a = source();
    a.remove_region(kvm_memslots::RegionId(1)).expect("removed");
    let later = a
        .add_region(RegionSpec::new(GuestAddress(32 * MIB), MIB))
        .expect("added");
    let layout = MemoryLayout::of(&a);
    let b = manager();
    let ids = layout.build(&b).expect("built");
    let of = |m: &MemoryManager<FakeKvm>| -> Vec<(u64, u64)> {
        m.regions().iter().map(|r| (r.id.0, r.gpa.0)).collect()
    };
    assert_eq!(of(&b), of(&a));
    assert_eq!(ids.last(), Some(&later));
    // A region added after the restore takes an id no region had.
    let next = b
        .add_region(RegionSpec::new(GuestAddress(64 * MIB), MIB))
        .expect("added");
    assert!(a.regions().iter().all(|r| r.id < next), "{next}");
    // A layout built onto a manager that has one of its ids is refused, and changes nothing.
    let err = layout.build(&b).expect_err("ids in use");
    assert!(
        matches!(err, kvm_memslots::Error::RegionIdInUse(_)),
        "{err}"
    );
    assert_eq!(b.regions().len(), a.regions().len() + 1);
}

#[test]
fn a_manager_mapped_from_the_memory_file_loads_on_touch_and_never_writes_the_file() {
    let a = source();
    write(&a, MIB + 3 * PAGE_SIZE, 0x5a, 100);
    write(&a, 8 * MIB, 0x6b, PAGE_SIZE as usize);
    let layout = MemoryLayout::of(&a);
    let (_path, file) = TempFile::new("private");
    write_memory_file(&a, &layout, &file).expect("written");
    let before = contents(&a);

    let b = manager();
    layout.build_from_file(&b, &file).expect("mapped");
    assert_eq!(contents(&b), before, "every byte, loaded on touch");
    // The guest's writes stay in the VM's copy.
    write(&b, MIB + 3 * PAGE_SIZE, 0x77, 8);
    let mut byte = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut byte, 3 * PAGE_SIZE).expect("read");
    assert_eq!(byte, [0x5a], "the file is untouched");
    // A discarded page reads zeros, not the file's page.
    b.discard(GuestAddress(MIB + 3 * PAGE_SIZE), PAGE_SIZE)
        .expect("discarded");
    let mut page = vec![0xffu8; PAGE_SIZE as usize];
    b.handle()
        .memory()
        .read_slice(&mut page, GuestAddress(MIB + 3 * PAGE_SIZE))
        .expect("read");
    assert!(page.iter().all(|b| *b == 0), "zeros after a discard");
    // A file of another size is refused before anything is mapped.
    let (_p, short) = TempFile::new("private-short");
    short.set_len(PAGE_SIZE).expect("sized");
    let c = manager();
    assert!(matches!(
        layout.build_from_file(&c, &short),
        Err(SnapshotError::FileSize { .. })
    ));
    assert!(c.regions().is_empty());
}

#[test]
fn a_lazy_restore_fills_exactly_the_pages_touched() {
    use kvm_memslots_persist::LazyLoader;
    use std::sync::atomic::Ordering;
    let a = source();
    write(&a, MIB + 5 * PAGE_SIZE, 0x3c, 64);
    write(&a, MIB + 9 * PAGE_SIZE, 0x4d, 64);
    write(&a, 8 * MIB, 0x5e, 64);
    write(&a, MIB + 12 * PAGE_SIZE, 0x6f, 64);
    write(&a, 8 * MIB + 3 * PAGE_SIZE, 0x70, 64);
    let layout = MemoryLayout::of(&a);
    let (_path, file) = TempFile::new("lazy");
    write_memory_file(&a, &layout, &file).expect("written");

    let b = manager();
    layout.build(&b).expect("built");
    let loader = LazyLoader::start(&b, &layout, &file).expect("userfaultfd");
    let memory = b.handle().memory();
    let read = |gpa: u64| {
        let mut bytes = [0u8; 64];
        memory
            .read_slice(&mut bytes, GuestAddress(gpa))
            .expect("read");
        bytes
    };
    // Two pages with data and one hole touched: three pages filled, two from the file.
    assert_eq!(read(MIB + 5 * PAGE_SIZE), [0x3c; 64]);
    assert_eq!(read(8 * MIB), [0x5e; 64]);
    assert_eq!(read(MIB + 6 * PAGE_SIZE), [0; 64]);
    let stats = loader.stats();
    assert_eq!(stats.copied.load(Ordering::Relaxed), 2);
    assert_eq!(stats.zeroed.load(Ordering::Relaxed), 1);
    // Touched again: nothing more to fill.
    assert_eq!(read(MIB + 5 * PAGE_SIZE), [0x3c; 64]);
    assert_eq!(stats.copied.load(Ordering::Relaxed), 2);
    // A filled page that is discarded comes back as zeros, not as the file's page.
    b.discard(GuestAddress(MIB + 5 * PAGE_SIZE), PAGE_SIZE)
        .expect("discarded");
    assert_eq!(read(MIB + 5 * PAGE_SIZE), [0; 64]);
    // The page never touched still has its data.
    assert_eq!(read(MIB + 9 * PAGE_SIZE), [0x4d; 64]);
    // A page discarded before anything touched it reads zeros too, not the file's page: in
    // anonymous memory and in a memfd.
    for gpa in [MIB + 12 * PAGE_SIZE, 8 * MIB + 3 * PAGE_SIZE] {
        b.discard(GuestAddress(gpa), PAGE_SIZE).expect("discarded");
        assert_eq!(read(gpa), [0; 64], "{gpa:#x}");
    }
    assert!(!stats.failed.load(Ordering::Relaxed));
    drop(loader);
    // Unregistered: the memory is ordinary memory again.
    assert_eq!(read(MIB + 20 * PAGE_SIZE), [0; 64]);
}

/// The loader asks the file, page by page, whether a page is a hole; a file cut under it
/// (`cp new.mem old.mem` would) is a failure it reports, not a hole to fill with zeros.
#[test]
fn a_lazy_restore_of_a_memory_file_cut_under_it_fails_rather_than_fill_zeros() {
    use kvm_memslots_persist::LazyLoader;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let a = source();
    write(&a, MIB + 5 * PAGE_SIZE, 0x3c, 64);
    let layout = MemoryLayout::of(&a);
    let (_path, file) = TempFile::new("lazy-cut");
    write_memory_file(&a, &layout, &file).expect("written");
    let b = manager();
    layout.build(&b).expect("built");
    let loader = LazyLoader::start(&b, &layout, &file).expect("userfaultfd");
    file.set_len(0).expect("cut");
    // The toucher waits on the fault the handler cannot fill, until the loader goes.
    let memory = b.handle();
    let toucher = std::thread::spawn(move || {
        memory
            .memory()
            .read_obj::<u64>(GuestAddress(MIB + 5 * PAGE_SIZE))
            .expect("read")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !loader.stats().failed.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the loader never failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(loader.stats().zeroed.load(Ordering::Acquire), 0);
    drop(loader);
    // Unregistered: the fault goes on as ordinary memory's.
    assert_eq!(toucher.join().expect("the toucher"), 0);
}

#[test]
fn a_chain_across_hotplug_removal_and_moves_merges_into_the_last_point() {
    use kvm_memslots_persist::merge_snapshots;
    let a = source();
    a.start_dirty_log(Target::All).expect("logging");
    write(&a, MIB, 0x11, 2 * PAGE_SIZE as usize);
    let base_layout = MemoryLayout::of(&a);
    let (_b, base) = TempFile::new("chain-base");
    write_memory_file(&a, &base_layout, &base).expect("full");
    a.harvest_dirty(Target::All).expect("harvest");

    // Between the full snapshot and the first diff: a region is hotplugged (logging from the
    // start: every page of it is dirty first) and written, another is removed.
    let plugged = a
        .add_region(
            RegionSpec::new(GuestAddress(32 * MIB), MIB).with_flags(SlotFlags {
                log_dirty: true,
                read_only: false,
            }),
        )
        .expect("hotplug");
    write(&a, 32 * MIB + 3 * PAGE_SIZE, 0x22, 64);
    let memfd = a
        .regions()
        .into_iter()
        .find(|r| r.gpa == GuestAddress(8 * MIB))
        .expect("the memfd region");
    a.remove_region(memfd.id).expect("removed");
    let first_layout = MemoryLayout::of(&a);
    let (_d1, first) = TempFile::new("chain-diff1");
    write_dirty_pages(
        &a,
        &first_layout,
        &a.harvest_dirty(Target::All).expect("h"),
        &first,
    )
    .expect("diff 1");

    // Then the hotplugged region moves and both old and new pages change.
    a.move_region(plugged, GuestAddress(40 * MIB))
        .expect("moved");
    write(&a, 40 * MIB, 0x33, 64);
    write(&a, MIB + PAGE_SIZE, 0x44, 64);
    let second_layout = MemoryLayout::of(&a);
    let (_d2, second) = TempFile::new("chain-diff2");
    write_dirty_pages(
        &a,
        &second_layout,
        &a.harvest_dirty(Target::All).expect("h"),
        &second,
    )
    .expect("diff 2");

    let (_m, merged) = TempFile::new("chain-merged");
    merge_snapshots(
        &[
            (&base_layout, &base),
            (&first_layout, &first),
            (&second_layout, &second),
        ],
        &merged,
    )
    .expect("merged");
    // The same bytes as a full snapshot of the last point, and a restore from it.
    let (_f, full) = TempFile::new("chain-full");
    write_memory_file(&a, &second_layout, &full).expect("full now");
    let bytes = |f: &File| {
        let mut b = vec![0u8; second_layout.memory_file_size() as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 0).expect("read");
        b
    };
    assert_eq!(bytes(&merged), bytes(&full));
    let b = manager();
    second_layout.build(&b).expect("built");
    load_memory_file(&b, &second_layout, &merged).expect("loaded");
    assert_eq!(contents(&b), contents(&a));
}

#[test]
fn a_build_is_all_or_nothing() {
    use kvm_memslots::testing::{Faulty, KvmCall};
    use kvm_memslots::ErrorKind;
    let layout = MemoryLayout::of(&source());
    // The first region takes 128 slots, the second one: the third region's slot fails.
    let b = MemoryManager::new(Faulty::new(FakeKvm::new(512, true)));
    b.kvm().fail(KvmCall::SetRegion, 129, libc::ENOMEM);
    let sequence = b.change_sequence();
    let err = layout.build(&b).unwrap_err();
    assert_eq!(err.errno(), Some(libc::ENOMEM), "{err}");
    assert!(b.regions().is_empty(), "nothing of the layout stays");
    assert!(b.kvm().inner().slots().is_empty(), "nor in KVM");
    assert_eq!(
        b.change_sequence(),
        sequence + 2,
        "one change, undone as one"
    );
    // Built whole once KVM accepts.
    assert_eq!(layout.build(&b).unwrap().len(), layout.regions.len());

    // The same failure, and the undo refused too: nothing is published, the manager says
    // KVM and the map disagree, and refuses further changes.
    let b = MemoryManager::new(Faulty::new(FakeKvm::new(512, true)));
    b.kvm().fail_from(KvmCall::SetRegion, 129, libc::ENOMEM);
    let err = layout.build(&b).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Broken, "{err}");
    assert_eq!(err.errno(), Some(libc::ENOMEM));
    assert!(
        matches!(err, kvm_memslots::Error::UndoFailed { .. }),
        "{err}"
    );
    assert!(b.regions().is_empty(), "{err}");
}

/// How many of this process's open files are `path`.
fn open_files_of(path: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target == path)
        .count()
}

#[test]
fn a_file_backed_restore_opens_the_memory_file_once_whatever_the_region_count() {
    let m = MemoryManager::new(FakeKvm::new(1200, true));
    let specs = (0..1100).map(|i| RegionSpec::new(GuestAddress(i * 2 * MIB), 64 << 10));
    m.add_regions(specs).expect("1,100 regions");
    write(&m, 2 * MIB * 1099, 0x5a, 4096);
    let layout = MemoryLayout::of(&m);
    let (temp, file) = TempFile::new("many-regions");
    write_memory_file(&m, &layout, &file).expect("written");
    let restored = MemoryManager::new(FakeKvm::new(1200, true));
    layout
        .build_from_file(&restored, &file)
        .expect("mapped from the file");
    // The file handed in, and one duplicate shared by the 1,100 mappings.
    assert_eq!(open_files_of(&temp.0), 2);
    assert_eq!(contents(&restored), contents(&m));
    drop(restored);
    assert_eq!(open_files_of(&temp.0), 1, "closed with the last mapping");
}

/// A VM restored from a memory file and snapshotted again before the guest touched all of it:
/// the pages it never touched are in the file, not in the process's page tables, and the new
/// snapshot must still hold them (and a page discarded since must come back as zeros).
#[test]
fn a_snapshot_of_a_file_backed_restore_holds_the_pages_never_touched() {
    let a = source();
    write(&a, MIB + 3 * PAGE_SIZE, 0x5a, 100);
    write(&a, MIB + 9 * PAGE_SIZE, 0x3c, PAGE_SIZE as usize);
    write(&a, 8 * MIB, 0x6b, PAGE_SIZE as usize);
    let layout = MemoryLayout::of(&a);
    let (_path, file) = TempFile::new("restored-first");
    write_memory_file(&a, &layout, &file).expect("written");

    let b = manager();
    layout.build_from_file(&b, &file).expect("mapped");
    // Nothing read yet, but one page changed and one discarded.
    write(&b, MIB + 20 * PAGE_SIZE, 0x11, 16);
    b.discard(GuestAddress(MIB + 9 * PAGE_SIZE), PAGE_SIZE)
        .expect("discarded");
    let (_again, second) = TempFile::new("restored-second");
    write_memory_file(&b, &MemoryLayout::of(&b), &second).expect("written");

    let c = manager();
    MemoryLayout::of(&b).build(&c).expect("built");
    load_memory_file(&c, &MemoryLayout::of(&b), &second).expect("loaded");
    assert_eq!(contents(&c), contents(&b), "every byte of the restored VM");
    let mut page = vec![0xffu8; PAGE_SIZE as usize];
    c.handle()
        .memory()
        .read_slice(&mut page, GuestAddress(MIB + 9 * PAGE_SIZE))
        .expect("read");
    assert!(page.iter().all(|b| *b == 0), "the discarded page is zeros");
    let mut byte = [0u8; 1];
    c.handle()
        .memory()
        .read_slice(&mut byte, GuestAddress(MIB + 3 * PAGE_SIZE))
        .expect("read");
    assert_eq!(byte, [0x5a], "a page the restored VM never touched");
}

/// A region with holes (slots over parts of it only, as a virtio-mem piece has) restores with
/// the same slots, its memory with it; a region cut by its slot size records no slot list.
#[test]
fn a_region_with_holes_restores_with_its_holes() {
    let a = manager();
    let plain = a
        .add_region(RegionSpec::new(GuestAddress(MIB), MIB).with_slot_size(256 << 10))
        .unwrap();
    let spec = RegionSpec::new(GuestAddress(4 * MIB), 4 * MIB)
        .with_slot_ranges(vec![MIB..2 * MIB, 3 * MIB..4 * MIB]);
    let holed = a.add_region(spec).unwrap();
    write(&a, 5 * MIB + 64, 0x5a, 100);
    write(&a, 7 * MIB, 0x7b, 100);
    // Memory behind a hole is the region's too: it is saved and restored with it.
    let behind = a.region_memory(holed).unwrap();
    assert_eq!(behind.size(), 4 * MIB);

    let layout = MemoryLayout::of(&a);
    assert_eq!(layout.regions[0].slot_ranges, None);
    assert_eq!(
        layout.regions[1].slot_ranges,
        Some(vec![[MIB, 2 * MIB], [3 * MIB, 4 * MIB]])
    );
    let json = String::from_utf8_lossy(&layout.to_bytes()).into_owned();
    assert_eq!(json.matches("slot_ranges").count(), 1, "{json}");
    let (_path, file) = TempFile::new("holes");
    write_memory_file(&a, &layout, &file).unwrap();

    let b = manager();
    let read = MemoryLayout::from_bytes(&layout.to_bytes()).unwrap();
    assert_eq!(read, layout);
    read.build(&b).unwrap();
    load_memory_file(&b, &read, &file).unwrap();
    assert_eq!(b.slot_ranges(holed), a.slot_ranges(holed));
    assert_eq!(b.slot_ranges(plain), a.slot_ranges(plain));
    let memory = b.handle().memory();
    assert_eq!(
        memory.read_obj::<u8>(GuestAddress(5 * MIB + 64)).unwrap(),
        0x5a
    );
    assert_eq!(memory.read_obj::<u8>(GuestAddress(7 * MIB)).unwrap(), 0x7b);
    assert!(
        memory.read_obj::<u8>(GuestAddress(4 * MIB)).is_err(),
        "a hole"
    );
    assert!(
        memory.read_obj::<u8>(GuestAddress(6 * MIB)).is_err(),
        "a hole"
    );

    // A slot list that is not one is refused with the reason.
    let mut bad = layout.clone();
    bad.regions[1].slot_ranges = Some(vec![[MIB, 3 * MIB], [2 * MIB, 4 * MIB]]);
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("out of order"), "{err}");
}

/// A memory file written in slices: the caller is asked between every two, with the bytes
/// written so far, and can stop it there; unstopped, the file is the one written at once.
#[test]
fn a_memory_file_written_in_slices_asks_between_them_and_stops_when_told() {
    use kvm_memslots_persist::{write_dirty_pages_sliced, write_memory_file_sliced, Slices};
    let m = manager();
    m.add_region(RegionSpec::new(GuestAddress(0), 4 * MIB))
        .expect("the fake takes it");
    m.start_dirty_log(Target::All).expect("logging");
    m.harvest_dirty(Target::All).expect("harvested");
    let ram = m.handle().memory();
    ram.write_slice(&vec![0x5a; (2 * MIB) as usize], GuestAddress(MIB))
        .expect("guest memory");
    for page in (MIB..3 * MIB).step_by(PAGE_SIZE as usize) {
        m.kvm().guest_write(page);
    }
    let layout = MemoryLayout::of(&m);
    let (whole_path, whole) = TempFile::new("sliced-whole");
    let at_once = write_memory_file(&m, &layout, &whole).expect("written");

    // Unstopped: asked after every 256 KiB (not before the first, nor after the last).
    let (sliced_path, sliced) = TempFile::new("sliced");
    let mut asked = Vec::new();
    let mut between = |written: u64| {
        asked.push(written);
        Ok(())
    };
    let slices = Slices {
        bytes: 256 << 10,
        between: &mut between,
    };
    let stats = write_memory_file_sliced(&m, &layout, &sliced, slices).expect("written");
    assert_eq!(stats.bytes, at_once.bytes);
    let expected: Vec<u64> = (1..8).map(|n| n * (256 << 10)).collect();
    assert_eq!(
        asked, expected,
        "asked between slices, with the bytes so far"
    );
    let read = |path: &TempFile| std::fs::read(&path.0).expect("read back");
    assert_eq!(read(&sliced_path), read(&whole_path), "the same file");

    // Stopped at the third ask: three slices written, nothing after.
    let (stopped_path, stopped) = TempFile::new("sliced-stopped");
    let mut asks = 0;
    let mut stop = |_| {
        asks += 1;
        if asks == 3 {
            Err("a client cancelled it".to_string())
        } else {
            Ok(())
        }
    };
    let slices = Slices {
        bytes: 256 << 10,
        between: &mut stop,
    };
    let err = write_memory_file_sliced(&m, &layout, &stopped, slices).expect_err("stopped");
    assert!(
        matches!(&err, SnapshotError::Stopped(why) if why == "a client cancelled it"),
        "{err}"
    );
    let written = read(&stopped_path);
    let data = written.iter().filter(|b| **b == 0x5a).count() as u64;
    assert_eq!(data, 3 * (256 << 10), "three slices, no more");

    // A Diff's pages the same way.
    let dirty = m.harvest_dirty(Target::All).expect("harvested");
    let (_diff_path, diff) = TempFile::new("sliced-diff");
    let mut asked = 0;
    let mut between = |_| {
        asked += 1;
        Ok(())
    };
    let slices = Slices {
        bytes: MIB,
        between: &mut between,
    };
    let stats = write_dirty_pages_sliced(&m, &layout, &dirty, &diff, slices).expect("written");
    assert_eq!((stats.bytes, asked), (2 * MIB, 1));
}

#[test]
fn a_snapshot_records_the_page_size_and_a_restore_keeps_or_overrides_it() {
    let test = "a_snapshot_records_the_page_size_and_a_restore_keeps_or_overrides_it";
    // The source's region, the copy restore's and the lazy restore's.
    if !pool_has(test, 6) {
        return;
    }
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
        .expect("a region of 4 KiB pages");
    a.add_region(
        RegionSpec::new(GuestAddress(4 * MIB), 4 * MIB)
            .with_page_size(PageSize::Huge2M)
            .with_slot_size(2 * MIB),
    )
    .expect("a region of 2 MiB pages");
    a.add_region(RegionSpec::new(GuestAddress(16 * MIB), MIB))
        .expect("a region of 4 KiB pages off the 2 MiB grid");
    write(&a, 100, 0x11, 10);
    write(&a, 4 * MIB + 5 * PAGE_SIZE, 0x22, 10);
    write(&a, 7 * MIB, 0x33, PAGE_SIZE as usize);
    let layout = MemoryLayout::of(&a);
    assert_eq!(
        layout
            .regions
            .iter()
            .map(|r| r.page_size)
            .collect::<Vec<_>>(),
        [
            LayoutPageSize::Base,
            LayoutPageSize::Huge2M,
            LayoutPageSize::Base
        ]
    );
    let bytes = layout.to_bytes();
    let json = String::from_utf8_lossy(&bytes);
    assert_eq!(
        json.matches("\"page_size\"").count(),
        1,
        "only a region of other pages than 4 KiB names them: {json}"
    );
    let read = MemoryLayout::from_bytes(&bytes).expect("read back");
    assert_eq!(read, layout);
    let (_path, file) = TempFile::new("huge-full");
    let stats = write_memory_file(&a, &layout, &file).expect("written");
    // Sparse at 4 KiB whatever the page size: a touched 2 MiB page writes the 4 KiB pages that
    // hold data, not the whole page.
    assert_eq!(stats.bytes, 3 * PAGE_SIZE, "{stats:?}");

    // A copy restore maps 2 MiB pages again and holds every byte.
    let b = manager();
    read.build(&b).expect("built");
    load_memory_file(&b, &read, &file).expect("loaded");
    assert_eq!(contents(&b), contents(&a));
    let page_sizes: Vec<PageSize> = {
        let mut r = b.regions();
        r.sort_by_key(|r| r.gpa);
        r.into_iter().map(|r| r.page_size).collect()
    };
    assert_eq!(
        page_sizes,
        [PageSize::Base, PageSize::Huge2M, PageSize::Base]
    );

    // The memory file is on no hugetlbfs: mapping it as 2 MiB pages is refused before
    // anything is mapped, and a restore that overrides the page size maps it.
    let c = manager();
    let err = read.build_from_file(&c, &file).expect_err("not hugetlbfs");
    assert!(err.to_string().contains("hugetlbfs"), "{err}");
    assert!(c.regions().is_empty(), "nothing mapped");
    let base = read
        .with_page_size(PageSize::Base)
        .expect("4 KiB fits anything");
    base.build_from_file(&c, &file)
        .expect("mapped in 4 KiB pages");
    assert_eq!(contents(&c), contents(&a));
    // A lazy restore maps 2 MiB pages again and fills them whole (tests/lazy_huge.rs).
    let d = manager();
    read.build(&d).expect("built");
    let loader = kvm_memslots_persist::LazyLoader::start(&d, &read, &file).expect("lazy");
    assert_eq!(contents(&d), contents(&a));
    drop(loader);
    // And the other way: 2 MiB pages for a layout of 4 KiB, where it fits the grid.
    let misfit = base
        .with_page_size(PageSize::Huge2M)
        .expect_err("1 MiB at 0");
    assert!(
        misfit.to_string().contains("pages of 0x200000 bytes"),
        "{misfit}"
    );
}

/// A file-backed restore of a region of transparent huge pages maps it in 4 KiB pages (a
/// private mapping of a file has no transparent huge pages), with every byte, and says so in
/// the region's page size; a copy restore keeps THP.
#[test]
fn a_file_backed_restore_maps_a_thp_region_in_4k_pages() {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(0), 4 * MIB).with_page_size(PageSize::Transparent))
        .expect("a THP region");
    write(&a, 3 * PAGE_SIZE, 0x5a, 100);
    let layout = MemoryLayout::of(&a);
    assert_eq!(layout.regions[0].page_size, LayoutPageSize::Transparent);
    let (_path, file) = TempFile::new("thp-full");
    write_memory_file(&a, &layout, &file).expect("written");
    let b = manager();
    layout.build_from_file(&b, &file).expect("mapped");
    assert_eq!(contents(&b), contents(&a));
    assert_eq!(b.regions()[0].page_size, PageSize::Base);
    let c = manager();
    layout.build(&c).expect("built");
    load_memory_file(&c, &layout, &file).expect("loaded");
    assert_eq!(contents(&c), contents(&a));
    assert_eq!(c.regions()[0].page_size, PageSize::Transparent);
}

#[test]
fn a_layout_of_2m_pages_off_their_grid_is_refused() {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(2 * MIB), 2 * MIB))
        .expect("a region");
    let mut layout = MemoryLayout::of(&a);
    layout.regions[0].page_size = LayoutPageSize::Huge2M;
    layout.validate().expect("on the 2 MiB grid");
    layout.regions[0].gpa = 3 * MIB;
    let err = layout.validate().expect_err("off the grid");
    assert!(err.to_string().contains("pages of 0x200000 bytes"), "{err}");
    let err = MemoryLayout::from_bytes(&layout.to_bytes()).expect_err("read and refused");
    assert!(err.to_string().contains("pages of 0x200000 bytes"), "{err}");
}

/// Every byte of `m`'s region `id` as the host's readers see it (inaccessible ranges as zeros).
fn region_bytes(m: &MemoryManager<FakeKvm>, id: kvm_memslots::RegionId) -> Vec<u8> {
    let memory = m.region_memory(id).expect("the region");
    let mut bytes = vec![0u8; memory.size() as usize];
    memory
        .read_volatile(0, &mut bytes)
        .expect("inside the region");
    bytes
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn a_region_with_unreachable_ranges_under_its_slot_snapshots_them_as_zeros() {
    // An unplugged block inside a plugged piece: one slot over the region, a range of it
    // PROT_NONE. Full and diff snapshots must not fault on it nor fail, and write zeros.
    let a = manager();
    let r = a
        .add_region(RegionSpec::new(GuestAddress(MIB), 2 * MIB))
        .unwrap();
    a.start_dirty_log(Target::All).unwrap();
    write(&a, MIB, 0x5a, 2 * MIB as usize);
    let layout = MemoryLayout::of(&a);
    let (_base_path, base) = TempFile::new("unreachable-base");
    write_memory_file(&a, &layout, &base).unwrap();
    a.harvest_dirty(Target::All).unwrap();
    let gone = 64 * PAGE_SIZE..128 * PAGE_SIZE;
    a.set_accessible(r, std::slice::from_ref(&gone), false)
        .unwrap();
    a.discard_region(r, gone.clone()).unwrap();
    assert_eq!(a.slot_ranges(r), Some(vec![0..2 * MIB]));
    // A diff: the unreachable pages changed (to zeros), so they are in it, written as zeros.
    let dirty = a.harvest_dirty(Target::All).unwrap();
    let (_diff_path, diff) = TempFile::new("unreachable-diff");
    let stats = write_dirty_pages(&a, &layout, &dirty, &diff).unwrap();
    assert_eq!(stats.bytes, gone.end - gone.start, "{stats:?}");
    merge_memory_files(&layout, &base, &[diff]).unwrap();
    // A full snapshot now: the unreachable pages are not data.
    let (_full_path, full) = TempFile::new("unreachable-full");
    let stats = write_memory_file(&a, &layout, &full).unwrap();
    assert_eq!(stats.bytes, 2 * MIB - (gone.end - gone.start), "{stats:?}");
    let read = |f: &File| {
        let mut bytes = vec![0u8; layout.memory_file_size() as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut bytes, 0).unwrap();
        bytes
    };
    let expected = region_bytes(&a, r);
    assert!(expected[gone.start as usize..gone.end as usize]
        .iter()
        .all(|b| *b == 0));
    assert_eq!(read(&full), expected);
    assert_eq!(read(&base), expected, "base + diff differs");
    // A restore loads around what the new manager has made unreachable (as a device restore
    // does once the layout is built), and reaches every other byte.
    let b = manager();
    let ids = layout.build(&b).unwrap();
    b.set_accessible(ids[0], std::slice::from_ref(&gone), false)
        .unwrap();
    load_memory_file(&b, &layout, &full).unwrap();
    assert_eq!(region_bytes(&b, ids[0]), expected);
}
