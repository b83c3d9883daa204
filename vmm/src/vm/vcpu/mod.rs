//! The vCPU thread: the one exit loop every guest kind runs. It enters the guest, turns the exit
//! into an [`ExitAction`] with the pure handler, carries out what concerns memory (finishing an
//! access that hit a slot while it was away, counting expected exits) and hands port accesses
//! to the guest kind's [`VcpuPorts`], which is all a guest kind supplies: its port bus and what
//! its devices do. What the host holds of a running vCPU (kick, stop, pause: [`VcpuShared`])
//! and its exit counts ([`ExitCounters`]) are in modules of their own.

mod counters;
mod shared;

pub(crate) use counters::exit_totals;
pub use counters::ExitCounters;
pub use shared::VcpuShared;
pub(crate) use shared::{install_kick_handler, kick_until_finished, PauseError};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use kvm_ioctls::VcpuFd;
use kvm_memslots::{GuestMemorySlots, KvmVm, MemoryManager};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use crate::vm::exit::{
    handle_exit, Exit, ExitAction, ExitContext, ExitError, KVM_INTERNAL_ERROR_EMULATION,
};
use crate::vm::memory_gone;
use crate::vm::mmio::MmioBus;
use crate::vm::ports::PortBus;

/// Whether the vCPU goes on after a port access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Enter the guest again.
    Continue,
    /// Stop the vCPU without an error (the guest left, or nobody will drive it again).
    Stop,
}

/// What a guest kind supplies to the exit loop: its port bus and what its devices do. The loop
/// calls it only for port accesses, never with a map version held, so a device may block (the
/// test guest waits there for the host's next command).
pub trait VcpuPorts: Send {
    /// The guest kind's devices, as its bus names them.
    type Device: Copy + std::fmt::Debug;
    /// Why a device stopped the vCPU.
    type Error: std::error::Error + Send + 'static;

    /// The port bus the exit handler routes accesses with.
    fn bus(&self) -> &PortBus<Self::Device>;

    /// Called once on the vCPU's thread before it first enters the guest; `Stop` ends the
    /// vCPU there.
    fn before_run(&mut self, vcpu: &VcpuFd) -> Flow {
        let _ = vcpu;
        Flow::Continue
    }

    /// The guest reads `data.len()` bytes from `device` at `offset`: fill `data`.
    fn read(
        &mut self,
        device: Self::Device,
        offset: u16,
        data: &mut [u8],
    ) -> Result<Flow, Self::Error>;

    /// Device windows and absent memory where there is no slot (none by default).
    fn mmio(&self) -> Option<&MmioBus> {
        None
    }

    /// The guest reads `data.len()` bytes of MMIO device `device` at `offset`: fill `data`.
    fn mmio_read(
        &mut self,
        device: usize,
        offset: u64,
        data: &mut [u8],
    ) -> Result<Flow, Self::Error> {
        let _ = (device, offset);
        data.fill(0xff);
        Ok(Flow::Continue)
    }

    /// The guest writes `data` to MMIO device `device` at `offset`.
    fn mmio_write(&mut self, device: usize, offset: u64, data: &[u8]) -> Result<Flow, Self::Error> {
        let _ = (device, offset, data);
        Ok(Flow::Continue)
    }

    /// The guest writes `data` to `device` at `offset`. `vcpu` is the vCPU, out of
    /// `KVM_RUN`: a device that blocks here (the test guest between commands) may read or set
    /// its state meanwhile.
    fn write(
        &mut self,
        vcpu: &VcpuFd,
        device: Self::Device,
        offset: u16,
        data: &[u8],
    ) -> Result<Flow, Self::Error>;
}

/// Why a vCPU stopped other than by request; `E` is the guest kind's device error.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError<E: std::error::Error + 'static> {
    /// `KVM_RUN` failed.
    #[error("vCPU {vcpu}: KVM_RUN failed: {source}")]
    Run {
        /// The vCPU.
        vcpu: usize,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// `KVM_EXIT_INTERNAL_ERROR` in guest ring 0 on a host that emulates it (kvm_pvm), with no
    /// slot change under way: the emulator met an instruction it does not have.
    #[error("vCPU {vcpu} at rip {rip:#x} (KVM suberror {suberror}): KVM could not emulate a guest instruction (KVM_EXIT_INTERNAL_ERROR) and no slot change was under way; on a host without hardware virtualisation (kvm_pvm) guest ring 0 runs in KVM's instruction emulator, which lacks some instructions: a limitation of the host, not a VMM crash")]
    HostLimitation {
        /// The vCPU.
        vcpu: usize,
        /// The guest's instruction pointer.
        rip: u64,
        /// KVM's `internal.suberror` (1: emulation failure).
        suberror: u32,
    },
    /// `KVM_EXIT_INTERNAL_ERROR`, emulation failure, in guest ring 0 with no slot change under
    /// way, where the host runs the guest's ring 0 on the CPU (hardware virtualisation): most
    /// likely the guest ran an instruction KVM's emulator lacks where it has no memory. (At
    /// CPL > 0 the guest gets `#UD` instead.)
    #[error("vCPU {vcpu} at rip {rip:#x} (ring {cpl}): KVM could not emulate a guest instruction (KVM_EXIT_INTERNAL_ERROR, emulation failure) and no slot change was under way: most likely the guest ran an instruction KVM's emulator lacks (a VEX/AVX load or store, an instruction fetch) at a guest address with no memory slot (a device window, or memory that is not there), not a limitation of the host")]
    EmulationFailure {
        /// The vCPU.
        vcpu: usize,
        /// The guest's instruction pointer.
        rip: u64,
        /// The guest's privilege level (CS.DPL).
        cpl: u8,
    },
    /// Injecting `#UD` into the guest (an instruction KVM could not emulate in guest user
    /// mode) failed.
    #[error("vCPU {vcpu} at rip {rip:#x}: KVM could not emulate a guest instruction in user mode, and injecting #UD into the guest failed: {source}")]
    InjectInvalidOpcode {
        /// The vCPU.
        vcpu: usize,
        /// The guest's instruction pointer.
        rip: u64,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// The guest triple-faulted (or a reset by triple fault, `reboot=t`).
    #[error("vCPU {vcpu}: the guest shut down (triple fault) at rip {rip:#x}")]
    TripleFault {
        /// The vCPU.
        vcpu: usize,
        /// Its instruction pointer.
        rip: u64,
    },
    /// The exit handler gave up.
    #[error("vCPU {vcpu}: {error}")]
    Exit {
        /// The vCPU.
        vcpu: usize,
        /// Why.
        error: ExitError,
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
    /// Collecting the dirty rings when this vCPU's was full failed (the entries collected are
    /// kept for the next harvest).
    #[error("vCPU {vcpu}: its dirty ring is full, and collecting the rings failed: {source}")]
    DirtyRing {
        /// The vCPU.
        vcpu: usize,
        /// The manager's error.
        source: kvm_memslots::Error,
    },
    /// Guest memory was gone under the VM: its backing file (a file-backed restore's memory
    /// file) was truncated or replaced, and an access got `SIGBUS`.
    #[error(
        "vCPU {vcpu}: guest memory at {place} is gone: its backing file was truncated or \
         replaced under the VM; the VM stopped, and nothing of it can be saved"
    )]
    MemoryGone {
        /// The vCPU.
        vcpu: usize,
        /// Where: the guest address, the region and the file, as far as known.
        place: String,
    },
    /// A device of the guest kind stopped the vCPU.
    #[error("vCPU {vcpu}: {error}")]
    Device {
        /// The vCPU.
        vcpu: usize,
        /// The device's error.
        error: E,
    },
}

/// One vCPU, ready to run on its own thread.
#[derive(Debug)]
pub(crate) struct Vcpu<P> {
    /// Its index (and KVM vCPU id).
    pub(crate) index: usize,
    /// KVM's vCPU, set up.
    pub(crate) fd: VcpuFd,
    /// The guest's memory.
    pub(crate) memory: Arc<MemoryManager<KvmVm>>,
    /// Shared with the host.
    pub(crate) shared: Arc<VcpuShared>,
    /// The guest kind's ports.
    pub(crate) ports: P,
}

impl<P: VcpuPorts + 'static> Vcpu<P> {
    /// Starts the vCPU on a thread of its own (named `vcpuN`). When the loop ends, the thread
    /// passes its outcome to `finish`, then signals `stopped` (the event loop's wake-up) and
    /// returns what `finish` returned.
    pub(crate) fn spawn<T: Send + 'static>(
        self,
        stopped: Arc<EventFd>,
        finish: impl FnOnce(Result<(), VcpuError<P::Error>>) -> T + Send + 'static,
    ) -> std::io::Result<JoinHandle<T>> {
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.index))
            .spawn(move || {
                self.shared.thread_started();
                let shared = Arc::clone(&self.shared);
                let outcome = self.run();
                shared.thread_ending();
                let outcome = finish(outcome);
                // The loop may have gone already; nothing is left to tell then.
                let _ = stopped.write(1);
                outcome
            })
    }
}

fn rip(fd: &VcpuFd) -> u64 {
    fd.get_regs().map(|r| r.rip).unwrap_or(u64::MAX)
}

/// `internal.suberror` of the run area, after a run that ended in `KVM_EXIT_INTERNAL_ERROR`.
fn internal_suberror(fd: &mut VcpuFd) -> u32 {
    let kvm_run = fd.get_kvm_run();
    // SAFETY: the last KVM_RUN ended in KVM_EXIT_INTERNAL_ERROR (the only caller's exit), for
    // which KVM fills the `internal` member of the union (`emulation_failure` shares its
    // first fields); reading a u32 of it is always defined.
    unsafe { kvm_run.__bindgen_anon_1.internal.suberror }
}

/// Queues `#UD` (vector 6, no error code) for the guest's next entry: KVM left RIP on the
/// instruction it could not emulate, so the guest sees a fault there, as it would for an
/// instruction the CPU lacks. The vCPU's other events (a pending interrupt, NMI, interrupt
/// shadow) are read first and set back as they were.
fn inject_invalid_opcode(fd: &VcpuFd) -> Result<(), kvm_ioctls::Error> {
    const UD_VECTOR: u8 = 6;
    let mut events = fd.get_vcpu_events()?;
    events.exception.injected = 1;
    events.exception.pending = 0;
    events.exception.nr = UD_VECTOR;
    events.exception.has_error_code = 0;
    events.exception.error_code = 0;
    events.exception_has_payload = 0;
    fd.set_vcpu_events(&events)
}

/// Waits while a slot change is being applied; false if the vCPU was asked to stop meanwhile.
fn wait_for_change(memory: &MemoryManager<KvmVm>, shared: &VcpuShared) -> bool {
    memory.wait_settled(|| shared.stop_requested()).is_some()
}

impl<P: VcpuPorts> Vcpu<P> {
    /// Runs the guest until the host asks the vCPU to stop or a device says so (`Ok`), or an
    /// error stops it.
    fn run(self) -> Result<(), VcpuError<P::Error>> {
        let Vcpu {
            index: vcpu,
            mut fd,
            memory,
            shared,
            mut ports,
        } = self;
        if ports.before_run(&fd) == Flow::Stop {
            return Ok(());
        }
        let ended = Self::exit_loop(vcpu, &mut fd, &memory, &shared, &mut ports);
        if ended.is_err() {
            // Where the guest was, for whoever reports the failure.
            shared.set_failed_rip(rip(&fd));
        }
        ended
    }

    /// Enters the guest and handles its exits until the host asks the vCPU to stop or a
    /// device says so (`Ok`), or an error stops it.
    fn exit_loop(
        vcpu: usize,
        fd: &mut VcpuFd,
        memory: &MemoryManager<KvmVm>,
        shared: &VcpuShared,
        ports: &mut P,
    ) -> Result<(), VcpuError<P::Error>> {
        let (mut immediate_exit, mut interrupted) = (false, false);
        loop {
            if shared.stop_requested() {
                return Ok(());
            }
            if let Some(hva) = memory_gone::memory_gone() {
                return Err(VcpuError::MemoryGone {
                    vcpu,
                    place: memory_gone::gone_place(memory, hva),
                });
            }
            // A pause parks the vCPU at a whole instruction: KVM finishes what the last exit
            // left pending (a port or MMIO read's data goes into the guest on the next entry)
            // in a run with `immediate_exit` set, which returns at once without entering the
            // guest. That run's return is the point to park at.
            if immediate_exit && interrupted {
                fd.set_kvm_immediate_exit(0);
                immediate_exit = false;
                if shared.pause_requested() && !shared.park(fd) {
                    return Ok(());
                }
                continue;
            }
            if !immediate_exit && shared.pause_requested() {
                fd.set_kvm_immediate_exit(1);
                immediate_exit = true;
            }
            let sequence_at_entry = memory.change_sequence();
            let (exit, buffer) = match Exit::from_kvm(fd.run()) {
                Ok(exit) => exit,
                // An access to unreachable memory under a slot (an unplugged virtio-mem block
                // in a plugged piece) that KVM did not say where: its slot goes, and the
                // access, run again, exits as absent memory. Bounded: once nothing is left to
                // isolate, the same fault is fatal. A file cut under the VM is named below
                // instead.
                Err(source)
                    if source.errno() == libc::EFAULT
                        && memory_gone::cut_memory(memory).is_none()
                        && ports.mmio().is_some_and(|bus| bus.isolate(None)) =>
                {
                    shared
                        .counters
                        .unreachable_isolated
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(source) => {
                    return Err(
                        match (source.errno() == libc::EFAULT)
                            .then(|| memory_gone::cut_memory(memory))
                        {
                            Some(Some(place)) => VcpuError::MemoryGone { vcpu, place },
                            _ => VcpuError::Run { vcpu, source },
                        },
                    )
                }
            };
            // kvm-ioctls leaves an internal error's suberror in the run area; what an emulation
            // failure does depends on the privilege level (an unreadable one counts as ring 0,
            // the fatal side).
            let (exit, mut buffer) = match exit {
                Exit::InternalError { .. } => {
                    let cpl = fd.get_sregs().map_or(0, |s| s.cs.dpl);
                    (Exit::internal_error(internal_suberror(fd), cpl), None)
                }
                exit => (exit, buffer),
            };
            let counters = &shared.counters;
            counters.by_kind[exit.kind()].fetch_add(1, Ordering::Relaxed);
            // KVM said where: a page of a file cut under the VM is named exactly (other
            // memory faults are the handler's fatal error, with the address).
            if let Exit::MemoryFault { gpa, .. } = exit {
                if let Some(place) = memory_gone::cut_at(memory, gpa) {
                    return Err(VcpuError::MemoryGone { vcpu, place });
                }
                // Unreachable memory under a slot, as above, where KVM said where.
                if ports.mmio().is_some_and(|bus| bus.isolate(Some(gpa))) {
                    counters
                        .unreachable_isolated
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            interrupted = matches!(exit, Exit::Interrupted);
            let mmio = exit.is_mmio();
            let memory_error = |gpa: u64| move |source| VcpuError::Memory { vcpu, gpa, source };
            let action = loop {
                // A sequence and a map that agree (the manager re-reads the sequence around
                // the load). `load_consistent` borrows the version without a shared
                // reference-count update, so exits on several vCPUs do not contend.
                let (sequence_now, map) = memory.load_consistent();
                let expected_mmio = if mmio {
                    let window = shared.expected_mmio.lock();
                    window.unwrap_or_else(|p| p.into_inner()).clone()
                } else {
                    None
                };
                let ctx = ExitContext {
                    memory: &map,
                    sequence_at_entry,
                    sequence_now,
                    expected_mmio,
                    ports: ports.bus(),
                    mmio: ports.mmio(),
                };
                match handle_exit(&exit, &ctx) {
                    ExitAction::WaitForChange => {
                        // A slot is away for a moment: wait for the change (pinning no map
                        // version), then handle the exit again against the map afterwards.
                        drop(map);
                        if !wait_for_change(memory, shared) {
                            return Ok(());
                        }
                    }
                    ExitAction::WriteMemory { gpa, data } => {
                        GuestMemorySlots::of(&map)
                            .write_slice(&data, gpa)
                            .map_err(memory_error(gpa.0))?;
                        counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                        break ExitAction::Resume;
                    }
                    ExitAction::ReadMemory { gpa, len } => {
                        let buffer = buffer.as_deref_mut().expect("a read exit has a buffer");
                        GuestMemorySlots::of(&map)
                            .read_slice(&mut buffer[..len], gpa)
                            .map_err(memory_error(gpa.0))?;
                        counters
                            .completed_after_change
                            .fetch_add(1, Ordering::Relaxed);
                        break ExitAction::Resume;
                    }
                    // The map version is let go here: what follows may block.
                    action => break action,
                }
            };
            let device_error = |error| VcpuError::Device { vcpu, error };
            let flow = match action {
                ExitAction::Resume => Flow::Continue,
                ExitAction::RetryAfterChange => {
                    // KVM left RIP on the instruction: the next entry runs it, against the
                    // slots as they are now.
                    counters
                        .retried_after_change
                        .fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::InjectInvalidOpcode => {
                    inject_invalid_opcode(fd).map_err(|source| VcpuError::InjectInvalidOpcode {
                        vcpu,
                        rip: rip(fd),
                        source,
                    })?;
                    if counters
                        .invalid_opcodes_injected
                        .fetch_add(1, Ordering::Relaxed)
                        == 0
                    {
                        eprintln!(
                            "tinyvmm: vCPU {vcpu} at rip {:#x}: KVM could not emulate a guest \
                             user-mode instruction (a VEX/AVX access or an instruction fetch \
                             where the guest has no memory) and no slot change was under way; \
                             the guest gets #UD, as KVM gives it without \
                             KVM_CAP_EXIT_ON_EMULATION_FAILURE (reported once per vCPU)",
                            rip(fd)
                        );
                    }
                    Flow::Continue
                }
                ExitAction::CountExpected => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    counters.expected.fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::DropReadOnlyWrite => {
                    counters.read_only_writes.fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                ExitAction::CollectDirtyRings => {
                    // Never fatal: the entries go into the regions' pending bits for the next
                    // harvest, and the guest goes on.
                    memory
                        .collect_dirty_rings()
                        .map_err(|source| VcpuError::DirtyRing { vcpu, source })?;
                    Flow::Continue
                }
                ExitAction::ReadAllOnes => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    Flow::Continue
                }
                ExitAction::AbsentMemory => {
                    if let Some(buffer) = buffer {
                        buffer.fill(0xff);
                    }
                    if counters.absent_memory.fetch_add(1, Ordering::Relaxed) == 0 {
                        let gpa = match exit {
                            Exit::MmioRead { gpa, .. } | Exit::MmioWrite { gpa, .. } => gpa,
                            _ => 0,
                        };
                        eprintln!(
                            "tinyvmm: vCPU {vcpu} touched absent (unplugged) memory at {gpa:#x}; \
                             reads see all ones, writes are dropped (reported once per vCPU)"
                        );
                    }
                    Flow::Continue
                }
                ExitAction::MmioRead { device, offset } => {
                    let buffer = buffer.expect("an MMIO read has a buffer");
                    ports
                        .mmio_read(device, offset, buffer)
                        .map_err(device_error)?
                }
                ExitAction::MmioWrite { device, offset } => {
                    let Exit::MmioWrite { data, .. } = exit else {
                        unreachable!("an MMIO write comes from an MmioWrite exit")
                    };
                    // At most 8 bytes: copied out of the run area, as for ports.
                    let mut bytes = [0u8; 8];
                    let len = data.len().min(bytes.len());
                    bytes[..len].copy_from_slice(&data[..len]);
                    ports
                        .mmio_write(device, offset, &bytes[..len])
                        .map_err(device_error)?
                }
                ExitAction::PortRead { device, offset } => {
                    let buffer = buffer.expect("a port read has a buffer");
                    ports.read(device, offset, buffer).map_err(device_error)?
                }
                ExitAction::PortWrite { device, offset } => {
                    let Exit::IoOut { data, .. } = exit else {
                        unreachable!("a port write comes from an IoOut exit")
                    };
                    // A port write is at most 4 bytes: copy it out of the run area, so that
                    // the device may use the vCPU itself.
                    let mut bytes = [0u8; 8];
                    let len = data.len().min(bytes.len());
                    bytes[..len].copy_from_slice(&data[..len]);
                    ports
                        .write(fd, device, offset, &bytes[..len])
                        .map_err(device_error)?
                }
                ExitAction::Fatal(ExitError::EmulationFailure) => {
                    let Exit::InternalError { cpl, .. } = exit else {
                        unreachable!("an emulation failure comes from an InternalError exit")
                    };
                    let rip = rip(fd);
                    // Guest ring 0 in KVM's emulator (kvm_pvm) meets instructions it lacks
                    // anywhere; elsewhere the emulator mostly runs accesses with no slot.
                    if cpl == 0 && crate::vm::host_emulates_ring0() {
                        return Err(VcpuError::HostLimitation {
                            vcpu,
                            rip,
                            suberror: KVM_INTERNAL_ERROR_EMULATION,
                        });
                    }
                    return Err(VcpuError::EmulationFailure { vcpu, rip, cpl });
                }
                ExitAction::Fatal(ExitError::Shutdown) => {
                    if let Some(place) = memory_gone::cut_memory(memory) {
                        return Err(VcpuError::MemoryGone { vcpu, place });
                    }
                    let rip = rip(fd);
                    return Err(VcpuError::TripleFault { vcpu, rip });
                }
                ExitAction::Fatal(error) => return Err(VcpuError::Exit { vcpu, error }),
                ExitAction::WaitForChange
                | ExitAction::WriteMemory { .. }
                | ExitAction::ReadMemory { .. } => unreachable!("handled with the map above"),
            };
            if flow == Flow::Stop {
                return Ok(());
            }
        }
    }
}
