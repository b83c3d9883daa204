//! The vCPU-exit handler: a pure function from an exit and what the VMM knows to what to do.
//!
//! The interesting case is an MMIO exit on an address the memory map calls RAM. KVM and the map
//! agree except while a change is being applied (the manager's change sequence is odd, or moved
//! during the run): then the exit is the guest touching a slot that is away for a moment (being
//! moved, or deleted and re-created), and the handler asks the vCPU to wait for the change and
//! finish the access against the memory map as it is afterwards, never reporting MMIO. Outside
//! such a window the same exit means KVM and the map disagree: a fatal error, never papered over.
//!
//! Port I/O goes through a [`PortBus`]: port ranges mapped to devices. The test guest's bus holds
//! its command-protocol ports and nothing else (any other port is fatal); a Linux guest's bus
//! holds the serial console and the i8042, and answers every other port as absent hardware does
//! (reads all ones, writes dropped), because Linux probes legacy ports that are not there.

use std::fmt;
use std::ops::Range;

use kvm_memslots::SlotBacking;
use memslot_map::MemslotMap;
use vm_memory::GuestAddress;

use crate::test_guest::layout::port;

/// What answers a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortDevice {
    /// The test guest finished a command.
    CommandDone,
    /// The test guest ran its exit command.
    GuestExit,
    /// The test guest took an exception.
    GuestFault,
    /// The 16550 serial console (offsets 0 to 7).
    Serial,
    /// The i8042 keyboard controller (offset 0: data port 0x60, offset 4: command port 0x64).
    I8042,
    /// Nothing: reads see all ones, writes are dropped (an empty ISA bus).
    Absent,
}

/// A port range and the device behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    /// First port.
    pub base: u16,
    /// Number of ports.
    pub len: u16,
    /// The device; it sees offsets from `base`.
    pub device: PortDevice,
}

/// Port ranges mapped to devices, and what answers the ports in no range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortBus {
    /// Sorted by base, never overlapping.
    ranges: Vec<PortRange>,
    /// The device for ports in no range; `None` makes them fatal.
    otherwise: Option<PortDevice>,
}

/// Why a port range cannot join a bus.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ports {base:#x}+{len} for {device:?} are empty, wrap past 0xffff or overlap {other:?}")]
pub struct PortBusError {
    /// First port.
    pub base: u16,
    /// Number of ports.
    pub len: u16,
    /// The device.
    pub device: PortDevice,
    /// The range it overlaps, if any.
    pub other: Option<PortRange>,
}

impl PortBus {
    /// An empty bus; `otherwise` answers ports in no range (`None`: such ports are fatal).
    pub fn new(otherwise: Option<PortDevice>) -> Self {
        PortBus {
            ranges: Vec::new(),
            otherwise,
        }
    }

    /// Maps `len` ports from `base` to `device`.
    pub fn insert(&mut self, base: u16, len: u16, device: PortDevice) -> Result<(), PortBusError> {
        let error = |other| PortBusError {
            base,
            len,
            device,
            other,
        };
        let end = u32::from(base) + u32::from(len);
        if len == 0 || end > 0x1_0000 {
            return Err(error(None));
        }
        let at = self.ranges.partition_point(|r| r.base < base);
        let overlaps = |r: &PortRange| {
            u32::from(r.base) < end && u32::from(base) < u32::from(r.base) + u32::from(r.len)
        };
        for neighbour in [at.checked_sub(1), Some(at)].into_iter().flatten() {
            if let Some(r) = self.ranges.get(neighbour).filter(|r| overlaps(r)) {
                return Err(error(Some(*r)));
            }
        }
        self.ranges.insert(at, PortRange { base, len, device });
        Ok(())
    }

    /// The test guest's bus: its three command-protocol ports; any other port is fatal.
    pub fn test_guest() -> Self {
        let mut bus = PortBus::new(None);
        for (base, device) in [
            (port::DONE, PortDevice::CommandDone),
            (port::EXIT, PortDevice::GuestExit),
            (port::FAULT, PortDevice::GuestFault),
        ] {
            bus.insert(base, 1, device)
                .expect("the test guest's ports are distinct");
        }
        bus
    }

    /// The device answering `port`, and the port's offset in its range.
    pub fn find(&self, port: u16) -> Option<(PortDevice, u16)> {
        let at = self.ranges.partition_point(|r| r.base <= port);
        let found = at
            .checked_sub(1)
            .map(|i| self.ranges[i])
            .filter(|r| u32::from(port) < u32::from(r.base) + u32::from(r.len))
            .map(|r| (r.device, port - r.base));
        found.or(self.otherwise.map(|d| (d, 0)))
    }

    /// The ranges, by base.
    pub fn ranges(&self) -> &[PortRange] {
        &self.ranges
    }
}

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
    /// KVM could not handle the guest's instruction (`KVM_EXIT_INTERNAL_ERROR`).
    InternalError,
    /// Entering the guest failed (`KVM_EXIT_FAIL_ENTRY`).
    FailEntry {
        /// The hardware's reason.
        reason: u64,
    },
    /// A signal interrupted the run (`EINTR`), for example a request to stop.
    Interrupted,
    /// Anything else.
    Other(&'static str),
}

impl<'a> Exit<'a> {
    /// Turns what `KVM_RUN` returned into an exit, with the buffer a read's answer goes into
    /// (port and MMIO reads). `EINTR` and `EAGAIN` (a signal, `immediate_exit`) are
    /// [`Exit::Interrupted`]; other errors are returned.
    pub fn from_kvm(
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
            Ok(VcpuExit::InternalError) => (Exit::InternalError, None),
            Ok(VcpuExit::FailEntry(reason, _)) => (Exit::FailEntry { reason }, None),
            Ok(VcpuExit::Intr) => (Exit::Interrupted, None),
            Ok(_) => (Exit::Other("an exit kind tinyvmm does not handle"), None),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                (Exit::Interrupted, None)
            }
            Err(e) => return Err(e),
        })
    }
}

/// What the handler knows besides the exit.
pub struct ExitContext<'a> {
    /// The current version of the memory map.
    pub memory: &'a MemslotMap<SlotBacking>,
    /// The manager's change sequence read just before the vCPU entered the guest.
    pub sequence_at_entry: u64,
    /// The change sequence now (after the exit).
    pub sequence_now: u64,
    /// Addresses where MMIO exits are expected and only counted (the move benchmarks' window,
    /// where the kernel's own test counts them the same way).
    pub expected_mmio: Option<Range<u64>>,
    /// The devices behind the ports.
    pub ports: &'a PortBus,
}

/// What the vCPU loop does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Enter the guest again.
    Resume,
    /// The guest finished a command (or is ready for its first): tell the host, wait for the
    /// next one, then resume.
    CommandDone,
    /// The guest left: stop this vCPU.
    GuestExit,
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
    /// As [`Action::WriteMemory`], for a read: give the guest `len` bytes read at `gpa`.
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
    /// The guest took an exception; its fault block says which.
    GuestFault,
    /// The guest read a device's port: the device fills the exit's buffer.
    DeviceRead {
        /// The device.
        device: PortDevice,
        /// The port's offset in the device's range.
        offset: u16,
    },
    /// The guest wrote a device's port: the device takes the exit's data.
    DeviceWrite {
        /// The device.
        device: PortDevice,
        /// The port's offset in the device's range.
        offset: u16,
    },
    /// A read of a port where nothing answers: the guest sees all ones.
    ReadAllOnes,
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
    /// `KVM_EXIT_INTERNAL_ERROR`.
    #[error("KVM could not emulate a guest instruction (KVM_EXIT_INTERNAL_ERROR); on a host without hardware virtualisation (kvm_pvm) guest ring 0 runs in KVM's instruction emulator, which lacks some instructions: a limitation of the host, not a VMM crash")]
    InternalError,
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
}

/// Decides what to do about `exit`.
pub fn handle_exit(exit: &Exit<'_>, ctx: &ExitContext<'_>) -> Action {
    match *exit {
        Exit::IoOut { port, .. } => match ctx.ports.find(port) {
            Some((PortDevice::CommandDone, _)) => Action::CommandDone,
            Some((PortDevice::GuestExit, _)) => Action::GuestExit,
            Some((PortDevice::GuestFault, _)) => Action::GuestFault,
            Some((PortDevice::Absent, _)) => Action::Resume,
            Some((device, offset)) => Action::DeviceWrite { device, offset },
            None => Action::Fatal(ExitError::UnexpectedPort { port, write: true }),
        },
        Exit::IoIn { port, .. } => match ctx.ports.find(port) {
            Some((device @ (PortDevice::Serial | PortDevice::I8042), offset)) => {
                Action::DeviceRead { device, offset }
            }
            Some((PortDevice::Absent, _)) => Action::ReadAllOnes,
            // The protocol ports are write-only.
            Some(_) | None => Action::Fatal(ExitError::UnexpectedPort { port, write: false }),
        },
        Exit::MmioRead { gpa, len } => handle_mmio(gpa, len, None, ctx),
        Exit::MmioWrite { gpa, data } => handle_mmio(gpa, data.len(), Some(data), ctx),
        Exit::Interrupted => Action::Resume,
        Exit::Hlt => Action::Fatal(ExitError::Halted),
        Exit::Shutdown => Action::Fatal(ExitError::Shutdown),
        Exit::InternalError => Action::Fatal(ExitError::InternalError),
        Exit::FailEntry { reason } => Action::Fatal(ExitError::FailEntry(reason)),
        Exit::Other(what) => Action::Fatal(ExitError::Other(what)),
    }
}

fn handle_mmio(gpa: u64, len: usize, write: Option<&[u8]>, ctx: &ExitContext<'_>) -> Action {
    let changing = ctx.sequence_now % 2 == 1;
    let changed = ctx.sequence_now != ctx.sequence_at_entry;
    if changing {
        return Action::WaitForChange;
    }
    let slot = ctx.memory.find_by_gpa(GuestAddress(gpa));
    let read_only_write = write.is_some() && slot.is_some_and(|s| s.flags().read_only);
    if let Some(slot) = slot {
        if read_only_write {
            // KVM exits on every write to a read-only slot: that is what read-only means.
            return Action::DropReadOnlyWrite;
        }
        if changed {
            // The slot was away while the guest touched it; the change is done and the
            // address is memory now: finish the access there.
            return match write {
                Some(data) => Action::WriteMemory {
                    gpa: GuestAddress(gpa),
                    data: data.to_vec(),
                },
                None => Action::ReadMemory {
                    gpa: GuestAddress(gpa),
                    len,
                },
            };
        }
        return Action::Fatal(ExitError::SlotMismatch {
            gpa,
            slot: slot.id().0,
        });
    }
    if ctx.expected_mmio.as_ref().is_some_and(|w| w.contains(&gpa)) {
        return Action::CountExpected;
    }
    Action::Fatal(ExitError::UnexpectedMmio {
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
mod tests {
    use super::*;
    use kvm_memslots::fake::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use memslot_map::SlotFlags;

    const RAM: u64 = 0x10_0000;

    fn memory() -> MemoryManager<FakeKvm> {
        let m = MemoryManager::new(FakeKvm::new(8, false));
        m.add_region(RegionSpec::new(GuestAddress(RAM), 0x4000))
            .unwrap();
        m.add_region(
            RegionSpec::new(GuestAddress(0x20_0000), 0x1000).with_flags(SlotFlags {
                read_only: true,
                log_dirty: false,
            }),
        )
        .unwrap();
        m
    }

    fn decide(m: &MemoryManager<FakeKvm>, exit: Exit<'_>, at_entry: u64, now: u64) -> Action {
        let snapshot = m.snapshot();
        let context = ExitContext {
            memory: snapshot.map(),
            sequence_at_entry: at_entry,
            sequence_now: now,
            expected_mmio: Some(0x30_0000..0x30_1000),
            ports: &PortBus::test_guest(),
        };
        handle_exit(&exit, &context)
    }

    #[test]
    fn ports_drive_the_command_protocol() {
        let m = memory();
        let out = |port| Exit::IoOut { port, data: &[0] };
        assert_eq!(decide(&m, out(port::DONE), 0, 0), Action::CommandDone);
        assert_eq!(decide(&m, out(port::EXIT), 0, 0), Action::GuestExit);
        assert_eq!(decide(&m, out(port::FAULT), 0, 0), Action::GuestFault);
        assert_eq!(
            decide(&m, out(0x80), 0, 0),
            Action::Fatal(ExitError::UnexpectedPort {
                port: 0x80,
                write: true
            })
        );
        assert_eq!(
            decide(&m, Exit::IoIn { port: 0x60, len: 1 }, 0, 0),
            Action::Fatal(ExitError::UnexpectedPort {
                port: 0x60,
                write: false
            })
        );
    }

    #[test]
    fn the_bus_routes_ranges_refuses_overlaps_and_answers_the_rest_by_its_default() {
        let mut bus = PortBus::new(Some(PortDevice::Absent));
        bus.insert(0x3f8, 8, PortDevice::Serial).unwrap();
        bus.insert(0x60, 5, PortDevice::I8042).unwrap();
        let e = bus.insert(0x3fc, 2, PortDevice::Absent).unwrap_err();
        assert_eq!(e.other.map(|r| r.base), Some(0x3f8));
        assert!(bus.insert(0x3f0, 9, PortDevice::Absent).is_err());
        assert!(bus.insert(0xffff, 2, PortDevice::Absent).is_err());
        assert!(bus.insert(0x10, 0, PortDevice::Absent).is_err());
        bus.insert(0x3f0, 8, PortDevice::Absent).unwrap();
        assert_eq!(bus.ranges().len(), 3);
        assert_eq!(bus.find(0x3ff), Some((PortDevice::Serial, 7)));
        assert_eq!(bus.find(0x400), Some((PortDevice::Absent, 0)));
        assert_eq!(bus.find(0x64), Some((PortDevice::I8042, 4)));

        // A Linux guest's bus: devices get their accesses, other ports read all ones.
        let m = memory();
        let snapshot = m.snapshot();
        let ctx = ExitContext {
            memory: snapshot.map(),
            sequence_at_entry: 0,
            sequence_now: 0,
            expected_mmio: None,
            ports: &bus,
        };
        let out = |port| Exit::IoOut { port, data: &[1] };
        assert_eq!(
            handle_exit(&out(0x3f8), &ctx),
            Action::DeviceWrite {
                device: PortDevice::Serial,
                offset: 0
            }
        );
        assert_eq!(
            handle_exit(
                &Exit::IoIn {
                    port: 0x3fd,
                    len: 1
                },
                &ctx
            ),
            Action::DeviceRead {
                device: PortDevice::Serial,
                offset: 5
            }
        );
        assert_eq!(handle_exit(&out(0x80), &ctx), Action::Resume);
        assert_eq!(
            handle_exit(
                &Exit::IoIn {
                    port: 0x2f8,
                    len: 1
                },
                &ctx
            ),
            Action::ReadAllOnes
        );
    }

    #[test]
    fn an_exit_on_memory_during_a_change_waits_then_completes_against_the_map() {
        let m = memory();
        let write = Exit::MmioWrite {
            gpa: RAM + 8,
            data: &[1, 2, 3, 4],
        };
        let read = Exit::MmioRead {
            gpa: RAM + 16,
            len: 8,
        };
        // A change is being applied: wait for it.
        assert_eq!(decide(&m, write, 4, 5), Action::WaitForChange);
        assert_eq!(decide(&m, read, 5, 5), Action::WaitForChange);
        // It finished during the run: finish the access in memory.
        assert_eq!(
            decide(&m, write, 4, 6),
            Action::WriteMemory {
                gpa: GuestAddress(RAM + 8),
                data: vec![1, 2, 3, 4]
            }
        );
        assert_eq!(
            decide(&m, read, 5, 6),
            Action::ReadMemory {
                gpa: GuestAddress(RAM + 16),
                len: 8
            }
        );
    }

    #[test]
    fn an_exit_on_memory_with_no_change_is_a_mismatch_never_mmio() {
        let m = memory();
        let action = decide(&m, Exit::MmioRead { gpa: RAM, len: 4 }, 6, 6);
        let Action::Fatal(error) = action else {
            panic!("{action:?}")
        };
        assert!(
            error
                .to_string()
                .contains("KVM's slots and the map disagree"),
            "{error}"
        );
    }

    #[test]
    fn other_addresses_are_counted_in_the_window_or_fatal() {
        let m = memory();
        let window = Exit::MmioWrite {
            gpa: 0x30_0008,
            data: &[0; 8],
        };
        assert_eq!(decide(&m, window, 2, 2), Action::CountExpected);
        // Also after a change: the window is not memory then either.
        assert_eq!(decide(&m, window, 2, 4), Action::CountExpected);
        let stray = Exit::MmioRead {
            gpa: 0x40_0000,
            len: 2,
        };
        let Action::Fatal(error) = decide(&m, stray, 2, 4) else {
            panic!()
        };
        assert_eq!(
            error.to_string(),
            "guest read 2 byte(s) at 0x400000, which is neither memory nor a device"
        );
    }

    #[test]
    fn writes_to_read_only_memory_are_dropped_and_other_stops_are_named() {
        let m = memory();
        let rom = Exit::MmioWrite {
            gpa: 0x20_0010,
            data: &[9],
        };
        assert_eq!(decide(&m, rom, 0, 0), Action::DropReadOnlyWrite);
        assert_eq!(decide(&m, rom, 0, 2), Action::DropReadOnlyWrite);
        assert_eq!(decide(&m, Exit::Interrupted, 0, 0), Action::Resume);
        let Action::Fatal(e) = decide(&m, Exit::InternalError, 0, 0) else {
            panic!()
        };
        assert!(e.to_string().contains("limitation of the host"), "{e}");
        assert_eq!(
            decide(&m, Exit::Hlt, 0, 0),
            Action::Fatal(ExitError::Halted)
        );
    }
}
