//! A Linux guest's ports, as the shared vCPU loop sees them: the legacy devices (serial console
//! and i8042) on a bus that answers every other port as absent hardware.

use std::sync::Arc;

use super::hotplug::{VirtioMemDevice, VIRTIO_MEM_DEVICE};
use crate::devices::legacy::{DeviceIoError, LegacyDevice, LegacyDevices};
use crate::vm::mmio::MmioBus;
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
    /// The virtio-mem device and its MMIO window and area, if the guest has one.
    pub hotplug: Option<(VirtioMemDevice, Arc<MmioBus>)>,
}

impl VcpuPorts for LinuxPorts {
    type Device = LegacyDevice;
    type Error = DeviceIoError;

    fn bus(&self) -> &PortBus<LegacyDevice> {
        &self.bus
    }

    fn mmio(&self) -> Option<&MmioBus> {
        self.hotplug.as_ref().map(|(_, bus)| &**bus)
    }

    fn mmio_read(
        &mut self,
        device: usize,
        offset: u64,
        data: &mut [u8],
    ) -> Result<Flow, DeviceIoError> {
        match &self.hotplug {
            Some((transport, _)) if device == VIRTIO_MEM_DEVICE => transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .read(offset, data),
            _ => data.fill(0xff),
        }
        Ok(Flow::Continue)
    }

    fn mmio_write(
        &mut self,
        device: usize,
        offset: u64,
        data: &[u8],
    ) -> Result<Flow, DeviceIoError> {
        if let Some((transport, _)) = &self.hotplug {
            if device == VIRTIO_MEM_DEVICE {
                // A queue notify plugs or unplugs blocks here, on the vCPU's thread, through
                // the manager (no map version is held).
                transport
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write(offset, data);
            }
        }
        Ok(Flow::Continue)
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
