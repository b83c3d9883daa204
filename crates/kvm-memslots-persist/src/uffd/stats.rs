//! What a loader's handler did ([`LoaderStats`]).

use std::sync::atomic::{AtomicBool, AtomicU64};

/// What the handler did. Pages are counted in 4 KiB pages whatever the regions' page size (a
/// 2 MiB page filled counts 512).
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Pages filled from the file on fault (counted before the faulting thread is woken; a
    /// fault fills its whole block, see the [`uffd`](super) module's docs).
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
