//! The pre-copy rounds, on a thread of its own so that the API keeps answering (`GET /migrate`
//! and `PUT /migrate/cancel` for a migration, `GET /snapshot` and `PUT /snapshot/cancel` for a
//! live snapshot) while they run.
//!
//! Rounds: turn dirty logging on, open the sink (a migration sends the layout) and wait for it
//! to accept; round 1 carries every page that holds data (a live Diff: the pages its chain
//! logged since its base); each next round harvests (bitmap or ring, never behind the writers'
//! lock) and carries what the guest dirtied meanwhile. Before each round the pause it would
//! take to carry what is left — the last harvest's duration plus its pages at the last round's
//! throughput — is compared with the budget; once it fits the vCPUs pause, the last pages and
//! the state go, and the sink's last word completes it (a migration's destination says the VM
//! runs there; a live snapshot's vCPUs go on). At the timeout, or earlier once the harvest
//! alone took longer than the budget three rounds running while the pages left would have fit
//! it (more rounds cannot help then), `force` goes on to the pause anyway and `cancel` gives
//! up. Anything else leaves the VM running here as before: vCPUs resumed, logging as it was
//! (a run with a reader of its own takes no page from a client or a snapshot chain, and its
//! end stops only the logging it alone held) — with one exception. Once a migration's Done
//! record went out whole, the destination may run the VM (it starts it before it answers), so
//! a missing answer leaves the vCPUs paused here: resuming them could run the guest twice.
//! The run ends [`Phase::Unconfirmed`] and hands the paused vCPUs to the controller, where a
//! client who knows the destination does not run the VM resumes it.
//!
//! Every wait of the sink (a migration's on its destination: connecting, its answer to the
//! layout, each write, its final word) answers to the run's [`Waits`]: a cancel or a signal
//! ends it, and before the pause the timeout ends it too (with `force`, not the rounds'
//! writes: the pause follows them).
//!
//! The rounds know no guest kind: a guest kind hands over its vCPUs as [`PreCopyVcpu`]s
//! (paused, saved and resumed its own way), and its state goes with the sink. Nor do they
//! know where the pages go ([`Sink`]): a migration's destination, or a live snapshot's files,
//! where the vCPUs go on once the state is taken and the snapshot chain lends its reader of
//! the dirty log ([`Reader::Lent`]) so that a Diff can follow from the snapshot's point. Every
//! harvest goes to the sink the moment the rounds have it ([`Sink::took`]), before any step
//! that can end them: a live Diff that does not complete gives the chain back every page it
//! took from the lent reader, whichever step ended it.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_memslots::{DirtyConsumer, DirtyPages, KvmVm, MemoryManager, Target, PAGE_SIZE};
use kvm_memslots_persist::MemoryLayout;

use super::error::PreCopyError;
use super::progress::{Phase, Progress};
use super::sink::{Next, Sink, Waits};
use crate::vm::state::VcpuState;
use crate::vm::vcpu::PauseError;

/// The fewest bytes a round must send for its throughput to count.
const MIN_MEASURED: u64 = 1 << 20;
/// Rounds in a row in which the harvest alone took longer than the (non-zero) budget while the
/// pages left would have fit it: then waiting cannot help, and `on_timeout` applies at once.
const HARVEST_BOUND_ROUNDS: u32 = 3;

/// What the rounds do when their timeout comes before they converged (or once the pause
/// cannot fit the budget).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Give up: the VM keeps running here.
    Cancel,
    /// Stop and copy what is left, however long the pause.
    Force,
}

/// How the rounds go: the longest pause the VM may see, how long they may take, and what
/// happens at the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rounds {
    /// The longest pause (its pages left over the measured throughput, plus the harvest).
    pub(crate) downtime: Duration,
    /// How long before `on_timeout` applies.
    pub(crate) timeout: Duration,
    /// What happens at the timeout.
    pub(crate) on_timeout: OnTimeout,
}

/// Whose reader of the dirty log the rounds harvest with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reader {
    /// One of their own, made at the start and removed at the end (a migration).
    Own,
    /// One its owner lent, left logging at the end (a live snapshot's chain, whose next Diff
    /// follows from the snapshot's point).
    Lent(DirtyConsumer),
}

/// A vCPU as the rounds pause, save and resume it: each guest kind has its own handle.
pub trait PreCopyVcpu: std::fmt::Debug + Send + 'static {
    /// Pauses it: once this returns, it is out of the guest and has published what it
    /// dirtied.
    fn pause(&self) -> Result<(), PauseError>;
    /// Its state, read while it is paused.
    fn save(&self) -> Result<VcpuState, PauseError>;
    /// Lifts the pause (not a hold: a held vCPU stays paused).
    fn resume(&self);
    /// Keeps the pause until [`release`](Self::release): a migration ended
    /// [`Phase::Unconfirmed`] with the vCPU paused, and nothing but a client's
    /// resume may run it here again (a later live snapshot's own resume does not).
    fn hold(&self);
    /// Lifts the hold and the pause (a client resumed the VM).
    fn release(&self);
}

/// The VM as a run sees it: taken from the controller when it starts, unchanged while it runs
/// (the controller refuses changes meanwhile).
#[derive(Debug)]
pub(crate) struct SourceVm<V> {
    /// Its memory.
    pub(crate) memory: Arc<MemoryManager<KvmVm>>,
    /// Its vCPUs.
    pub(crate) vcpus: Vec<V>,
}

/// How a run ended, for the controller.
#[derive(Debug)]
pub(crate) struct Ending<V> {
    /// The vCPUs, left paused because the outcome is unknown
    /// ([`Phase::Unconfirmed`]): resume them only if the destination does not run the
    /// VM.
    pub(crate) held: Vec<V>,
}

impl<V> Default for Ending<V> {
    fn default() -> Self {
        Ending { held: Vec::new() }
    }
}

/// A run under way or ended (a migration, or a live snapshot): its progress, and the thread
/// that runs it.
#[derive(Debug)]
pub(crate) struct PreCopy<V> {
    status: Arc<Mutex<Progress>>,
    bytes_copied: Arc<AtomicU64>,
    cancel: Arc<AtomicBool>,
    started: Instant,
    thread: Option<JoinHandle<Ending<V>>>,
    ending: Option<Ending<V>>,
}

impl<V: PreCopyVcpu> PreCopy<V> {
    /// Starts copying `vm` into `sink` in `rounds`, harvesting with `reader`; `interrupt` is
    /// the process's stop flag.
    pub(crate) fn start(
        rounds: Rounds,
        sink: Box<dyn Sink>,
        vm: SourceVm<V>,
        reader: Reader,
        interrupt: &'static AtomicBool,
    ) -> io::Result<Self> {
        let status = Arc::new(Mutex::new(Progress {
            phase: Phase::Setup,
            round: 0,
            bytes_written: 0,
            guest_memory_bytes: vm.memory.memory_use().guest_memory,
            pages_left: 0,
            dirty_rate_pages_per_second: 0.0,
            throughput_bytes_per_second: 0.0,
            estimated_pause_ms: 0.0,
            forced: false,
            pause_ms: None,
            elapsed_ms: 0.0,
            error: None,
        }));
        let waits = Waits {
            cancel: Arc::new(AtomicBool::new(false)),
            interrupt,
            started: Instant::now(),
            timeout: rounds.timeout,
            bytes: Arc::new(AtomicU64::new(0)),
        };
        // The rounds read the dirty log as a reader of their own, logging every region (and
        // any added meanwhile) for themselves; or with the reader they were lent.
        let consumer = match reader {
            Reader::Lent(consumer) => consumer,
            Reader::Own => {
                let consumer = vm.memory.add_dirty_consumer().map_err(io::Error::other)?;
                if let Err(e) = vm.memory.log_new_regions_for(consumer, true) {
                    let _ = vm.memory.remove_dirty_consumer(consumer);
                    return Err(io::Error::other(e));
                }
                consumer
            }
        };
        let (bytes_copied, cancel) = (Arc::clone(&waits.bytes), Arc::clone(&waits.cancel));
        let run = Run {
            rounds,
            vm,
            sink,
            status: Arc::clone(&status),
            waits,
            consumer,
            owns_consumer: reader == Reader::Own,
            targets: vec![Target::All],
        };
        let memory = Arc::clone(&run.vm.memory);
        let thread = match std::thread::Builder::new()
            .name("precopy".into())
            .spawn(move || run.run())
        {
            Ok(thread) => thread,
            Err(e) => {
                if reader == Reader::Own {
                    let _ = memory.remove_dirty_consumer(consumer);
                }
                return Err(e);
            }
        };
        Ok(PreCopy {
            status,
            bytes_copied,
            cancel,
            started: Instant::now(),
            thread: Some(thread),
            ending: None,
        })
    }

    /// Its progress now.
    pub(crate) fn progress(&self) -> Progress {
        let mut progress = self
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        progress.bytes_written = self.bytes_copied.load(Ordering::Relaxed);
        if progress.elapsed_ms == 0.0 || self.is_running() {
            progress.elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
        }
        // Round 1 has no figure of its own until it ends: its live rate so far.
        if progress.phase == Phase::PreCopy && progress.round == 1 && progress.elapsed_ms > 0.0 {
            progress.throughput_bytes_per_second =
                progress.bytes_written as f64 / (progress.elapsed_ms / 1e3);
        }
        progress
    }

    /// Whether its thread still runs.
    pub(crate) fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Asks it to stop at its next step; the VM keeps running here.
    pub(crate) fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// Waits for its thread; returns how it ended (once: later calls get the default).
    pub(crate) fn join(&mut self) -> Ending<V> {
        if let Some(thread) = self.thread.take() {
            let ending = thread.join().unwrap_or_else(|_| {
                let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
                status.phase = Phase::Failed;
                status.error = Some("the pre-copy thread panicked".into());
                Ending::default()
            });
            self.ending = Some(ending);
        }
        self.ending.take().unwrap_or_default()
    }

    /// Whether it completed: the sink has the whole VM.
    pub(crate) fn completed(&self) -> bool {
        self.phase() == Phase::Completed
    }

    /// Where it is now.
    pub(crate) fn phase(&self) -> Phase {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).phase
    }
}

/// The run's thread's state.
struct Run<V> {
    rounds: Rounds,
    vm: SourceVm<V>,
    sink: Box<dyn Sink>,
    status: Arc<Mutex<Progress>>,
    waits: Waits,
    /// The rounds' reader of the dirty log.
    consumer: DirtyConsumer,
    /// Whether the run made its reader (and removes it at the end).
    owns_consumer: bool,
    /// What to log and harvest: every region, or (local mode) those not handed over.
    targets: Vec<Target>,
}

/// How fast the rounds go.
#[derive(Debug, Clone, Copy)]
struct Pace {
    /// Bytes per second the last round was sent at.
    throughput: f64,
    /// How long the last harvest took.
    harvest_time: Duration,
}

impl<V: PreCopyVcpu> Run<V> {
    fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.status.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn run(mut self) -> Ending<V> {
        let memory = Arc::clone(&self.vm.memory);
        let outcome = self.copy(&memory);
        // Its logging ends where no other consumer logs (a failed stop leaves it logging:
        // harmless, a later harvest reports the pages).
        if self.owns_consumer {
            let _ = memory.remove_dirty_consumer(self.consumer);
        }
        let mut held = Vec::new();
        match outcome {
            Ok(pause) => self.update(|s| {
                s.phase = Phase::Completed;
                s.pause_ms = Some(pause.as_secs_f64() * 1e3);
            }),
            Err(e) => {
                self.update(|s| {
                    s.phase = match e {
                        PreCopyError::Cancelled(_) => Phase::Cancelled,
                        PreCopyError::Unconfirmed(_) => Phase::Unconfirmed,
                        _ => Phase::Failed,
                    };
                    s.error = Some(e.to_string());
                });
                if matches!(e, PreCopyError::Unconfirmed(_)) {
                    held = std::mem::take(&mut self.vm.vcpus);
                    for vcpu in &held {
                        vcpu.hold();
                    }
                }
            }
        }
        let elapsed = self.waits.started.elapsed().as_secs_f64() * 1e3;
        self.update(|s| s.elapsed_ms = elapsed);
        Ending { held }
    }

    /// Harvests every target, handing each harvest to the sink at once ([`Sink::took`]): a
    /// lent reader's pages are then the sink's to give back, whatever ends the rounds before
    /// they are carried (a cancel, the timeout, a vCPU that cannot pause, a failed step).
    fn harvest(&mut self, memory: &MemoryManager<KvmVm>) -> Result<Vec<DirtyPages>, PreCopyError> {
        let mut dirty = Vec::new();
        for &target in &self.targets {
            let harvest = memory.harvest_dirty_for(self.consumer, target)?;
            self.sink.took(&harvest);
            dirty.extend(harvest);
        }
        Ok(dirty)
    }

    /// Runs the rounds to the sink's last word; returns the pause.
    fn copy(&mut self, memory: &MemoryManager<KvmVm>) -> Result<Duration, PreCopyError> {
        // The layout as the VM has it (the destination logs nothing it was not asked to).
        let layout = MemoryLayout::of(memory);
        self.targets = self.sink.open(&self.waits, memory, &layout)?;
        for &target in &self.targets {
            memory.start_dirty_log_for(self.consumer, target)?;
        }
        // From here every write is logged: what the first harvest reports goes out in round 1
        // (all of memory, or for a live Diff these pages, which its sink took) or is dirty
        // again.
        self.harvest(memory)?;
        let mut last_harvest = Instant::now();
        self.sink.accepted()?;
        self.waits.check_cancel()?;
        let Rounds {
            downtime: budget,
            timeout,
            on_timeout,
        } = self.rounds;
        // With `force`, the timeout ends the rounds, not a round under way: the pause follows.
        let rounds_by_timeout = on_timeout == OnTimeout::Cancel;

        self.update(|s| {
            s.phase = Phase::PreCopy;
            s.round = 1;
        });
        self.sink.expect(Next::Round(1), rounds_by_timeout);
        let round_start = Instant::now();
        let sent = self.sink.send_all(memory)?;
        self.sink.end_round()?;
        let mut pace = Pace {
            throughput: throughput(sent, round_start.elapsed()),
            harvest_time: Duration::ZERO,
        };
        let mut round = 1;
        let mut harvest_bound = 0;
        let dirty = loop {
            self.waits.check_cancel()?;
            let harvest_start = Instant::now();
            let dirty = self.harvest(memory)?;
            pace.harvest_time = harvest_start.elapsed();
            let pages: u64 = dirty.iter().map(|d| d.count()).sum();
            let window = last_harvest.elapsed().as_secs_f64();
            last_harvest = harvest_start;
            let copy =
                Duration::from_secs_f64((pages * PAGE_SIZE) as f64 / pace.throughput.max(1.0));
            let estimate = pace.harvest_time + copy;
            self.update(|s| {
                s.pages_left = pages;
                s.dirty_rate_pages_per_second = pages as f64 / window.max(1e-9);
                s.throughput_bytes_per_second = pace.throughput;
                s.estimated_pause_ms = estimate.as_secs_f64() * 1e3;
            });
            if estimate <= budget {
                break dirty;
            }
            // The guest's writes are not what is in the way, the harvest is (a bitmap harvest
            // reads every slot's log, dirty or not): more rounds cannot make it fit. (A budget
            // of 0, which nothing fits, asks for rounds until the timeout.)
            harvest_bound = if !budget.is_zero() && pace.harvest_time > budget && copy <= budget {
                harvest_bound + 1
            } else {
                0
            };
            let stuck = harvest_bound >= HARVEST_BOUND_ROUNDS;
            if stuck || self.waits.started.elapsed() >= timeout {
                match on_timeout {
                    OnTimeout::Force => {
                        self.update(|s| s.forced = true);
                        break dirty;
                    }
                    OnTimeout::Cancel if stuck => {
                        return Err(PreCopyError::Cancelled(format!(
                            "the {} ms budget cannot be met: harvesting the dirty log alone took \
                             over it in each of the last {HARVEST_BOUND_ROUNDS} rounds (last \
                             {:.0} ms) with little else left to send; raise downtime_ms, use \
                             on_timeout force, or the dirty ring (--dirty-ring), whose harvest \
                             costs what was dirtied",
                            budget.as_millis(),
                            pace.harvest_time.as_secs_f64() * 1e3,
                        )))
                    }
                    OnTimeout::Cancel => {
                        return Err(PreCopyError::Cancelled(format!(
                            "not converged within {timeout:?}: {pages} pages left would take \
                             about {:.0} ms, over the {} ms budget",
                            estimate.as_secs_f64() * 1e3,
                            budget.as_millis()
                        )))
                    }
                }
            }
            round += 1;
            self.update(|s| s.round = round);
            self.sink.expect(Next::Round(round), rounds_by_timeout);
            let round_start = Instant::now();
            let sent = self.sink.send_dirty(memory, &dirty)?;
            self.sink.end_round()?;
            // A round of a few pages times the syscalls more than the link: keep the last
            // real figure.
            if sent >= MIN_MEASURED {
                pace.throughput = throughput(sent, round_start.elapsed());
            }
        };
        self.waits.check_cancel()?;
        let paused_at = Instant::now();
        self.update(|s| {
            s.phase = Phase::StopAndCopy;
            s.round = round + 1;
        });
        // From the pause on, only a stall, a cancel or a signal ends a wait: the timeout (past
        // with `force`) would leave a destination that is restoring the VM in doubt.
        self.sink.expect(Next::LastPages, false);
        match self.stop_and_copy(memory, &layout, dirty) {
            Ok(()) if self.sink.stays() => {
                // The VM goes on here: what is left is done off its pause.
                self.resume();
                let pause = paused_at.elapsed();
                self.sink.settle()?;
                Ok(pause)
            }
            Ok(()) => Ok(paused_at.elapsed()),
            // The destination may run the VM: it must not run here too.
            Err(e @ PreCopyError::Unconfirmed(_)) => Err(e),
            Err(e) => {
                self.resume();
                Err(e)
            }
        }
    }

    fn resume(&self) {
        for vcpu in &self.vm.vcpus {
            vcpu.resume();
        }
    }

    /// Pauses the vCPUs, carries the pages left and the state, and (a migration) waits for
    /// the destination to run the VM. The caller resumes the vCPUs if this fails, unless it
    /// fails [`PreCopyError::Unconfirmed`].
    fn stop_and_copy(
        &mut self,
        memory: &MemoryManager<KvmVm>,
        layout: &MemoryLayout,
        dirty: Vec<DirtyPages>,
    ) -> Result<(), PreCopyError> {
        for (index, vcpu) in self.vm.vcpus.iter().enumerate() {
            vcpu.pause()
                .map_err(|error| PreCopyError::Vcpu { vcpu: index, error })?;
        }
        // Out of the guest, every vCPU has published what it dirtied: this harvest is the
        // last word.
        let mut pages = dirty;
        pages.extend(self.harvest(memory)?);
        self.sink.send_dirty(memory, &pages)?;
        self.sink.end_round()?;
        let mut vcpus = Vec::with_capacity(self.vm.vcpus.len());
        for (index, vcpu) in self.vm.vcpus.iter().enumerate() {
            vcpus.push(
                vcpu.save()
                    .map_err(|error| PreCopyError::Vcpu { vcpu: index, error })?,
            );
        }
        self.sink.finish(memory, layout, vcpus)
    }
}

fn throughput(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64().max(1e-6)
}
