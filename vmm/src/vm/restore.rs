//! Guest memory from a snapshot's memory file, for any guest kind: the saved layout's regions
//! (with their ids) built in a VM's manager and filled the way the restore asks
//! ([`MemBackend`]).

use std::fs::File;

use kvm_memslots::{KvmVm, MemoryManager, RegionId};
use kvm_memslots_persist::{
    load_memory_file, LazyLoader, LazyOptions, MemoryLayout, SnapshotError,
};

/// How a restored VM gets its memory from the snapshot's memory file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MemBackend {
    /// Read every page that holds data into fresh memory before the guest runs.
    Copy,
    /// Map the file privately: pages load from the page cache when the guest first touches
    /// them; its writes never reach the file.
    #[default]
    File,
    /// Fresh memory filled page by page on first touch by a userfaultfd handler, from the file
    /// or with zeros for its holes; it can record the pages first touched and prefetch a
    /// recorded list ([`LazyOptions`]).
    Uffd,
}

/// Memory restored into a manager: the regions' ids (in the layout's order) and, for
/// [`MemBackend::Uffd`], the fault handler, to hold for as long as the VM lives (dropping it
/// stops the handler).
#[derive(Debug)]
pub(crate) struct RestoredMemory {
    /// The regions, in the layout's order.
    pub(crate) ids: Vec<RegionId>,
    /// The lazy loader, for a uffd restore.
    pub(crate) loader: Option<LazyLoader>,
}

/// Gives `memory` (empty) `layout`'s regions, filled from `file` as `backend` says, with
/// `lazy`'s working-set prefetch and recording: the userfaultfd backend's only, the others refuse
/// them.
pub(crate) fn restore_memory_with(
    memory: &std::sync::Arc<MemoryManager<KvmVm>>,
    layout: &MemoryLayout,
    file: &File,
    backend: MemBackend,
    lazy: LazyOptions,
) -> Result<RestoredMemory, SnapshotError> {
    if backend != MemBackend::Uffd && (lazy.prefetch.is_some() || lazy.record.is_some()) {
        return Err(SnapshotError::WorkingSet(format!(
            "prefetching or recording a working set needs the uffd memory backend, not {}",
            format!("{backend:?}").to_lowercase()
        )));
    }
    let mut loader = None;
    let ids = match backend {
        MemBackend::Copy => {
            let ids = layout.build(memory)?;
            load_memory_file(memory, layout, file)?;
            ids
        }
        MemBackend::File => {
            let ids = layout.build_from_file(memory, file)?;
            // Its memory is the file's: a bus error there is the file cut under the VM.
            super::memory_gone::guard(memory.regions().iter().map(|r| (r.hva.0, r.size)));
            ids
        }
        MemBackend::Uffd => {
            // Before anything is mapped: a layout the loader cannot fill is refused whole.
            LazyLoader::check_layout(layout)?;
            let ids = layout.build(memory)?;
            loader = Some(LazyLoader::start_with(memory, layout, file, lazy)?);
            ids
        }
    };
    Ok(RestoredMemory { ids, loader })
}
