//! Running a Linux guest: its vCPU threads (exits go through the pure exit handler and the port
//! bus) and the event-loop subscriber for the console's input and the i8042's reset line.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use kvm_ioctls::VcpuFd;
use kvm_memslots::{GuestMemorySlots, KvmVm, MemoryManager};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::legacy::{DeviceIoError, LegacyDevices};
use crate::vm::exit::{handle_exit, Action, Exit, ExitContext, ExitError, PortBus};

/// Why a Linux guest's vCPU stopped, other than by the host's request.
#[derive(Debug, thiserror::Error)]
pub enum GuestStop {
    /// `KVM_EXIT_INTERNAL_ERROR`: on this host's kvm_pvm, the emulator met an instruction it
    /// does not have.
    #[error("vCPU {vcpu} at rip {rip:#x} (KVM suberror {suberror}): {error}", error = ExitError::InternalError)]
    HostLimitation {
        /// The vCPU.
        vcpu: u8,
        /// The guest's instruction pointer.
        rip: u64,
        /// KVM's `internal.suberror` (1: emulation failure).
        suberror: u32,
    },
    /// The guest triple-faulted (or a reset by triple fault, `reboot=t`).
    #[error("vCPU {vcpu}: the guest shut down (triple fault) at rip {rip:#x}")]
    TripleFault {
        /// The vCPU.
        vcpu: u8,
        /// Its instruction pointer.
        rip: u64,
    },
    /// The exit handler gave up.
    #[error("vCPU {vcpu}: {error}")]
    Exit {
        /// The vCPU.
        vcpu: u8,
        /// Why.
        error: ExitError,
    },
    /// `KVM_RUN` failed.
    #[error("vCPU {vcpu}: KVM_RUN failed: {source}")]
    Run {
        /// The vCPU.
        vcpu: u8,
        /// The kernel's error.
        source: kvm_ioctls::Error,
    },
    /// A device failed.
    #[error("vCPU {vcpu}: {source}")]
    Device {
        /// The vCPU.
        vcpu: u8,
        /// The device's error.
        source: DeviceIoError,
    },
    /// Finishing an access against memory failed.
    #[error("vCPU {vcpu}: finishing an access at {gpa:#x} against memory failed: {source}")]
    Memory {
        /// The vCPU.
        vcpu: u8,
        /// The address.
        gpa: u64,
        /// vm-memory's error.
        source: vm_memory::GuestMemoryError,
    },
}

/// A vCPU of a Linux guest, ready to run on its own thread.
pub struct LinuxVcpu {
    /// Its index (and APIC ID).
    pub index: u8,
    /// KVM's vCPU, set up.
    pub fd: VcpuFd,
    /// The guest's memory.
    pub memory: Arc<MemoryManager<KvmVm>>,
    /// The devices.
    pub devices: Arc<LegacyDevices>,
    /// The port bus.
    pub bus: Arc<PortBus>,
    /// Set by the host to stop the vCPU at its next exit.
    pub stop: Arc<AtomicBool>,
    /// Signalled when the vCPU stops, for the event loop.
    pub stopped: Arc<EventFd>,
}

impl LinuxVcpu {
    /// Runs the guest until the host stops the vCPU (`Ok`) or the guest stops it.
    pub fn run(mut self) -> Result<(), GuestStop> {
        let result = self.run_loop();
        let _ = self.stopped.write(1);
        result
    }

    fn rip(&self) -> u64 {
        self.fd.get_regs().map(|r| r.rip).unwrap_or(u64::MAX)
    }

    fn run_loop(&mut self) -> Result<(), GuestStop> {
        let vcpu = self.index;
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            let sequence_at_entry = self.memory.change_sequence();
            let (exit, read_buffer) =
                Exit::from_kvm(self.fd.run()).map_err(|source| GuestStop::Run { vcpu, source })?;
            let mmio = matches!(exit, Exit::MmioRead { .. } | Exit::MmioWrite { .. });
            let (map, action) = loop {
                // The sequence first, then the map, then the sequence again (see the test
                // guest's vCPU loop); `load` borrows the version without cloning it.
                let sequence_now = self.memory.change_sequence();
                let map = self.memory.load();
                if mmio && self.memory.change_sequence() != sequence_now {
                    continue;
                }
                let ctx = ExitContext {
                    memory: &map,
                    sequence_at_entry,
                    sequence_now,
                    expected_mmio: None,
                    ports: &self.bus,
                };
                match handle_exit(&exit, &ctx) {
                    Action::WaitForChange => {
                        // A slot is away for a moment: wait for the change, then handle the
                        // exit again against the map as it is afterwards.
                        drop(map);
                        while self.memory.change_sequence() % 2 == 1 {
                            if self.stop.load(Ordering::Acquire) {
                                return Ok(());
                            }
                            std::thread::sleep(Duration::from_micros(20));
                        }
                    }
                    action => break (map, action),
                }
            };
            let guest_memory = GuestMemorySlots::of(&map);
            let device_error = |source| GuestStop::Device { vcpu, source };
            match action {
                Action::Resume | Action::CountExpected | Action::DropReadOnlyWrite => {}
                Action::DeviceWrite { device, offset } => {
                    if let Exit::IoOut { data, .. } = exit {
                        self.devices
                            .write(device, offset, data)
                            .map_err(device_error)?;
                    }
                }
                Action::DeviceRead { device, offset } => {
                    if let Some(buffer) = read_buffer {
                        self.devices.read(device, offset, buffer);
                    }
                }
                Action::ReadAllOnes => {
                    if let Some(buffer) = read_buffer {
                        buffer.fill(0xff);
                    }
                }
                Action::WaitForChange => unreachable!("waited for above"),
                Action::WriteMemory { gpa, data } => {
                    guest_memory
                        .write_slice(&data, gpa)
                        .map_err(|source| GuestStop::Memory {
                            vcpu,
                            gpa: gpa.0,
                            source,
                        })?
                }
                Action::ReadMemory { gpa, len } => {
                    if let Some(buffer) = read_buffer {
                        guest_memory
                            .read_slice(&mut buffer[..len], gpa)
                            .map_err(|source| GuestStop::Memory {
                                vcpu,
                                gpa: gpa.0,
                                source,
                            })?;
                    }
                }
                Action::Fatal(ExitError::InternalError) => {
                    let kvm_run = self.fd.get_kvm_run();
                    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, for which KVM fills
                    // the `internal` member of the union; reading a u32 of it is always defined.
                    let suberror = unsafe { kvm_run.__bindgen_anon_1.internal.suberror };
                    return Err(GuestStop::HostLimitation {
                        vcpu,
                        rip: self.rip(),
                        suberror,
                    });
                }
                Action::Fatal(ExitError::Shutdown) => {
                    return Err(GuestStop::TripleFault {
                        vcpu,
                        rip: self.rip(),
                    })
                }
                Action::Fatal(error) => return Err(GuestStop::Exit { vcpu, error }),
                // The protocol ports of the test guest are not on a Linux guest's bus.
                Action::CommandDone | Action::GuestExit | Action::GuestFault => {
                    return Err(GuestStop::Exit {
                        vcpu,
                        error: ExitError::Other("a test-guest protocol port on a Linux guest"),
                    })
                }
            }
        }
    }
}

/// The event loop's part of a Linux guest: console input from the host's terminal into the
/// serial FIFO, and the i8042's reset line.
pub struct ConsoleSubscriber {
    /// The devices.
    pub devices: Arc<LegacyDevices>,
    /// The i8042's reset line.
    pub reset: EventFd,
    /// Set once the guest asked for a reset.
    pub reset_seen: Arc<AtomicBool>,
    /// The terminal the console reads from, if any.
    pub input: Option<RawFd>,
}

impl MutEventSubscriber for ConsoleSubscriber {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.reset.as_raw_fd() {
            let _ = self.reset.read();
            self.reset_seen.store(true, Ordering::Release);
        } else if Some(fd) == self.input {
            let mut buffer = [0u8; 64];
            // Straight from the descriptor: std's stdin buffers what it reads, and bytes left in
            // its buffer would wait for the next key without epoll saying so.
            // SAFETY: `buffer` is valid for writes of its length; `fd` is the process's stdin,
            // open for the life of the process.
            let read = unsafe { libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len()) };
            let retry = read < 0
                && matches!(
                    std::io::Error::last_os_error().kind(),
                    std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                );
            match usize::try_from(read) {
                Ok(n) if n > 0 => {
                    // The 16550's FIFO holds 64 bytes; what it cannot take is dropped, as a
                    // UART drops bytes that overrun it.
                    self.devices.console_input(&buffer[..n]);
                }
                _ if retry => {}
                _ => {
                    // End of input (or an error reading it): stop watching it.
                    let _ = ops.remove(events);
                    self.input = None;
                }
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        ops.add(Events::new(&self.reset, EventSet::IN))
            .expect("watching the reset eventfd");
        if let Some(fd) = self.input {
            if ops.add(Events::new_raw(fd, EventSet::IN)).is_err() {
                self.input = None;
            }
        }
    }
}

/// The host terminal in raw mode (no line editing or echo; Ctrl-C still stops the VMM) while
/// it is the guest's console; restored on drop.
pub struct RawTerminal {
    fd: RawFd,
    saved: libc::termios,
}

impl RawTerminal {
    /// Puts `fd` in raw mode if it is a terminal.
    pub fn new(fd: RawFd) -> Option<Self> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(fd) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; all zeros is a valid value to be overwritten.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios for tcgetattr to fill.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only changes the flags of the termios it is given.
        unsafe { libc::cfmakeraw(&mut raw) };
        raw.c_lflag |= libc::ISIG;
        raw.c_oflag |= libc::OPOST | libc::ONLCR;
        // SAFETY: `raw` is a valid termios.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawTerminal { fd, saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: `saved` is the termios read from this descriptor.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}
