//! Memory files on hugetlbfs (here a `MFD_HUGETLB` memfd, which lives on the kernel's own
//! hugetlbfs mount): a Full written there through its mapping keeps its 2 MiB holes, a chain
//! merged there reads as the Full of its last point, and clones restored from it
//! (`build_from_file`) map every region in 2 MiB pages and share its pages until they write.
//! Dirty pages written over a Full there (a live Full's later rounds) update it. A Diff
//! started there and a layout that is not whole 2 MiB pages are refused, naming why. Tests that
//! need the hugetlb pool skip loudly where it is too small.

mod support;
use support::{pool_has, TempFile};

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{MemoryManager, PageSize, RegionSpec, Target, HUGE_PAGE_SIZE, PAGE_SIZE};
use kvm_memslots_persist::{
    merge_snapshots, write_dirty_pages, write_memory_file, MemoryLayout, SnapshotError,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;
/// Guest base of the three 2 MiB hugetlb pages, after one 2 MiB region of 4 KiB pages at 0.
const HUGE: u64 = 4 * MIB;

/// A new, empty file on hugetlbfs.
fn hugetlbfs_file() -> File {
    let flags = libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    // SAFETY: the name is a valid NUL-terminated string; the call has no other input.
    let fd = unsafe { libc::memfd_create(c"hugetlbfs-template".as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    unsafe { File::from_raw_fd(fd) }
}

fn manager() -> MemoryManager<FakeKvm> {
    MemoryManager::new(FakeKvm::new(64, true))
}

/// 2 MiB of 4 KiB pages at 0 (a few bytes written) and three 2 MiB hugetlb pages at [`HUGE`]:
/// the first holds one written 4 KiB page, the second is written whole, the third never.
fn source() -> MemoryManager<FakeKvm> {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
        .expect("4 KiB pages");
    a.add_region(
        RegionSpec::new(GuestAddress(HUGE), 3 * HUGE_PAGE_SIZE).with_page_size(PageSize::Huge2M),
    )
    .expect("2 MiB pages");
    let mem = a.handle().memory();
    mem.write_slice(&[0x5a; 100], GuestAddress(100))
        .expect("written");
    mem.write_slice(
        &[0xa1; PAGE_SIZE as usize],
        GuestAddress(HUGE + 3 * PAGE_SIZE),
    )
    .expect("written");
    mem.write_slice(
        &vec![0xb2; HUGE_PAGE_SIZE as usize],
        GuestAddress(HUGE + HUGE_PAGE_SIZE),
    )
    .expect("written");
    drop(mem);
    a
}

/// Every byte of `m`'s guest memory in `[0, HUGE + 6 MiB)` but the gap between the regions.
fn contents(m: &MemoryManager<FakeKvm>) -> Vec<u8> {
    let mem = m.handle().memory();
    let mut out = vec![0u8; (2 * MIB + 3 * HUGE_PAGE_SIZE) as usize];
    let (low, high) = out.split_at_mut(2 * MIB as usize);
    mem.read_slice(low, GuestAddress(0)).expect("read");
    mem.read_slice(high, GuestAddress(HUGE)).expect("read");
    out
}

#[test]
fn clones_of_a_full_on_hugetlbfs_map_2m_pages_and_share_them_until_they_write() {
    let test = "clones_of_a_full_on_hugetlbfs_map_2m_pages_and_share_them_until_they_write";
    // The source's 3 pages, the template's 3 with data, and each clone's 4 reserved.
    if !pool_has(test, 3 + 3 + 2 * 4) {
        return;
    }
    let a = source();
    let layout = MemoryLayout::of(&a);
    let template = hugetlbfs_file();
    let stats = write_memory_file(&a, &layout, &template).expect("written on hugetlbfs");
    assert_eq!(stats.bytes, 2 * PAGE_SIZE + HUGE_PAGE_SIZE, "{stats:?}");
    let meta = template.metadata().expect("metadata");
    assert_eq!(meta.len(), layout.memory_file_size());
    // The low region's page and the first two huge pages hold data; the third is a hole.
    assert_eq!(
        meta.blocks() * 512,
        3 * HUGE_PAGE_SIZE,
        "2 MiB holes stay holes"
    );
    let mut byte = [0u8; 1];
    template
        .read_exact_at(&mut byte, 2 * MIB + 3 * PAGE_SIZE)
        .expect("read");
    assert_eq!(byte[0], 0xa1);

    let expected = contents(&a);
    let clones: Vec<MemoryManager<FakeKvm>> = (0..2)
        .map(|_| {
            let clone = manager();
            layout
                .build_from_file(&clone, &template)
                .expect("a clone of the template");
            clone
        })
        .collect();
    for clone in &clones {
        assert!(
            clone
                .regions()
                .iter()
                .all(|r| r.page_size == PageSize::Huge2M),
            "every region maps the hugetlbfs file in 2 MiB pages: {:?}",
            clone.regions()
        );
        assert_eq!(contents(clone), expected, "the clone reads the template");
    }
    // The first clone writes; the second and the template do not see it.
    clones[0]
        .handle()
        .memory()
        .write_slice(&[0xc3; 64], GuestAddress(HUGE + 3 * PAGE_SIZE))
        .expect("written");
    clones[0]
        .handle()
        .memory()
        .write_slice(&[0xc4; 8], GuestAddress(HUGE + 2 * HUGE_PAGE_SIZE))
        .expect("written in the template's hole");
    assert_eq!(
        contents(&clones[1]),
        expected,
        "the other clone is unchanged"
    );
    template
        .read_exact_at(&mut byte, 2 * MIB + 3 * PAGE_SIZE)
        .expect("read");
    assert_eq!(byte[0], 0xa1, "the template is unchanged");
    let mut got = [0u8; 1];
    clones[0]
        .handle()
        .memory()
        .read_slice(&mut got, GuestAddress(HUGE + 2 * HUGE_PAGE_SIZE))
        .expect("read");
    assert_eq!(got[0], 0xc4);
}

#[test]
fn a_chain_merged_onto_hugetlbfs_reads_as_the_full_of_its_last_point() {
    let test = "a_chain_merged_onto_hugetlbfs_reads_as_the_full_of_its_last_point";
    // The source's 3 pages and the merged file's 3 with data.
    if !pool_has(test, 3 + 3) {
        return;
    }
    let a = source();
    a.start_dirty_log(Target::All).expect("logging");
    let layout = MemoryLayout::of(&a);
    let (_full_path, full) = TempFile::new("hugetlbfs-full");
    write_memory_file(&a, &layout, &full).expect("the Full");
    a.harvest_dirty(Target::All).expect("the Full's harvest");
    // The Diff: a page rewritten, and one zeroed.
    let mem = a.handle().memory();
    mem.write_slice(&[0xd5; 32], GuestAddress(HUGE + HUGE_PAGE_SIZE + 8))
        .expect("written");
    mem.write_slice(&[0; PAGE_SIZE as usize], GuestAddress(HUGE + 3 * PAGE_SIZE))
        .expect("zeroed");
    drop(mem);
    let dirty = a.harvest_dirty(Target::All).expect("the Diff's harvest");
    let (_diff_path, diff) = TempFile::new("hugetlbfs-diff");
    write_dirty_pages(&a, &layout, &dirty, &diff).expect("the Diff");

    let merged = hugetlbfs_file();
    merge_snapshots(&[(&layout, &full), (&layout, &diff)], &merged).expect("merged on hugetlbfs");
    let mut bytes = vec![0u8; layout.memory_file_size() as usize];
    merged.read_exact_at(&mut bytes, 0).expect("read");
    assert_eq!(
        bytes,
        contents(&a),
        "the merged file is the last point's memory"
    );
    // Every page of it holds data now but the third huge page, never written.
    assert_eq!(
        merged.metadata().expect("metadata").blocks() * 512,
        3 * HUGE_PAGE_SIZE
    );
}

/// A live Full's later rounds write dirty pages over its first on hugetlbfs: the file then
/// holds the last point's memory, zeros written over data included.
#[test]
fn dirty_pages_written_over_a_full_on_hugetlbfs_update_it() {
    let test = "dirty_pages_written_over_a_full_on_hugetlbfs_update_it";
    // The source's 3 pages and the file's 3 with data.
    if !pool_has(test, 3 + 3) {
        return;
    }
    let a = source();
    a.start_dirty_log(Target::All).expect("logging");
    let layout = MemoryLayout::of(&a);
    let full = hugetlbfs_file();
    write_memory_file(&a, &layout, &full).expect("the first round");
    a.harvest_dirty(Target::All)
        .expect("the first round's harvest");
    let mem = a.handle().memory();
    mem.write_slice(&[0xe6; 16], GuestAddress(HUGE + HUGE_PAGE_SIZE + 4096))
        .expect("written");
    mem.write_slice(&[0; PAGE_SIZE as usize], GuestAddress(HUGE + 3 * PAGE_SIZE))
        .expect("zeroed");
    drop(mem);
    let dirty = a
        .harvest_dirty(Target::All)
        .expect("the next round's harvest");
    write_dirty_pages(&a, &layout, &dirty, &full).expect("a later round");
    let mut bytes = vec![0u8; layout.memory_file_size() as usize];
    full.read_exact_at(&mut bytes, 0).expect("read");
    assert_eq!(bytes, contents(&a), "the file is the last round's memory");
}

#[test]
fn a_diff_or_a_layout_off_the_2m_grid_on_hugetlbfs_is_refused_naming_why() {
    let a = manager();
    // 1 MiB of 4 KiB pages: the layout is not whole 2 MiB pages.
    a.add_region(RegionSpec::new(GuestAddress(0), MIB))
        .expect("4 KiB pages");
    a.start_dirty_log(Target::All).expect("logging");
    let layout = MemoryLayout::of(&a);
    let file = hugetlbfs_file();
    let err = write_memory_file(&a, &layout, &file).expect_err("refused");
    assert!(
        matches!(&err, SnapshotError::Unsupported(why)
                 if why.contains("hugetlbfs") && why.contains("whole 2 MiB pages")),
        "{err}"
    );
    assert_eq!(
        file.metadata().expect("metadata").len(),
        0,
        "nothing written"
    );

    let dirty = a.harvest_dirty(Target::All).expect("a harvest");
    let err = write_dirty_pages(&a, &layout, &dirty, &file).expect_err("refused");
    assert!(
        matches!(&err, SnapshotError::Unsupported(why)
                 if why.contains("Diff") && why.contains("hugetlbfs")),
        "{err}"
    );
    assert_eq!(
        file.metadata().expect("metadata").len(),
        0,
        "nothing written"
    );
}
