//! The test guest's ports, as the shared vCPU loop sees them: three write-only protocol ports
//! (command done, exit, fault) and nothing else, so any other port stops the vCPU.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, LazyLock};

use kvm_memslots::{KvmVm, MemoryManager};
use vmm_sys_util::eventfd::EventFd;

use super::command::Fault;
use super::layout::port;
use crate::vm::exit::ExitError;
use crate::vm::mmio::MmioBus;
use crate::vm::ports::{PortBus, Unmapped};
use crate::vm::state::{StateError, VcpuState};
use crate::vm::vcpu::{Flow, VcpuPorts};
use kvm_ioctls::VcpuFd;

/// A protocol port of the test guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GuestPort {
    /// The guest finished a command (or is ready for its first one).
    Done,
    /// The guest ran its exit command.
    Exit,
    /// The guest took an exception; its fault block says which.
    Fault,
}

impl GuestPort {
    /// The port's number.
    fn number(self) -> u16 {
        match self {
            GuestPort::Done => port::DONE,
            GuestPort::Exit => port::EXIT,
            GuestPort::Fault => port::FAULT,
        }
    }
}

/// The test guest's bus: its three protocol ports; any other port is fatal.
fn bus() -> &'static PortBus<GuestPort> {
    static BUS: LazyLock<PortBus<GuestPort>> = LazyLock::new(|| {
        let mut bus = PortBus::new(Unmapped::Fatal);
        for device in [GuestPort::Done, GuestPort::Exit, GuestPort::Fault] {
            bus.insert(device.number(), 1, device)
                .expect("the test guest's ports are distinct");
        }
        bus
    });
    &BUS
}

/// Why the test guest's ports stopped a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum GuestPortError {
    /// The guest took an exception.
    #[error("the guest took {0}")]
    Fault(Fault),
    /// The guest read a protocol port, which are write-only.
    #[error(transparent)]
    Read(ExitError),
}

/// The vCPU loop's error for a test-guest vCPU.
pub(super) type VcpuError = crate::vm::vcpu::VcpuError<GuestPortError>;

/// What a test-guest vCPU thread tells the host.
#[derive(Debug)]
pub(super) enum VcpuEvent {
    /// The guest finished a command (or is ready for its first one); the vCPU waits for the
    /// host's go-ahead before it enters the guest again.
    Done,
    /// The vCPU stopped: the guest exited, or the host asked it to stop.
    Stopped,
    /// The vCPU stopped on an error.
    Failed(VcpuError),
}

/// What the host sends a vCPU that waits between commands.
#[derive(Debug)]
pub(super) enum GoAhead {
    /// Enter the guest again (a command was posted, or the VMM is stopping).
    Resume,
    /// Send the vCPU's state, and keep waiting.
    SaveState(Sender<Result<VcpuState, StateError>>),
}

/// A test-guest vCPU's side of the command protocol.
#[derive(Debug)]
pub(super) struct TestGuestPorts {
    /// Where the vCPU reports finished commands.
    pub(crate) events: Sender<VcpuEvent>,
    /// Written after each report, for an event loop that waits for news of the vCPUs.
    pub(crate) notify: Arc<EventFd>,
    /// The host's go-ahead after [`VcpuEvent::Done`].
    pub(crate) resume: Receiver<GoAhead>,
    /// The guest's memory, to read the fault block.
    pub(crate) memory: Arc<MemoryManager<KvmVm>>,
    /// Wait for a go-ahead before first entering the guest (a restored guest, saved between
    /// commands).
    pub(crate) parked: bool,
    /// Absent memory (and device windows) where the guest has no slot, if any.
    pub(crate) mmio: Option<Arc<MmioBus>>,
}

impl TestGuestPorts {
    /// Waits for the host's go-ahead, saving the vCPU's state whenever asked meanwhile.
    fn wait(&mut self, vcpu: &VcpuFd) -> Flow {
        loop {
            match self.resume.recv() {
                Ok(GoAhead::Resume) => return Flow::Continue,
                // Out of KVM_RUN and idle: the state is stable.
                Ok(GoAhead::SaveState(reply)) => {
                    let _ = reply.send(VcpuState::save(vcpu));
                }
                // The host is gone: nobody will post another command.
                Err(_) => return Flow::Stop,
            }
        }
    }
}

impl VcpuPorts for TestGuestPorts {
    type Device = GuestPort;
    type Error = GuestPortError;

    fn bus(&self) -> &PortBus<GuestPort> {
        bus()
    }

    fn mmio(&self) -> Option<&MmioBus> {
        self.mmio.as_deref()
    }

    fn before_run(&mut self, vcpu: &VcpuFd) -> Flow {
        if std::mem::take(&mut self.parked) {
            return self.wait(vcpu);
        }
        Flow::Continue
    }

    fn read(&mut self, device: GuestPort, _: u16, _: &mut [u8]) -> Result<Flow, GuestPortError> {
        Err(GuestPortError::Read(ExitError::UnexpectedPort {
            port: device.number(),
            write: false,
        }))
    }

    fn write(
        &mut self,
        vcpu: &VcpuFd,
        device: GuestPort,
        _: u16,
        _: &[u8],
    ) -> Result<Flow, GuestPortError> {
        match device {
            GuestPort::Done => {
                // Waiting for the next command may take long; the loop holds no map version.
                if self.events.send(VcpuEvent::Done).is_err() {
                    return Ok(Flow::Stop);
                }
                // A full counter (never, in practice) still leaves the eventfd readable.
                let _ = self.notify.write(1);
                Ok(self.wait(vcpu))
            }
            GuestPort::Exit => Ok(Flow::Stop),
            GuestPort::Fault => Err(GuestPortError::Fault(Fault::read(&*self.memory.current()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::ports::PortTarget;

    #[test]
    fn the_bus_has_the_three_protocol_ports_and_nothing_else() {
        let bus = bus();
        assert_eq!(bus.find(port::DONE), PortTarget::Device(GuestPort::Done, 0));
        assert_eq!(bus.find(port::EXIT), PortTarget::Device(GuestPort::Exit, 0));
        assert_eq!(
            bus.find(port::FAULT),
            PortTarget::Device(GuestPort::Fault, 0)
        );
        assert_eq!(bus.find(0x80), PortTarget::Nothing);
        assert_eq!(bus.find(port::DONE - 1), PortTarget::Nothing);
        assert_eq!(bus.ranges().len(), 3);
    }
}
