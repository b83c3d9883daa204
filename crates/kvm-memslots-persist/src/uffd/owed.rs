//! What the live loaders of this process still owe: the pages of their regions not filled yet
//! that are data in their memory files, which snapshots and migrations must copy
//! ([`owed_runs`]) or fill before handing memory over ([`fill_owed`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use kvm_memslots::{RegionMemory, PAGE_SIZE};

use super::region::Lazy;
use super::stats::LoaderStats;
use crate::error::SnapshotError;
use crate::sparse::file_data_runs;

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

/// The byte ranges of `memory` (offsets in it, whole pages) that a live
/// [`LazyLoader`](crate::LazyLoader) of this process still owes: pages it has not filled yet (nor
/// seen discarded) that are data in the memory file it restores from. Empty for memory no loader
/// serves. Touching such a page fills it (the loader serves the fault), so reading guest memory
/// there reads the file's data.
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

/// From now on a snapshot of `lazies` (a loader's regions, filled from `file`) asks this
/// loader for the pages it owes.
pub(super) fn owe(lazies: &[Arc<Lazy>], file: &Arc<File>, stats: &Arc<LoaderStats>) {
    OWED.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(lazies.iter().map(|lazy| {
            let owed = Owed {
                lazy: Arc::clone(lazy),
                file: Arc::clone(file),
                stats: Arc::clone(stats),
            };
            (lazy.base, owed)
        }));
}

/// Nothing fills `lazies` (a loader's regions) any more: their entries go (a region's entry
/// another loader made since, at the same address, stays).
pub(super) fn forgive(lazies: &[Arc<Lazy>]) {
    let mut owed = OWED.lock().unwrap_or_else(PoisonError::into_inner);
    for lazy in lazies {
        let at = lazy.base;
        if owed.get(&at).is_some_and(|o| Arc::ptr_eq(&o.lazy, lazy)) {
            owed.remove(&at);
        }
    }
}
