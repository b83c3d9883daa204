//! The event loop's side of a Linux guest: console input from the host's terminal into the
//! serial FIFO, the i8042's reset line, and the terminal in raw mode while it is the console.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::legacy::LegacyDevices;

/// The event loop's part of a Linux guest: console input from the host's terminal into the
/// serial FIFO, and the i8042's reset line.
#[derive(Debug)]
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

impl std::fmt::Debug for RawTerminal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTerminal")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
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
