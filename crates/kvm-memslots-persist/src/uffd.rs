//! Lazy restore with userfaultfd: a snapshot's regions are fresh anonymous memory registered
//! for missing-page faults, and a handler thread fills each page the first time anything
//! touches it (a vCPU through KVM, or the VMM), from the memory file (`UFFDIO_COPY`) or, for a
//! hole, with zeros (`UFFDIO_ZEROPAGE`). Nothing is read up front, not even where the holes
//! are: a first fill asks the file with one `SEEK_DATA` (a scan of a memory file with 65536
//! runs of data took about 95 ms, all of it before the guest's first instruction). A file cut
//! under the loader fails it (the page is past the file's end), it is not taken for a hole.
//!
//! A discarded page reads zeros afterwards, as a discard promises, whether the handler had
//! filled it or not: the loader asks for `UFFD_FEATURE_EVENT_REMOVE`, so a discard of
//! registered memory (`MADV_DONTNEED`, `MADV_REMOVE`) first tells the handler its range, which
//! the handler then treats as filled (and a page filled once that faults again is one that was
//! discarded since). The discard waits until the handler has read the event, and the handler
//! serves events in order, so no fault after the discard is served before it. libc has only
//! the system call's number, so the ioctl structures are declared here from the kernel's
//! `include/uapi/linux/userfaultfd.h`.
//!
//! **Snapshots of a lazy restore.** A page the handler has not filled yet has no page table
//! entry, so `/proc/self/pagemap` says nothing of it, yet the VM reads the file's data there.
//! While a loader lives, its regions and what it has filled are listed for this process's
//! snapshots and migrations: [`data_runs`](crate::data_runs) (and so a full memory file and a
//! stream's first round) adds the pages the loader still owes that are data in the file, and
//! reading them through the mapping fills them; a memfd handed over
//! ([`shared_files`](crate::stream::shared_files)) is filled first. A page is marked filled
//! only once its fill is done, so one being filled counts as owed.
//!
//! **Page sizes.** A fault fills a *block* around the faulting address, and the loader marks
//! what it filled in *units*:
//! - 4 KiB pages: one page, one `UFFDIO_COPY` (or `UFFDIO_ZEROPAGE` for a hole) a fault.
//! - 2 MiB hugetlb pages: the whole huge page. The kernel fills and discards a hugetlb mapping
//!   only in whole pages (`UFFDIO_COPY` of a huge-page-aligned, huge-page-sized range; no
//!   `UFFDIO_ZEROPAGE`), so the block and the unit are the 2 MiB page: one `pread` of its 2 MiB
//!   of the memory file (holes read as zeros; the region's place in the file need not be on
//!   the 2 MiB grid), one copy. A page that is all hole, or discarded since its fill, is a
//!   copy from a buffer of zeros. A 512 MiB guest touched whole costs 256 copies instead of
//!   131,072.
//! - Transparent huge pages: the 2 MiB block of host addresses around the fault (clipped to
//!   the region), in runs of its 4 KiB pages not filled yet, marked at 4 KiB. Filled at 2 MiB
//!   rather than 4 KiB because a guest that touches one page of a block will touch others (a
//!   THP region is asked for to be backed 2 MiB at a time), so 512 faults become one; and
//!   because khugepaged does not collapse a range of a userfaultfd-registered mapping that has
//!   a page missing or mapping the zero page, so filled 4 KiB at a time the region would stay
//!   in 4 KiB pages. A block with any data is read whole and copied (its holes as real zero
//!   pages); a block all hole maps the zero page. Marks stay at 4 KiB because a THP region
//!   may discard single 4 KiB pages.
//!
//! Whatever the page size, the working set and the stats ([`LoaderStats`]) count 4 KiB pages
//! of the memory file: a recorded first touch in a 2 MiB hugetlb page (or a THP block) is the
//! block's pages not filled before, and a prefetch of a list that names any 4 KiB page of a
//! hugetlb page fills the whole page.
//!
//! **Regions removed** from the manager while the loader lives are unmapped as without it: the
//! loader does not hold their mappings, the kernel ends a registration with its mapping, and
//! the loader forgets a region whose mapping is gone (its pages are owed no more, and are not
//! prefetched).
//!
//! **Working sets** ([`LazyOptions`]): the handler sees every first touch, so it can record
//! the pages in that order ([`Recording`]) until told to stop, for a set time, or until the
//! loader ends, and hand the list ([`WorkingSet`]) over. Given such a list, it fills those
//! pages ahead of the guest, in the list's order, a window of up to 256 pages at a time (one
//! block where that is larger: a 2 MiB page) (one `pread` of the window, one `UFFDIO_COPY` per
//! run of units in it, 64 copies at most), and looks for faults between windows: a fault is
//! served first, so a page the guest needs before the prefetch reaches it waits for one window
//! at most (64 copies, or one 2 MiB copy). Prefetching in the handler's own thread keeps a
//! discard exact: the handler marks a discarded range as soon as it reads the event, before it
//! fills anything else, and skips marked pages; a copy the kernel refuses while a discard is
//! under way (`EAGAIN`) is tried again after the handler has read it. A page filled twice (a
//! fault on a page the prefetch filled meanwhile, `EEXIST`) keeps its first fill, and the
//! faulting thread is woken.
//!
//! # Example
//!
//! A snapshot restored lazily: nothing is read until the first touch (here the VMM's own read;
//! a vCPU's access through KVM faults the same way). Needs userfaultfd (Linux 4.3+, and root or
//! `vm.unprivileged_userfaultfd`).
//!
//! ```
//! use kvm_memslots::testing::FakeKvm;
//! use kvm_memslots::{MemoryManager, RegionSpec};
//! use kvm_memslots_persist::{write_memory_file, LazyLoader, MemoryLayout};
//! use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
//!
//! let vm = MemoryManager::new(FakeKvm::new(64, true));
//! vm.add_region(RegionSpec::new(GuestAddress(0), 2 << 20))?;
//! vm.handle().memory().write_obj(7u64, GuestAddress(0x1000))?;
//! let layout = MemoryLayout::of(&vm);
//! # let path = std::env::temp_dir().join(format!("kvm-memslots-persist-uffd-doc-{}", std::process::id()));
//! # let memory_file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
//! # std::fs::remove_file(&path)?;
//! write_memory_file(&vm, &layout, &memory_file)?;
//!
//! let restored = MemoryManager::new(FakeKvm::new(64, true));
//! layout.build(&restored)?;
//! let loader = LazyLoader::start(&restored, &layout, &memory_file)?;
//! assert_eq!(restored.handle().memory().read_obj::<u64>(GuestAddress(0x1000))?, 7);
//! drop(loader);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::ioctl_with_mut_ref;

use kvm_memslots::{KvmMemory, MemoryManager, PageSize, RegionMemory, HUGE_PAGE_SIZE, PAGE_SIZE};

use crate::error::SnapshotError;
use crate::layout::{LayoutBacking, LayoutPageSize, MemoryLayout};
use crate::sparse::{file_data_runs, range_has_data};
use crate::working_set::WorkingSet;

const UFFDIO: u32 = 0xAA;
const UFFD_API: u64 = 0xAA;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

/// The ioctl numbers (the macros make public functions: kept in a private module).
mod nr {
    use super::{UffdioApi, UffdioCopy, UffdioRange, UffdioRegister, UffdioZeropage, UFFDIO};
    use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

    ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, UffdioApi);
    ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, UffdioRegister);
    ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, UffdioRange);
    ioctl_ior_nr!(UFFDIO_WAKE, UFFDIO, 0x02, UffdioRange);
    ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
    ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);
}
use nr::{
    UFFDIO_API, UFFDIO_COPY, UFFDIO_REGISTER, UFFDIO_UNREGISTER, UFFDIO_WAKE, UFFDIO_ZEROPAGE,
};

/// One registered region: where its mapping was, its place in the file, and the pages filled
/// so far (a later fault there follows a discard: zeros). A page is marked filled once its fill
/// is done (or once it was discarded), never before: a page not marked holds the file's data or
/// is being filled with it, which is what a snapshot asks ([`owed_runs`]).
///
/// The mapping is not held: the manager owns it, and a region it removes is unmapped as its
/// last reference goes, as without a loader. The kernel ends the registration with the mapping
/// (a userfaultfd registration belongs to the mapping), so nothing faults there any more; the
/// loader sees the region gone when [`mapping`](Self::mapping) finds nothing, and never takes
/// another mapping later made at the same address for it. A snapshot's scan and the loader's
/// unregistering hold the mapping meanwhile; the handler does not (it would keep the memory
/// mapped after a fill woke the thread that then removes the region): a fill of a region gone
/// fails in the kernel, which only fills what is registered with this loader.
struct Lazy {
    memory: Weak<RegionMemory>,
    base: u64,
    size: u64,
    file_offset: u64,
    /// Bytes a mark in `filled` stands for: the region's pages where the kernel fills and
    /// discards only whole ones (2 MiB for hugetlb), 4 KiB otherwise.
    unit: u64,
    /// Bytes a fault fills at most: the block of this size (on its alignment in the host's
    /// address space, clipped to the region) around the faulting address. 2 MiB for huge
    /// pages (hugetlb or transparent), 4 KiB otherwise.
    block: u64,
    /// Its pages are hugetlb pages, which `UFFDIO_ZEROPAGE` does not fill: zeros are copied.
    hugetlb: bool,
    /// One bit a unit.
    filled: Vec<AtomicU64>,
}

impl Lazy {
    fn holds(&self, hva: u64) -> bool {
        hva >= self.base && hva - self.base < self.size
    }

    /// The region's mapping, held; `None` once the manager removed the region (unmapped, or
    /// being unmapped).
    fn mapping(&self) -> Option<Arc<RegionMemory>> {
        self.memory.upgrade()
    }

    /// Whether the manager removed the region.
    fn gone(&self) -> bool {
        self.memory.strong_count() == 0
    }

    /// Marks unit `unit` (of [`unit`](Self::unit) bytes) filled; whether it was filled
    /// before.
    fn fill(&self, unit: u64) -> bool {
        let bit = 1 << (unit % 64);
        self.filled[(unit / 64) as usize].fetch_or(bit, Ordering::AcqRel) & bit != 0
    }

    /// Whether unit `unit` is filled.
    fn is_filled(&self, unit: u64) -> bool {
        self.filled[(unit / 64) as usize].load(Ordering::Acquire) & (1 << (unit % 64)) != 0
    }

    /// Whether the 4 KiB page `page` of the region is filled (its unit is).
    fn page_filled(&self, page: u64) -> bool {
        self.is_filled(page * PAGE_SIZE / self.unit)
    }

    /// Marks the units of host range `[start, end)` (clipped to the region) filled: they were
    /// discarded, so they read zeros from now on.
    fn discarded(&self, start: u64, end: u64) {
        let base = self.base;
        let first = start.max(base) - base;
        let last = end.min(base + self.size).saturating_sub(base);
        for unit in first / self.unit..last.div_ceil(self.unit) {
            self.fill(unit);
        }
    }

    /// The block a fault at `hva` fills, as offsets in the region.
    fn block_of(&self, hva: u64) -> Range<u64> {
        let start = (hva & !(self.block - 1)).max(self.base);
        let end = ((hva & !(self.block - 1)) + self.block).min(self.base + self.size);
        start - self.base..end - self.base
    }

    /// The runs of units of `range` (offsets in the region, whole units) not filled yet, as
    /// offsets in the region.
    fn unfilled_runs(&self, range: Range<u64>) -> Vec<Range<u64>> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        for unit in range.start / self.unit..range.end / self.unit {
            if self.is_filled(unit) {
                continue;
            }
            let at = unit * self.unit;
            match runs.last_mut() {
                Some(run) if run.end == at => run.end += self.unit,
                _ => runs.push(at..at + self.unit),
            }
        }
        runs
    }

    /// The bytes a prefetch window reads and fills at most in this region: [`WINDOW`] pages,
    /// or one block where that is larger.
    fn window(&self) -> u64 {
        (WINDOW * PAGE_SIZE).max(self.block)
    }

    /// The pages of the memory file the region holds.
    fn file_pages(&self) -> Range<u64> {
        self.file_offset / PAGE_SIZE..(self.file_offset + self.size) / PAGE_SIZE
    }
}

/// The regions the live loaders of this process registered, each with the memory file it fills
/// them from. A page a loader has not filled yet has no page table entry, so
/// `/proc/self/pagemap` says nothing of it, yet it holds the file's data: a snapshot or a
/// migration of the memory asks here ([`owed_runs`]) which pages those are. Kept here rather
/// than passed by the caller so that every writer of memory files and streams (and any VMM's)
/// is right without knowing the memory was restored lazily, as it is for swapped pages. By
/// host address (the regions' mappings never overlap), so that a layout of thousands of
/// regions asks in O(log n) a region.
static OWED: Mutex<BTreeMap<u64, Owed>> = Mutex::new(BTreeMap::new());

/// A region under a loader, as [`OWED`] holds it.
struct Owed {
    lazy: Arc<Lazy>,
    file: Arc<File>,
    /// Its loader's: whether the handler stopped at an error.
    stats: Arc<LoaderStats>,
}

/// The byte ranges of `memory` (offsets in it, whole pages) that a live [`LazyLoader`] of this
/// process still owes: pages it has not filled yet (nor seen discarded) that are data in the
/// memory file it restores from. Empty for memory no loader serves. Touching such a page fills
/// it (the loader serves the fault), so reading guest memory there reads the file's data.
pub(crate) fn owed_runs(memory: &RegionMemory) -> Result<Vec<Range<u64>>, SnapshotError> {
    let (base, size) = (memory.host_address(), memory.size());
    // The loaders' regions that overlap `memory`: those starting before its end, back to the
    // first that ends before its start. Cloned out of the lock: the scan below seeks in files.
    // A region its manager removed is no longer the loader's (another mapping may lie there
    // now): its entry goes. One still mapped is held until the scan is done.
    let mut table = OWED.lock().unwrap_or_else(PoisonError::into_inner);
    let mut gone = Vec::new();
    // (region, its mapping held, its file, whether its loader failed)
    type Scan = (Arc<Lazy>, Arc<RegionMemory>, Arc<File>, bool);
    let mut owed: Vec<Scan> = Vec::new();
    for (start, o) in table
        .range(..base + size)
        .rev()
        .take_while(|(start, o)| *start + o.lazy.size > base)
    {
        let Some(mapping) = o.lazy.mapping() else {
            gone.push(*start);
            continue;
        };
        let failed = o.stats.failed.load(Ordering::Acquire);
        owed.push((Arc::clone(&o.lazy), mapping, Arc::clone(&o.file), failed));
    }
    for start in gone {
        table.remove(&start);
    }
    drop(table);
    let mut runs: Vec<Range<u64>> = Vec::new();
    for (lazy, _mapping, file, failed) in owed {
        let lazy_base = lazy.base;
        // The part of the loader's region that `memory` covers, as offsets in the region.
        let from = base.max(lazy_base) - lazy_base;
        let to = (base + size).min(lazy_base + lazy.size) - lazy_base;
        // Nothing fills its pages any more: a read of one not filled would wait for ever, and
        // which of them hold data the file (cut, say) may no longer tell.
        let unfilled = (from / PAGE_SIZE..to.div_ceil(PAGE_SIZE))
            .filter(|p| !lazy.page_filled(*p))
            .count();
        if failed && unfilled > 0 {
            return Err(SnapshotError::Format(format!(
                "the lazy restore's fault handler stopped at an error: {unfilled} pages at host \
                 {lazy_base:#x} it had not filled cannot be read"
            )));
        }
        let len = file
            .metadata()
            .map_err(crate::error::io(
                "reading the size of a lazy restore's memory file",
            ))?
            .len();
        let within = (lazy.file_offset + from).min(len)..(lazy.file_offset + to).min(len);
        for data in file_data_runs(&file, within)? {
            let first = (data.start.max(lazy.file_offset + from) - lazy.file_offset) / PAGE_SIZE;
            let last = (data.end.min(lazy.file_offset + to) - lazy.file_offset).div_ceil(PAGE_SIZE);
            for page in (first..last).filter(|p| !lazy.page_filled(*p)) {
                // As an offset in `memory`.
                let at = lazy_base + page * PAGE_SIZE - base;
                match runs.last_mut() {
                    Some(run) if run.end == at => run.end += PAGE_SIZE,
                    _ => runs.push(at..at + PAGE_SIZE),
                }
            }
        }
    }
    Ok(runs)
}

/// Fills every page of `memory` a live loader still owes ([`owed_runs`]) by touching it, so
/// that the memory itself holds them: for memory handed to another process (a memfd), whose
/// pages the loader could not fill there.
pub(crate) fn fill_owed(memory: &RegionMemory) -> Result<(), SnapshotError> {
    let mut byte = [0u8; 1];
    for run in owed_runs(memory)? {
        for at in run.step_by(PAGE_SIZE as usize) {
            memory
                .read_volatile(at, &mut byte)
                .map_err(|e| SnapshotError::Format(format!("filling a lazy page: {e}")))?;
        }
    }
    Ok(())
}

/// What a lazy restore does besides filling pages on fault ([`LazyLoader::start_with`]).
#[derive(Debug, Default)]
pub struct LazyOptions {
    /// Pages to fill ahead of the guest, in the list's order, while faults are still served
    /// first: a list recorded on a restore of the same snapshot ([`WorkingSet::check`] it
    /// against the snapshot; the loader refuses one that does not fit the layout).
    pub prefetch: Option<WorkingSet>,
    /// Record the pages first touched.
    pub record: Option<Recording>,
}

/// A recording of the pages a lazily restored VM touches first, in that order: the first
/// fills of faults (a vCPU's through KVM, or the VMM's own accesses), not the pages a prefetch
/// filled.
pub struct Recording {
    snapshot: u128,
    until: Option<Duration>,
    done: Box<dyn FnOnce(WorkingSet) + Send>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("snapshot", &self.snapshot)
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}

impl Recording {
    /// Records until [`LazyLoader::stop_recording`], until the loader is dropped, or (given
    /// `until`) for that long after the loader starts, whichever comes first; then hands the
    /// list, of snapshot `snapshot` ([`WorkingSet::snapshot`]), to `done`, once. `done` runs
    /// on the thread that ends the recording (the handler's, for a set time): keep it short.
    pub fn new(
        snapshot: u128,
        until: Option<Duration>,
        done: impl FnOnce(WorkingSet) + Send + 'static,
    ) -> Self {
        Recording {
            snapshot,
            until,
            done: Box::new(done),
        }
    }
}

/// A recording under way: the list so far and where it goes.
struct Recorder {
    set: WorkingSet,
    done: Box<dyn FnOnce(WorkingSet) + Send>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("pages", &self.set.pages())
            .finish_non_exhaustive()
    }
}

/// Where a loader's recording is kept, shared by the handler and the loader.
type RecorderSlot = Arc<Mutex<Option<Recorder>>>;

/// Ends the recording in `slot`, if one is under way: hands its list over (outside the lock).
/// Whether there was one.
fn finish_recording(slot: &Mutex<Option<Recorder>>) -> bool {
    let recorder = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    match recorder {
        Some(recorder) => {
            (recorder.done)(recorder.set);
            true
        }
        None => false,
    }
}

/// The handler of a lazily restored manager's page faults; stops (and unregisters the
/// memory) when dropped. Keep it as long as the VM runs.
#[derive(Debug)]
pub struct LazyLoader {
    uffd: Arc<OwnedFd>,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<LoaderStats>,
    recording: RecorderSlot,
    /// Its regions (registered), as [`OWED`] lists them until it is dropped.
    lazies: Vec<Arc<Lazy>>,
}

impl std::fmt::Debug for Lazy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lazy")
            .field("host_address", &format_args!("{:#x}", self.base))
            .field("size", &format_args!("{:#x}", self.size))
            .field("file_offset", &self.file_offset)
            .field("mapped", &(self.memory.strong_count() > 0))
            .finish_non_exhaustive()
    }
}

/// What the handler did. Pages are counted in 4 KiB pages whatever the regions' page size (a
/// 2 MiB page filled counts 512).
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Pages filled from the file on fault (counted before the faulting thread is woken; a
    /// fault fills its whole block, see the module's docs).
    pub copied: AtomicU64,
    /// Pages filled with zeros (holes, or pages discarded after their first fill).
    pub zeroed: AtomicU64,
    /// Pages of a working set filled ahead of the guest.
    pub prefetched: AtomicU64,
    /// `UFFDIO_COPY` calls made, for faults and prefetch (zeros copied into hugetlb pages
    /// included): what a restore pays per call, beside what it pays per byte.
    pub copy_calls: AtomicU64,
    /// Set once the prefetch has gone through its whole list (or stopped at an error).
    pub prefetch_done: AtomicBool,
    /// Set when the handler met an error it could not serve a fault past (it stops; the
    /// faulting thread then waits for ever, so this is also printed).
    pub failed: AtomicBool,
}

/// Says why the handler could not fill the page at `hva`; false (the handler stops, and the
/// loader reports it failed).
fn fill_failed(hva: u64, e: std::io::Error) -> bool {
    eprintln!("kvm-memslots-persist: the userfaultfd handler could not fill {hva:#x}: {e}");
    false
}

/// A new userfaultfd (close-on-exec, non-blocking) that has agreed to the API with `features`,
/// and the features the kernel offers.
fn new_uffd(features: u64) -> Result<(OwnedFd, u64), SnapshotError> {
    // SAFETY: userfaultfd(2) takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(os_error("userfaultfd"));
    }
    // SAFETY: `fd` is a new descriptor this function owns from here on.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ..Default::default()
    };
    // SAFETY: UFFDIO_API on a userfaultfd with a valid `uffdio_api`, which outlives the call;
    // the kernel writes the features it offers back into it.
    if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_API(), &mut api) } < 0 {
        return Err(os_error("UFFDIO_API"));
    }
    Ok((uffd, api.features))
}

fn os_error(what: &str) -> SnapshotError {
    SnapshotError::Io {
        what: what.into(),
        source: std::io::Error::last_os_error(),
    }
}

impl LazyLoader {
    /// Registers every region of `layout` in `memory` (built with [`MemoryLayout::build`]:
    /// anonymous or memfd) for missing-page faults and starts the handler that fills them from
    /// `memory_file`.
    pub fn start<K: KvmMemory>(
        memory: &MemoryManager<K>,
        layout: &MemoryLayout,
        memory_file: &File,
    ) -> Result<Self, SnapshotError> {
        Self::start_with(memory, layout, memory_file, LazyOptions::default())
    }

    /// Refuses, naming the region, a layout this host's userfaultfd cannot fill: a region of
    /// 2 MiB hugetlb pages where the kernel takes no missing-page faults on hugetlbfs
    /// (`UFFD_FEATURE_MISSING_HUGETLBFS`), or a shared region (a memfd) where it takes none on
    /// shared memory (`UFFD_FEATURE_MISSING_SHMEM`). Every page size is filled otherwise
    /// (hugetlb pages whole, see the module's docs). [`start`] checks it first; a caller checks
    /// it before it builds the layout's regions, so that nothing is mapped for a restore that
    /// cannot go on.
    ///
    /// [`start`]: Self::start
    pub fn check_layout(layout: &MemoryLayout) -> Result<(), SnapshotError> {
        let needs = |r: &crate::layout::RegionLayout| match (r.page_size, r.backing) {
            (LayoutPageSize::Huge2M, _) => Some((
                UFFD_FEATURE_MISSING_HUGETLBFS,
                "2 MiB hugetlb pages, which this kernel's userfaultfd does not fill",
            )),
            (_, LayoutBacking::Shared) => Some((
                UFFD_FEATURE_MISSING_SHMEM,
                "shared memory (a memfd), which this kernel's userfaultfd does not fill",
            )),
            _ => None,
        };
        if layout.regions.iter().all(|r| needs(r).is_none()) {
            return Ok(());
        }
        let (_uffd, features) = new_uffd(0)?;
        match layout.regions.iter().find_map(|r| {
            needs(r)
                .filter(|(bit, _)| features & bit == 0)
                .map(|n| (r, n))
        }) {
            Some((r, (_, why))) => Err(SnapshotError::Unsupported(format!(
                "a lazy restore of region {} is not possible: it has {why}; restore it by copy, \
                 or with another page size (MemoryLayout::with_page_size)",
                r.id
            ))),
            None => Ok(()),
        }
    }

    /// As [`start`](Self::start), and the handler also prefetches `options.prefetch` and
    /// records the pages first touched for `options.record`. A list that does not fit `layout`
    /// ([`WorkingSet::check_layout`]) is refused before anything is registered.
    pub fn start_with<K: KvmMemory>(
        memory: &MemoryManager<K>,
        layout: &MemoryLayout,
        memory_file: &File,
        options: LazyOptions,
    ) -> Result<Self, SnapshotError> {
        Self::check_layout(layout)?;
        if let Some(list) = &options.prefetch {
            list.check_layout(layout)?;
        }
        // Which pages are holes is asked page by page, on first fill: a scan of the whole
        // file here (two seeks a run of data) would hold the guest's start back by as much.
        layout.check_file_size(memory_file)?;
        let regions: Vec<(Arc<RegionMemory>, u64)> = layout
            .mappings(memory)?
            .into_iter()
            .zip(layout.regions.iter().map(|r| r.file_offset))
            .collect();
        let (uffd, _) = new_uffd(UFFD_FEATURE_EVENT_REMOVE)?;
        let mut lazies = Vec::with_capacity(regions.len());
        for (region, file_offset) in regions {
            let mut register = UffdioRegister {
                range: UffdioRange {
                    start: region.host_address(),
                    len: region.size(),
                },
                mode: UFFDIO_REGISTER_MODE_MISSING,
                ioctls: 0,
            };
            // SAFETY: UFFDIO_REGISTER with a valid structure naming the region's own mapping,
            // which `region` keeps mapped; faults there now wait for this loader.
            if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_REGISTER(), &mut register) } < 0 {
                return Err(os_error("UFFDIO_REGISTER"));
            }
            let page_size = region.page_size();
            let unit = page_size.alignment();
            let block = match page_size {
                PageSize::Base => PAGE_SIZE,
                PageSize::Huge2M | PageSize::Transparent => HUGE_PAGE_SIZE,
            };
            let units = region.size() / unit;
            lazies.push(Arc::new(Lazy {
                memory: Arc::downgrade(&region),
                base: region.host_address(),
                size: region.size(),
                file_offset,
                unit,
                block,
                hugetlb: page_size == PageSize::Huge2M,
                filled: (0..units.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            }));
        }
        let uffd = Arc::new(uffd);
        let stop =
            Arc::new(
                EventFd::new(libc::EFD_NONBLOCK).map_err(|source| SnapshotError::Io {
                    what: "an eventfd for the fault handler".into(),
                    source,
                })?,
            );
        let stats = Arc::new(LoaderStats::default());
        stats
            .prefetch_done
            .store(options.prefetch.is_none(), Ordering::Release);
        let file = Arc::new(
            memory_file
                .try_clone()
                .map_err(|source| SnapshotError::Io {
                    what: "duplicating the memory file".into(),
                    source,
                })?,
        );
        let deadline = options
            .record
            .as_ref()
            .and_then(|r| r.until)
            .map(|until| Instant::now() + until);
        let recording: RecorderSlot = Arc::new(Mutex::new(options.record.map(|r| Recorder {
            set: WorkingSet::new(r.snapshot, layout),
            done: r.done,
        })));
        let window = lazies.iter().map(|l| l.window()).max().unwrap_or(0);
        let prefetch = options
            .prefetch
            .filter(|list| !list.runs.is_empty())
            .map(|list| Prefetch {
                page: list.runs[0].start,
                runs: list.runs,
                run: 0,
                buffer: vec![0u8; window as usize],
            });
        let block = lazies.iter().map(|l| l.block).max().unwrap_or(PAGE_SIZE);
        // Zeros to copy into hugetlb pages (calloc'd: untouched until copied from).
        let zeros = if lazies.iter().any(|l| l.hugetlb) {
            vec![0u8; HUGE_PAGE_SIZE as usize]
        } else {
            Vec::new()
        };
        let thread = {
            let handler = Handler {
                uffd: Arc::clone(&uffd),
                stats: Arc::clone(&stats),
                lazies: lazies.clone(),
                file: Arc::clone(&file),
                buffer: vec![0u8; block as usize],
                zeros,
                deferred: Vec::new(),
                recording: Arc::clone(&recording),
                deadline,
                prefetch,
            };
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("uffd".into())
                .spawn(move || handler.serve(&stop))
                .map_err(|source| SnapshotError::Io {
                    what: "starting the fault handler".into(),
                    source,
                })?
        };
        // From here on a snapshot of these regions asks this loader for the pages it owes.
        OWED.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(lazies.iter().map(|lazy| {
                let owed = Owed {
                    lazy: Arc::clone(lazy),
                    file: Arc::clone(&file),
                    stats: Arc::clone(&stats),
                };
                (lazy.base, owed)
            }));
        Ok(LazyLoader {
            uffd,
            stop,
            thread: Some(thread),
            stats,
            recording,
            lazies,
        })
    }

    /// What the handler did so far.
    pub fn stats(&self) -> &LoaderStats {
        &self.stats
    }

    /// Ends the recording now, if one is under way: its list goes to its `done` (on this
    /// thread). Whether one was.
    pub fn stop_recording(&self) -> bool {
        finish_recording(&self.recording)
    }
}

impl Drop for LazyLoader {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        finish_recording(&self.recording);
        // Nothing fills the pages not filled yet any more: they read zeros once unregistered.
        let mut owed = OWED.lock().unwrap_or_else(PoisonError::into_inner);
        for lazy in &self.lazies {
            let at = lazy.base;
            if owed.get(&at).is_some_and(|o| Arc::ptr_eq(&o.lazy, lazy)) {
                owed.remove(&at);
            }
        }
        drop(owed);
        // A region the manager removed was unregistered with its mapping (and another mapping
        // may lie there now): only the regions still mapped, each held meanwhile.
        for lazy in &self.lazies {
            let Some(_mapping) = lazy.mapping() else {
                continue;
            };
            let mut range = UffdioRange {
                start: lazy.base,
                len: lazy.size,
            };
            // SAFETY: UFFDIO_UNREGISTER of the range this loader registered, whose mapping
            // `_mapping` keeps mapped for the call; the memory behaves as ordinary anonymous
            // memory afterwards.
            unsafe { ioctl_with_mut_ref(self.uffd.as_ref(), UFFDIO_UNREGISTER(), &mut range) };
        }
    }
}

/// Pages a prefetch reads and fills at a time, in at most [`WINDOW_COPIES`] copies: a fault
/// waits for one window at most.
const WINDOW: u64 = 256;

/// Copies (`UFFDIO_COPY`, one per run of neighbouring pages) a prefetch window makes at most.
const WINDOW_COPIES: usize = 64;

/// A working set being prefetched: the list, where the next page is in it, and the buffer one
/// window is read into.
struct Prefetch {
    runs: Vec<Range<u64>>,
    run: usize,
    page: u64,
    buffer: Vec<u8>,
}

/// The result of one fill ioctl.
enum Filled {
    /// This many bytes from the start (all, or fewer where the next page could not be filled).
    Bytes(u64),
    /// The first page was filled already (`EEXIST`).
    Exists,
    /// The kernel asks to try again (`EAGAIN`: a discard is under way).
    Later,
    /// Another error.
    Failed(std::io::Error),
}

/// What an ioctl that returned `r` and reported `done` bytes (or a negative errno) did.
fn filled(r: i32, done: i64, len: u64) -> Filled {
    if r >= 0 {
        return Filled::Bytes(len);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        _ if done > 0 => Filled::Bytes(done as u64),
        Some(libc::EEXIST) => Filled::Exists,
        Some(libc::EAGAIN) => Filled::Later,
        _ => Filled::Failed(e),
    }
}

/// `UFFDIO_COPY` of `src` to the registered range at `dst`.
fn uffd_copy(uffd: &OwnedFd, dst: u64, src: &[u8]) -> Filled {
    let mut copy = UffdioCopy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        ..Default::default()
    };
    // SAFETY: UFFDIO_COPY from a buffer of this thread (valid for `len` bytes for the call) to
    // pages of a registered region, which the loader keeps mapped; the kernel copies and wakes
    // the threads that fault there.
    let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_COPY(), &mut copy) };
    filled(r, copy.copy, copy.len)
}

/// `UFFDIO_ZEROPAGE` of the `len` bytes (whole base pages) of a registered region at `dst`.
fn uffd_zeropage(uffd: &OwnedFd, dst: u64, len: u64) -> Filled {
    let mut zero = UffdioZeropage {
        range: UffdioRange { start: dst, len },
        ..Default::default()
    };
    // SAFETY: UFFDIO_ZEROPAGE of pages of a registered region; the kernel checks the range
    // against the registration and maps the zero page there, nothing else is written.
    let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_ZEROPAGE(), &mut zero) };
    filled(r, zero.zeropage, len)
}

/// Wakes the threads waiting on the `len` bytes at `hva` (filled by someone else meanwhile).
fn uffd_wake(uffd: &OwnedFd, hva: u64, len: u64) {
    let mut range = UffdioRange { start: hva, len };
    // SAFETY: UFFDIO_WAKE of a range of a registered region; it only wakes waiters.
    unsafe { ioctl_with_mut_ref(uffd, UFFDIO_WAKE(), &mut range) };
}

/// How [`Handler::fill_run`] ended.
enum RunEnd {
    /// Every unit of the run is filled (by it, or by someone else before).
    Done,
    /// The kernel asked to try again (`EAGAIN`: a discard is under way); the units from there
    /// on are not filled.
    Later,
    /// The region was removed meanwhile: nothing more to fill.
    Gone,
    /// It could not fill (said on stderr): the handler stops.
    Failed,
}

/// The handler thread's state.
struct Handler {
    uffd: Arc<OwnedFd>,
    stats: Arc<LoaderStats>,
    lazies: Vec<Arc<Lazy>>,
    file: Arc<File>,
    /// One block read for a fault (the largest a region's fault fills).
    buffer: Vec<u8>,
    /// Zeros for hugetlb pages (empty without hugetlb regions).
    zeros: Vec<u8>,
    /// Faulting addresses whose fill the kernel asked to try again (`EAGAIN`; recorded
    /// already).
    deferred: Vec<u64>,
    recording: RecorderSlot,
    /// When a timed recording ends (`None` once it has, or without one).
    deadline: Option<Instant>,
    prefetch: Option<Prefetch>,
}

impl Handler {
    /// Waits for faults (or the stop eventfd) and fills each faulting page once; in between,
    /// prefetches.
    fn serve(mut self, stop: &EventFd) {
        loop {
            let timeout = if !self.deferred.is_empty() {
                1
            } else if self.prefetch.is_some() {
                0
            } else if let Some(deadline) = self.deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                left.as_millis().min(i32::MAX as u128) as i32 + 1
            } else {
                -1
            };
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: poll(2) on two valid pollfds in a local array.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if ready < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if fds[1].revents != 0 {
                return;
            }
            let served = if fds[0].revents != 0 {
                self.message()
            } else {
                self.prefetch_window();
                true
            };
            // A fill the kernel deferred goes again once the handler has read on.
            let ok = served
                && std::mem::take(&mut self.deferred)
                    .into_iter()
                    .all(|hva| self.fault(hva, false));
            if !ok {
                self.stats.failed.store(true, Ordering::Release);
                return;
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.deadline = None;
                finish_recording(&self.recording);
            }
        }
    }

    /// Reads and serves one message; false if a fault could not be served.
    fn message(&mut self) -> bool {
        let mut msg = [0u8; 32];
        // SAFETY: reading one 32-byte `uffd_msg` into a local buffer of that size.
        let n = unsafe { libc::read(self.uffd.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len()) };
        if n != 32 {
            return true; // EAGAIN: another wake-up took it.
        }
        let word = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
        match msg[0] {
            UFFD_EVENT_REMOVE => {
                // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 start; u64 end; } }
                let (start, end) = (word(8), word(16));
                for lazy in &self.lazies {
                    lazy.discarded(start, end);
                }
                true
            }
            // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 flags; u64 address; } }
            UFFD_EVENT_PAGEFAULT => self.fault(word(16) & !(PAGE_SIZE - 1), true),
            _ => true,
        }
    }

    /// Fills the faulting page at `hva`: on its first fill, the units of its block not filled
    /// yet, from the file (zeros for a block that is a hole there); after a discard, its unit
    /// with zeros. Records a first fill if `record`. False if it could not.
    fn fault(&mut self, hva: u64, record: bool) -> bool {
        let Some(lazy) = self.lazies.iter().find(|l| l.holds(hva)).map(Arc::clone) else {
            return true;
        };
        let unit = (hva - lazy.base) / lazy.unit;
        // Marked filled once the fill is done (below), so that a snapshot reading the marks
        // meanwhile takes the page for one that still holds the file's data.
        if lazy.is_filled(unit) {
            // Filled before, then discarded: zeros.
            let at = unit * lazy.unit;
            return match self.fill_run(&lazy, at..at + lazy.unit, None) {
                RunEnd::Done | RunEnd::Gone => true,
                RunEnd::Later => {
                    self.deferred.push(hva);
                    true
                }
                RunEnd::Failed => false,
            };
        }
        let block = lazy.block_of(hva);
        let runs = lazy.unfilled_runs(block.start / lazy.unit * lazy.unit..block.end);
        // Recorded before the ioctl wakes the faulting thread, so that what it does next
        // (end the recording, say) comes after.
        if record {
            let first = lazy.file_offset / PAGE_SIZE;
            for run in &runs {
                self.record(first + run.start / PAGE_SIZE..first + run.end / PAGE_SIZE);
            }
        }
        let at = lazy.file_offset + block.start;
        let len = block.end - block.start;
        let data = match range_has_data(&self.file, at, len) {
            Ok(data) => data,
            Err(e) => return fill_failed(hva, e),
        };
        let mut buffer = std::mem::take(&mut self.buffer);
        let read = if data {
            // Holes inside the block read zeros.
            self.file.read_exact_at(&mut buffer[..len as usize], at)
        } else {
            Ok(())
        };
        if let Err(e) = read {
            self.buffer = buffer;
            return fill_failed(hva, e);
        }
        let mut ok = true;
        for run in runs {
            let src = data.then(|| {
                &buffer[(run.start - block.start) as usize..(run.end - block.start) as usize]
            });
            match self.fill_run(&lazy, run, src) {
                RunEnd::Done => continue,
                // The faulting thread retries its access (its page may lie in another run).
                RunEnd::Gone => uffd_wake(&self.uffd, lazy.base + unit * lazy.unit, lazy.unit),
                RunEnd::Later => {
                    // Tried again after the handler has read the discard under way (a discard
                    // of the page by then makes the fill zeros), unless this fill reached the
                    // faulting page (the rest of its block then faults on its own).
                    if !lazy.is_filled(unit) {
                        self.deferred.push(hva);
                    }
                }
                RunEnd::Failed => ok = false,
            }
            break;
        }
        self.buffer = buffer;
        ok
    }

    /// Fills `run` (offsets in `lazy`'s region, whole units) with `src` (as long), or zeros,
    /// and marks what it filled; a unit filled meanwhile is left as it is, and its waiters
    /// woken.
    fn fill_run(&self, lazy: &Lazy, run: Range<u64>, src: Option<&[u8]>) -> RunEnd {
        let mut at = run.start;
        while at < run.end {
            let dst = lazy.base + at;
            let left = run.end - at;
            let (result, count) = match src {
                Some(src) => {
                    let from = &src[(at - run.start) as usize..];
                    self.stats
                        .copied
                        .fetch_add(left / PAGE_SIZE, Ordering::AcqRel);
                    self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                    (uffd_copy(&self.uffd, dst, from), &self.stats.copied)
                }
                None if lazy.hugetlb => {
                    // hugetlb pages take no UFFDIO_ZEROPAGE: zeros are copied, a page at a time.
                    let len = left.min(self.zeros.len() as u64);
                    self.stats
                        .zeroed
                        .fetch_add(len / PAGE_SIZE, Ordering::AcqRel);
                    self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                    let zeros = &self.zeros[..len as usize];
                    (uffd_copy(&self.uffd, dst, zeros), &self.stats.zeroed)
                }
                None => {
                    self.stats
                        .zeroed
                        .fetch_add(left / PAGE_SIZE, Ordering::AcqRel);
                    (uffd_zeropage(&self.uffd, dst, left), &self.stats.zeroed)
                }
            };
            // Counted before the ioctl wakes the faulting thread, so that it sees the count;
            // what was not filled is taken back.
            let asked = match src {
                None if lazy.hugetlb => left.min(self.zeros.len() as u64),
                _ => left,
            };
            let done = match result {
                Filled::Bytes(bytes) => bytes,
                _ => 0,
            };
            count.fetch_sub((asked - done) / PAGE_SIZE, Ordering::AcqRel);
            match result {
                Filled::Bytes(bytes) => {
                    for unit in at / lazy.unit..(at + bytes) / lazy.unit {
                        lazy.fill(unit);
                    }
                    at += bytes;
                }
                // Filled meanwhile (another fault, or the prefetch): the waiters are woken.
                Filled::Exists => {
                    lazy.fill(at / lazy.unit);
                    uffd_wake(&self.uffd, dst, lazy.unit);
                    at += lazy.unit;
                }
                Filled::Later => return RunEnd::Later,
                // The region was removed (and so unregistered) after the fault was queued:
                // there is nothing to fill; a thread still waiting there retries its access.
                Filled::Failed(_) if lazy.gone() => {
                    uffd_wake(&self.uffd, dst, left);
                    return RunEnd::Gone;
                }
                Filled::Failed(e) => {
                    fill_failed(dst, e);
                    return RunEnd::Failed;
                }
            }
        }
        RunEnd::Done
    }

    /// Notes pages `pages` of the memory file in the recording, if one is under way.
    fn record(&self, pages: Range<u64>) {
        let mut recording = self
            .recording
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(recorder) = recording.as_mut() {
            for page in pages {
                recorder.set.push(page);
            }
        }
    }

    /// Fills the next window of the working set (up to [`Lazy::window`] bytes of one region
    /// from the unit of the next page of the list on, as far as the list stays inside it): one
    /// read, one copy per run of units not filled yet. A list's page of a region of 2 MiB
    /// hugetlb pages fills its whole page.
    fn prefetch_window(&mut self) {
        let Some(p) = self.prefetch.as_mut() else {
            return;
        };
        let first = p.page;
        let at = self.lazies.partition_point(|l| l.file_pages().end <= first);
        let Some(lazy) = self
            .lazies
            .get(at)
            .filter(|l| l.file_pages().contains(&first))
        else {
            // The list was checked against the layout: not reached.
            self.end_prefetch();
            return;
        };
        if lazy.gone() {
            // The region was removed: the list goes on past its pages.
            let end = lazy.file_pages().end;
            while p.runs.get(p.run).is_some_and(|r| r.end <= end) {
                p.run += 1;
            }
            let next = p.runs.get(p.run).map(|r| r.start.max(end));
            match next {
                Some(page) => p.page = page,
                None => self.end_prefetch(),
            }
            return;
        }
        // In units of the region (`ratio` pages of the list each), from the one `first` is in.
        let ratio = lazy.unit / PAGE_SIZE;
        let region_first = lazy.file_pages().start;
        let first_unit = (first - region_first) / ratio;
        let limit_unit = (first_unit + lazy.window() / lazy.unit).min(lazy.size / lazy.unit);
        let (low, limit) = (
            region_first + first_unit * ratio,
            region_first + limit_unit * ratio,
        );
        // The list's pages from `first` on while they stay in the window's units, as many runs
        // as the window copies (so that it reads no further than it fills): (the list's run,
        // its first page here, the units it covers).
        let mut segments = Vec::new();
        let (mut run, mut page) = (p.run, p.page);
        while run < p.runs.len() && (low..limit).contains(&page) && segments.len() < WINDOW_COPIES {
            let end = p.runs[run].end.min(limit);
            let units = (page - region_first) / ratio..(end - region_first).div_ceil(ratio);
            segments.push((run, page, units));
            if end < p.runs[run].end {
                page = end;
                break;
            }
            run += 1;
            page = p.runs.get(run).map_or(0, |r| r.start);
        }
        let span = segments
            .iter()
            .map(|(_, _, units)| units.end)
            .max()
            .unwrap_or(first_unit)
            - first_unit;
        let buffer = &mut p.buffer[..(span * lazy.unit) as usize];
        if let Err(e) = self.file.read_exact_at(buffer, low * PAGE_SIZE) {
            eprintln!("kvm-memslots-persist: the prefetch stopped: reading the memory file: {e}");
            self.end_prefetch();
            return;
        }
        let (base, unit) = (lazy.base, lazy.unit);
        // Where the list goes on from unit `next` of a segment that starts at page `from`.
        let resume = |from: u64, next: u64| from.max(region_first + next * ratio);
        let mut copies = 0;
        for (segment_run, segment_page, units) in segments {
            let mut next = units.start;
            while next < units.end {
                if lazy.is_filled(next) {
                    next += 1;
                    continue;
                }
                let mut end = next + 1;
                while end < units.end && !lazy.is_filled(end) {
                    end += 1;
                }
                if copies == WINDOW_COPIES {
                    // The window's share: faults first, then on from here.
                    (p.run, p.page) = (segment_run, resume(segment_page, next));
                    return;
                }
                copies += 1;
                let src = &p.buffer
                    [((next - first_unit) * unit) as usize..((end - first_unit) * unit) as usize];
                self.stats.copy_calls.fetch_add(1, Ordering::AcqRel);
                match uffd_copy(&self.uffd, base + next * unit, src) {
                    Filled::Bytes(bytes) => {
                        let units = bytes / unit;
                        for filled in next..next + units {
                            lazy.fill(filled);
                        }
                        self.stats
                            .prefetched
                            .fetch_add(bytes / PAGE_SIZE, Ordering::AcqRel);
                        next += units;
                    }
                    // Filled some other way: leave it.
                    Filled::Exists => next += 1,
                    // A discard is under way: this window again once it has been read.
                    Filled::Later => {
                        (p.run, p.page) = (segment_run, resume(segment_page, next));
                        return;
                    }
                    // Removed meanwhile: the next window skips it.
                    Filled::Failed(_) if lazy.gone() => {
                        (p.run, p.page) = (segment_run, resume(segment_page, next));
                        return;
                    }
                    Filled::Failed(e) => {
                        eprintln!("kvm-memslots-persist: the prefetch stopped: {e}");
                        self.end_prefetch();
                        return;
                    }
                }
            }
        }
        (p.run, p.page) = (run, page);
        if run == p.runs.len() {
            self.end_prefetch();
        }
    }

    /// The prefetch is over (its list done, or stopped at an error).
    fn end_prefetch(&mut self) {
        self.prefetch = None;
        self.stats.prefetch_done.store(true, Ordering::Release);
    }
}
