//! The event loop's side of a Linux guest: console input from the host's terminal into the
//! serial FIFO, and the i8042's reset line. (The terminal in raw mode while it is the console
//! is `host::RawTerminal`.)

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::legacy::LegacyDevices;
use crate::host;

/// The event loop's part of a Linux guest: console input from the host's terminal into the
/// serial FIFO, and the i8042's reset line.
#[derive(Debug)]
pub(crate) struct ConsoleSubscriber {
    /// The devices.
    pub(crate) devices: Arc<LegacyDevices>,
    /// The i8042's reset line.
    pub(crate) reset: EventFd,
    /// Set once the guest asked for a reset.
    pub(crate) reset_seen: Arc<AtomicBool>,
    /// Whether the console reads the host's terminal on stdin.
    pub(crate) stdin: bool,
}

impl MutEventSubscriber for ConsoleSubscriber {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.reset.as_raw_fd() {
            let _ = self.reset.read();
            self.reset_seen.store(true, Ordering::Release);
        } else if self.stdin && fd == std::io::stdin().as_raw_fd() {
            let mut buffer = [0u8; 64];
            // Straight from the descriptor: std's stdin buffers what it reads, and bytes left in
            // its buffer would wait for the next key without epoll saying so.
            let read = host::read_stdin_unbuffered(&mut buffer);
            let retry = read.as_ref().is_err_and(|e| {
                matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                )
            });
            match read {
                Ok(n) if n > 0 => {
                    // The 16550's FIFO holds 64 bytes; what it cannot take is dropped, as a
                    // UART drops bytes that overrun it.
                    self.devices.console_input(&buffer[..n]);
                }
                _ if retry => {}
                _ => {
                    // End of input (or an error reading it): stop watching it.
                    let _ = ops.remove(events);
                    self.stdin = false;
                }
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        ops.add(Events::new(&self.reset, EventSet::IN))
            .expect("watching the reset eventfd");
        if self.stdin
            && ops
                .add(Events::new_raw(std::io::stdin().as_raw_fd(), EventSet::IN))
                .is_err()
        {
            self.stdin = false;
        }
    }
}
