//! One region a loader registered: where its mapping is, its place in the memory file, how
//! much a fault fills there, and the units filled so far.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use kvm_memslots::{PageSize, RegionMemory, HUGE_PAGE_SIZE, PAGE_SIZE};

/// Pages a prefetch reads and fills at a time (in at most 64 copies, the handler's
/// `WINDOW_COPIES`): a fault waits for one window at most.
const WINDOW: u64 = 256;

/// One registered region: where its mapping was, its place in the file, and the pages filled
/// so far (a later fault there follows a discard: zeros). A page is marked filled once its fill
/// is done (or once it was discarded), never before: a page not marked holds the file's data or
/// is being filled with it, which is what a snapshot asks ([`owed_runs`](super::owed_runs)).
///
/// The mapping is not held: the manager owns it, and a region it removes is unmapped as its
/// last reference goes, as without a loader. The kernel ends the registration with the mapping
/// (a userfaultfd registration belongs to the mapping), so nothing faults there any more; the
/// loader sees the region gone when [`mapping`](Self::mapping) finds nothing, and never takes
/// another mapping later made at the same address for it. A snapshot's scan and the loader's
/// unregistering hold the mapping meanwhile; the handler does not (it would keep the memory
/// mapped after a fill woke the thread that then removes the region): a fill of a region gone
/// fails in the kernel, which only fills what is registered with this loader.
pub(super) struct Lazy {
    memory: Weak<RegionMemory>,
    pub(super) base: u64,
    pub(super) size: u64,
    pub(super) file_offset: u64,
    /// Bytes a mark in `filled` stands for: the region's pages where the kernel fills and
    /// discards only whole ones (2 MiB for hugetlb), 4 KiB otherwise.
    pub(super) unit: u64,
    /// Bytes a fault fills at most: the block of this size (on its alignment in the host's
    /// address space, clipped to the region) around the faulting address. 2 MiB for huge
    /// pages (hugetlb or transparent), 4 KiB otherwise.
    pub(super) block: u64,
    /// Its pages are hugetlb pages, which `UFFDIO_ZEROPAGE` does not fill: zeros are copied.
    pub(super) hugetlb: bool,
    /// One bit a unit.
    filled: Vec<AtomicU64>,
}

impl Lazy {
    /// `region`, whose memory is at `file_offset` in the memory file, registered: nothing
    /// filled yet.
    pub(super) fn new(region: &Arc<RegionMemory>, file_offset: u64) -> Self {
        let page_size = region.page_size();
        let unit = page_size.alignment();
        let block = match page_size {
            PageSize::Base => PAGE_SIZE,
            PageSize::Huge2M | PageSize::Transparent => HUGE_PAGE_SIZE,
        };
        let units = region.size() / unit;
        Lazy {
            memory: Arc::downgrade(region),
            base: region.host_address(),
            size: region.size(),
            file_offset,
            unit,
            block,
            hugetlb: page_size == PageSize::Huge2M,
            filled: (0..units.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(super) fn holds(&self, hva: u64) -> bool {
        hva >= self.base && hva - self.base < self.size
    }

    /// The region's mapping, held; `None` once the manager removed the region (unmapped, or
    /// being unmapped).
    pub(super) fn mapping(&self) -> Option<Arc<RegionMemory>> {
        self.memory.upgrade()
    }

    /// Whether the manager removed the region.
    pub(super) fn gone(&self) -> bool {
        self.memory.strong_count() == 0
    }

    /// Marks unit `unit` (of [`unit`](Self::unit) bytes) filled; whether it was filled
    /// before.
    pub(super) fn fill(&self, unit: u64) -> bool {
        let bit = 1 << (unit % 64);
        self.filled[(unit / 64) as usize].fetch_or(bit, Ordering::AcqRel) & bit != 0
    }

    /// Whether unit `unit` is filled.
    pub(super) fn is_filled(&self, unit: u64) -> bool {
        self.filled[(unit / 64) as usize].load(Ordering::Acquire) & (1 << (unit % 64)) != 0
    }

    /// Whether the 4 KiB page `page` of the region is filled (its unit is).
    pub(super) fn page_filled(&self, page: u64) -> bool {
        self.is_filled(page * PAGE_SIZE / self.unit)
    }

    /// Marks the units of host range `[start, end)` (clipped to the region) filled: they were
    /// discarded, so they read zeros from now on.
    pub(super) fn discarded(&self, start: u64, end: u64) {
        let base = self.base;
        let first = start.max(base) - base;
        let last = end.min(base + self.size).saturating_sub(base);
        for unit in first / self.unit..last.div_ceil(self.unit) {
            self.fill(unit);
        }
    }

    /// The block a fault at `hva` fills, as offsets in the region.
    pub(super) fn block_of(&self, hva: u64) -> Range<u64> {
        let start = (hva & !(self.block - 1)).max(self.base);
        let end = ((hva & !(self.block - 1)) + self.block).min(self.base + self.size);
        start - self.base..end - self.base
    }

    /// The runs of units of `range` (offsets in the region, whole units) not filled yet, as
    /// offsets in the region.
    pub(super) fn unfilled_runs(&self, range: Range<u64>) -> Vec<Range<u64>> {
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
    pub(super) fn window(&self) -> u64 {
        (WINDOW * PAGE_SIZE).max(self.block)
    }

    /// The pages of the memory file the region holds.
    pub(super) fn file_pages(&self) -> Range<u64> {
        self.file_offset / PAGE_SIZE..(self.file_offset + self.size) / PAGE_SIZE
    }
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
