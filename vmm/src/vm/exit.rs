//! The vCPU-exit handler: a pure function from an exit and what the VMM knows to what to do.
//!
//! The interesting case is an MMIO exit on an address the memory map calls RAM. KVM and the map
//! agree except while a change is being applied (the manager's change sequence is odd, or moved
//! during the run): then the exit is the guest touching a slot that is away for a moment (being
//! moved, or deleted and re-created), and the handler asks the vCPU to wait for the change and
//! finish the access against the memory map as it is afterwards, never reporting MMIO. Outside
//! such a window the same exit means KVM and the map disagree: a fatal error, never papered over.
//!
//! An access KVM cannot emulate as MMIO (a VEX-encoded load or store, an instruction fetch)
//! fails in its emulator instead, and with `KVM_CAP_EXIT_ON_EMULATION_FAILURE` (which [`Vm`]
//! enables) exits as an emulation failure, the instruction not run. In a change's window the
//! handler treats it as the MMIO exit it would have been: wait for the change, then enter the
//! guest again to run the instruction against the slots as they are afterwards. Outside one (no
//! change during the run) the handler does what KVM does without the capability: in guest
//! user mode (CPL > 0) the guest gets `#UD` (its kernel handles it, as for any instruction it
//! cannot run), at CPL 0 the VM stops. Either way a failure that repeats with no change in
//! between never loops.
//!
//! [`Vm`]: super::Vm
//!
//! Port I/O goes through the guest kind's [`PortBus`]: the handler only says which device (of
//! the guest kind's own type) gets the access, or that nothing is there; the vCPU loop hands the
//! access to the guest kind. No guest's port or device is named here.

use std::fmt;
use std::ops::Range;

use kvm_memslots::GuestMemoryMap;
use vm_memory::GuestAddress;

use super::mmio::{MmioBus, MmioTarget};
use super::ports::{PortBus, PortTarget};

/// A vCPU exit, as far as the handler cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit<'a> {
    /// The guest wrote to a port.
    IoOut {
        /// The port.
        port: u16,
        /// What it wrote.
        data: &'a [u8],
    },
    /// The guest read from a port.
    IoIn {
        /// The port.
        port: u16,
        /// Bytes read.
        len: usize,
    },
    /// The guest read from an address that is no memory slot in KVM.
    MmioRead {
        /// The guest-physical address.
        gpa: u64,
        /// Bytes read.
        len: usize,
    },
    /// The guest wrote to an address that is no (writable) memory slot in KVM.
    MmioWrite {
        /// The guest-physical address.
        gpa: u64,
        /// What it wrote.
        data: &'a [u8],
    },
    /// The vCPU halted.
    Hlt,
    /// The guest triple-faulted (or asked for a shutdown).
    Shutdown,
    /// KVM could not handle the guest's instruction (`KVM_EXIT_INTERNAL_ERROR`), with KVM's
    /// suberror (`KVM_INTERNAL_ERROR_EMULATION`: its instruction emulator failed) and the
    /// vCPU's privilege level.
    InternalError {
        /// KVM's `internal.suberror`.
        suberror: u32,
        /// The vCPU's privilege level at the exit (CS.DPL: 0 kernel, 3 user), which decides
        /// what an emulation failure outside a change's window does.
        cpl: u8,
    },
    /// Entering the guest failed (`KVM_EXIT_FAIL_ENTRY`).
    FailEntry {
        /// The hardware's reason.
        reason: u64,
    },
    /// A signal interrupted the run (`EINTR`), for example a request to stop.
    Interrupted,
    /// The vCPU's dirty ring is full (`KVM_EXIT_DIRTY_RING_FULL`): it must be collected and
    /// reset before the guest can go on.
    DirtyRingFull,
    /// KVM could not map guest memory the guest touched (`KVM_EXIT_MEMORY_FAULT`: `KVM_RUN`
    /// failed with `EFAULT` or `EHWPOISON` and said where, on a kernel with
    /// `KVM_CAP_MEMORY_FAULT_INFO` that reports that fault): the guest range and KVM's flags.
    MemoryFault {
        /// The guest-physical address.
        gpa: u64,
        /// Bytes from it.
        size: u64,
        /// KVM's flags (`KVM_MEMORY_EXIT_FLAG_*`).
        flags: u64,
    },
    /// Anything else.
    Other(&'static str),
}

/// The names of the exit kinds, by `Exit::kind` (the metrics' `kind` label).
pub const EXIT_KINDS: [&str; 12] = [
    "io_out",
    "io_in",
    "mmio_read",
    "mmio_write",
    "hlt",
    "shutdown",
    "internal_error",
    "fail_entry",
    "interrupted",
    "dirty_ring_full",
    "other",
    "memory_fault",
];

impl<'a> Exit<'a> {
    /// Its kind, as an index into [`EXIT_KINDS`].
    pub(super) fn kind(&self) -> usize {
        match self {
            Exit::IoOut { .. } => 0,
            Exit::IoIn { .. } => 1,
            Exit::MmioRead { .. } => 2,
            Exit::MmioWrite { .. } => 3,
            Exit::Hlt => 4,
            Exit::Shutdown => 5,
            Exit::InternalError { .. } => 6,
            Exit::FailEntry { .. } => 7,
            Exit::Interrupted => 8,
            Exit::DirtyRingFull => 9,
            Exit::Other(_) => 10,
            Exit::MemoryFault { .. } => 11,
        }
    }

    /// Whether the guest touched an address that is no (writable) memory slot in KVM.
    pub(super) fn is_mmio(&self) -> bool {
        matches!(self, Exit::MmioRead { .. } | Exit::MmioWrite { .. })
    }

    /// Turns what `KVM_RUN` returned into an exit, with the buffer a read's answer goes into
    /// (port and MMIO reads). `EINTR` and `EAGAIN` (a signal, `immediate_exit`) are
    /// [`Exit::Interrupted`]; other errors are returned. An internal error's suberror and the
    /// vCPU's privilege level are not in kvm-ioctls' exit: they come as 0, for the caller to
    /// fill in from the run area and the vCPU's registers ([`Exit::internal_error`]).
    pub(super) fn from_kvm(
        run: Result<kvm_ioctls::VcpuExit<'a>, kvm_ioctls::Error>,
    ) -> Result<(Exit<'a>, Option<&'a mut [u8]>), kvm_ioctls::Error> {
        use kvm_ioctls::VcpuExit;
        Ok(match run {
            Ok(VcpuExit::IoOut(port, data)) => (Exit::IoOut { port, data }, None),
            Ok(VcpuExit::IoIn(port, data)) => {
                let len = data.len();
                (Exit::IoIn { port, len }, Some(data))
            }
            Ok(VcpuExit::MmioRead(gpa, data)) => {
                let len = data.len();
                (Exit::MmioRead { gpa, len }, Some(data))
            }
            Ok(VcpuExit::MmioWrite(gpa, data)) => (Exit::MmioWrite { gpa, data }, None),
            Ok(VcpuExit::Hlt) => (Exit::Hlt, None),
            Ok(VcpuExit::Shutdown) => (Exit::Shutdown, None),
            Ok(VcpuExit::InternalError) => (Exit::internal_error(0, 0), None),
            Ok(VcpuExit::FailEntry(reason, _)) => (Exit::FailEntry { reason }, None),
            Ok(VcpuExit::Intr) => (Exit::Interrupted, None),
            Ok(VcpuExit::Unsupported(kvm_bindings::KVM_EXIT_DIRTY_RING_FULL)) => {
                (Exit::DirtyRingFull, None)
            }
            Ok(VcpuExit::MemoryFault { flags, gpa, size }) => {
                (Exit::MemoryFault { gpa, size, flags }, None)
            }
            Ok(_) => (Exit::Other("an exit kind tinyvmm does not handle"), None),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                (Exit::Interrupted, None)
            }
            Err(e) => return Err(e),
        })
    }
}

/// `internal.suberror` of an emulation failure (`KVM_INTERNAL_ERROR_EMULATION`).
pub(super) const KVM_INTERNAL_ERROR_EMULATION: u32 = kvm_bindings::KVM_INTERNAL_ERROR_EMULATION;

impl Exit<'static> {
    /// An internal error with KVM's suberror, at privilege level `cpl`.
    pub(super) fn internal_error(suberror: u32, cpl: u8) -> Self {
        Exit::InternalError { suberror, cpl }
    }
}

/// What the handler knows besides the exit.
#[derive(Debug)]
pub struct ExitContext<'a, D> {
    /// The current version of the memory map.
    pub memory: &'a GuestMemoryMap,
    /// The manager's change sequence read just before the vCPU entered the guest.
    pub sequence_at_entry: u64,
    /// The change sequence now (after the exit).
    pub sequence_now: u64,
    /// Addresses where MMIO exits are expected and only counted (the move benchmarks' window,
    /// where the kernel's own test counts them the same way).
    pub expected_mmio: Option<Range<u64>>,
    /// The devices behind the ports.
    pub ports: &'a PortBus<D>,
    /// Device windows and absent memory, where there is no slot.
    pub mmio: Option<&'a MmioBus>,
}

/// What the vCPU loop does next about an exit. `D` is the guest kind's device type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitAction<D> {
    /// Enter the guest again.
    Resume,
    /// A slot change is being applied: wait until it is done, then handle this exit again.
    WaitForChange,
    /// The access hit memory that was away during a change that is now done: write `data` at
    /// `gpa` in the memory map (the write the guest made), then resume.
    WriteMemory {
        /// Where.
        gpa: GuestAddress,
        /// What.
        data: Vec<u8>,
    },
    /// KVM could not emulate the guest's instruction (a VEX access, an instruction fetch)
    /// where a slot was away during a change that is now done: the instruction did not run
    /// (KVM leaves RIP on it), so enter the guest again to run it against the slots as they
    /// are now.
    RetryAfterChange,
    /// KVM could not emulate the guest's instruction at guest CPL > 0 with no slot change
    /// during the run: inject `#UD` (vector 6, `KVM_SET_VCPU_EVENTS`) and enter the guest
    /// again, as KVM itself does without `KVM_CAP_EXIT_ON_EMULATION_FAILURE`. The guest's
    /// kernel handles it as any instruction it cannot run (Linux: `SIGILL` for the process);
    /// RIP is on the instruction, as for a fault.
    InjectInvalidOpcode,
    /// As [`ExitAction::WriteMemory`], for a read: give the guest `len` bytes read at `gpa`.
    ReadMemory {
        /// Where.
        gpa: GuestAddress,
        /// How many bytes.
        len: usize,
    },
    /// An exit inside the expected window: count it; a read gets all ones.
    CountExpected,
    /// A write to a read-only slot: dropped, as ROM drops writes.
    DropReadOnlyWrite,
    /// The dirty ring is full: collect and reset the rings, then resume.
    CollectDirtyRings,
    /// The guest read a device's port: the guest kind fills the exit's buffer.
    PortRead {
        /// The device.
        device: D,
        /// The port's offset in the device's range.
        offset: u16,
    },
    /// The guest wrote a device's port: the guest kind takes the exit's data.
    PortWrite {
        /// The device.
        device: D,
        /// The port's offset in the device's range.
        offset: u16,
    },
    /// A read of a port where nothing answers: the guest sees all ones.
    ReadAllOnes,
    /// The guest read a device's MMIO window: the guest kind fills the exit's buffer.
    MmioRead {
        /// The device, as the guest kind numbers them.
        device: usize,
        /// Offset in its window.
        offset: u64,
    },
    /// The guest wrote a device's MMIO window: the guest kind takes the exit's data.
    MmioWrite {
        /// The device.
        device: usize,
        /// Offset in its window.
        offset: u64,
    },
    /// An access to memory that is absent on purpose (an unplugged virtio-mem block): count
    /// it, a read sees all ones, a write is dropped, the guest goes on.
    AbsentMemory,
    /// Something the VMM cannot go on from.
    Fatal(ExitError),
}

/// Why a vCPU stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExitError {
    /// An MMIO access to an address that is neither memory nor a device.
    #[error("guest {} {len} byte(s) at {gpa:#x}, which is neither memory nor a device", if *.write { "wrote" } else { "read" })]
    UnexpectedMmio {
        /// The address.
        gpa: u64,
        /// Its size.
        len: usize,
        /// Whether it was a write.
        write: bool,
    },
    /// KVM exited on an address the map calls memory while no change was in flight.
    #[error("KVM exited on guest address {gpa:#x} of slot {slot}, which the memory map says KVM has: KVM's slots and the map disagree")]
    SlotMismatch {
        /// The address.
        gpa: u64,
        /// The slot the map has there.
        slot: u32,
    },
    /// A port no device answers.
    #[error("guest {} port {port:#x}, where there is no device", if *.write { "wrote to" } else { "read from" })]
    UnexpectedPort {
        /// The port.
        port: u16,
        /// Whether it was a write.
        write: bool,
    },
    /// `KVM_EXIT_INTERNAL_ERROR`, emulation failure, in guest ring 0 with no slot change
    /// during the run (at CPL > 0 the guest gets `#UD` instead).
    #[error("KVM could not emulate a guest instruction in guest ring 0 (KVM_EXIT_INTERNAL_ERROR, emulation failure) and no slot change was under way")]
    EmulationFailure,
    /// `KVM_EXIT_INTERNAL_ERROR` of another kind.
    #[error("KVM_EXIT_INTERNAL_ERROR (suberror {suberror})")]
    InternalError {
        /// KVM's `internal.suberror`.
        suberror: u32,
    },
    /// The guest halted; the test guest never does outside its fault handler.
    #[error("the guest halted")]
    Halted,
    /// Triple fault or shutdown.
    #[error("the guest shut down (triple fault)")]
    Shutdown,
    /// Entry failed.
    #[error("KVM could not enter the guest (KVM_EXIT_FAIL_ENTRY, reason {0:#x})")]
    FailEntry(u64),
    /// Any other exit.
    #[error("unexpected vCPU exit: {0}")]
    Other(&'static str),
    /// `KVM_EXIT_MEMORY_FAULT` on memory that is not a file cut under the VM (the vCPU loop
    /// names that case itself).
    #[error("KVM could not map the guest's memory at guest address {gpa:#x} ({size} bytes; KVM_EXIT_MEMORY_FAULT, flags {flags:#x})")]
    MemoryFault {
        /// The guest-physical address.
        gpa: u64,
        /// Bytes from it.
        size: u64,
        /// KVM's flags.
        flags: u64,
    },
}

/// Decides what to do about `exit`.
pub fn handle_exit<D: Copy>(exit: &Exit<'_>, ctx: &ExitContext<'_, D>) -> ExitAction<D> {
    match *exit {
        Exit::IoOut { port, .. } => match ctx.ports.find(port) {
            PortTarget::Device(device, offset) => ExitAction::PortWrite { device, offset },
            PortTarget::Absent => ExitAction::Resume,
            PortTarget::Nothing => {
                ExitAction::Fatal(ExitError::UnexpectedPort { port, write: true })
            }
        },
        Exit::IoIn { port, .. } => match ctx.ports.find(port) {
            PortTarget::Device(device, offset) => ExitAction::PortRead { device, offset },
            PortTarget::Absent => ExitAction::ReadAllOnes,
            PortTarget::Nothing => {
                ExitAction::Fatal(ExitError::UnexpectedPort { port, write: false })
            }
        },
        Exit::MmioRead { gpa, len } => handle_mmio(gpa, len, None, ctx),
        Exit::MmioWrite { gpa, data } => handle_mmio(gpa, data.len(), Some(data), ctx),
        Exit::Interrupted => ExitAction::Resume,
        Exit::DirtyRingFull => ExitAction::CollectDirtyRings,
        Exit::Hlt => ExitAction::Fatal(ExitError::Halted),
        Exit::Shutdown => ExitAction::Fatal(ExitError::Shutdown),
        Exit::InternalError { suberror, cpl } if suberror == KVM_INTERNAL_ERROR_EMULATION => {
            handle_emulation_failure(cpl, ctx)
        }
        Exit::InternalError { suberror, .. } => {
            ExitAction::Fatal(ExitError::InternalError { suberror })
        }
        Exit::FailEntry { reason } => ExitAction::Fatal(ExitError::FailEntry(reason)),
        Exit::Other(what) => ExitAction::Fatal(ExitError::Other(what)),
        Exit::MemoryFault { gpa, size, flags } => {
            ExitAction::Fatal(ExitError::MemoryFault { gpa, size, flags })
        }
    }
}

/// An instruction KVM's emulator could not run. The exit names no address, but a change under
/// way or done during the run may have taken the slot it touched away for a moment: as for an
/// MMIO exit, wait for the change, then run the instruction again (it did not retire). With no
/// change during the run nothing would be different the next time, so it is never run again
/// as it is: at guest CPL > 0 the guest gets `#UD`, what KVM gives it without
/// `KVM_CAP_EXIT_ON_EMULATION_FAILURE` (on a kvm_pvm host too, where guest ring 3 runs on the
/// CPU as under VT-x or AMD-V: see `docs/decisions/reslot.md`); at CPL 0 it is fatal, as KVM
/// makes it.
fn handle_emulation_failure<D>(cpl: u8, ctx: &ExitContext<'_, D>) -> ExitAction<D> {
    if ctx.sequence_now % 2 == 1 {
        return ExitAction::WaitForChange;
    }
    if ctx.sequence_now != ctx.sequence_at_entry {
        return ExitAction::RetryAfterChange;
    }
    if cpl > 0 {
        return ExitAction::InjectInvalidOpcode;
    }
    ExitAction::Fatal(ExitError::EmulationFailure)
}

fn handle_mmio<D>(
    gpa: u64,
    len: usize,
    write: Option<&[u8]>,
    ctx: &ExitContext<'_, D>,
) -> ExitAction<D> {
    let changing = ctx.sequence_now % 2 == 1;
    let changed = ctx.sequence_now != ctx.sequence_at_entry;
    if changing {
        return ExitAction::WaitForChange;
    }
    let slot = ctx.memory.find_by_gpa(GuestAddress(gpa));
    let read_only_write = write.is_some() && slot.is_some_and(|s| s.flags().read_only);
    if let Some(slot) = slot {
        if read_only_write {
            // KVM exits on every write to a read-only slot: that is what read-only means.
            return ExitAction::DropReadOnlyWrite;
        }
        if changed {
            // The slot was away while the guest touched it; the change is done and the
            // address is memory now: finish the access there.
            return match write {
                Some(data) => ExitAction::WriteMemory {
                    gpa: GuestAddress(gpa),
                    data: data.to_vec(),
                },
                None => ExitAction::ReadMemory {
                    gpa: GuestAddress(gpa),
                    len,
                },
            };
        }
        return ExitAction::Fatal(ExitError::SlotMismatch {
            gpa,
            slot: slot.id().0,
        });
    }
    match ctx.mmio.and_then(|bus| bus.find(gpa)) {
        Some(MmioTarget::Device { device, offset }) => {
            return match write {
                Some(_) => ExitAction::MmioWrite { device, offset },
                None => ExitAction::MmioRead { device, offset },
            }
        }
        Some(MmioTarget::Absent) => return ExitAction::AbsentMemory,
        None => {}
    }
    if ctx.expected_mmio.as_ref().is_some_and(|w| w.contains(&gpa)) {
        return ExitAction::CountExpected;
    }
    ExitAction::Fatal(ExitError::UnexpectedMmio {
        gpa,
        len,
        write: write.is_some(),
    })
}

impl fmt::Display for Exit<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests;
