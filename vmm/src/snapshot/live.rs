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
pub const SLICE: u64 = 4 << 20;

/// How writing a live snapshot's files fails.
#[derive(Debug, thiserror::Error)]
pub enum LiveSnapshotError {
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
    pub unsaved: PageSet,
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
    pub fn diff_of(mut self, base: SnapshotInfo, carried: PageSet) -> Self {
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
mod tests {
    //! The pre-copy engine (`precopy`) into a [`FileSink`] on a real KVM VM with
    //! no vCPU: the "guest" is the VMM writing pages (its write bitmap reports them to every
    //! reader of the dirty log) from inside the sink's own steps, so that every harvest has
    //! pages, and a fault is injected at an exact step. What a live Diff took from the chain's
    //! reader must reach the chain again however it ends.

    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::time::Duration;

    use kvm_memslots::{DirtyConsumer, RegionSpec, PAGE_SIZE};
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

    use super::*;
    use crate::precopy::{OnTimeout, Phase, PreCopy, PreCopyVcpu, Reader, Rounds, SourceVm};
    use crate::vm::vcpu::PauseError;

    const MIB: u64 = 1 << 20;
    /// Two regions of this size, at 0 and at 1 GiB.
    const REGION: u64 = 4 * MIB;
    const REGIONS: [u64; 2] = [0, 1 << 30];

    /// A snapshot's two files, new, in `dir`: `STEM.state` and `STEM.mem`.
    fn new_files(dir: &std::path::Path, stem: &str) -> [(PathBuf, File); 2] {
        ["state", "mem"].map(|what| new_file_at(dir.join(format!("{stem}.{what}"))))
    }

    /// A new, empty file at `path`, removed first if a run left it.
    fn new_file_at(path: PathBuf) -> (PathBuf, File) {
        let _ = std::fs::remove_file(&path);
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("a new file");
        (path, file)
    }

    /// A vCPU that pauses, or fails to (the run then never saves it).
    #[derive(Debug)]
    struct Vcpu {
        pause_fails: bool,
    }

    impl PreCopyVcpu for Vcpu {
        fn pause(&self) -> Result<(), PauseError> {
            if self.pause_fails {
                Err(PauseError::Stopped)
            } else {
                Ok(())
            }
        }

        fn save(&self) -> Result<VcpuState, PauseError> {
            Err(PauseError::Stopped)
        }

        fn resume(&self) {}

        fn hold(&self) {}

        fn release(&self) {}
    }

    /// What the sink does at its fault step.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Fault {
        /// A client's cancel (`PUT /snapshot/cancel`) comes.
        Cancel,
        /// The process is told to stop (SIGTERM).
        Interrupt,
        /// The step fails.
        Fail,
    }

    /// The guest: writes one new page at each step of the sink and remembers it.
    struct Guest {
        memory: Arc<Memory>,
        written: Mutex<BTreeSet<u64>>,
        next: AtomicUsize,
    }

    impl Guest {
        fn write(&self) {
            let n = self.next.fetch_add(1, Ordering::Relaxed) as u64;
            let pages = REGION / PAGE_SIZE;
            let gpa = REGIONS[(n % 2) as usize] + (n / 2 * 7 % pages) * PAGE_SIZE;
            self.memory
                .handle()
                .memory()
                .write_obj(n + 1, GuestAddress(gpa))
                .expect("guest memory");
            self.written.lock().expect("not poisoned").insert(gpa);
        }
    }

    /// A [`FileSink`] whose every step first lets the guest write a page, and whose step
    /// number `at` (counted from 0 over every call) brings `fault`.
    struct Hooked {
        inner: FileSink,
        guest: Arc<Guest>,
        steps: AtomicUsize,
        at: usize,
        fault: Fault,
        cancel: Option<Arc<AtomicBool>>,
        interrupt: &'static AtomicBool,
        /// The most bitmaps the sink held at any step.
        most_held: Arc<AtomicUsize>,
    }

    impl Hooked {
        fn step(&self) -> Result<(), PreCopyError> {
            self.guest.write();
            let held = self.inner.diff.as_ref().map_or(0, |d| d.pages.bitmaps());
            self.most_held.fetch_max(held, Ordering::Relaxed);
            if self.steps.fetch_add(1, Ordering::Relaxed) != self.at {
                return Ok(());
            }
            match self.fault {
                Fault::Cancel => {
                    if let Some(cancel) = &self.cancel {
                        cancel.store(true, Ordering::Release);
                    }
                    Ok(())
                }
                Fault::Interrupt => {
                    self.interrupt.store(true, Ordering::Release);
                    Ok(())
                }
                Fault::Fail => Err(PreCopyError::Sink("injected".into())),
            }
        }
    }

    impl Sink for Hooked {
        fn open(
            &mut self,
            waits: &Waits,
            memory: &Memory,
            layout: &MemoryLayout,
        ) -> Result<Vec<Target>, PreCopyError> {
            self.cancel = Some(Arc::clone(&waits.cancel));
            self.step()?;
            self.inner.open(waits, memory, layout)
        }

        fn accepted(&mut self) -> Result<(), PreCopyError> {
            self.step()?;
            self.inner.accepted()
        }

        fn expect(&self, next: Next, by_timeout: bool) {
            // An expectation cannot fail: a failure there is a cancel.
            if self.step().is_err() {
                if let Some(cancel) = &self.cancel {
                    cancel.store(true, Ordering::Release);
                }
            }
            self.inner.expect(next, by_timeout);
        }

        fn took(&mut self, harvest: &[DirtyPages]) {
            self.inner.took(harvest);
        }

        fn send_all(&mut self, memory: &Memory) -> Result<u64, PreCopyError> {
            self.step()?;
            self.inner.send_all(memory)
        }

        fn send_dirty(
            &mut self,
            memory: &Memory,
            dirty: &[DirtyPages],
        ) -> Result<u64, PreCopyError> {
            self.step()?;
            self.inner.send_dirty(memory, dirty)
        }

        fn end_round(&mut self) -> Result<(), PreCopyError> {
            self.step()?;
            self.inner.end_round()
        }

        fn finish(
            &mut self,
            memory: &Memory,
            layout: &MemoryLayout,
            states: Vec<VcpuState>,
        ) -> Result<(), PreCopyError> {
            self.step()?;
            self.inner.finish(memory, layout, states)
        }

        fn stays(&self) -> bool {
            self.inner.stays()
        }

        fn settle(&mut self) -> Result<(), PreCopyError> {
            self.step()?;
            self.inner.settle()
        }
    }

    /// A VM with two regions, the chain's reader logging since a base snapshot of it.
    struct Chain {
        memory: Arc<Memory>,
        reader: DirtyConsumer,
        base: SnapshotInfo,
        dir: PathBuf,
    }

    impl Drop for Chain {
        /// A passing test leaves no scratch folder (a failing one leaves it to look at).
        fn drop(&mut self) {
            if !std::thread::panicking() {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }

    impl Chain {
        fn new(name: &str) -> Self {
            let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
            let fd = Arc::new(kvm.create_vm().expect("a VM"));
            let memory = Arc::new(MemoryManager::new(
                KvmVm::new(&kvm, fd).expect("a KVM VM for the manager"),
            ));
            for gpa in REGIONS {
                memory
                    .add_region(RegionSpec::new(GuestAddress(gpa), REGION).with_slot_size(MIB))
                    .expect("a region");
            }
            let reader = memory.add_dirty_consumer().expect("a reader");
            memory
                .start_dirty_log_for(reader, Target::All)
                .expect("logging");
            memory
                .harvest_dirty_for(reader, Target::All)
                .expect("the base's harvest");
            let layout = MemoryLayout::of(&memory);
            let check = MemoryCheck::of_memory(&*memory.current(), &layout).expect("guest memory");
            let dir = std::env::temp_dir()
                .join(format!("tinyvmm-live-engine-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("a scratch folder");
            Chain {
                memory,
                reader,
                base: SnapshotInfo::full(check).expect("an id"),
                dir,
            }
        }

        /// Every page of `pages` (by guest address at harvest).
        fn addresses(pages: &[DirtyPages]) -> BTreeSet<u64> {
            pages
                .iter()
                .flat_map(|d| d.addresses().map(|a| a.0))
                .collect()
        }
    }

    /// How one live Diff ended, and what the chain has for its next Diff.
    struct Ended {
        phase: Phase,
        error: Option<String>,
        /// What the Diff gave back, and what the chain's reader logged since.
        next_diff: BTreeSet<u64>,
        /// The bitmaps the Diff gave back.
        unsaved: usize,
        most_held: usize,
        /// Every page the guest wrote since the base, and those carried into the Diff.
        wanted: BTreeSet<u64>,
    }

    /// Runs a live Diff of `chain` in `rounds`, carrying `carried` in, with `fault` at step
    /// `at` and the vCPU `vcpu`; waits for it to end.
    fn live_diff(
        chain: &Chain,
        rounds: Rounds,
        (at, fault): (usize, Fault),
        vcpu: Option<Vcpu>,
    ) -> Ended {
        let guest = Arc::new(Guest {
            memory: Arc::clone(&chain.memory),
            written: Mutex::new(BTreeSet::new()),
            next: AtomicUsize::new(0),
        });
        // Written before it starts: only its round 1 (the reader's log) has them.
        guest.write();
        guest.write();
        // A failed Diff's pages, carried into this one.
        let carried = PageSet::from(vec![DirtyPages {
            region: kvm_memslots::RegionId(1),
            gpa: GuestAddress(REGIONS[1]),
            pages: REGION / PAGE_SIZE,
            bitmap: {
                let mut bitmap = vec![0u64; (REGION / PAGE_SIZE / 64) as usize];
                bitmap[3] = 1 << 5;
                bitmap
            },
        }]);
        let carried_pages = Chain::addresses(carried.pages());
        let files = new_files(&chain.dir, &format!("{at}-{fault:?}"));
        let [state, mem] = files;
        let outcome = Arc::new(Mutex::new(LiveOutcome::default()));
        let write_state: StateWriter = Box::new(|_, _| Ok(Box::new(|_| Vec::new())));
        let inner = FileSink::new(state, mem, write_state, Arc::clone(&outcome))
            .diff_of(chain.base, carried);
        let interrupt: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
        let most_held = Arc::new(AtomicUsize::new(0));
        let sink = Hooked {
            inner,
            guest: Arc::clone(&guest),
            steps: AtomicUsize::new(0),
            at,
            fault,
            cancel: None,
            interrupt,
            most_held: Arc::clone(&most_held),
        };
        let vm = SourceVm {
            memory: Arc::clone(&chain.memory),
            vcpus: vcpu.into_iter().collect(),
        };
        let mut run = PreCopy::start(
            rounds,
            Box::new(sink),
            vm,
            Reader::Lent(chain.reader),
            interrupt,
        )
        .expect("the run starts");
        run.join();
        let info = run.progress();
        let unsaved = std::mem::take(&mut outcome.lock().expect("not poisoned").unsaved);
        let mut next_diff = Chain::addresses(unsaved.pages());
        next_diff.extend(Chain::addresses(
            &chain
                .memory
                .harvest_dirty_for(chain.reader, Target::All)
                .expect("the chain's harvest"),
        ));
        let mut wanted = guest.written.lock().expect("not poisoned").clone();
        wanted.extend(carried_pages);
        Ended {
            phase: info.phase,
            error: info.error,
            next_diff,
            unsaved: unsaved.bitmaps(),
            most_held: most_held.load(Ordering::Relaxed),
            wanted,
        }
    }

    /// Rounds that never converge (a budget of 0) until the timeout cancels them.
    fn endless(timeout: Duration) -> Rounds {
        Rounds {
            downtime: Duration::ZERO,
            timeout,
            on_timeout: OnTimeout::Cancel,
        }
    }

    /// What the chain's next Diff lacks of what the live Diff took, if anything.
    fn lost(ended: &Ended, case: &str) -> Option<String> {
        let lost: Vec<String> = ended
            .wanted
            .difference(&ended.next_diff)
            .map(|gpa| format!("{gpa:#x}"))
            .collect();
        (!lost.is_empty()).then(|| {
            format!(
                "{case}: the live Diff ended {:?} ({:?}) and the chain's next Diff lacks {lost:?}",
                ended.phase, ended.error
            )
        })
    }

    fn assert_carried(ended: &Ended, case: &str) {
        if let Some(lost) = lost(ended, case) {
            panic!("{lost}");
        }
    }

    /// A cancel, a signal or a failure at every step of a live Diff's first rounds: the next
    /// Diff has every page it took (and those it was carrying), whatever step it ended at.
    #[test]
    fn kvm_a_live_diff_ended_at_any_step_gives_back_every_page_it_took() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::snapshot::live::kvm_a_live_diff_ended_at_any_step_gives_back_every_page_it_took",
        ) {
            return;
        }
        let chain = Chain::new("any-step");
        let mut failures = Vec::new();
        // open, accepted, expect, send_all, end_round, then three steps a round.
        for at in 0..14 {
            for fault in [Fault::Cancel, Fault::Interrupt, Fault::Fail] {
                let ended = live_diff(&chain, endless(Duration::from_secs(600)), (at, fault), None);
                assert_ne!(ended.phase, Phase::Completed);
                failures.extend(lost(&ended, &format!("{fault:?} at step {at}")));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// The timeout with `on_timeout: cancel` ends the rounds right after a harvest; a vCPU
    /// that cannot pause ends them right after the last one: neither loses those pages.
    #[test]
    fn kvm_a_live_diff_that_times_out_or_cannot_pause_gives_back_every_page_it_took() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::snapshot::live::kvm_a_live_diff_that_times_out_or_cannot_pause_gives_back_every_page_it_took",
        ) {
            return;
        }
        let chain = Chain::new("timeout");
        let never = (usize::MAX, Fault::Fail);
        let ended = live_diff(&chain, endless(Duration::ZERO), never, None);
        assert_eq!(ended.phase, Phase::Cancelled, "{:?}", ended.error);
        assert_carried(&ended, "the timeout");
        for on_timeout in [OnTimeout::Force, OnTimeout::Cancel] {
            // A budget the first round fits: the pause comes at once, and fails.
            let rounds = Rounds {
                downtime: Duration::from_secs(600),
                timeout: Duration::from_secs(600),
                on_timeout,
            };
            let vcpu = Vcpu { pause_fails: true };
            let ended = live_diff(&chain, rounds, never, Some(vcpu));
            assert_eq!(ended.phase, Phase::Failed, "{:?}", ended.error);
            assert_carried(&ended, "a vCPU that cannot pause");
        }
        // With `force`, the timeout pauses instead: that fails too.
        let rounds = Rounds {
            downtime: Duration::ZERO,
            timeout: Duration::ZERO,
            on_timeout: OnTimeout::Force,
        };
        let ended = live_diff(&chain, rounds, never, Some(Vcpu { pause_fails: true }));
        assert_eq!(ended.phase, Phase::Failed, "{:?}", ended.error);
        assert_carried(&ended, "a forced pause that fails");
    }

    /// Rounds that go on and on hold one bitmap per region, not one per round, and what a
    /// cancel gives back is one per region too.
    #[test]
    fn kvm_a_live_diff_holds_one_bitmap_per_region_however_many_rounds() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::snapshot::live::kvm_a_live_diff_holds_one_bitmap_per_region_however_many_rounds",
        ) {
            return;
        }
        let chain = Chain::new("rounds");
        // 5 steps before round 2, then 3 a round: cancelled in round 40.
        let ended = live_diff(
            &chain,
            endless(Duration::from_secs(600)),
            (5 + 3 * 40, Fault::Cancel),
            None,
        );
        assert_eq!(ended.phase, Phase::Cancelled, "{:?}", ended.error);
        assert_carried(&ended, "a cancel in round 40");
        assert!(
            ended.most_held <= REGIONS.len(),
            "the Diff held {} bitmaps for {} regions",
            ended.most_held,
            REGIONS.len()
        );
        assert!(
            ended.unsaved <= REGIONS.len(),
            "the cancelled Diff gave back {} bitmaps for {} regions",
            ended.unsaved,
            REGIONS.len()
        );
    }

    /// A file system that writes one slice, then stalls until it is let go: the first call
    /// between slices tells the test the write is under way and waits for the test's word
    /// (its cancel or stop was given); every later call waits at the gate, which the test opens
    /// only once the run has ended (or its hang guard gave up).
    struct Stalling {
        writing: std::sync::mpsc::SyncSender<()>,
        told: Mutex<std::sync::mpsc::Receiver<()>>,
        gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
        calls: AtomicUsize,
    }

    impl Stalling {
        fn between(&self) {
            if self.calls.fetch_add(1, Ordering::AcqRel) == 0 {
                let _ = self.writing.send(());
                let _ = self.told.lock().expect("not poisoned").recv();
                return;
            }
            let (open, opened) = &*self.gate;
            let mut open = open.lock().expect("not poisoned");
            while !*open {
                open = opened.wait(open).expect("not poisoned");
            }
        }
    }

    /// A cancel (`PUT /snapshot/cancel`) or a stop (Stop, SIGTERM) while a live Diff's round
    /// writes a memory file on a stalled file system ends the run after the slice under way:
    /// the cancel and the wait for the run (as Stop waits) return while the rest of the round
    /// is still held at the gate, and the Diff gives back every page it took. Written in one
    /// piece, as before, the round would wait at the gate until the hang guard opened it.
    #[test]
    fn kvm_a_live_diff_on_a_stalled_file_system_is_cancelled_between_slices() {
        if !kvm_test_support::require_kvm(
            "tinyvmm::snapshot::live::kvm_a_live_diff_on_a_stalled_file_system_is_cancelled_between_slices",
        ) {
            return;
        }
        let chain = Chain::new("stalled");
        for fault in [Fault::Cancel, Fault::Interrupt] {
            // Every page of both regions changed since the base: 8 MiB, 8 slices of 1 MiB.
            let ram = chain.memory.handle().memory();
            let mut wanted = BTreeSet::new();
            for gpa in REGIONS {
                ram.write_slice(&vec![0x5a; REGION as usize], GuestAddress(gpa))
                    .expect("guest memory");
                wanted.extend((gpa..gpa + REGION).step_by(PAGE_SIZE as usize));
            }
            let files = new_files(&chain.dir, &format!("stalled-{fault:?}"));
            let paths = [files[0].0.clone(), files[1].0.clone()];
            let [state, mem] = files;
            let (writing, writing_rx) = std::sync::mpsc::sync_channel(1);
            let (told_tx, told) = std::sync::mpsc::sync_channel(1);
            let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
            let stalling = Arc::new(Stalling {
                writing,
                told: Mutex::new(told),
                gate: Arc::clone(&gate),
                calls: AtomicUsize::new(0),
            });
            let outcome = Arc::new(Mutex::new(LiveOutcome::default()));
            let write_state: StateWriter = Box::new(|_, _| Ok(Box::new(|_| Vec::new())));
            let mut sink = FileSink::new(state, mem, write_state, Arc::clone(&outcome))
                .diff_of(chain.base, PageSet::new());
            sink.slice = MIB;
            let hook = Arc::clone(&stalling);
            sink.between_slices = Some(Arc::new(move |_| hook.between()));
            let interrupt: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
            let vm: SourceVm<Vcpu> = SourceVm {
                memory: Arc::clone(&chain.memory),
                vcpus: Vec::new(),
            };
            let mut run = PreCopy::start(
                endless(Duration::from_secs(600)),
                Box::new(sink),
                vm,
                Reader::Lent(chain.reader),
                interrupt,
            )
            .expect("the run starts");
            let open_gate = || {
                *gate.0.lock().expect("not poisoned") = true;
                gate.1.notify_all();
            };
            // Hang guards only: nothing here depends on how fast anything runs.
            let guard = Duration::from_secs(120);
            writing_rx
                .recv_timeout(guard)
                .expect("the round started writing the memory file");
            match fault {
                Fault::Cancel => run.cancel(),
                _ => interrupt.store(true, Ordering::Release),
            }
            told_tx.send(()).expect("the file system waits for word");
            // Stop cancels and waits for the run, as here.
            let (ended_tx, ended) = std::sync::mpsc::channel();
            let waiter = std::thread::spawn(move || {
                run.join();
                let _ = ended_tx.send(run.progress());
            });
            let info = ended.recv_timeout(guard);
            open_gate();
            waiter.join().expect("the waiter");
            let info = info.unwrap_or_else(|_| {
                panic!("{fault:?}: the run waited for the rest of the round's writes at the gate")
            });
            assert_eq!(info.phase, Phase::Cancelled, "{fault:?}: {:?}", info.error);
            assert!(
                stalling.calls.load(Ordering::Acquire) == 1,
                "{fault:?}: the write went on past the slice under way"
            );
            for path in &paths {
                assert!(!path.exists(), "{fault:?}: {} left behind", path.display());
            }
            // The chain's next Diff has every page the cancelled one took.
            let unsaved = std::mem::take(&mut outcome.lock().expect("not poisoned").unsaved);
            let mut next_diff = Chain::addresses(unsaved.pages());
            next_diff.extend(Chain::addresses(
                &chain
                    .memory
                    .harvest_dirty_for(chain.reader, Target::All)
                    .expect("the chain's harvest"),
            ));
            let lost: Vec<&u64> = wanted.difference(&next_diff).collect();
            assert!(
                lost.is_empty(),
                "{fault:?}: the next Diff lacks {} pages",
                lost.len()
            );
        }
    }

    /// The live Full's memory check (read in the pause, never from the file it checks).
    mod memory_check {
        use std::sync::atomic::{AtomicBool, AtomicU64};
        use std::time::{Duration, Instant};

        use kvm_memslots::RegionSpec;
        use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

        use super::super::*;
        use crate::precopy::Waits;
        use crate::vm::{Vm, VmOptions};

        static NOT_STOPPING: AtomicBool = AtomicBool::new(false);

        /// A new, empty file in the temporary directory, removed first if a run left it.
        fn new_file(name: &str) -> (PathBuf, File) {
            super::new_file_at(
                std::env::temp_dir()
                    .join(format!("tinyvmm-live-unit-{}-{name}", std::process::id())),
            )
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
            sink.send_all(memory).expect("round 1");
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
}
