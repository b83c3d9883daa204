//! A live snapshot: the VM goes on running while its memory is copied into the memory file in
//! rounds by the pre-copy engine (`precopy`), as a migration copies it to another VMM, into a
//! [`FileSink`] instead of a stream: round 1 writes every page that holds data (a Full) or the pages
//! dirtied since the chain's last snapshot (a Diff), each next round the pages the guest
//! dirtied meanwhile, and once what is left fits the pause budget
//! the vCPUs pause for the last pages and their state, and go on. The snapshot's point is that
//! pause: the memory file holds memory as it was then, and the state file the vCPUs and
//! devices as they were then. The pause does not grow with guest memory, only with what the
//! guest dirtied in the last round (and, with bitmap harvests, with the slots harvested).
//!
//! The rounds read the dirty log with the snapshot chain's own reader: what the guest writes
//! after the pause stays logged for the chain's next Diff.
//!
//! The memory file is written in slices of [`SLICE`] bytes, and a cancel or a stop (`PUT
//! /snapshot/cancel`, Stop, SIGTERM) is looked at between two: a slow or stalled file system
//! holds them for one slice at most, not for a whole round (a Full's round 1 is all of guest
//! memory). A cancelled Diff gives back every page it took, as on every other way out.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kvm_memslots::{DirtyPages, KvmVm, MemoryManager, Target};
use kvm_memslots_persist::{
    write_dirty_pages_sliced, write_memory_file_sliced, MemoryLayout, Slices, SnapshotError,
    WriteStats,
};

use super::info::{MemoryCheck, SnapshotInfo};
use super::pages::PageSet;
use crate::precopy::{Next, PreCopyError, Sink, Waits};
use crate::vm::state::VcpuState;

type Memory = MemoryManager<KvmVm>;

/// The most one write of the memory file carries: a cancel or a stop waits for one such write
/// at most (4 MiB: under 10 ms at 500 MB/s; a round of 16 GiB is 4096 of them, each one
/// system call, so the slicing costs nothing measurable).
const SLICE: u64 = 4 << 20;

/// How writing a live snapshot's files fails.
#[derive(Debug, thiserror::Error)]
enum LiveSnapshotError {
    /// Writing guest memory into the memory file failed.
    #[error("writing the snapshot failed: {0}")]
    MemoryFile(SnapshotError),
    /// Guest memory could not be read for the snapshot's memory check.
    #[error("writing the snapshot failed: reading guest memory: {0}")]
    ReadMemory(vm_memory::GuestMemoryError),
    /// The snapshot could not get an id.
    #[error("writing the snapshot failed: a snapshot id: {0}")]
    Id(std::io::Error),
    /// The state file could not be written.
    #[error("writing the snapshot failed: the state file: {0}")]
    StateFile(std::io::Error),
}

impl From<LiveSnapshotError> for PreCopyError {
    fn from(error: LiveSnapshotError) -> Self {
        PreCopyError::Sink(Box::new(error))
    }
}

/// Called between two slices with the bytes written so far in that write (a test's slow file
/// system).
#[cfg(test)]
type SliceHook = Arc<dyn Fn(u64) + Send + Sync>;

/// Takes the VM's state for a snapshot of memory laid out as `layout`, with the vCPUs'
/// `states`, by index, in the guest kind's own format: called with the vCPUs paused (it reads
/// the devices' state too); what it returns makes the state file's bytes once the snapshot's
/// info is known ([`StateBytes`]), which need not wait in the pause.
pub(crate) type StateWriter =
    Box<dyn FnOnce(&MemoryLayout, Vec<VcpuState>) -> Result<StateBytes, String> + Send>;

/// A state taken: the state file's bytes for the snapshot it is.
type StateBytes = Box<dyn FnOnce(SnapshotInfo) -> Vec<u8> + Send>;

/// What a live snapshot left behind once its rounds ended.
#[derive(Debug, Default)]
pub(super) struct LiveOutcome {
    /// The snapshot, once both files are whole.
    pub(crate) written: Option<SnapshotInfo>,
    /// A Diff that did not complete: every page it took from the chain's reader (those
    /// carried into it too), for the chain's next Diff.
    pub(crate) unsaved: PageSet,
}

/// A live Diff's own part: the snapshot it follows, every page it took from the chain's
/// reader and those carried into it (one bitmap per region, each round merged in: they are
/// the chain's again if it does not complete).
struct DiffOf {
    base: SnapshotInfo,
    pages: PageSet,
}

/// A live snapshot's two files, as the rounds write them. Dropped before it finished, it
/// removes both: a failed snapshot leaves no file behind.
pub(super) struct FileSink {
    paths: [PathBuf; 2],
    state_file: File,
    mem_file: File,
    write_state: Option<StateWriter>,
    /// The state, taken in the pause, written after it.
    taken: Option<StateBytes>,
    /// Where the snapshot goes once written whole (or a Diff's pages, if it is not).
    written: Arc<Mutex<LiveOutcome>>,
    /// Set for a Diff.
    diff: Option<DiffOf>,
    /// The bytes the snapshot's memory check covers, copied from guest memory in the pause
    /// (hashed once the vCPUs go on).
    head: Option<Vec<u8>>,
    /// The run's waits: its cancel and stop flags, and its bytes for progress.
    waits: Option<Waits>,
    /// The layout the rounds copy (it does not change while they run).
    layout: Option<MemoryLayout>,
    finished: bool,
    /// The most one write of the memory file carries ([`SLICE`]).
    slice: u64,
    /// A test's slow file system, between slices.
    #[cfg(test)]
    between_slices: Option<SliceHook>,
}

impl std::fmt::Debug for FileSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSink")
            .field("paths", &self.paths)
            .field("finished", &self.finished)
            .finish()
    }
}

impl FileSink {
    /// A sink of a Full into `state_file` (at `state_path`) and `mem_file` (at `mem_path`),
    /// both new and empty; `write_state` makes the state file's bytes, and `written` gets the
    /// snapshot once both files are whole.
    pub(super) fn new(
        (state_path, state_file): (PathBuf, File),
        (mem_path, mem_file): (PathBuf, File),
        write_state: StateWriter,
        written: Arc<Mutex<LiveOutcome>>,
    ) -> Self {
        FileSink {
            paths: [state_path, mem_path],
            state_file,
            mem_file,
            write_state: Some(write_state),
            taken: None,
            written,
            waits: None,
            layout: None,
            finished: false,
            diff: None,
            head: None,
            slice: SLICE,
            #[cfg(test)]
            between_slices: None,
        }
    }

    /// Makes it a Diff following `base`: round 1 writes the pages `carried` (a failed Diff's,
    /// not yet saved) and those the chain's reader logged since `base`.
    pub(super) fn diff_of(mut self, base: SnapshotInfo, carried: PageSet) -> Self {
        self.diff = Some(DiffOf {
            base,
            pages: carried,
        });
        self
    }

    /// Writes the memory file with `write`, in [`SLICE`]s: between two, the bytes so far go to
    /// the run's progress, and a cancel or a stop ends the write (the run's error, as any of
    /// its waits would give). Returns the bytes written.
    fn sliced(
        &self,
        write: impl FnOnce(&File, Slices<'_>) -> Result<WriteStats, SnapshotError>,
    ) -> Result<u64, PreCopyError> {
        let waits = self.waits.as_ref().expect("the rounds open the sink first");
        let mut counted = 0;
        let mut stopped = None;
        let mut between = |written: u64| {
            waits.bytes.fetch_add(written - counted, Ordering::Relaxed);
            counted = written;
            #[cfg(test)]
            if let Some(hook) = &self.between_slices {
                hook(written);
            }
            waits.check_cancel().map_err(|e| {
                let why = e.to_string();
                stopped = Some(e);
                why
            })
        };
        let slices = Slices {
            bytes: self.slice,
            between: &mut between,
        };
        let written = write(&self.mem_file, slices);
        match written {
            Ok(stats) => {
                waits
                    .bytes
                    .fetch_add(stats.bytes - counted, Ordering::Relaxed);
                Ok(stats.bytes)
            }
            Err(SnapshotError::Stopped(why)) => {
                Err(stopped.unwrap_or(PreCopyError::Cancelled(why)))
            }
            Err(e) => Err(LiveSnapshotError::MemoryFile(e).into()),
        }
    }
}

impl Drop for FileSink {
    fn drop(&mut self) {
        if !self.finished {
            for path in &self.paths {
                let _ = std::fs::remove_file(path);
            }
            // A Diff's pages go back to the chain: the next Diff writes them.
            if let Some(diff) = self.diff.take() {
                self.written
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .unsaved = diff.pages;
            }
        }
    }
}

impl Sink for FileSink {
    fn open(
        &mut self,
        waits: &Waits,
        _memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, PreCopyError> {
        self.waits = Some(waits.clone());
        self.layout = Some(layout.clone());
        Ok(vec![Target::All])
    }

    fn accepted(&mut self) -> Result<(), PreCopyError> {
        Ok(())
    }

    /// A Diff keeps every page the rounds take, merged into one bitmap per region: if it
    /// does not complete, dropping it hands them back (with those carried into it).
    fn took(&mut self, harvest: &[DirtyPages]) {
        if let Some(diff) = self.diff.as_mut() {
            diff.pages.merge(harvest);
        }
    }

    /// Writing a file has no other side to wait for.
    fn expect(&self, _next: Next, _by_timeout: bool) {}

    /// A Full's every page, or a Diff's pages: those carried into it and those the chain's
    /// reader had logged since its base (the rounds' first harvest, which it took).
    fn send_all(&mut self, memory: &Memory) -> Result<u64, PreCopyError> {
        let layout = self
            .layout
            .as_ref()
            .expect("the rounds open the sink first");
        self.sliced(|file, slices| match &self.diff {
            None => write_memory_file_sliced(memory, layout, file, slices),
            Some(diff) => {
                write_dirty_pages_sliced(memory, layout, diff.pages.pages(), file, slices)
            }
        })
    }

    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, PreCopyError> {
        let layout = self
            .layout
            .as_ref()
            .expect("the rounds open the sink first");
        // A Diff has them already (`took`).
        self.sliced(|file, slices| write_dirty_pages_sliced(memory, layout, dirty, file, slices))
    }

    fn end_round(&mut self) -> Result<(), PreCopyError> {
        Ok(())
    }

    /// Takes the VM's state (the vCPUs paused at the point); [`settle`](Sink::settle) makes
    /// and writes the state file once they run again.
    /// The bytes the snapshot's memory check covers are copied here, from guest memory at the
    /// point, for a Full as for a Diff (whose own file has holes where the check looks:
    /// `MemoryCheck`): never read back from the memory file, which the check is there to
    /// check (a page the rounds left out of the file would pass a check made of it). The
    /// copy (2 MiB, about 0.1 ms here) is in the pause; hashing them (about 0.7 ms) is not.
    fn finish(
        &mut self,
        memory: &Memory,
        layout: &MemoryLayout,
        states: Vec<VcpuState>,
    ) -> Result<(), PreCopyError> {
        let head = MemoryCheck::read_head(&*memory.current(), layout)
            .map_err(LiveSnapshotError::ReadMemory)?;
        self.head = Some(head);
        let write_state = self
            .write_state
            .take()
            .expect("the rounds finish a sink once");
        self.taken = Some(write_state(layout, states).map_err(PreCopyError::State)?);
        Ok(())
    }

    fn stays(&self) -> bool {
        true
    }

    /// Makes the snapshot, its memory check of the bytes copied in the pause, and writes the
    /// state file.
    fn settle(&mut self) -> Result<(), PreCopyError> {
        let taken = self.taken.take().expect("settled after finishing");
        let head = self
            .head
            .take()
            .expect("the check's bytes are copied when the sink finishes");
        let layout = self
            .layout
            .as_ref()
            .expect("the rounds open the sink first");
        let check = MemoryCheck::of_head(&head, layout);
        let info = match &self.diff {
            None => SnapshotInfo::full(check),
            Some(diff) => diff.base.next_diff(check),
        }
        .map_err(LiveSnapshotError::Id)?;
        let bytes = taken(info);
        self.state_file
            .write_all_at(&bytes, 0)
            .map_err(LiveSnapshotError::StateFile)?;
        self.finished = true;
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .written = Some(info);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
