//! Lazy restores of huge-page regions: a fault in a 2 MiB hugetlb page fills the whole page
//! with one `UFFDIO_COPY` (holes in the memory file read as zeros), a working set names and
//! prefetches whole 2 MiB pages, and a transparent-huge-page region is filled a 2 MiB block a
//! fault. Tests that need the hugetlb pool skip loudly where it is too small.

mod support;
use support::lazy::{prefetching, restored, wait_prefetched};
use support::{pool_has, TempFile};

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Backing, MemoryManager, PageSize, RegionSpec, HUGE_PAGE_SIZE, PAGE_SIZE};
use kvm_memslots_persist::{
    write_memory_file, LayoutPageSize, LazyLoader, LazyOptions, MemoryLayout, Recording, WorkingSet,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

fn manager() -> MemoryManager<FakeKvm> {
    MemoryManager::new(FakeKvm::new(64, true))
}

/// Guest base of the 2 MiB hugetlb region (anonymous, three pages), after a 1 MiB region of
/// 4 KiB pages: its place in the memory file (1 MiB) is not on the 2 MiB grid.
const HUGE: u64 = 4 * MIB;
/// Guest base of the shared (memfd) 2 MiB hugetlb region, one page.
const SHARED: u64 = 16 * MIB;

/// A VM with a 1 MiB region of 4 KiB pages at 0, three 2 MiB hugetlb pages at [`HUGE`] and
/// one shared at [`SHARED`]: in the first huge page only its 4 KiB pages 3 and 400 hold data
/// (the rest is a hole of the memory file), the second is written whole, the third never; the
/// shared one and the small region hold a few bytes.
fn source() -> MemoryManager<FakeKvm> {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(0), MIB))
        .expect("4 KiB pages");
    a.add_region(
        RegionSpec::new(GuestAddress(HUGE), 3 * HUGE_PAGE_SIZE).with_page_size(PageSize::Huge2M),
    )
    .expect("2 MiB pages");
    a.add_region(
        RegionSpec::new(GuestAddress(SHARED), HUGE_PAGE_SIZE)
            .with_page_size(PageSize::Huge2M)
            .with_backing(Backing::Memfd),
    )
    .expect("2 MiB pages of a memfd");
    let memory = a.handle().memory();
    let page = |i: u64| vec![(i % 251) as u8 + 1; PAGE_SIZE as usize];
    memory
        .write_slice(&page(7), GuestAddress(5 * PAGE_SIZE))
        .expect("written");
    for i in [3, 400] {
        memory
            .write_slice(&page(i), GuestAddress(HUGE + i * PAGE_SIZE))
            .expect("written");
    }
    for i in 0..512 {
        memory
            .write_slice(
                &page(i),
                GuestAddress(HUGE + HUGE_PAGE_SIZE + i * PAGE_SIZE),
            )
            .expect("written");
    }
    memory
        .write_obj(0xfeed_u64, GuestAddress(SHARED + 0x1234))
        .expect("written");
    a
}

/// Every byte of the guest range `[gpa, gpa + len)` of `m`.
fn bytes(m: &MemoryManager<FakeKvm>, gpa: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    m.handle()
        .memory()
        .read_slice(&mut out, GuestAddress(gpa))
        .expect("guest memory");
    out
}

/// Every byte of every region of `m`, in guest-address order.
fn contents(m: &MemoryManager<FakeKvm>) -> Vec<u8> {
    let mut regions = m.regions();
    regions.sort_by_key(|r| r.gpa);
    regions
        .into_iter()
        .flat_map(|r| bytes(m, r.gpa.0, r.size))
        .collect()
}

/// The source's snapshot: its layout and memory file.
fn snapshot(a: &MemoryManager<FakeKvm>, name: &str) -> (MemoryLayout, TempFile, File) {
    let layout = MemoryLayout::of(a);
    let (path, file) = TempFile::new(name);
    write_memory_file(a, &layout, &file).expect("written");
    (layout, path, file)
}

/// The [`source`] VM and its snapshot (named `name`), or `None` where the hugetlb pool is too
/// small for `test` (which then skips, loudly).
fn huge_snapshot(
    test: &str,
    name: &str,
) -> Option<(MemoryManager<FakeKvm>, MemoryLayout, TempFile, File)> {
    if !pool_has(test, 8) {
        return None;
    }
    let a = source();
    let (layout, path, file) = snapshot(&a, name);
    Some((a, layout, path, file))
}

/// Whether the guest range `[gpa, gpa + len)` of `m` reads all zeros.
fn zeros(m: &MemoryManager<FakeKvm>, gpa: u64, len: u64) -> bool {
    bytes(m, gpa, len).iter().all(|b| *b == 0)
}

fn stat(loader: &LazyLoader) -> [u64; 4] {
    let s = loader.stats();
    [
        s.copied.load(Ordering::Acquire),
        s.zeroed.load(Ordering::Acquire),
        s.prefetched.load(Ordering::Acquire),
        s.copy_calls.load(Ordering::Acquire),
    ]
}

#[test]
fn a_lazy_restore_fills_whole_2m_pages_with_one_copy_each() {
    let Some((a, layout, _path, file)) = huge_snapshot(
        "a_lazy_restore_fills_whole_2m_pages_with_one_copy_each",
        "fill",
    ) else {
        return;
    };
    assert_eq!(layout.regions[1].page_size, LayoutPageSize::Huge2M);
    assert_eq!(
        layout.regions[1].file_offset, MIB,
        "off the 2 MiB grid in the file"
    );

    LazyLoader::check_layout(&layout).expect("this host's userfaultfd fills hugetlb pages");
    let (b, loader) = restored(&layout, &file, LazyOptions::default());
    assert_eq!(stat(&loader), [0, 0, 0, 0], "nothing read up front");

    // One byte of the first huge page, which is mostly a hole in the file: the whole page is
    // filled by one copy, holes as zeros, data where the file has it.
    let byte = bytes(&b, HUGE + 100 * PAGE_SIZE, 1);
    assert_eq!(byte, [0]);
    assert_eq!(stat(&loader), [512, 0, 0, 1], "one copy of 512 pages");
    let first = bytes(&b, HUGE, HUGE_PAGE_SIZE);
    assert_eq!(first, bytes(&a, HUGE, HUGE_PAGE_SIZE));
    assert_eq!(first[(3 * PAGE_SIZE) as usize], 4, "data of page 3");
    assert_eq!(first[(400 * PAGE_SIZE) as usize], 150, "data of page 400");
    assert_eq!(stat(&loader), [512, 0, 0, 1], "no other fault in that page");

    // The page written whole, then the one that is all hole (zeros copied: hugetlb pages take
    // no UFFDIO_ZEROPAGE).
    assert_eq!(
        bytes(&b, HUGE + HUGE_PAGE_SIZE, 2 * HUGE_PAGE_SIZE),
        bytes(&a, HUGE + HUGE_PAGE_SIZE, 2 * HUGE_PAGE_SIZE)
    );
    assert_eq!(stat(&loader), [1024, 512, 0, 3]);

    // The shared region, the small one, everything.
    assert_eq!(contents(&b), contents(&a));
    let [copied, _, _, calls] = stat(&loader);
    // The shared page whole; the small region page by page: its one page of data copied, its
    // holes zero pages (no copy).
    assert_eq!(copied, 1536 + 1);
    assert_eq!(calls, 4 + 1);

    // A huge page discarded after its fill reads zeros (filled again with one copy of zeros).
    b.discard(GuestAddress(HUGE + HUGE_PAGE_SIZE), HUGE_PAGE_SIZE)
        .expect("a whole page");
    assert!(zeros(&b, HUGE + HUGE_PAGE_SIZE, HUGE_PAGE_SIZE));
    assert_eq!(stat(&loader)[3], calls + 1);
    assert!(!loader.stats().failed.load(Ordering::Acquire));
}

#[test]
fn a_2m_page_discarded_before_its_fill_reads_zeros() {
    let Some((a, layout, _path, file)) =
        huge_snapshot("a_2m_page_discarded_before_its_fill_reads_zeros", "discard")
    else {
        return;
    };
    let (b, loader) = restored(&layout, &file, LazyOptions::default());
    b.discard(GuestAddress(HUGE + HUGE_PAGE_SIZE), HUGE_PAGE_SIZE)
        .expect("a whole page");
    assert!(zeros(&b, HUGE + HUGE_PAGE_SIZE, HUGE_PAGE_SIZE));
    assert_eq!(stat(&loader), [0, 512, 0, 1], "zeros, not the file's data");
    // Its neighbours still hold the file's data.
    assert_eq!(
        bytes(&b, HUGE, HUGE_PAGE_SIZE),
        bytes(&a, HUGE, HUGE_PAGE_SIZE)
    );
}

#[test]
fn a_working_set_of_2m_pages_is_recorded_and_prefetched_whole() {
    let Some((a, layout, _path, file)) = huge_snapshot(
        "a_working_set_of_2m_pages_is_recorded_and_prefetched_whole",
        "working-set",
    ) else {
        return;
    };

    // Recorded: the guest touches the second huge page, then the first (one byte each).
    let (tx, rx) = mpsc::channel();
    let options = LazyOptions {
        record: Some(Recording::new(9, None, move |set| {
            tx.send(set).expect("the test waits")
        })),
        ..LazyOptions::default()
    };
    let (b, loader) = restored(&layout, &file, options);
    bytes(&b, HUGE + HUGE_PAGE_SIZE + 3 * PAGE_SIZE, 1);
    bytes(&b, HUGE + 77 * PAGE_SIZE, 1);
    assert!(loader.stop_recording());
    let set = rx.recv().expect("the list");
    // Whole huge pages, by their 4 KiB pages of the memory file (the region starts at page 256
    // of it).
    assert_eq!(set.runs, [768..1280, 256..768]);
    drop(loader);
    let set = WorkingSet::from_bytes(&set.to_bytes()).expect("reads back");
    set.check(9, &layout).expect("fits");

    // Prefetched: two copies of 512 pages, ahead of any fault.
    let (c, loader) = restored(&layout, &file, prefetching(set));
    wait_prefetched(&loader);
    assert_eq!(stat(&loader), [0, 0, 1024, 2]);
    assert_eq!(
        bytes(&c, HUGE, 2 * HUGE_PAGE_SIZE),
        bytes(&a, HUGE, 2 * HUGE_PAGE_SIZE)
    );
    assert_eq!(
        stat(&loader),
        [0, 0, 1024, 2],
        "no fault in the pages prefetched"
    );
    assert_eq!(contents(&c), contents(&a));
}

#[test]
fn a_list_page_inside_a_2m_page_prefetches_the_whole_page() {
    let Some((a, layout, _path, file)) = huge_snapshot(
        "a_list_page_inside_a_2m_page_prefetches_the_whole_page",
        "inside",
    ) else {
        return;
    };
    // A list naming single 4 KiB pages of the huge pages (as one edited or recorded elsewhere
    // might): each fills its whole huge page, once.
    let mut set = WorkingSet::new(0, &layout);
    for page in [256 + 512 + 10, 256 + 512 + 11, 256 + 3, 256 + 1024 + 511] {
        set.push(page);
    }
    let (c, loader) = restored(&layout, &file, prefetching(set));
    wait_prefetched(&loader);
    assert_eq!(stat(&loader), [0, 0, 1536, 3]);
    assert_eq!(contents(&c), contents(&a));
}

#[test]
fn a_transparent_huge_page_region_is_filled_a_2m_block_a_fault() {
    let a = manager();
    a.add_region(RegionSpec::new(GuestAddress(0), 4 * MIB).with_page_size(PageSize::Transparent))
        .expect("THP");
    let memory = a.handle().memory();
    for i in 0..1024u64 {
        memory
            .write_obj(i + 1, GuestAddress(i * PAGE_SIZE + 8))
            .expect("written");
    }
    let (layout, _path, file) = snapshot(&a, "thp");
    assert_eq!(layout.regions[0].page_size, LayoutPageSize::Transparent);
    let (b, loader) = restored(&layout, &file, LazyOptions::default());
    // A fault at 2 MiB into the region fills the 2 MiB block of host addresses around it
    // (wholly inside the 4 MiB region) with one copy.
    bytes(&b, 2 * MIB, 1);
    assert_eq!(stat(&loader), [512, 0, 0, 1]);
    // A 4 KiB page of a filled block discarded reads zeros, its neighbours their data.
    b.discard(GuestAddress(2 * MIB + 5 * PAGE_SIZE), PAGE_SIZE)
        .expect("4 KiB of a THP region");
    assert!(zeros(&b, 2 * MIB + 5 * PAGE_SIZE, PAGE_SIZE));
    assert_eq!(
        bytes(&b, 2 * MIB + 6 * PAGE_SIZE, PAGE_SIZE),
        bytes(&a, 2 * MIB + 6 * PAGE_SIZE, PAGE_SIZE)
    );
    let mut expected = contents(&a);
    let at = (2 * MIB + 5 * PAGE_SIZE) as usize;
    expected[at..at + PAGE_SIZE as usize].fill(0);
    assert_eq!(contents(&b), expected);
    // The rest of the region in at most two more blocks (the region need not start on the
    // 2 MiB grid of host addresses), plus the discarded page's zeros.
    let [copied, zeroed, _, calls] = stat(&loader);
    assert_eq!((copied, zeroed), (1024, 1));
    assert!(calls <= 3, "{calls} copies");
}
