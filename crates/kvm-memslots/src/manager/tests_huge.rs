//! Regions of 2 MiB hugetlb pages and of transparent huge pages, against the rule-enforcing fake
//! KVM: what is refused (and that a refusal changes nothing), and what the host really maps.
//!
//! The tests that map hugetlb pages need free pages in the host's pool
//! (`resources/setup-host.sh` reserves some); without them they say so loudly and return.

use vm_memory::Bytes;

use super::*;
use crate::error::ErrorKind;
use crate::region_memory::{
    hugetlb_pages_available, Backing, PageSize, RegionMemory, HUGE_PAGE_SIZE,
};
use crate::testing::{FakeKvm, Faulty};

type Manager = MemoryManager<Faulty<FakeKvm>>;

const MIB: u64 = 1 << 20;
const HUGE: u64 = HUGE_PAGE_SIZE;

fn manager() -> Manager {
    MemoryManager::new(Faulty::new(FakeKvm::new(64, true)))
}

fn huge(gpa: u64, size: u64) -> RegionSpec {
    RegionSpec::new(GuestAddress(gpa), size).with_page_size(PageSize::Huge2M)
}

/// Whether the pool has `pages` free pages; if not, a loud line saying the test did not run.
fn pool_has(test: &str, pages: u64) -> bool {
    let available = hugetlb_pages_available();
    if available < pages {
        eprintln!(
            "SKIPPED kvm-memslots::{test}: the hugetlb pool has {available} free 2 MiB pages, \
             the test needs {pages} (resources/setup-host.sh reserves a pool)"
        );
        return false;
    }
    true
}

/// Asserts that `err` refuses a value off the 2 MiB grid.
fn assert_off_the_grid(err: &Error) {
    assert!(
        matches!(
            err,
            Error::Unaligned {
                page_size: HUGE,
                ..
            }
        ),
        "{err:?}"
    );
}

/// The page size the kernel backs the mapping at `hva` with (`KernelPageSize` in smaps), in KiB.
fn kernel_page_kib(hva: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) =
                    (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
                {
                    inside = (start..end).contains(&hva);
                    continue;
                }
            }
        }
        if inside {
            if let Some(kib) = line.strip_prefix("KernelPageSize:") {
                return kib
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .expect("a size");
            }
        }
    }
    panic!("no mapping at {hva:#x} in /proc/self/smaps")
}

#[test]
fn a_huge_page_region_must_be_aligned_to_its_pages_and_a_refusal_changes_nothing() {
    let m = manager();
    m.add_region(RegionSpec::new(GuestAddress(0), MIB))
        .expect("a 4 KiB region");
    let regions = m.regions();
    let calls = m.kvm().inner().set_calls();
    let cases = [
        (huge(3 * MIB, 4 * MIB), "guest address", 3 * MIB),
        (huge(4 * MIB, 3 * MIB), "size", 3 * MIB),
        (huge(4 * MIB, 8 * MIB).with_slot_size(MIB), "slot size", MIB),
    ];
    for (spec, what, value) in cases {
        let err = m.add_region(spec).expect_err("refused");
        assert!(
            matches!(err, Error::Unaligned { what: w, value: v, page_size: HUGE } if w == what && v == value),
            "{err:?}"
        );
        assert!(err.to_string().contains("(0x200000)"), "{err}");
        assert_eq!(err.kind(), ErrorKind::Invalid);
    }
    let err = m
        .add_region(huge(4 * MIB, 8 * MIB).with_slot_ranges(vec![0..HUGE, 3 * MIB..8 * MIB]))
        .expect_err("a slot edge inside a huge page");
    assert!(
        err.to_string()
            .contains("is not aligned to the region's 2 MiB pages"),
        "{err}"
    );
    assert_eq!(m.regions(), regions, "nothing was added");
    assert_eq!(m.kvm().inner().set_calls(), calls, "KVM was asked nothing");
    // The same range in base pages is fine: the rule is the page size's.
    m.add_region(RegionSpec::new(GuestAddress(3 * MIB), 3 * MIB))
        .expect("4 KiB pages take any page-aligned range");
}

#[test]
fn transparent_huge_pages_are_refused_for_a_private_file_or_a_shared_one_off_tmpfs() {
    let m = manager();
    let file = tempfile_of(4 * MIB);
    let spec = RegionSpec::new(GuestAddress(0), 4 * MIB)
        .with_backing(Backing::PrivateFile(vm_memory::FileOffset::new(file, 0)))
        .with_page_size(PageSize::Transparent);
    let err = m.add_region(spec).expect_err("refused");
    assert!(
        matches!(
            err,
            Error::PageSizeBacking {
                page_size: "thp",
                backing: "private file"
            }
        ),
        "{err:?}"
    );
    assert!(m.regions().is_empty());
    // 2 MiB pages from a file that is not on hugetlbfs: the mapping refuses, naming why.
    let spec = RegionSpec::new(GuestAddress(0), 4 * MIB)
        .with_backing(Backing::File(vm_memory::FileOffset::new(
            tempfile_of(4 * MIB),
            0,
        )))
        .with_page_size(PageSize::Huge2M);
    let err = m.add_region(spec).expect_err("refused");
    assert!(
        err.to_string().contains("not on a hugetlbfs mount"),
        "{err}"
    );
    assert!(m.regions().is_empty());
    // Shared, a file takes transparent huge pages on tmpfs only (a memfd handed over).
    let spec = RegionSpec::new(GuestAddress(0), 4 * MIB)
        .with_backing(Backing::File(vm_memory::FileOffset::new(
            tempfile_of(4 * MIB),
            0,
        )))
        .with_page_size(PageSize::Transparent);
    let err = m.add_region(spec).expect_err("refused");
    assert!(err.to_string().contains("not on tmpfs"), "{err}");
    assert!(m.regions().is_empty());
    let memfd = RegionMemory::new(4 * MIB, &Backing::Memfd, PageSize::Base).expect("a memfd");
    let fo = memfd.file_offset().expect("a memfd").clone();
    let spec = RegionSpec::new(GuestAddress(0), 4 * MIB)
        .with_backing(Backing::File(fo))
        .with_page_size(PageSize::Transparent);
    m.add_region(spec).expect("a memfd handed over keeps THP");
    assert_eq!(m.regions()[0].page_size, PageSize::Transparent);
}

#[test]
fn clones_of_a_hugetlb_template_share_its_pages_until_they_write() {
    let test = "clones_of_a_hugetlb_template_share_its_pages_until_they_write";
    // The template's page, and one reserved for each clone's private copy.
    if !pool_has(test, 3) {
        return;
    }
    // A memfd of hugetlb pages lives on the kernel's own hugetlbfs mount.
    let template = RegionMemory::new(HUGE, &Backing::Memfd, PageSize::Huge2M).expect("template");
    let fo = template.file_offset().expect("a memfd").clone();
    // Its data, written through a shared mapping of the file in another manager.
    let writer = manager();
    writer
        .add_region(huge(0, HUGE).with_backing(Backing::File(fo.clone())))
        .expect("the template shared");
    writer
        .current()
        .write_obj(7u8, GuestAddress(4096))
        .expect("the template's data");
    let m = manager();
    let clones: Vec<RegionId> = (0..2)
        .map(|i| {
            m.add_region(huge(i * 4 * MIB, HUGE).with_backing(Backing::PrivateFile(fo.clone())))
                .expect("a clone")
        })
        .collect();
    let mem = m.current();
    mem.write_obj(9u8, GuestAddress(4096))
        .expect("the first clone writes");
    let first: u8 = mem.read_obj(GuestAddress(4096)).expect("read");
    let second: u8 = mem.read_obj(GuestAddress(4 * MIB + 4096)).expect("read");
    let mut original = [0u8; 1];
    template.read_volatile(4096, &mut original).expect("read");
    assert_eq!((first, second, original[0]), (9, 7, 7));
    // A discard of a clone's page gives zeros, not the template's page back.
    m.discard_region(clones[0], 0..HUGE)
        .expect("discard a whole page");
    let first: u8 = mem.read_obj(GuestAddress(4096)).expect("read");
    assert_eq!(first, 0);
}

#[test]
fn a_region_the_pool_cannot_hold_is_refused_before_anything_is_mapped() {
    let m = manager();
    // More than the pool could hold whatever other tests hold meanwhile.
    let pages = hugetlb_pages_available() + 1000;
    let err = m
        .add_regions([
            RegionSpec::new(GuestAddress(0), 2 * MIB),
            huge(HUGE, pages * HUGE),
        ])
        .expect_err("refused");
    match err {
        Error::HugetlbPool { needed, available } => {
            assert_eq!(needed, pages);
            assert!(available < needed);
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("free 2 MiB pages"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(m.regions().is_empty(), "the batch is all or nothing");
    assert_eq!(m.kvm().inner().set_calls(), 0, "KVM was asked nothing");
}

#[test]
fn huge_pages_back_the_region_and_discards_take_whole_pages_only() {
    if !pool_has(
        "huge_pages_back_the_region_and_discards_take_whole_pages_only",
        4,
    ) {
        return;
    }
    for backing in [Backing::Anonymous, Backing::Memfd] {
        let m = manager();
        let id = m
            .add_region(huge(4 * MIB, 2 * HUGE).with_backing(backing.clone()))
            .expect("a region of 2 MiB pages");
        let info = m.region(id).expect("the region");
        assert_eq!(info.page_size, PageSize::Huge2M);
        let mem = m.current();
        for page in 0..2 {
            mem.write_obj(
                0xabu8 + page as u8,
                GuestAddress(4 * MIB + page * HUGE + 4096),
            )
            .expect("write");
        }
        assert_eq!(
            kernel_page_kib(info.hva.0),
            2048,
            "{} memory of hugetlb pages",
            backing.kind()
        );
        // Half a page, or a range that ends inside one, is refused and changes nothing.
        for (gpa, len) in [
            (4 * MIB, MIB),
            (4 * MIB + MIB, HUGE),
            (4 * MIB, HUGE + 4096),
        ] {
            let err = m
                .discard(GuestAddress(gpa), len)
                .expect_err("a partial page");
            assert_off_the_grid(&err);
            let err = m
                .discard_region(id, gpa - 4 * MIB..gpa - 4 * MIB + len)
                .expect_err("a partial page");
            assert_off_the_grid(&err);
        }
        for page in 0..2 {
            let byte: u8 = mem
                .read_obj(GuestAddress(4 * MIB + page * HUGE + 4096))
                .expect("read");
            assert_eq!(byte, 0xab + page as u8, "a refused discard freed nothing");
        }
        // A whole page: it reads back as zeros, its neighbour keeps its data.
        m.discard(GuestAddress(4 * MIB), HUGE)
            .expect("a whole page");
        let gone: u8 = mem.read_obj(GuestAddress(4 * MIB + 4096)).expect("read");
        let kept: u8 = mem
            .read_obj(GuestAddress(4 * MIB + HUGE + 4096))
            .expect("read");
        assert_eq!((gone, kept), (0, 0xac));
        // Moves and re-slots keep to the pages too.
        let err = m
            .move_region(id, GuestAddress(64 * MIB + MIB))
            .expect_err("a move off the 2 MiB grid");
        assert_off_the_grid(&err);
        let err = m
            .reslot(Reslot {
                region: id,
                range: 0..2 * HUGE,
                slots: vec![0..MIB, MIB..2 * HUGE],
            })
            .expect_err("a slot edge inside a page");
        assert!(matches!(err, Error::SlotLayout { .. }), "{err:?}");
        m.reslot(Reslot {
            region: id,
            range: 0..2 * HUGE,
            slots: vec![0..HUGE, HUGE..2 * HUGE],
        })
        .expect("a split on the page boundary");
        m.move_region(id, GuestAddress(64 * MIB))
            .expect("a move on the grid");
        let kept: u8 = m
            .current()
            .read_obj(GuestAddress(64 * MIB + HUGE + 4096))
            .expect("read");
        assert_eq!(kept, 0xac);
    }
}

#[test]
fn transparent_huge_pages_take_any_page_aligned_range() {
    let m = manager();
    let id = m
        .add_region(
            RegionSpec::new(GuestAddress(4096), 3 * MIB).with_page_size(PageSize::Transparent),
        )
        .expect("THP accepts what 4 KiB pages accept");
    assert_eq!(
        m.region(id).expect("region").page_size,
        PageSize::Transparent
    );
    m.discard(GuestAddress(8192), 4096)
        .expect("a discard of one base page");
}

/// A file of `size` bytes in the temporary folder, already unlinked.
fn tempfile_of(size: u64) -> std::fs::File {
    let path =
        std::env::temp_dir().join(format!("kvm-memslots-huge-{}-{}", std::process::id(), size));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("a temporary file");
    std::fs::remove_file(&path).expect("unlink it");
    file.set_len(size).expect("size it");
    file
}
