//! A vCPU thread: runs the guest and carries out what the exit handler decides.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use kvm_ioctls::VcpuFd;
use kvm_memslots::{GuestMemorySlots, KvmVm, MemoryManager};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use crate::test_guest::Fault;
use crate::vm::exit::{handle_exit, Action, Exit, ExitContext, ExitError, PortBus};

/// The test guest's ports: its command protocol, nothing else.
static TEST_GUEST_PORTS: LazyLock<PortBus> = LazyLock::new(PortBus::test_guest);

extern "C" fn ignore_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that kicks a vCPU thread out of `KVM_RUN` (its run then fails with `EINTR`).
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the kick signal's handler (a no-op: the signal only has to interrupt `KVM_RUN`),
/// once per process.
pub fn install_kick_handler() {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), ignore_signal)
            .expect("SIGRTMIN is a valid signal for a handler");
    });
}

/// Kicks the vCPU thread `thread` out of the guest until it has finished, for at most
/// `timeout` (a kick can land just before the thread enters the guest, so one is not enough).
/// Returns whether the thread finished.
pub fn kick_until_finished<T>(thread: &std::thread::JoinHandle<T>, timeout: Duration) -> bool {
    use vmm_sys_util::signal::Killable;
    let deadline = std::time::Instant::now() + timeout;
    while !thread.is_finished() && std::time::Instant::now() < deadline {
        let _ = thread.kill(kick_signal());
        std::thread::sleep(Duration::from_millis(1));
    }
    thread.is_finished()
}

/// Counts of the exits a vCPU handled, readable while it runs.
#[derive(Debug, Default)]
pub struct ExitCounters {
    /// Every exit.
    pub exits: AtomicU64,
    /// Accesses to memory that was away during a slot change, finished against the map.
    pub completed_after_change: AtomicU64,
    /// Exits inside the expected window.
    pub expected: AtomicU64,
    /// Writes to read-only slots, dropped.
    pub read_only_writes: AtomicU64,
}

/// What the host and a vCPU thread share.
#[derive(Debug, Default)]
pub struct VcpuShared {
    /// Exit counts.
    pub counters: ExitCounters,
    /// Where MMIO exits are expected (see [`ExitContext::expected_mmio`]).
    pub expected_mmio: Mutex<Option<Range<u64>>>,
    /// Set to make the vCPU stop at its next exit.
    pub stop: AtomicBool,
}

/// Why a vCPU stopped other than by the guest's exit command.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// The exit handler gave up.
    #[error("vCPU {vcpu}: {error}")]
    Exit {
        /// The vCPU.
        vcpu: usize,
        /// Why.
        error: ExitError,
    },
    /// The guest took an exception.
    #[error("vCPU {vcpu}: the guest took {fault}")]
    Fault {
        /// The vCPU.
        vcpu: usize,
        /// What the guest's fault block says.
        fault: Fault,
    },
    /// `KVM_RUN` failed.
    #[error("vCPU {vcpu}: KVM_RUN failed: {source}")]
    Run {
        /// The vCPU.
        vcpu: usize,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// Finishing an access against the memory map failed.
    #[error("vCPU {vcpu}: finishing an access at {gpa:#x} against memory failed: {source}")]
    Memory {
        /// The vCPU.
        vcpu: usize,
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
}

/// What a vCPU thread tells the host.
#[derive(Debug)]
pub enum VcpuEvent {
    /// The guest finished a command (or is ready for its first one); the vCPU waits for the
    /// host's go-ahead before it enters the guest again.
    Done,
    /// The vCPU stopped: the guest exited, or the host asked it to stop.
    Stopped,
    /// The vCPU stopped on an error.
    Failed(VcpuError),
}

/// One vCPU, ready to run on its own thread.
pub struct Vcpu {
    /// Its index (and KVM vCPU id).
    pub index: usize,
    /// KVM's vCPU.
    pub fd: VcpuFd,
    /// The guest's memory.
    pub memory: Arc<MemoryManager<KvmVm>>,
    /// Shared with the host.
    pub shared: Arc<VcpuShared>,
    /// Where events go.
    pub events: Sender<VcpuEvent>,
    /// The host's go-ahead after [`VcpuEvent::Done`].
    pub resume: Receiver<()>,
    /// Signalled when the vCPU stops, for the VMM's event loop.
    pub stopped: Arc<EventFd>,
}

impl Vcpu {
    /// Runs the guest until it exits, the host stops it or an error; reports how it ended.
    pub fn run(mut self) {
        let event = match self.run_loop() {
            Ok(()) => VcpuEvent::Stopped,
            Err(e) => VcpuEvent::Failed(e),
        };
        // The host may have gone already; nothing is left to tell then.
        let _ = self.events.send(event);
        let _ = self.stopped.write(1);
    }

    fn run_loop(&mut self) -> Result<(), VcpuError> {
        let Vcpu {
            index,
            fd,
            memory,
            shared,
            events,
            resume,
            ..
        } = self;
        let vcpu = *index;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            let sequence_at_entry = memory.change_sequence();
            let (exit, mut read_buffer) =
                Exit::from_kvm(fd.run()).map_err(|source| VcpuError::Run { vcpu, source })?;
            shared.counters.exits.fetch_add(1, Ordering::Relaxed);
            let mmio = matches!(exit, Exit::MmioRead { .. } | Exit::MmioWrite { .. });
            loop {
                // The sequence first, then the map: a map loaded after an even sequence holds
                // every change that sequence counts. `load` borrows the version without a
                // shared reference-count update, so exits on several vCPUs do not contend.
                let sequence_now = memory.change_sequence();
                let map = memory.load();
                // A change may have been published between the two loads (its odd step comes
                // before its publication): the map would then be newer than `sequence_now`
                // says, and an exit from before that change would look like a mismatch.
                if mmio && memory.change_sequence() != sequence_now {
                    continue;
                }
                let guest_memory = GuestMemorySlots::of(&map);
                let expected_mmio = if mmio {
                    shared
                        .expected_mmio
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone()
                } else {
                    None
                };
                let ctx = ExitContext {
                    memory: &map,
                    sequence_at_entry,
                    sequence_now,
                    expected_mmio,
                    ports: &TEST_GUEST_PORTS,
                };
                let memory_error = |gpa: u64| move |source| VcpuError::Memory { vcpu, gpa, source };
                match handle_exit(&exit, &ctx) {
                    Action::WaitForChange => {
                        while memory.change_sequence() % 2 == 1 {
                            if shared.stop.load(Ordering::Acquire) {
                                return Ok(());
                            }
                            std::thread::sleep(Duration::from_micros(20));
                        }
                        continue;
                    }
                    Action::Resume => {}
                    Action::CommandDone => {
                        // Waiting for the next command may take long: pin no map version
                        // (and none of its mappings) meanwhile.
                        drop(map);
                        if events.send(VcpuEvent::Done).is_err() || resume.recv().is_err() {
                            // The host is gone: nobody will post another command.
                            return Ok(());
                        }
                    }
                    Action::GuestExit => return Ok(()),
                    Action::WriteMemory { gpa, data } => {
                        guest_memory
                            .write_slice(&data, gpa)
                            .map_err(memory_error(gpa.0))?;
                        shared
                            .counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    Action::ReadMemory { gpa, len } => {
                        let buffer = read_buffer
                            .as_deref_mut()
                            .expect("a read exit has a buffer");
                        guest_memory
                            .read_slice(&mut buffer[..len], gpa)
                            .map_err(memory_error(gpa.0))?;
                        shared
                            .counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    Action::CountExpected => {
                        if let Some(buffer) = read_buffer.as_deref_mut() {
                            buffer.fill(0xff);
                        }
                        shared.counters.expected.fetch_add(1, Ordering::Relaxed);
                    }
                    Action::DropReadOnlyWrite => {
                        shared
                            .counters
                            .read_only_writes
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    Action::GuestFault => {
                        let fault = Fault::read(guest_memory);
                        return Err(VcpuError::Fault { vcpu, fault });
                    }
                    Action::Fatal(error) => return Err(VcpuError::Exit { vcpu, error }),
                    // The test guest's bus has no devices and no default.
                    Action::DeviceRead { .. }
                    | Action::DeviceWrite { .. }
                    | Action::ReadAllOnes => {
                        let (port, write) = match exit {
                            Exit::IoOut { port, .. } => (port, true),
                            Exit::IoIn { port, .. } => (port, false),
                            _ => (0, false),
                        };
                        let error = ExitError::UnexpectedPort { port, write };
                        return Err(VcpuError::Exit { vcpu, error });
                    }
                }
                break;
            }
        }
    }
}
