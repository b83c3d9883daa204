//! A VM running the test guest: the generic VM with the guest's system region, its vCPU
//! threads on the shared exit loop, and the host's side of the command protocol.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_memslots::{KvmVm, MemoryManager, RegionId};
use kvm_memslots_persist::{MemoryLayout, SnapshotError};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::ports::{GoAhead, GuestPortError, TestGuestPorts, VcpuError, VcpuEvent};
pub use super::test_vm::{MemBackend, TestVm};
use crate::control::vm::{FailureReason, VmFailure};
use crate::precopy::PreCopyVcpu;
use crate::test_guest::{self, Command, CommandBlock, Op, Outcome};
use crate::vm::state::{StateError, VcpuState};
use crate::vm::vcpu::{kick_until_finished, PauseError, Vcpu, VcpuShared};
use crate::vm::VmError;
use kvm_ioctls::VcpuFd;

/// Why the test guest's VM could not be set up or driven.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// Creating or setting up the VM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The memory manager refused.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// Writing the guest's tables and code failed.
    #[error("writing the guest's system memory failed: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
    /// More vCPUs than the test guest's layout has room for.
    #[error("{0} vCPUs asked for; the test guest supports 1 to {max}", max = test_guest::MAX_VCPUS)]
    TooManyVcpus(usize),
    /// A vCPU stopped on an error.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Fewer than two slots, or more than KVM has.
    #[error("{asked} slots asked for; KVM offers 2 to {max} (one is the system region's)")]
    SlotCount {
        /// Slots asked for.
        asked: usize,
        /// KVM's limit.
        max: usize,
    },
    /// A snapshot could not be read or loaded.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A restored layout has no system region at guest address 0.
    #[error("the snapshot's layout has no test-guest system region at guest address 0")]
    NoSystemRegion,
    /// A vCPU's state could not be read or set.
    #[error(transparent)]
    State(#[from] StateError),
    /// A vCPU is running a command, or stopped: its state cannot be saved.
    #[error("vCPU {0} is busy or stopped: its state can be saved only between commands")]
    Busy(usize),
    /// The eventfd the vCPUs tell the host's event loop about their news with could not be
    /// made.
    #[error("creating the vCPUs' notifier (an eventfd) failed: {0}")]
    Notifier(std::io::Error),
    /// A vCPU thread could not be started.
    #[error("starting vCPU thread {vcpu} failed: {source}")]
    Thread {
        /// The vCPU.
        vcpu: usize,
        /// The system's error.
        source: std::io::Error,
    },
    /// The guest did not finish a command in time.
    #[error("vCPU {vcpu}: no answer from the guest within {timeout:?} to {op:?}")]
    Timeout {
        /// The vCPU.
        vcpu: usize,
        /// The command.
        op: Op,
        /// How long the host waited.
        timeout: Duration,
    },
    /// A vCPU stopped while the host waited for it.
    #[error("vCPU {0} stopped while the host was waiting for it")]
    Stopped(usize),
    /// A vCPU thread panicked.
    #[error("vCPU {0}'s thread panicked")]
    Panicked(usize),
    /// A vCPU did not stop within 10 s of being asked at shutdown.
    #[error("vCPU {0} did not stop when asked")]
    Stuck(usize),
    /// An earlier command timed out or its wait was interrupted on this vCPU, which may still
    /// be running it.
    #[error("vCPU {0} takes no command since one timed out or was interrupted")]
    Wedged(usize),
    /// A verify command found a page that does not hold its pattern.
    #[error("guest found {found:#x} at {gpa:#x} where the host had written {expected:#x}")]
    GuestSawWrongData {
        /// The address.
        gpa: u64,
        /// What the guest read.
        found: u64,
        /// What the host had written.
        expected: u64,
    },
    /// The host could not read guest memory.
    #[error("host read at {gpa:#x} failed: {source}")]
    HostRead {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// The host could not write guest memory.
    #[error("host write at {gpa:#x} failed: {source}")]
    HostWrite {
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
    /// A signal asked the job to stop between two steps.
    #[error("interrupted")]
    Interrupted,
    /// The host read back something other than what the guest wrote.
    #[error("host found {found:#x} at {gpa:#x} where the guest had written {expected:#x}")]
    HostSawWrongData {
        /// The address.
        gpa: u64,
        /// What the host read.
        found: u64,
        /// What the guest had written.
        expected: u64,
    },
}

/// Checks from the host that `gpa` holds what the test guest writes there with `seed`.
pub fn expect_pattern(
    memory: &impl vm_memory::GuestMemory,
    gpa: u64,
    seed: u64,
) -> Result<(), GuestError> {
    use vm_memory::Bytes;
    let found: u64 = memory
        .read_obj(GuestAddress(gpa))
        .map_err(|source| GuestError::HostRead { gpa, source })?;
    let expected = test_guest::pattern(gpa, seed);
    if found != expected {
        return Err(GuestError::HostSawWrongData {
            gpa,
            found,
            expected,
        });
    }
    Ok(())
}

/// Checks that `slots` KVM slots in all are at least two (the system region's and one of a
/// test area) and at most `max`.
pub fn check_slot_count(slots: usize, max: usize) -> Result<(), GuestError> {
    if slots < 2 || slots > max {
        return Err(GuestError::SlotCount { asked: slots, max });
    }
    Ok(())
}

/// Starting the test guest's vCPUs (here, beside the vCPU threads they start).
impl TestVm {
    /// Creates `count` vCPUs in the guest's boot state and starts their threads; returns once
    /// each guest reported ready.
    pub fn start_vcpus(&self, count: usize, stopped: &Arc<EventFd>) -> Result<Vcpus, GuestError> {
        let kvm = self.vm.kvm();
        let mut vcpus = self.spawn_vcpus(count, stopped, false, |index, fd| {
            test_guest::layout::set_up_vcpu(kvm, fd, index)
                .map_err(|(what, source)| VmError::Setup { what, source })?;
            Ok(())
        })?;
        for index in 0..count {
            vcpus.wait_event(index, Op::Write)?;
        }
        Ok(vcpus)
    }

    /// Creates one vCPU per saved state, gives each its state, and starts their threads parked:
    /// each enters the guest at its first command (the guests were saved between commands,
    /// past reporting ready).
    pub fn start_restored_vcpus(
        &self,
        states: &[VcpuState],
        stopped: &Arc<EventFd>,
    ) -> Result<Vcpus, GuestError> {
        self.spawn_vcpus(states.len(), stopped, true, |index, fd| {
            Ok(states[index].restore(fd)?)
        })
    }

    /// Creates `count` vCPUs, sets each up with `init`, and starts their threads (`parked`:
    /// waiting for a go-ahead before they first enter the guest).
    fn spawn_vcpus(
        &self,
        count: usize,
        stopped: &Arc<EventFd>,
        parked: bool,
        init: impl Fn(usize, &VcpuFd) -> Result<(), GuestError>,
    ) -> Result<Vcpus, GuestError> {
        if count == 0 || count > test_guest::MAX_VCPUS {
            return Err(GuestError::TooManyVcpus(count));
        }
        let memory = self.vm.memory();
        let notify = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(GuestError::Notifier)?);
        let mut vcpus = Vcpus {
            memory: Arc::clone(memory),
            threads: Vec::new(),
            timeout: Duration::from_secs(120),
            interrupt: crate::lifecycle::termination_signal(),
            notify: Arc::clone(&notify),
            failure: None,
        };
        for index in 0..count {
            let fd = self.vm.create_vcpu(index)?;
            init(index, &fd)?;
            let (events_tx, events) = channel();
            let (resume, resume_rx) = channel();
            let shared = Arc::new(VcpuShared::default());
            let vcpu = Vcpu {
                index,
                fd,
                memory: Arc::clone(memory),
                shared: Arc::clone(&shared),
                ports: TestGuestPorts {
                    events: events_tx.clone(),
                    notify: Arc::clone(&notify),
                    resume: resume_rx,
                    memory: Arc::clone(memory),
                    parked,
                    mmio: self.mmio.clone(),
                },
            };
            let notify = Arc::clone(&notify);
            let thread = vcpu
                .spawn(Arc::clone(stopped), move |outcome| {
                    // The host may have gone already; nothing is left to tell then.
                    let _ = events_tx.send(match outcome {
                        Ok(()) => VcpuEvent::Stopped,
                        Err(e) => VcpuEvent::Failed(e),
                    });
                    let _ = notify.write(1);
                })
                .map_err(|source| GuestError::Thread {
                    vcpu: index,
                    source,
                })?;
            vcpus.threads.push(VcpuThread {
                thread: Some(thread),
                shared,
                events,
                resume: Some(resume),
                block: CommandBlock::new(index),
                running: None,
                posted: 0,
                wedged: false,
            });
        }
        Ok(vcpus)
    }
}

/// How long a vCPU may take to pause for a migration.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a migration needs of one test-guest vCPU: its pause, and its go-ahead channel.
#[derive(Debug)]
pub(crate) struct VcpuHandle {
    /// What the host shares with the vCPU thread (its pause).
    shared: Arc<VcpuShared>,
    /// Its go-ahead channel, for a vCPU waiting between commands (its state is read there).
    resume: Sender<GoAhead>,
    /// It runs a command (a write loop): it is paused inside the guest to read its state.
    running: bool,
}

impl PreCopyVcpu for VcpuHandle {
    /// Pauses it if it runs a command (one between commands is out of the guest already).
    fn pause(&self) -> Result<(), PauseError> {
        if self.running {
            self.shared.pause(PAUSE_TIMEOUT)
        } else {
            // Between commands it is out of the guest, and the controller posts none while a
            // migration runs.
            Ok(())
        }
    }

    /// Its state, read by its own thread.
    fn save(&self) -> Result<VcpuState, PauseError> {
        if self.running {
            return self.shared.save_paused();
        }
        match ask_idle_state(&self.resume, PAUSE_TIMEOUT) {
            Ok(state) => Ok(state?),
            Err(_) => Err(PauseError::Stopped),
        }
    }

    /// Lifts a pause (not a hold).
    fn resume(&self) {
        if self.running {
            self.shared.resume();
        }
    }

    /// Holds the pause of a vCPU that runs a command (one between commands runs none: the
    /// controller refuses guest commands while a migration holds the VM).
    fn hold(&self) {
        if self.running {
            self.shared.hold();
        }
    }

    fn release(&self) {
        if self.running {
            self.shared.release();
        }
    }
}

/// Why a vCPU between commands gave no state.
#[derive(Debug)]
enum Unanswered {
    /// Its thread has gone.
    Gone,
    /// It did not answer in time.
    Silent,
}

/// The state of a vCPU waiting between commands, read by its own thread when its go-ahead
/// channel asks.
fn ask_idle_state(
    resume: &Sender<GoAhead>,
    timeout: Duration,
) -> Result<Result<VcpuState, StateError>, Unanswered> {
    let (reply, state) = channel();
    resume
        .send(GoAhead::SaveState(reply))
        .map_err(|_| Unanswered::Gone)?;
    state.recv_timeout(timeout).map_err(|_| Unanswered::Silent)
}

/// The test guest's system region among a restored layout's regions (`ids`, in its order).
pub(super) fn system_region(
    layout: &MemoryLayout,
    ids: &[RegionId],
) -> Result<RegionId, GuestError> {
    layout
        .regions
        .iter()
        .position(|r| r.gpa == 0 && r.size == test_guest::SYSTEM_SIZE)
        .map(|i| ids[i])
        .ok_or(GuestError::NoSystemRegion)
}

#[derive(Debug)]
struct VcpuThread {
    thread: Option<JoinHandle<()>>,
    shared: Arc<VcpuShared>,
    events: Receiver<VcpuEvent>,
    /// The go-ahead after a command; dropped at shutdown so that a waiting vCPU leaves.
    resume: Option<Sender<GoAhead>>,
    block: CommandBlock,
    /// The command the guest is running, if any.
    running: Option<Command>,
    /// The sequence number of the last command posted.
    posted: u64,
    /// A command timed out: the guest may still be on it, so the vCPU takes no other.
    wedged: bool,
}

/// The running vCPUs, and the host's side of the command protocol.
#[derive(Debug)]
pub struct Vcpus {
    memory: Arc<MemoryManager<KvmVm>>,
    threads: Vec<VcpuThread>,
    timeout: Duration,
    /// Once set, waiting for a command gives up ([`GuestError::Interrupted`]): by default the
    /// process's SIGINT/SIGTERM flag, so that a long command never holds the VMM's exit.
    interrupt: &'static AtomicBool,
    /// Readable once a vCPU reported something (a command done, its loop ended).
    notify: Arc<EventFd>,
    /// The first vCPU that stopped on an error (or without being asked), once one has.
    failure: Option<VmFailure>,
}

impl Vcpus {
    /// Number of vCPUs.
    pub fn count(&self) -> usize {
        self.threads.len()
    }

    /// What vCPU `index` shares with the host (exit counts, the expected-MMIO window).
    pub fn shared(&self, index: usize) -> &Arc<VcpuShared> {
        &self.threads[index].shared
    }

    /// Sets how long [`wait`](Self::wait) waits for a command.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Posts `command` to vCPU `index` and lets it run; [`wait`](Self::wait) collects it. A
    /// vCPU whose last command timed out takes no new one: `wait` reports that.
    pub fn start(&mut self, index: usize, command: Command) {
        let vcpu = &mut self.threads[index];
        assert!(
            vcpu.running.is_none(),
            "vCPU {index} is still running a command"
        );
        vcpu.running = Some(command);
        if vcpu.wedged {
            return;
        }
        vcpu.posted = vcpu.block.post(&*self.memory.current(), &command);
        // A vCPU that stopped has dropped its receiver; `wait` reports why.
        if let Some(resume) = &vcpu.resume {
            let _ = resume.send(GoAhead::Resume);
        }
    }

    /// Every vCPU's state, read by its own thread while it waits between commands.
    pub fn save_states(&mut self) -> Result<Vec<VcpuState>, GuestError> {
        let mut states = Vec::with_capacity(self.threads.len());
        for (index, vcpu) in self.threads.iter().enumerate() {
            let resume = match &vcpu.resume {
                Some(resume) if vcpu.running.is_none() && !vcpu.wedged => resume,
                _ => return Err(GuestError::Busy(index)),
            };
            match ask_idle_state(resume, Duration::from_secs(10)) {
                Ok(state) => states.push(state?),
                Err(Unanswered::Gone) => return Err(GuestError::Stopped(index)),
                Err(Unanswered::Silent) => return Err(GuestError::Busy(index)),
            }
        }
        Ok(states)
    }

    /// The command vCPU `index` is running, if any (a write loop runs until stopped).
    pub(super) fn running(&self, index: usize) -> Option<Command> {
        self.threads[index].running
    }

    /// What a migration needs of each vCPU; refused while one is wedged or stopped, or runs a
    /// command other than a write loop (a client waits for its answer, here).
    pub(super) fn migration_handles(&self) -> Result<Vec<VcpuHandle>, GuestError> {
        self.threads
            .iter()
            .enumerate()
            .map(|(index, vcpu)| match &vcpu.resume {
                Some(resume)
                    if !vcpu.wedged
                        && !vcpu.shared.has_finished()
                        && vcpu.running.is_none_or(|c| c.op == Op::WriteLoop) =>
                {
                    Ok(VcpuHandle {
                        shared: Arc::clone(&vcpu.shared),
                        resume: resume.clone(),
                        running: vcpu.running.is_some(),
                    })
                }
                _ => Err(GuestError::Busy(index)),
            })
            .collect()
    }

    /// Takes up the commands restored vCPUs were on when they were saved (a migrated or
    /// snapshotted guest in a write loop) and lets those vCPUs run on; the others wait for
    /// their next command. A vCPU that runs a command already is left as it is.
    pub(super) fn resume_unfinished(&mut self) {
        for vcpu in self.threads.iter_mut().filter(|v| v.running.is_none()) {
            let Some((command, seq)) = vcpu.block.unfinished(&*self.memory.current()) else {
                continue;
            };
            vcpu.running = Some(command);
            vcpu.posted = seq;
            if let Some(resume) = &vcpu.resume {
                let _ = resume.send(GoAhead::Resume);
            }
        }
    }

    /// Asks vCPU `index`'s write loop to end after its current pass.
    pub fn stop_loop(&self, index: usize) {
        self.threads[index].block.stop(&*self.memory.current());
    }

    /// Asks vCPU `index`'s command to end where it is (see [`CommandBlock::cancel`]); its
    /// answer says how far it got ([`Outcome::cut_at`]).
    pub(super) fn cancel(&self, index: usize) {
        self.threads[index].block.cancel(&*self.memory.current());
    }

    /// Readable once a vCPU has reported something since the last [`poll`](Self::poll)s:
    /// for an event loop to wait on (edge of news, not a count: read it to re-arm).
    pub(super) fn notifier(&self) -> &EventFd {
        &self.notify
    }

    /// The first vCPU that stopped on an error or without being asked, once one has: the
    /// guest cannot run again.
    pub(super) fn failure(&self) -> Option<&VmFailure> {
        self.failure.as_ref()
    }

    /// Takes note of vCPU `index` having stopped, with `error` or without being asked: the
    /// first such is the VM's failure.
    fn note_failure(&mut self, index: usize, error: Option<&VcpuError>) {
        if self.failure.is_some() {
            return;
        }
        let loop_rip = self.threads[index].shared.failed_rip();
        let (reason, rip, message) = match error {
            Some(e) => {
                let (reason, rip) = match e {
                    VcpuError::TripleFault { rip, .. } => (FailureReason::TripleFault, Some(*rip)),
                    VcpuError::HostLimitation { rip, .. }
                    | VcpuError::EmulationFailure { rip, .. } => {
                        (FailureReason::InternalError, Some(*rip))
                    }
                    VcpuError::Device {
                        error: GuestPortError::Fault(fault),
                        ..
                    } => (FailureReason::Exception, Some(fault.rip())),
                    _ => (FailureReason::Error, loop_rip),
                };
                (reason, rip, e.to_string())
            }
            None => (
                FailureReason::Stopped,
                loop_rip,
                format!("vCPU {index}'s thread ended without being asked to"),
            ),
        };
        self.failure = Some(VmFailure {
            vcpu: index,
            reason,
            rip,
            message,
        });
    }

    /// What vCPU `index`'s report means to the host (`None`: it has gone without one): `Ok`
    /// for a command done; a vCPU that stopped is the VM's failure.
    fn take_event(&mut self, index: usize, event: Option<VcpuEvent>) -> Result<(), GuestError> {
        match event {
            Some(VcpuEvent::Done) => Ok(()),
            Some(VcpuEvent::Failed(e)) => {
                self.note_failure(index, Some(&e));
                Err(e.into())
            }
            Some(VcpuEvent::Stopped) | None => {
                self.note_failure(index, None);
                Err(GuestError::Stopped(index))
            }
        }
    }

    /// The answer to vCPU `index`'s command, if it has come (never waits): the command, and
    /// what the guest reported or why it gave no report. `None` while it runs, or if the vCPU
    /// runs none.
    pub fn poll(&mut self, index: usize) -> Option<(Command, Result<Outcome, GuestError>)> {
        let command = self.threads[index].running?;
        let answered = loop {
            let vcpu = &self.threads[index];
            if vcpu.wedged {
                break Err(GuestError::Wedged(index));
            }
            let event = match vcpu.events.try_recv() {
                Ok(event) => Some(event),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) => return None,
            };
            if let Err(e) = self.take_event(index, event) {
                break Err(e);
            }
            // Only the answer to this command counts (the guest numbers them).
            let vcpu = &self.threads[index];
            if vcpu.block.done_seq(&*self.memory.current()) == vcpu.posted {
                break Ok(());
            }
        };
        self.threads[index].running = None;
        Some((
            command,
            answered.and_then(|()| self.reported(index, command)),
        ))
    }

    /// What the guest reported for `command`, its last on vCPU `index`.
    fn reported(&self, index: usize, command: Command) -> Result<Outcome, GuestError> {
        let outcome = self.threads[index]
            .block
            .outcome(&*self.memory.current(), command.op);
        if let Some((gpa, found)) = outcome.mismatch {
            // A stub returns its own address; data holds its address ^ seed.
            let expected = match command.op {
                Op::Exec | Op::Call => gpa,
                _ => test_guest::pattern(gpa, command.seed),
            };
            return Err(GuestError::GuestSawWrongData {
                gpa,
                found,
                expected,
            });
        }
        Ok(outcome)
    }

    /// Write-loop passes vCPU `index` has completed so far.
    pub fn passes(&self, index: usize) -> u64 {
        self.threads[index].block.passes(&*self.memory.current())
    }

    /// Has waits give up once `interrupt` is set.
    pub fn set_interrupt(&mut self, interrupt: &'static AtomicBool) {
        self.interrupt = interrupt;
    }

    fn wait_event(&mut self, index: usize, op: Op) -> Result<(), GuestError> {
        let timeout = self.timeout;
        let deadline = Instant::now() + timeout;
        // In slices, to see the interrupt flag (a signal handler cannot wake a channel).
        let event = loop {
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(20));
            match self.threads[index].events.recv_timeout(slice) {
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {
                    if self.interrupt.load(Ordering::Acquire) {
                        return Err(GuestError::Interrupted);
                    }
                }
                event => break event,
            }
        };
        match event {
            Ok(event) => self.take_event(index, Some(event)),
            Err(RecvTimeoutError::Disconnected) => self.take_event(index, None),
            Err(RecvTimeoutError::Timeout) => Err(GuestError::Timeout {
                vcpu: index,
                op,
                timeout,
            }),
        }
    }

    /// Waits for vCPU `index` to finish its command; returns what the guest reported.
    pub fn wait(&mut self, index: usize) -> Result<Outcome, GuestError> {
        let command = self.threads[index]
            .running
            .take()
            .expect("wait follows start");
        if self.threads[index].wedged {
            return Err(GuestError::Wedged(index));
        }
        // Only the answer to this command counts (the guest numbers them).
        loop {
            if let Err(e) = self.wait_event(index, command.op) {
                // The guest may still be on the command: the vCPU takes no other.
                if matches!(e, GuestError::Timeout { .. } | GuestError::Interrupted) {
                    self.threads[index].wedged = true;
                }
                return Err(e);
            }
            let vcpu = &self.threads[index];
            if vcpu.block.done_seq(&*self.memory.current()) == vcpu.posted {
                break;
            }
        }
        self.reported(index, command)
    }

    /// Runs `command` on vCPU `index` to the end.
    pub fn run(&mut self, index: usize, command: Command) -> Result<Outcome, GuestError> {
        self.start(index, command);
        self.wait(index)
    }

    /// Ends every vCPU: the exit command for those between commands, a kick for the others;
    /// joins their threads. Returns the first error a vCPU stopped with.
    pub fn shut_down(mut self) -> Result<(), GuestError> {
        let mut first_error = None;
        for index in 0..self.threads.len() {
            let vcpu = &mut self.threads[index];
            vcpu.shared.request_stop();
            if vcpu.running.is_none() && !vcpu.wedged {
                vcpu.block.post(&*self.memory.current(), &Command::exit());
                if let Some(resume) = &vcpu.resume {
                    let _ = resume.send(GoAhead::Resume);
                }
            } else {
                vcpu.block.stop(&*self.memory.current());
            }
            // With no sender left, a vCPU waiting for a go-ahead after its last command leaves.
            vcpu.resume = None;
        }
        for (index, vcpu) in self.threads.iter_mut().enumerate() {
            let Some(thread) = vcpu.thread.take() else {
                continue;
            };
            // A vCPU inside the guest leaves at its next exit; a signal makes one come soon.
            if !kick_until_finished(&thread, Duration::from_secs(10)) {
                // Never wait forever for a vCPU: leave its thread behind and say so.
                first_error.get_or_insert(GuestError::Stuck(index));
                continue;
            }
            if thread.join().is_err() && first_error.is_none() {
                first_error = Some(GuestError::Panicked(index));
            }
            while let Ok(event) = vcpu.events.try_recv() {
                if let VcpuEvent::Failed(e) = event {
                    first_error.get_or_insert(e.into());
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
