//! Memory hotplug for a Linux guest: a virtio-mem device (kvm-virtio-mem) on the virtio-mmio
//! transport, which Linux's `virtio_mem` driver drives, and the API that sets how much of it
//! the guest should plug (`PATCH /hotplug/memory`, through [`super::controller`]).
//!
//! The hotplug area starts at the first GiB boundary above RAM (and above 4 GiB); it has no
//! slot and is not in the e820 map. Neighbouring blocks the guest plugs share a KVM slot up to
//! a maximum slot size (128 MiB by default, `--hotplug-max-slot-mib`; the block size gives each
//! block a slot of its own); unplugged blocks have none and their memory goes back to the
//! host. The device's
//! window sits in the MMIO gap below 4 GiB, its interrupt is an irqfd on an IOAPIC pin, and
//! the kernel learns both from the DSDT (an `LNRO0005` device, `super::acpi`) or, booted
//! without ACPI, from `virtio_mmio.device=` on its command line (which needs a kernel with
//! `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`). An access to an unplugged block is counted and
//! answered as absent memory; the guest goes on.

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_memslots::KvmVm;
use kvm_virtio_mem::{
    MmioTransport, TransportState, VirtioMem, VirtioMemOptions, VirtioMemState, MMIO_WINDOW_SIZE,
};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use super::acpi::MmioDevice;
use super::layout::MMIO_GAP_END;
use crate::control::hotplug::{HotplugConfig, HotplugInfo};
use crate::vm::mmio::{MmioBus, Unreachable};
use crate::vm::{Vm, VmError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Where the device's MMIO window is (in the gap below 4 GiB, clear of the IOAPIC and LAPIC).
pub const VIRTIO_MEM_MMIO: u64 = 0xd000_0000;
/// The IOAPIC pin (GSI) of its interrupt.
const VIRTIO_MEM_IRQ: u32 = 5;
/// Its number on the Linux guest's MMIO bus.
pub(super) const VIRTIO_MEM_DEVICE: usize = 0;

/// The virtio-mem device as the VMM holds it: shared by the vCPUs (MMIO exits) and the API.
pub type VirtioMemDevice = Arc<Mutex<MmioTransport<VirtioMem<KvmVm>>>>;

/// Why the hotplug device could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    /// The device refused its options (the area overlaps memory, or needs more slots than
    /// are free).
    #[error("the virtio-mem device: {0}")]
    Device(#[from] kvm_virtio_mem::Error),
    /// Its interrupt could not be set up.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The saved transport state does not fit the device.
    #[error("the virtio-mem transport: {0}")]
    Transport(#[from] kvm_virtio_mem::TransportError),
    /// Its interrupt's eventfd could not be created.
    #[error("creating the virtio-mem interrupt's eventfd failed: {0}")]
    EventFd(std::io::Error),
}

/// The hotplug device and what the guest needs to find it.
#[derive(Debug)]
pub struct Hotplug {
    /// The device.
    pub device: VirtioMemDevice,
    /// Its MMIO window and its area (absent memory where unplugged).
    pub mmio: Arc<MmioBus>,
    /// Its window and interrupt as the guest finds them.
    pub(crate) window: MmioDevice,
}

impl Hotplug {
    /// What the kernel command line gets: plugged memory is onlined as movable (so that it can
    /// be unplugged again), and without ACPI the device's place.
    pub fn cmdline(&self, acpi: bool) -> String {
        cmdline(self.window, acpi)
    }
}

fn cmdline(window: MmioDevice, acpi: bool) -> String {
    let mut line = String::new();
    if !acpi {
        let MmioDevice { base, size, gsi } = window;
        line.push_str(&format!(" virtio_mmio.device={size}@{base:#x}:{gsi}"));
    }
    line.push_str(" memhp_default_state=online_movable");
    line
}

/// Where a hotplug area goes for RAM ending at `ram_end`: the first GiB boundary at or above
/// both it and 4 GiB.
fn area_base(ram_end: u64) -> u64 {
    ram_end.max(MMIO_GAP_END).next_multiple_of(GIB)
}

/// Where RAM ends on `vm` (no block is plugged yet).
fn ram_end(vm: &Vm) -> u64 {
    vm.memory()
        .regions()
        .iter()
        .map(|r| r.gpa.0 + r.size)
        .max()
        .unwrap_or(0)
}

/// Sets the device up on `vm` for the area `config` describes (its sizes checked by
/// `HotplugConfig::validate`'s rules, which the device applies again), above RAM: plugged
/// blocks share KVM slots of up to its slot size (a slot per block without one).
pub fn setup(vm: &Vm, config: &HotplugConfig) -> Result<Hotplug, HotplugError> {
    let options = config.options(GuestAddress(area_base(ram_end(vm))));
    let device = VirtioMem::new(Arc::clone(vm.memory()), options)?;
    connect(vm, options, |interrupt| Ok(device.into_mmio(interrupt)))
}

/// The device of a restored VM (`vm` holds its plugged blocks' regions, rebuilt from the
/// layout) at `base`, as `device` and `transport` saved it, for the area `config` describes.
/// Its maximum slot size is the one `device` records (`config`'s is not used); a state saved
/// before it was recorded gets a slot per block, as Linux guests had then.
pub fn restore(
    vm: &Vm,
    base: u64,
    config: &HotplugConfig,
    device: &VirtioMemState,
    transport: &TransportState,
) -> Result<Hotplug, HotplugError> {
    let options = HotplugConfig {
        slot_size_mib: None,
        ..*config
    }
    .options(GuestAddress(base));
    let device = VirtioMem::restore(Arc::clone(vm.memory()), options, device)?;
    connect(vm, options, |interrupt| {
        Ok(MmioTransport::restore(device, interrupt, transport)?)
    })
}

/// Puts a device for `options` behind its transport (made by `transport` with the device's
/// interrupt, an irqfd on its IOAPIC pin) in its MMIO window.
fn connect(
    vm: &Vm,
    options: VirtioMemOptions,
    transport: impl FnOnce(Box<EventFd>) -> Result<MmioTransport<VirtioMem<KvmVm>>, HotplugError>,
) -> Result<Hotplug, HotplugError> {
    let interrupt = EventFd::new(0).map_err(HotplugError::EventFd)?;
    vm.fd()
        .register_irqfd(&interrupt, VIRTIO_MEM_IRQ)
        .map_err(VmError::setup("KVM_IRQFD for virtio-mem"))?;
    let device = Arc::new(Mutex::new(transport(Box::new(interrupt))?));
    let mut mmio = MmioBus::new();
    mmio.insert_device(VIRTIO_MEM_MMIO, MMIO_WINDOW_SIZE, VIRTIO_MEM_DEVICE)
        .expect("the device window is in the free MMIO gap");
    mmio.insert_absent(options.addr.0, options.region_size)
        .expect("the area lies above RAM and the window");
    mmio.set_unreachable(Arc::new(Isolator(Arc::clone(&device))));
    Ok(Hotplug {
        device,
        mmio: Arc::new(mmio),
        window: MmioDevice {
            base: VIRTIO_MEM_MMIO as u32,
            size: MMIO_WINDOW_SIZE as u32,
            gsi: VIRTIO_MEM_IRQ,
        },
    })
}

/// The device's unplugged blocks under their pieces' slots, for the vCPUs' MMIO bus
/// ([`MmioBus::set_unreachable`]): a guest access to one faults inside KVM, and the piece is
/// isolated (its slots become the runs of its plugged blocks) so that the access, run again,
/// exits as absent memory. Either guest kind's bus can take it.
#[derive(Debug)]
pub struct Isolator(pub VirtioMemDevice);

impl Unreachable for Isolator {
    fn isolate(&self, gpa: Option<u64>) -> bool {
        let mut transport = lock(&self.0);
        // A refused re-slot leaves the fault unexplained: the vCPU then stops on it.
        transport
            .device_mut()
            .isolate_unplugged(gpa.map(GuestAddress))
            .is_ok_and(|pieces| pieces > 0)
    }
}

pub(crate) fn lock(device: &VirtioMemDevice) -> MutexGuard<'_, MmioTransport<VirtioMem<KvmVm>>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// `GET /hotplug/memory` for the device.
pub fn hotplug_info(device: &VirtioMemDevice) -> HotplugInfo {
    let transport = lock(device);
    let mem = transport.device();
    let region = mem.region();
    HotplugInfo {
        total_size_mib: (region.end - region.start) / MIB,
        block_size_mib: mem.block_size() / MIB,
        slot_size_mib: mem.max_slot_size() / MIB,
        plugged_size_mib: mem.plugged_size() / MIB,
        requested_size_mib: mem.requested_size() / MIB,
        guest_address: region.start,
        page_size: mem.page_size().into(),
        mapped_slots: mem.slots(),
        last_busy: mem.last_busy().map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_names_the_device_only_without_acpi() {
        let window = MmioDevice {
            base: VIRTIO_MEM_MMIO as u32,
            size: 0x200,
            gsi: 5,
        };
        assert_eq!(
            cmdline(window, false),
            " virtio_mmio.device=512@0xd0000000:5 memhp_default_state=online_movable"
        );
        assert_eq!(cmdline(window, true), " memhp_default_state=online_movable");
    }

    #[test]
    fn the_area_starts_on_a_gib_above_ram_and_4_gib() {
        assert_eq!(area_base(512 * MIB), 4 * GIB);
        assert_eq!(area_base(5 * GIB), 5 * GIB);
        assert_eq!(area_base(5 * GIB + 1), 6 * GIB);
    }
}
