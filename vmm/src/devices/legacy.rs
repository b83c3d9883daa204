//! The legacy devices a Linux guest gets: a 16550 serial console (vm-superio) at 0x3f8 on IRQ 4,
//! and an i8042 whose reset command ends the VM. The exit handler routes ports to them through
//! the [`PortBus`] of [`LegacyDevices::bus`]; the vCPU threads and the event loop (for console
//! input) share them.

use std::io::Write;
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vm::ports::{PortBus, Unmapped};

/// The serial console's ports.
pub(crate) const SERIAL_PORT: u16 = 0x3f8;
/// The serial console's interrupt line (GSI).
pub(crate) const SERIAL_IRQ: u32 = 4;
/// The i8042's data port; its command port is 4 above.
const I8042_PORT: u16 = 0x60;

/// A legacy device, as the port bus names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegacyDevice {
    /// The 16550 serial console (offsets 0 to 7).
    Serial,
    /// The i8042 keyboard controller (offset 0: data port 0x60, offset 4: command port 0x64).
    I8042,
}

/// An eventfd as a vm-superio interrupt or reset line.
#[derive(Debug)]
struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> Result<(), std::io::Error> {
        self.0.write(1)
    }
}

/// The serial console's output.
pub(crate) type ConsoleOutput = Box<dyn Write + Send>;

/// The serial console's registers and its receive FIFO (vm-superio's `SerialState`),
/// serialisable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SerialSnapshot {
    /// Divisor latch, low byte.
    pub(crate) baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub(crate) baud_divisor_high: u8,
    /// Interrupt enable register.
    pub(crate) interrupt_enable: u8,
    /// Interrupt identification register.
    pub(crate) interrupt_identification: u8,
    /// Line control register.
    pub(crate) line_control: u8,
    /// Line status register.
    pub(crate) line_status: u8,
    /// Modem control register.
    pub(crate) modem_control: u8,
    /// Modem status register.
    pub(crate) modem_status: u8,
    /// Scratch register.
    pub(crate) scratch: u8,
    /// Input not yet read by the guest.
    pub(crate) in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialSnapshot {
    fn from(s: SerialState) -> Self {
        SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialSnapshot> for SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The devices, shared between vCPU threads and the event loop.
pub struct LegacyDevices {
    serial: Mutex<Serial<EventFdTrigger, vm_superio::serial::NoEvents, ConsoleOutput>>,
    i8042: Mutex<I8042Device<EventFdTrigger>>,
}

/// Why the devices could not be created.
#[derive(Debug, thiserror::Error)]
#[error("creating the {what} eventfd failed: {source}")]
pub struct DeviceError {
    /// Which one.
    what: &'static str,
    /// The system's error.
    source: std::io::Error,
}

/// A device access that failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceIoError {
    /// The serial console could not write its output or raise its interrupt.
    #[error("the serial console failed: {0}")]
    Serial(vm_superio::serial::Error<std::io::Error>),
    /// The i8042 could not signal its reset line.
    #[error("signalling the i8042's reset line failed: {0}")]
    Reset(std::io::Error),
}

impl DeviceError {
    /// The eventfd for `what` could not be made: `source`.
    pub(crate) fn new(what: &'static str, source: std::io::Error) -> Self {
        DeviceError { what, source }
    }
}

impl std::fmt::Debug for LegacyDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyDevices").finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A device whose user panicked mid-access is still a device.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl LegacyDevices {
    /// The serial console writing to `output`, with its interrupt on `serial_irq` (an irqfd),
    /// and the i8042 signalling `reset` when the guest asks for a reset.
    pub fn new(output: ConsoleOutput, serial_irq: EventFd, reset: EventFd) -> Self {
        LegacyDevices {
            serial: Mutex::new(Serial::new(EventFdTrigger(serial_irq), output)),
            i8042: Mutex::new(I8042Device::new(EventFdTrigger(reset))),
        }
    }

    /// The serial console as saved in `state`, writing to `output`, with its interrupt on
    /// `serial_irq`, and the i8042 (which has no state of its own: it answers reads with 0 and
    /// acts only on the reset command) signalling `reset`. Refused if the saved FIFO holds
    /// more than the device's.
    pub(crate) fn restore(
        output: ConsoleOutput,
        serial_irq: EventFd,
        reset: EventFd,
        state: &SerialSnapshot,
    ) -> Result<Self, String> {
        let serial = Serial::from_state(
            &SerialState::from(state),
            EventFdTrigger(serial_irq),
            vm_superio::serial::NoEvents,
            output,
        )
        .map_err(|e| format!("the serial console's saved state: {e}"))?;
        Ok(LegacyDevices {
            serial: Mutex::new(serial),
            i8042: Mutex::new(I8042Device::new(EventFdTrigger(reset))),
        })
    }

    /// The serial console's state (the i8042 has none).
    pub(crate) fn serial_state(&self) -> SerialSnapshot {
        lock(&self.serial).state().into()
    }

    /// Creates an eventfd for a device line.
    pub(crate) fn eventfd(what: &'static str) -> Result<EventFd, DeviceError> {
        EventFd::new(EFD_NONBLOCK).map_err(|e| DeviceError { what, source: e })
    }

    /// A Linux guest's bus: the serial console, the i8042, and absent hardware elsewhere.
    pub fn bus() -> PortBus<LegacyDevice> {
        let mut bus = PortBus::new(Unmapped::Absent);
        bus.insert(SERIAL_PORT, 8, LegacyDevice::Serial)
            .expect("the serial's ports are free");
        // 0x61 (the PIT's speaker port) is the in-kernel PIT's and never exits to here.
        bus.insert(I8042_PORT, 5, LegacyDevice::I8042)
            .expect("the i8042's ports are free");
        bus
    }

    /// The guest reads `data.len()` bytes from `device` at `offset`.
    pub(crate) fn read(&self, device: LegacyDevice, offset: u16, data: &mut [u8]) {
        data.fill(0xff);
        let Some(first) = data.first_mut() else {
            return;
        };
        let offset = offset as u8;
        *first = match device {
            LegacyDevice::Serial => lock(&self.serial).read(offset),
            LegacyDevice::I8042 => lock(&self.i8042).read(offset),
        };
    }

    /// The guest writes `data` to `device` at `offset`; a failure to write the console's output
    /// or to signal a line is reported.
    pub(crate) fn write(
        &self,
        device: LegacyDevice,
        offset: u16,
        data: &[u8],
    ) -> Result<(), DeviceIoError> {
        let Some(&value) = data.first() else {
            return Ok(());
        };
        let offset = offset as u8;
        match device {
            LegacyDevice::Serial => lock(&self.serial)
                .write(offset, value)
                .map_err(DeviceIoError::Serial),
            LegacyDevice::I8042 => lock(&self.i8042)
                .write(offset, value)
                .map_err(DeviceIoError::Reset),
        }
    }

    /// Queues console input for the guest; returns how many bytes the FIFO took.
    pub(crate) fn console_input(&self, bytes: &[u8]) -> usize {
        let mut serial = lock(&self.serial);
        let room = serial.fifo_capacity();
        if room == 0 {
            return 0;
        }
        serial
            .enqueue_raw_bytes(&bytes[..bytes.len().min(room)])
            .unwrap_or(0)
    }

    /// Flushes the console's output.
    pub(crate) fn flush(&self) {
        let _ = lock(&self.serial).writer_mut().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::ports::PortTarget;
    use std::io;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_bus_routes_the_serial_and_the_i8042_and_answers_the_rest_as_absent() {
        let bus = LegacyDevices::bus();
        assert_eq!(bus.find(0x3f8), PortTarget::Device(LegacyDevice::Serial, 0));
        assert_eq!(bus.find(0x3fd), PortTarget::Device(LegacyDevice::Serial, 5));
        assert_eq!(bus.find(0x64), PortTarget::Device(LegacyDevice::I8042, 4));
        assert_eq!(bus.find(0x2f8), PortTarget::Absent);
    }

    #[test]
    fn serial_output_reaches_the_writer_and_a_reset_signals_its_line() {
        let out = Shared::default();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let reset = EventFd::new(EFD_NONBLOCK).unwrap();
        let devices = LegacyDevices::new(
            Box::new(out.clone()),
            irq.try_clone().unwrap(),
            reset.try_clone().unwrap(),
        );
        for b in b"ok\n" {
            devices.write(LegacyDevice::Serial, 0, &[*b]).unwrap();
        }
        assert_eq!(&*out.0.lock().unwrap(), b"ok\n");
        assert!(reset.read().is_err(), "no reset yet");
        devices.write(LegacyDevice::I8042, 4, &[0xfe]).unwrap();
        assert_eq!(reset.read().unwrap(), 1);
        assert_eq!(devices.console_input(b"x"), 1);
        let mut data = [0u8; 1];
        devices.read(LegacyDevice::Serial, 0, &mut data);
        assert_eq!(data, *b"x");
    }
}
