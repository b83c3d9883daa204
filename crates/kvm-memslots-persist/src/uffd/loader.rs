//! The loader of a lazy restore ([`LazyLoader`]): it registers a restored manager's regions
//! with a new userfaultfd, starts the handler thread that fills them, lists them as owed for
//! snapshots, and undoes all of it when dropped.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use kvm_memslots::{KvmMemory, MemoryManager, RegionMemory};

use super::handler::Handler;
use super::owed::{forgive, owe};
use super::recording::{finish_recording, Recorder, RecorderSlot, Recording};
use super::region::Lazy;
use super::stats::LoaderStats;
use super::sys::{
    new_uffd, register, unregister, UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MISSING_HUGETLBFS,
    UFFD_FEATURE_MISSING_SHMEM,
};
use crate::error::SnapshotError;
use crate::layout::{LayoutBacking, LayoutPageSize, MemoryLayout};
use crate::working_set::WorkingSet;

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

/// The handler of a lazily restored manager's page faults; stops (and unregisters the
/// memory) when dropped. Keep it as long as the VM runs.
#[derive(Debug)]
pub struct LazyLoader {
    uffd: Arc<OwnedFd>,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<LoaderStats>,
    recording: RecorderSlot,
    /// Its regions (registered), as the table of what loaders owe lists them until it is
    /// dropped.
    lazies: Vec<Arc<Lazy>>,
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
            // `region` keeps the mapping for the call; faults there now wait for this loader.
            register(&uffd, region.host_address(), region.size())?;
            lazies.push(Arc::new(Lazy::new(&region, file_offset)));
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
        let thread = {
            let handler = Handler::new(
                Arc::clone(&uffd),
                Arc::clone(&stats),
                lazies.clone(),
                Arc::clone(&file),
                Arc::clone(&recording),
                deadline,
                options.prefetch,
            );
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
        owe(&lazies, &file, &stats);
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
        forgive(&self.lazies);
        // A region the manager removed was unregistered with its mapping (and another mapping
        // may lie there now): only the regions still mapped, each held meanwhile.
        for lazy in &self.lazies {
            let Some(_mapping) = lazy.mapping() else {
                continue;
            };
            unregister(&self.uffd, lazy.base, lazy.size);
        }
    }
}
