//! A live snapshot: the VM goes on running while its memory is copied into the memory file in
//! rounds, as a migration copies it to another VMM (`migration::source`, into a [`FileSink`]
//! instead of a stream): round 1 writes every page that holds data (a Full) or the pages
//! dirtied since the chain's last snapshot (a Diff), each next round the pages the guest
//! dirtied meanwhile, and once what is left fits the pause budget
//! the vCPUs pause for the last pages and their state, and go on. The snapshot's point is that
//! pause: the memory file holds memory as it was then, and the state file the vCPUs and
//! devices as they were then. The pause does not grow with guest memory, only with what the
//! guest dirtied in the last round (and, with bitmap harvests, with the slots harvested).
//!
//! The rounds read the dirty log with the snapshot chain's own reader: what the guest writes
//! after the pause stays logged for the chain's next Diff.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kvm_memslots::{DirtyPages, KvmVm, MemoryManager, Target};
use kvm_memslots_persist::{write_dirty_pages, write_memory_file, MemoryLayout};

use super::info::{MemoryCheck, SnapshotInfo};
use crate::control::migration::MigrationInfo;
use crate::control::snapshot::LiveSnapshotInfo;
use crate::migration::sink::{Sink, Waits};
use crate::migration::source::MigrationError;
use crate::vm::state::VcpuState;

type Memory = MemoryManager<KvmVm>;

/// Takes the VM's state for a snapshot of memory laid out as `layout`, with the vCPUs'
/// `states`, by index, in the guest kind's own format: called with the vCPUs paused (it reads
/// the devices' state too); what it returns makes the state file's bytes once the snapshot's
/// info is known ([`StateBytes`]), which need not wait in the pause.
pub type StateWriter =
    Box<dyn FnOnce(&MemoryLayout, Vec<VcpuState>) -> Result<StateBytes, String> + Send>;

/// A state taken: the state file's bytes for the snapshot it is.
pub type StateBytes = Box<dyn FnOnce(SnapshotInfo) -> Vec<u8> + Send>;

/// What a live snapshot left behind once its rounds ended.
#[derive(Debug, Default)]
pub struct LiveOutcome {
    /// The snapshot, once both files are whole.
    pub written: Option<SnapshotInfo>,
    /// A Diff that did not complete: every page it took from the chain's reader (those
    /// carried into it too), for the chain's next Diff.
    pub unsaved: Vec<DirtyPages>,
}

/// A live Diff's own part: the snapshot it follows, and the pages it has written (all it took
/// from the chain's reader).
struct DiffOf {
    base: SnapshotInfo,
    pages: Vec<DirtyPages>,
}

/// A live snapshot's two files, as the rounds write them. Dropped before it finished, it
/// removes both: a failed snapshot leaves no file behind.
pub struct FileSink {
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
    bytes: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// The layout the rounds copy (it does not change while they run).
    layout: Option<MemoryLayout>,
    finished: bool,
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
    pub fn new(
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
            bytes: None,
            layout: None,
            finished: false,
            diff: None,
            head: None,
        }
    }

    /// Makes it a Diff following `base`: round 1 writes the pages `carried` (a failed Diff's,
    /// not yet saved) and those the chain's reader logged since `base`.
    pub fn diff_of(mut self, base: SnapshotInfo, carried: Vec<DirtyPages>) -> Self {
        self.diff = Some(DiffOf {
            base,
            pages: carried,
        });
        self
    }

    fn count(&self, bytes: u64) -> u64 {
        if let Some(counter) = &self.bytes {
            counter.fetch_add(bytes, Ordering::Relaxed);
        }
        bytes
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

fn write_failed(e: impl std::fmt::Display) -> MigrationError {
    MigrationError::Write(e.to_string())
}

impl Sink for FileSink {
    fn destination(&self) -> String {
        self.paths[1].display().to_string()
    }

    fn open(
        &mut self,
        waits: &Waits,
        _memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, MigrationError> {
        self.bytes = Some(Arc::clone(&waits.bytes));
        self.layout = Some(layout.clone());
        Ok(vec![Target::All])
    }

    fn accepted(&mut self) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Writing a file has no other side to wait for.
    fn expect(&self, _what: &str, _by_timeout: bool) {}

    /// A Full's every page, or a Diff's pages: those carried into it and those `logged`.
    fn send_all(
        &mut self,
        memory: &Memory,
        logged: Vec<DirtyPages>,
    ) -> Result<u64, MigrationError> {
        let layout = self
            .layout
            .as_ref()
            .expect("the rounds open the sink first");
        let stats = match self.diff.as_mut() {
            None => write_memory_file(memory, layout, &self.mem_file),
            Some(diff) => {
                diff.pages.extend(logged);
                write_dirty_pages(memory, layout, &diff.pages, &self.mem_file)
            }
        }
        .map_err(write_failed)?;
        Ok(self.count(stats.bytes))
    }

    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, MigrationError> {
        let layout = self
            .layout
            .as_ref()
            .expect("the rounds open the sink first");
        // Kept before the write: a Diff that fails from here hands them to the next Diff.
        if let Some(diff) = self.diff.as_mut() {
            diff.pages.extend_from_slice(dirty);
        }
        let stats =
            write_dirty_pages(memory, layout, dirty, &self.mem_file).map_err(write_failed)?;
        Ok(self.count(stats.bytes))
    }

    fn end_round(&mut self) -> Result<(), MigrationError> {
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
    ) -> Result<(), MigrationError> {
        let head = MemoryCheck::read_head(&*memory.current(), layout)
            .map_err(|e| write_failed(format!("reading guest memory: {e}")))?;
        self.head = Some(head);
        let write_state = self
            .write_state
            .take()
            .expect("the rounds finish a sink once");
        self.taken = Some(write_state(layout, states).map_err(MigrationError::State)?);
        Ok(())
    }

    fn stays(&self) -> bool {
        true
    }

    /// Makes the snapshot, its memory check of the bytes copied in the pause, and writes the
    /// state file.
    fn settle(&mut self) -> Result<(), MigrationError> {
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
        .map_err(|e| write_failed(format!("a snapshot id: {e}")))?;
        let bytes = taken(info);
        self.state_file
            .write_all_at(&bytes, 0)
            .map_err(|e| write_failed(format!("the state file: {e}")))?;
        self.finished = true;
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .written = Some(info);
        Ok(())
    }
}

/// The progress `run` reports of a live snapshot into `paths` (state, memory), `written` once
/// completed.
pub fn progress(
    run: MigrationInfo,
    paths: &[PathBuf; 2],
    written: Option<SnapshotInfo>,
) -> LiveSnapshotInfo {
    LiveSnapshotInfo {
        phase: run.phase,
        snapshot_path: paths[0].clone(),
        mem_file_path: paths[1].clone(),
        round: run.round,
        bytes_written: run.bytes_sent,
        guest_memory_bytes: run.guest_memory_bytes,
        pages_left: run.pages_left,
        dirty_rate_pages_per_second: run.dirty_rate_pages_per_second,
        throughput_bytes_per_second: run.throughput_bytes_per_second,
        estimated_pause_ms: run.estimated_downtime_ms,
        forced: run.forced,
        pause_ms: run.downtime_ms,
        elapsed_ms: run.elapsed_ms,
        snapshot_id: written.map(|info| info.id.to_string()),
        error: run.error,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::time::{Duration, Instant};

    use kvm_memslots::RegionSpec;
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

    use super::*;
    use crate::migration::sink::Waits;
    use crate::vm::{Vm, VmOptions};

    static NOT_STOPPING: AtomicBool = AtomicBool::new(false);

    /// A new, empty file in the temporary directory, removed first if a run left it.
    fn new_file(name: &str) -> (PathBuf, File) {
        let path =
            std::env::temp_dir().join(format!("tinyvmm-live-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("a new file");
        (path, file)
    }

    /// A live Full's memory check is the memory of its point, read in the pause: a page the
    /// rounds left out of the memory file (as a lazy restore's unfilled pages once were) makes
    /// the file fail its own snapshot's check. Computed from the file it checks, the check
    /// would pass whatever the file missed.
    #[test]
    fn kvm_a_live_fulls_memory_check_is_read_from_memory_in_the_pause() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::snapshot::live::kvm_a_live_fulls_memory_check_is_read_from_memory_in_the_pause",
        ) {
            return;
        }
        let vm = Vm::new(VmOptions::default()).expect("a VM");
        let memory = vm.memory();
        memory
            .add_region(RegionSpec::new(GuestAddress(0), 4 << 20))
            .expect("a region");
        let ram = memory.handle().memory();
        ram.write_obj(0x5au64, GuestAddress(0x1000))
            .expect("guest memory");
        let (state_path, state_file) = new_file("state");
        let (mem_path, mem_file) = new_file("mem");
        let mem_check = mem_file.try_clone().expect("a second handle");
        let outcome = Arc::new(Mutex::new(LiveOutcome::default()));
        let write_state: StateWriter = Box::new(|_, _| Ok(Box::new(|_| b"state".to_vec())));
        let mut sink = FileSink::new(
            (state_path.clone(), state_file),
            (mem_path.clone(), mem_file),
            write_state,
            Arc::clone(&outcome),
        );
        let waits = Waits {
            cancel: Arc::new(AtomicBool::new(false)),
            interrupt: &NOT_STOPPING,
            started: Instant::now(),
            timeout: Duration::from_secs(60),
            bytes: Arc::new(AtomicU64::new(0)),
        };
        let layout = MemoryLayout::of(memory);
        sink.open(&waits, memory, &layout).expect("opened");
        sink.send_all(memory, Vec::new()).expect("round 1");
        // Changed after round 1 and never reported: the rounds leave it out of the file.
        ram.write_obj(0xa5u64, GuestAddress(0x1000))
            .expect("guest memory");
        sink.finish(memory, &layout, Vec::new()).expect("the pause");
        sink.settle().expect("settled");
        let info = outcome
            .lock()
            .expect("not poisoned")
            .written
            .expect("the snapshot");
        let at_the_pause = MemoryCheck::of_memory(&*memory.current(), &layout).expect("read");
        let file_check = info.memory.check(&mem_check);
        let _ = std::fs::remove_file(&state_path);
        let _ = std::fs::remove_file(&mem_path);
        assert_eq!(
            info.memory, at_the_pause,
            "the check is the memory's at the pause"
        );
        assert!(
            file_check.is_err(),
            "a memory file without the point's page fails the check"
        );
    }
}
