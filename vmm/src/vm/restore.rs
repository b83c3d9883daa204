//! Guest memory from a snapshot's memory file, for any guest kind: the saved layout's regions
//! (with their ids) built in a VM's manager and filled the way the restore asks
//! ([`MemBackend`]).

use std::fs::File;

use kvm_memslots::{KvmVm, MemoryManager, RegionId};
use kvm_memslots_persist::{load_memory_file, LazyLoader, MemoryLayout, SnapshotError};

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
    /// or with zeros for its holes.
    Uffd,
}

/// Memory restored into a manager: the regions' ids (in the layout's order) and, for
/// [`MemBackend::Uffd`], the fault handler, to hold for as long as the VM lives (dropping it
/// stops the handler).
#[derive(Debug)]
pub struct RestoredMemory {
    /// The regions, in the layout's order.
    pub ids: Vec<RegionId>,
    /// The lazy loader, for a uffd restore.
    pub loader: Option<LazyLoader>,
}

/// Gives `memory` (empty) `layout`'s regions, filled from `file` as `backend` says.
pub fn restore_memory(
    memory: &std::sync::Arc<MemoryManager<KvmVm>>,
    layout: &MemoryLayout,
    file: &File,
    backend: MemBackend,
) -> Result<RestoredMemory, SnapshotError> {
    let mut loader = None;
    let ids = match backend {
        MemBackend::Copy => {
            let ids = layout.build(memory)?;
            load_memory_file(memory, layout, file)?;
            ids
        }
        MemBackend::File => layout.build_from_file(memory, file)?,
        MemBackend::Uffd => {
            let ids = layout.build(memory)?;
            loader = Some(LazyLoader::start(memory, layout, file)?);
            ids
        }
    };
    Ok(RestoredMemory { ids, loader })
}
