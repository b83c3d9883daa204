//! A Linux guest's ports, as the shared vCPU loop sees them: the legacy devices (serial console
//! and i8042) on a bus that answers every other port as absent hardware.

use std::sync::Arc;

use crate::devices::legacy::{DeviceIoError, LegacyDevice, LegacyDevices};
use crate::vm::ports::PortBus;
use crate::vm::vcpu::{Flow, VcpuPorts};

/// Why a Linux guest's vCPU stopped, other than by the host's request.
pub type GuestStop = crate::vm::vcpu::VcpuError<DeviceIoError>;

/// A Linux vCPU's ports: the devices every vCPU shares, and their bus.
#[derive(Debug, Clone)]
pub struct LinuxPorts {
    /// The devices.
    pub devices: Arc<LegacyDevices>,
    /// Their bus.
    pub bus: Arc<PortBus<LegacyDevice>>,
}

impl VcpuPorts for LinuxPorts {
    type Device = LegacyDevice;
    type Error = DeviceIoError;

    fn bus(&self) -> &PortBus<LegacyDevice> {
        &self.bus
    }

    fn read(
        &mut self,
        device: LegacyDevice,
        offset: u16,
        data: &mut [u8],
    ) -> Result<Flow, DeviceIoError> {
        self.devices.read(device, offset, data);
        Ok(Flow::Continue)
    }

    fn write(
        &mut self,
        _: &kvm_ioctls::VcpuFd,
        device: LegacyDevice,
        offset: u16,
        data: &[u8],
    ) -> Result<Flow, DeviceIoError> {
        self.devices.write(device, offset, data)?;
        Ok(Flow::Continue)
    }
}
