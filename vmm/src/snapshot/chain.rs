//! The chain of snapshots a controller takes of a paused VM, whatever its guest kind: a Full
//! starts it, each Diff follows the last snapshot taken. The chain reads the dirty log as a
//! consumer of its own (a client's harvests and logging switches take nothing from it), and
//! each state file says what snapshot it is ([`SnapshotInfo`]). The guest kind writes only its
//! state file's contents, given the snapshot's info and layout.
//!
//! A live snapshot, Full or Diff ([`super::live`]), runs on a thread of its own with the
//! chain's reader lent to its rounds; the chain learns how it ended at its controller's next request
//! ([`SnapshotChain::settle`]), and refuses meanwhile what would change what it copies
//! ([`SnapshotChain::refusal`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvm_memslots::{DirtyConsumer, KvmVm, MemoryManager, Target};
use kvm_memslots_persist::{write_dirty_pages, write_memory_file, MemoryLayout, SnapshotError};

use super::info::{MemoryCheck, SnapshotInfo};
use super::live::{FileSink, LiveOutcome, StateWriter};
use super::pages::PageSet;
use crate::control::snapshot::{
    LiveSnapshotInfo, SnapshotCreate, SnapshotType, LIVE_DOWNTIME_MS, LIVE_TIMEOUT_S,
};
use crate::control::{ControllerError, Request};
use crate::precopy::{OnTimeout, PreCopy, PreCopyVcpu, Progress, Reader, Rounds, SourceVm};
use crate::vm::state::VcpuState;

/// The last snapshot of the chain: what the next Diff follows.
#[derive(Debug)]
struct SnapshotBase {
    /// What it was.
    info: SnapshotInfo,
    /// The pages Diffs that failed since harvested (kept for the next one), one bitmap per
    /// region.
    carried: PageSet,
}

/// A VM's chain of snapshots: its dirty-log consumer (from the first Full on), its last
/// snapshot, and its last live snapshot.
#[derive(Debug, Default)]
pub(crate) struct SnapshotChain {
    base: Option<SnapshotBase>,
    consumer: Option<DirtyConsumer>,
    live: Option<LiveRun>,
}

/// A live snapshot's run, whatever the guest kind's vCPUs.
trait Run: std::fmt::Debug + Send {
    fn progress(&self) -> Progress;
    fn cancel(&self);
    /// Waits for its thread to end.
    fn join(&mut self);
}

impl<V: PreCopyVcpu> Run for PreCopy<V> {
    fn progress(&self) -> Progress {
        PreCopy::progress(self)
    }

    fn cancel(&self) {
        PreCopy::cancel(self);
    }

    fn join(&mut self) {
        // A live snapshot's vCPUs are never held: it always resumes them.
        PreCopy::join(self);
    }
}

/// The last live snapshot: its run, its files, the snapshot once written, and whether the
/// chain has taken its outcome.
#[derive(Debug)]
struct LiveRun {
    run: Box<dyn Run>,
    paths: [PathBuf; 2],
    outcome: Arc<Mutex<LiveOutcome>>,
    /// A Diff (its base stays the chain's while it runs).
    diff: bool,
    settled: bool,
}

impl LiveRun {
    fn written(&self) -> Option<SnapshotInfo> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .written
    }

    /// Whether it still copies: its phase, which ends a moment before its thread does.
    fn under_way(&self) -> bool {
        self.run.progress().phase.under_way()
    }
}

type Memory = MemoryManager<KvmVm>;

impl SnapshotChain {
    /// A VM without snapshots.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The chain's reader of the dirty log, once a Full snapshot made one.
    pub(crate) fn consumer(&self) -> Option<DirtyConsumer> {
        self.consumer
    }

    /// Takes the snapshot `create` asks for of `memory` (its VM paused by the caller): creates
    /// both files (neither may exist), writes the memory file, then the state file
    /// `write_state` makes of the layout, the vCPUs' states (`save_states`) and the snapshot's
    /// info (a state the guest kind cannot make is a 409). A failed snapshot leaves no file
    /// behind and the chain as it was (a Diff's harvested pages go into the next Diff; a Full
    /// that failed leaves no base to diff against).
    pub(crate) fn create(
        &mut self,
        memory: &Memory,
        create: &SnapshotCreate,
        save_states: impl FnOnce() -> Result<Vec<VcpuState>, ControllerError>,
        write_state: StateWriter,
    ) -> Result<SnapshotInfo, ControllerError> {
        if create.snapshot_type == SnapshotType::Diff && self.base.is_none() {
            return Err(no_base());
        }
        let files = new_files(&[&create.snapshot_path, &create.mem_file_path])?;
        let (state_file, mem_file) = (&files[0].1, &files[1].1);
        let written = self.write(
            memory,
            create.snapshot_type,
            state_file,
            mem_file,
            (save_states, write_state),
        );
        if written.is_err() {
            // A failed snapshot leaves no file behind.
            for (path, _) in &files {
                let _ = std::fs::remove_file(path);
            }
        }
        written
    }

    fn write(
        &mut self,
        memory: &Memory,
        kind: SnapshotType,
        state_file: &File,
        mem_file: &File,
        (save_states, write_state): (
            impl FnOnce() -> Result<Vec<VcpuState>, ControllerError>,
            StateWriter,
        ),
    ) -> Result<SnapshotInfo, ControllerError> {
        let failed = |e: &dyn std::fmt::Display| {
            ControllerError::internal(format!("the snapshot failed: {e}"))
        };
        // What the snapshot harvested, until the whole snapshot is written: if any step
        // fails, every page of it goes into the next Diff (of the base before, for a Full).
        let mut harvested = None;
        // A Full's base before it: the base again if the Full fails.
        let mut previous = None;
        let mut layout = MemoryLayout::of(memory);
        match kind {
            SnapshotType::Full => {
                // The harvest below takes the dirty bits a Diff against the earlier base needs:
                // they are kept (`harvested`) until this Full is written whole, and go back to
                // that base if it is not.
                previous = self.base.take();
                // The chain logs every region, those added later too, so that a Diff can
                // follow; what was dirty before is in the full image.
                let full = self.chain_consumer(memory).and_then(|chain| {
                    memory
                        .start_dirty_log_for(chain, Target::All)
                        .and_then(|()| memory.harvest_dirty_for(chain, Target::All))
                        .map_err(ControllerError::from)
                });
                let full = full.and_then(|pages| {
                    harvested = Some(PageSet::from(pages));
                    // The regions log now: the layout says so.
                    layout = MemoryLayout::of(memory);
                    write_memory_file(memory, &layout, mem_file).map_err(|e| not_written(&e))
                });
                if let Err(e) = full {
                    self.full_failed(memory, previous, harvested);
                    return Err(e);
                }
            }
            SnapshotType::Diff => {
                // The layout may have changed since the last snapshot (regions added, removed,
                // moved): this Diff is laid out as memory is now, and merging follows region
                // ids (`snapshot-merge`).
                let chain = self.consumer.expect("a snapshot base has a chain");
                let carried = &mut self.base.as_mut().expect("checked by create").carried;
                let mut dirty = std::mem::take(carried);
                match memory.harvest_dirty_for(chain, Target::All) {
                    Ok(now) => dirty.merge_owned(now),
                    Err(e) => {
                        *carried = dirty;
                        return Err(e.into());
                    }
                }
                let written = write_dirty_pages(memory, &layout, dirty.pages(), mem_file);
                harvested = Some(dirty);
                if let Err(e) = written {
                    self.keep_for_next_diff(harvested);
                    return Err(not_written(&e));
                }
            }
        }
        // What this snapshot is, with the check of its point's memory (the VM is paused).
        let info = MemoryCheck::of_memory(&*memory.current(), &layout)
            .map_err(|e| failed(&format!("reading guest memory: {e}")))
            .and_then(|check| {
                match &self.base {
                    Some(base) if kind == SnapshotType::Diff => base.info.next_diff(check),
                    _ => SnapshotInfo::full(check),
                }
                .map_err(|e| failed(&format!("a snapshot id: {e}")))
            });
        let saved = info.and_then(|info| {
            let state = write_state(&layout, save_states()?)
                .map_err(|e| ControllerError::conflict(format!("the snapshot failed: {e}")))?;
            state_file
                .write_all_at(&state(info), 0)
                .map_err(|e| failed(&e))
                .map(|()| info)
        });
        let info = match saved {
            Ok(info) => info,
            Err(e) => {
                if kind == SnapshotType::Full {
                    self.full_failed(memory, previous, harvested);
                } else {
                    self.keep_for_next_diff(harvested);
                }
                return Err(e);
            }
        };
        self.base = Some(SnapshotBase {
            info,
            carried: PageSet::new(),
        });
        Ok(info)
    }

    /// Starts a live snapshot of `memory` as `create` asks (a Full, or a Diff of the chain's
    /// last snapshot), on `vcpus` (paused and resumed for its last pages and state; those of a
    /// paused VM stay paused), with the state file made by `write_state`; `interrupt` is the
    /// process's stop flag. Both files are created now (neither may exist); a snapshot that
    /// fails or is cancelled leaves neither, and a Full no base to diff against (a Diff leaves
    /// its base and its pages to the next Diff). Its progress is
    /// [`live_info`](Self::live_info).
    pub(crate) fn start_live<V: PreCopyVcpu>(
        &mut self,
        memory: &Arc<Memory>,
        create: &SnapshotCreate,
        vcpus: Vec<V>,
        write_state: StateWriter,
        interrupt: &'static AtomicBool,
    ) -> Result<(), ControllerError> {
        let diff = create.snapshot_type == SnapshotType::Diff;
        if diff && self.base.is_none() {
            return Err(no_base());
        }
        let rounds = Rounds {
            downtime: Duration::from_millis(create.downtime_ms.unwrap_or(LIVE_DOWNTIME_MS)),
            timeout: Duration::from_secs(match create.timeout_s.unwrap_or(LIVE_TIMEOUT_S) {
                0 => return Err(ControllerError::bad("timeout_s must be at least 1")),
                s => s,
            }),
            on_timeout: create.on_timeout.unwrap_or(OnTimeout::Force),
        };
        self.settle(memory);
        let [state, mem]: [(PathBuf, File); 2] =
            new_files(&[&create.snapshot_path, &create.mem_file_path])?
                .try_into()
                .map_err(|_| ControllerError::internal("two paths made other than two files"))?;
        let paths = [state.0.clone(), mem.0.clone()];
        // A Diff's memory file must be able to hold one before the rounds start, as a paused
        // Diff's is: refused now, not reported as a failed run after its rounds.
        if diff {
            if let Err(e) = kvm_memslots_persist::check_diff_file(&mem.1) {
                for path in &paths {
                    let _ = std::fs::remove_file(path);
                }
                return Err(not_written(&e));
            }
        }
        let outcome = Arc::new(Mutex::new(LiveOutcome::default()));
        let sink = FileSink::new(state, mem, write_state, Arc::clone(&outcome));
        // A Full: until it is written whole there is no base; the chain's reader logs every
        // region from now on and is lent to the rounds. A Diff: the base stays, the reader
        // (logging since the base) is lent, and the pages a failed Diff left go in first.
        let sink = match self.base.as_mut() {
            Some(base) if diff => sink.diff_of(base.info, std::mem::take(&mut base.carried)),
            _ => {
                self.base = None;
                sink
            }
        };
        let chain = self.chain_consumer(memory).and_then(|chain| {
            memory
                .start_dirty_log_for(chain, Target::All)
                .map(|()| chain)
                .map_err(ControllerError::from)
        });
        let started = chain.and_then(|chain| {
            let vm = SourceVm {
                memory: Arc::clone(memory),
                vcpus,
            };
            PreCopy::start(rounds, Box::new(sink), vm, Reader::Lent(chain), interrupt)
                .map_err(|e| ControllerError::internal(format!("starting the snapshot: {e}")))
        });
        match started {
            Ok(run) => {
                self.live = Some(LiveRun {
                    run: Box::new(run),
                    paths,
                    outcome,
                    diff,
                    settled: false,
                });
                Ok(())
            }
            Err(e) => {
                // The sink is gone: a Diff's carried pages are back in the outcome.
                let unsaved =
                    std::mem::take(&mut outcome.lock().unwrap_or_else(|p| p.into_inner()).unsaved);
                match self.base.as_mut() {
                    Some(base) if diff => base.carried = unsaved,
                    _ => self.end(memory),
                }
                Err(e)
            }
        }
    }

    /// Takes the outcome of a live snapshot that ended: its snapshot becomes the base the next
    /// Diff follows; a Full that failed or was cancelled ends the chain, a Diff leaves its
    /// base and hands every page it took to the next Diff.
    pub(crate) fn settle(&mut self, memory: &Memory) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        if live.settled || live.under_way() {
            return;
        }
        // Its phase is final: its thread ends at once.
        live.run.join();
        live.settled = true;
        let diff = live.diff;
        let unsaved = std::mem::take(
            &mut live
                .outcome
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .unsaved,
        );
        match (live.written(), self.base.as_mut()) {
            (Some(info), _) => {
                self.base = Some(SnapshotBase {
                    info,
                    carried: PageSet::new(),
                })
            }
            (None, Some(base)) if diff => base.carried = unsaved,
            (None, _) => self.end(memory),
        }
    }

    /// `GET /snapshot`: the last live snapshot's progress.
    pub(crate) fn live_info(&self) -> Result<LiveSnapshotInfo, ControllerError> {
        let live = self.live.as_ref().ok_or_else(|| {
            ControllerError::not_found(
                "no live snapshot has been started (PUT /snapshot/create with \"live\": true)",
            )
        })?;
        Ok(LiveSnapshotInfo::of(
            live.run.progress(),
            &live.paths,
            live.written().map(|info| info.id.to_string()),
        ))
    }

    /// `PUT /snapshot/cancel`.
    pub(crate) fn cancel_live(&self) -> Result<(), ControllerError> {
        match &self.live {
            Some(live) if live.under_way() => {
                live.run.cancel();
                Ok(())
            }
            _ => Err(ControllerError::conflict("no live snapshot is under way")),
        }
    }

    /// Whether a live snapshot is under way.
    fn live_running(&self) -> bool {
        self.live.as_ref().is_some_and(LiveRun::under_way)
    }

    /// Cancels a live snapshot under way and waits for it (the VMM is stopping).
    pub(crate) fn shut_down(&mut self, memory: &Memory) {
        if let Some(live) = &mut self.live {
            live.run.cancel();
            live.run.join();
        }
        self.settle(memory);
    }

    /// Why `request` cannot run now: a live snapshot is under way, and the request would
    /// change what it copies (the layout, the guest, the run state) or start another
    /// snapshot or a migration. Reads, the client's dirty log (a reader of its own) and a
    /// stop go on.
    pub(crate) fn refusal(&self, request: &Request) -> Option<ControllerError> {
        if !self.live_running() {
            return None;
        }
        let goes_on = matches!(
            request,
            Request::GetMemory
                | Request::GetRegion(_)
                | Request::GetDirtyLog
                | Request::SwitchDirtyLog(_)
                | Request::Harvest(_)
                | Request::GetHotplug
                | Request::GetVm
                | Request::GetMigration
                | Request::GetSnapshot
                | Request::CancelSnapshot
                | Request::StopRecording
                | Request::Act(_)
        );
        (!goes_on).then(|| {
            ControllerError::conflict(format!(
                "{} is refused: a live snapshot is under way: GET /snapshot for its progress, \
                 PUT /snapshot/cancel to stop it",
                request.name()
            ))
        })
    }

    /// The chain's dirty-log consumer, made (logging every new region) if there is none.
    fn chain_consumer(&mut self, memory: &Memory) -> Result<DirtyConsumer, ControllerError> {
        if let Some(chain) = self.consumer {
            return Ok(chain);
        }
        let chain = memory.add_dirty_consumer()?;
        if let Err(e) = memory.log_new_regions_for(chain, true) {
            let _ = memory.remove_dirty_consumer(chain);
            return Err(e.into());
        }
        self.consumer = Some(chain);
        Ok(chain)
    }

    /// A paused Full failed: the chain's base before it (if any) is the base again, with the
    /// pages the Full harvested for its next Diff, as if the Full had never been asked for; with
    /// none, the chain ends.
    fn full_failed(
        &mut self,
        memory: &Memory,
        previous: Option<SnapshotBase>,
        harvested: Option<PageSet>,
    ) {
        match previous {
            Some(mut base) => {
                if let Some(pages) = harvested {
                    base.carried.merge(pages.pages());
                }
                self.base = Some(base);
            }
            None => self.end(memory),
        }
    }

    /// Ends the chain's consumer (a Full failed: there is no base to diff against).
    fn end(&mut self, memory: &Memory) {
        if let Some(chain) = self.consumer.take() {
            if memory.remove_dirty_consumer(chain).is_err() {
                // Its logging could not be stopped: keep it for the next Full.
                self.consumer = Some(chain);
            }
        }
    }

    /// Puts the pages a failed Diff harvested back for the next one.
    fn keep_for_next_diff(&mut self, harvested: Option<PageSet>) {
        if let (Some(pages), Some(base)) = (harvested, self.base.as_mut()) {
            base.carried = pages;
        }
    }
}

/// Why a Diff cannot be taken yet.
fn no_base() -> ControllerError {
    ControllerError::bad("no snapshot to diff against: take a Full snapshot first")
}

/// A memory file that could not be written: the client's mistake (400) where the file cannot
/// hold it (a Diff on hugetlbfs, say), else ours.
fn not_written(e: &SnapshotError) -> ControllerError {
    match e {
        SnapshotError::Unsupported(_) => ControllerError::bad(format!("the snapshot failed: {e}")),
        _ => ControllerError::internal(format!("the snapshot failed: {e}")),
    }
}

/// Creates each of `paths` (which must not exist), or none of them.
fn new_files(paths: &[&Path]) -> Result<Vec<(PathBuf, File)>, ControllerError> {
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        match File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => files.push((path.to_path_buf(), file)),
            Err(e) => {
                for (made, _) in &files {
                    let _ = std::fs::remove_file(made);
                }
                return Err(ControllerError::bad(format!(
                    "cannot create {}: {e} (snapshot files must not exist)",
                    path.display()
                )));
            }
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

    use super::*;

    fn create(kind: SnapshotType, name: &str) -> SnapshotCreate {
        let path = |what: &str| {
            let path = std::env::temp_dir().join(format!(
                "tinyvmm-chain-unit-{}-{name}.{what}",
                std::process::id()
            ));
            let _ = std::fs::remove_file(&path);
            path
        };
        SnapshotCreate {
            snapshot_type: kind,
            snapshot_path: path("state"),
            mem_file_path: path("mem"),
            live: false,
            downtime_ms: None,
            timeout_s: None,
            on_timeout: None,
        }
    }

    fn writer(refuse: bool) -> StateWriter {
        Box::new(move |_, _| {
            if refuse {
                return Err("a device cannot save its state now".to_owned());
            }
            Ok(Box::new(|_| b"state".to_vec()))
        })
    }

    /// A paused Full refused late (its state file cannot be made: a 409) leaves the chain as
    /// it was: the base before it stays, and the next Diff holds every page written since that
    /// base, those the refused Full harvested too. (It used to drop the base: the Diff was
    /// refused, "no Full before it".)
    #[test]
    fn kvm_a_full_refused_late_keeps_the_chain() {
        let Some(vm) = crate::vm::test_vm_with_a_page(
            "tinyvmm::snapshot::chain::kvm_a_full_refused_late_keeps_the_chain",
        ) else {
            return;
        };
        let memory = vm.memory();
        let ram = memory.handle().memory();
        let mut chain = SnapshotChain::new();
        let first = create(SnapshotType::Full, "first");
        chain
            .create(memory, &first, || Ok(Vec::new()), writer(false))
            .expect("the first Full");
        ram.write_obj(0xa5u64, GuestAddress(0x2000))
            .expect("guest memory");
        let refused = create(SnapshotType::Full, "refused");
        let e = chain
            .create(memory, &refused, || Ok(Vec::new()), writer(true))
            .expect_err("the state cannot be made");
        assert!(e.to_string().contains("cannot save"), "{e}");
        assert!(!refused.snapshot_path.exists() && !refused.mem_file_path.exists());
        let diff = create(SnapshotType::Diff, "diff");
        chain
            .create(memory, &diff, || Ok(Vec::new()), writer(false))
            .expect("a Diff of the first Full");
        let file = File::open(&diff.mem_file_path).expect("the Diff's memory");
        let mut word = [0u8; 8];
        file.read_exact_at(&mut word, 0x2000).expect("read");
        assert_eq!(
            u64::from_le_bytes(word),
            0xa5,
            "the page written after the first Full"
        );
        file.read_exact_at(&mut word, 0x1000).expect("read");
        assert_eq!(
            u64::from_le_bytes(word),
            0,
            "not written since: not in the Diff"
        );
        for c in [&first, &diff] {
            let _ = std::fs::remove_file(&c.snapshot_path);
            let _ = std::fs::remove_file(&c.mem_file_path);
        }
    }
}
