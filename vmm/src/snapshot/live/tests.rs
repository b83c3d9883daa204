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
    let file = kvm_test_support::files::new_file_at(&path);
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

    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, PreCopyError> {
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
    /// The chain of the scratch folder `name`, or `None` without KVM (`test` then skips,
    /// loudly).
    fn new(test: &str, name: &str) -> Option<Self> {
        if !kvm_test_support::require_kvm(test) {
            return None;
        }
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
        let dir =
            std::env::temp_dir().join(format!("tinyvmm-live-engine-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        Some(Chain {
            memory,
            reader,
            base: SnapshotInfo::full(check).expect("an id"),
            dir,
        })
    }

    /// A live Diff of the base into the snapshot files `state` and `mem`, carrying `carried`
    /// in (its state file empty), and where it leaves what it gives back.
    fn diff_sink(
        &self,
        [state, mem]: [(PathBuf, File); 2],
        carried: PageSet,
    ) -> (FileSink, Arc<Mutex<LiveOutcome>>) {
        let outcome = Arc::new(Mutex::new(LiveOutcome::default()));
        let write_state: StateWriter = Box::new(|_, _| Ok(Box::new(|_| Vec::new())));
        let sink = FileSink::new(state, mem, write_state, Arc::clone(&outcome))
            .diff_of(self.base, carried);
        (sink, outcome)
    }

    /// What the chain has for its next Diff once a live Diff ended: what it gave back (in
    /// `outcome`), and what the chain's reader logged since.
    fn next_diff(&self, outcome: &Mutex<LiveOutcome>) -> (BTreeSet<u64>, usize) {
        let unsaved = std::mem::take(&mut outcome.lock().expect("not poisoned").unsaved);
        let mut next_diff = Chain::addresses(unsaved.pages());
        next_diff.extend(Chain::addresses(
            &self
                .memory
                .harvest_dirty_for(self.reader, Target::All)
                .expect("the chain's harvest"),
        ));
        (next_diff, unsaved.bitmaps())
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
    let (inner, outcome) = chain.diff_sink(files, carried);
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
    let (next_diff, unsaved) = chain.next_diff(&outcome);
    let mut wanted = guest.written.lock().expect("not poisoned").clone();
    wanted.extend(carried_pages);
    Ended {
        phase: info.phase,
        error: info.error,
        next_diff,
        unsaved,
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
    let Some(chain) = Chain::new(
        "tinyvmm::snapshot::live::kvm_a_live_diff_ended_at_any_step_gives_back_every_page_it_took",
        "any-step",
    ) else {
        return;
    };
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
    let Some(chain) = Chain::new(
        "tinyvmm::snapshot::live::kvm_a_live_diff_that_times_out_or_cannot_pause_gives_back_every_page_it_took",
        "timeout",
    ) else {
        return;
    };
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
    let Some(chain) = Chain::new(
        "tinyvmm::snapshot::live::kvm_a_live_diff_holds_one_bitmap_per_region_however_many_rounds",
        "rounds",
    ) else {
        return;
    };
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
    let Some(chain) = Chain::new(
        "tinyvmm::snapshot::live::kvm_a_live_diff_on_a_stalled_file_system_is_cancelled_between_slices",
        "stalled",
    ) else {
        return;
    };
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
        let (writing, writing_rx) = std::sync::mpsc::sync_channel(1);
        let (told_tx, told) = std::sync::mpsc::sync_channel(1);
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let stalling = Arc::new(Stalling {
            writing,
            told: Mutex::new(told),
            gate: Arc::clone(&gate),
            calls: AtomicUsize::new(0),
        });
        let (mut sink, outcome) = chain.diff_sink(files, PageSet::new());
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
        let (next_diff, _) = chain.next_diff(&outcome);
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

    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

    use super::super::*;
    use crate::precopy::Waits;

    static NOT_STOPPING: AtomicBool = AtomicBool::new(false);

    /// A new, empty file in the temporary directory, removed first if a run left it.
    fn new_file(name: &str) -> (PathBuf, File) {
        super::new_file_at(
            std::env::temp_dir().join(format!("tinyvmm-live-unit-{}-{name}", std::process::id())),
        )
    }

    /// A live Full's memory check is the memory of its point, read in the pause: a page the
    /// rounds left out of the memory file (as a lazy restore's unfilled pages once were) makes
    /// the file fail its own snapshot's check. Computed from the file it checks, the check
    /// would pass whatever the file missed.
    #[test]
    fn kvm_a_live_fulls_memory_check_is_read_from_memory_in_the_pause() {
        let Some(vm) = crate::vm::test_vm_with_a_page(
            "tinyvmm::snapshot::live::kvm_a_live_fulls_memory_check_is_read_from_memory_in_the_pause",
        ) else {
            return;
        };
        let memory = vm.memory();
        let ram = memory.handle().memory();
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
