//! The virtio-mmio transport, version 2 ("modern" register layout), generic over a
//! [`VirtioDevice`].
//!
//! A VMM maps one [`MMIO_WINDOW_SIZE`]-byte window per device and forwards each vCPU MMIO exit
//! in it to [`MmioTransport::read`] or [`MmioTransport::write`], with the offset inside the
//! window. The transport keeps the registers, the device status, feature negotiation and the
//! virtqueues' configuration; it calls the device to process a queue when the driver notifies
//! it, and raises the device's interrupt through an [`Interrupt`] (a KVM irqfd, typically).
//!
//! Accesses the specification does not allow (a control register read or written with a width
//! other than 4 bytes or off its alignment, an offset that names no register, a write to a
//! read-only register) are ignored; reads of them return zeros. Nothing a driver writes makes
//! the transport panic.

use std::fmt;
use std::io;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_CONFIG, VIRTIO_MMIO_CONFIG_GENERATION, VIRTIO_MMIO_DEVICE_FEATURES,
    VIRTIO_MMIO_DEVICE_FEATURES_SEL, VIRTIO_MMIO_DEVICE_ID, VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INTERRUPT_STATUS,
    VIRTIO_MMIO_MAGIC_VALUE, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, VIRTIO_MMIO_QUEUE_AVAIL_LOW,
    VIRTIO_MMIO_QUEUE_DESC_HIGH, VIRTIO_MMIO_QUEUE_DESC_LOW, VIRTIO_MMIO_QUEUE_NOTIFY,
    VIRTIO_MMIO_QUEUE_NUM, VIRTIO_MMIO_QUEUE_NUM_MAX, VIRTIO_MMIO_QUEUE_READY,
    VIRTIO_MMIO_QUEUE_SEL, VIRTIO_MMIO_QUEUE_USED_HIGH, VIRTIO_MMIO_QUEUE_USED_LOW,
    VIRTIO_MMIO_SHM_BASE_HIGH, VIRTIO_MMIO_SHM_BASE_LOW, VIRTIO_MMIO_SHM_LEN_HIGH,
    VIRTIO_MMIO_SHM_LEN_LOW, VIRTIO_MMIO_STATUS, VIRTIO_MMIO_VENDOR_ID, VIRTIO_MMIO_VERSION,
};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

/// Bytes of guest-physical address space one device's registers and configuration take.
pub const MMIO_WINDOW_SIZE: u64 = 0x200;
/// What `MagicValue` reads: "virt" in little-endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// What `Version` reads: the modern (non-legacy) register layout.
pub const MMIO_VERSION: u32 = 2;
/// What `VendorID` reads ("KVMS" in little-endian); drivers do not look at it.
pub const VENDOR_ID: u32 = 0x534d_564b;
/// Where the device-specific configuration space starts in the window.
pub const CONFIG_OFFSET: u64 = VIRTIO_MMIO_CONFIG as u64;

/// `InterruptStatus` bit: the device used a buffer of a queue.
pub const INTERRUPT_USED_BUFFER: u32 = 1;
/// `InterruptStatus` bit: the device's configuration (or status) changed.
pub const INTERRUPT_CONFIG_CHANGE: u32 = 2;

/// Device status bits (virtio 1.x, section 2.1).
pub mod status {
    use super::*;

    /// The guest found the device.
    pub const ACKNOWLEDGE: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
    /// The guest has a driver for it.
    pub const DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
    /// The driver is ready to drive the device.
    pub const DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
    /// Feature negotiation is complete (set only if the device accepted the features).
    pub const FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
    /// Set by the device: it met an error it cannot recover from and needs a reset.
    pub const DEVICE_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;
    /// Set by the driver: it gave up on the device.
    pub const FAILED: u32 = VIRTIO_CONFIG_S_FAILED;
}

/// The feature bit every modern device offers and every modern driver must accept.
pub const F_VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;

/// How a device raises its interrupt line. The transport has already set the reason in
/// `InterruptStatus` when it calls this.
pub trait Interrupt: Send + Sync {
    /// Raises the interrupt. An error is counted by the transport
    /// ([`MmioTransport::interrupt_failures`]); the status bits stay set, so the driver still
    /// finds the event when it next looks.
    fn trigger(&self) -> io::Result<()>;
}

impl Interrupt for EventFd {
    /// Writes 1 to the eventfd: with the eventfd registered as a KVM irqfd
    /// (`KVM_IRQFD`), KVM injects the interrupt without the VMM.
    fn trigger(&self) -> io::Result<()> {
        self.write(1)
    }
}

impl<T: Interrupt + ?Sized> Interrupt for Arc<T> {
    fn trigger(&self) -> io::Result<()> {
        (**self).trigger()
    }
}

/// A driver error the device cannot recover from (a malformed descriptor chain, a ring
/// outside guest memory): the transport sets `DEVICE_NEEDS_RESET` and stops processing the
/// device's queues until the driver resets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DriverError(pub String);

/// What processing a queue did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueOutcome {
    /// Buffers were put in the used ring: the transport raises a used-buffer interrupt.
    pub used_buffers: bool,
    /// The configuration space changed (`plugged_size`, say): the transport changes the
    /// configuration generation, without an interrupt.
    pub config_changed: bool,
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// The virtio device id (`DeviceID`).
    fn device_id(&self) -> u32;

    /// The feature bits the device offers, [`F_VERSION_1`] among them.
    fn features(&self) -> u64;

    /// Whether the device works with the features the driver accepted. The transport has
    /// already checked that they are a subset of [`features`](Self::features) and include
    /// [`F_VERSION_1`]; `false` leaves `FEATURES_OK` clear.
    fn accept_features(&self, acked: u64) -> bool {
        let _ = acked;
        true
    }

    /// The largest size of each queue, one entry per queue (powers of two, at most 32768).
    fn queue_max_sizes(&self) -> &[u16];

    /// Reads `data.len()` bytes of the configuration space from `offset`; bytes past its end
    /// read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// A driver write to the configuration space.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// The driver set `DRIVER_OK` with `features` negotiated. An error puts the device in
    /// `DEVICE_NEEDS_RESET`.
    fn activate(&mut self, features: u64) -> Result<(), DriverError>;

    /// The driver notified queue `index` (which is ready, with `DRIVER_OK` set): take the
    /// available buffers and answer them. An error puts the device in `DEVICE_NEEDS_RESET`.
    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
    ) -> Result<QueueOutcome, DriverError>;

    /// The driver reset the device (wrote 0 to `Status`). The transport resets its registers
    /// and the queues itself.
    fn reset(&mut self);
}

/// Why a transport could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A queue size the device gave is not a power of two between 1 and 32768.
    #[error("queue {index}: maximum size {size} is not a power of two between 1 and 32768")]
    QueueSize {
        /// The queue.
        index: usize,
        /// Its size.
        size: u16,
    },
    /// A saved state that this device cannot take.
    #[error("the saved transport state: {0}")]
    State(String),
}

/// A virtqueue's state as a transport saves it: virtio-queue's `QueueState`, serialisable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSnapshot {
    /// The maximum size the device offers.
    pub max_size: u16,
    /// The driver's chosen size.
    pub size: u16,
    /// Whether the driver made the queue ready.
    pub ready: bool,
    /// The descriptor table's guest address.
    pub desc_table: u64,
    /// The available ring's guest address.
    pub avail_ring: u64,
    /// The used ring's guest address.
    pub used_ring: u64,
    /// The next available-ring entry the device reads.
    pub next_avail: u16,
    /// The next used-ring entry the device writes.
    pub next_used: u16,
    /// Whether `VIRTIO_F_RING_EVENT_IDX` was negotiated.
    pub event_idx_enabled: bool,
}

/// What a transport holds beside its device: the registers the driver wrote, the
/// virtqueues, and the interrupt and configuration state, so that a driver finds its device
/// as it left it after a snapshot's restore or a migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportState {
    /// The device status.
    pub status: u32,
    /// `DeviceFeaturesSel`.
    pub device_features_sel: u32,
    /// `DriverFeaturesSel`.
    pub driver_features_sel: u32,
    /// The features the driver accepted.
    pub driver_features: u64,
    /// Whether the driver set a bit past the first 64 features.
    pub unknown_features_acked: bool,
    /// `QueueSel`.
    pub queue_sel: u32,
    /// Each virtqueue.
    pub queues: Vec<QueueSnapshot>,
    /// `InterruptStatus`.
    pub interrupt_status: u32,
    /// The configuration generation.
    pub config_generation: u32,
    /// The driver error that put the device in `DEVICE_NEEDS_RESET`, if one did.
    pub driver_error: Option<String>,
}

/// A virtio device behind virtio-mmio registers: what a VMM forwards a device's MMIO exits to.
pub struct MmioTransport<D> {
    device: D,
    interrupt: Box<dyn Interrupt>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    /// The driver wrote a set bit to a feature word past the first 64 bits.
    unknown_features_acked: bool,
    queue_sel: u32,
    queues: Vec<Queue>,
    interrupt_status: u32,
    config_generation: u32,
    interrupt_failures: u64,
    driver_error: Option<DriverError>,
}

impl<D: fmt::Debug> fmt::Debug for MmioTransport<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device", &self.device)
            .field("status", &format_args!("{:#x}", self.status))
            .field(
                "driver_features",
                &format_args!("{:#x}", self.driver_features),
            )
            .field("interrupt_status", &self.interrupt_status)
            .field("config_generation", &self.config_generation)
            .field("driver_error", &self.driver_error)
            .finish_non_exhaustive()
    }
}

fn low(value: u64) -> u32 {
    value as u32
}

fn high(value: u64) -> u32 {
    (value >> 32) as u32
}

fn set_low(value: u64, low: u32) -> u64 {
    (value & !0xffff_ffff) | u64::from(low)
}

fn set_high(value: u64, high: u32) -> u64 {
    (value & 0xffff_ffff) | (u64::from(high) << 32)
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// The transport for `device`, raising its interrupt through `interrupt`; the device
    /// starts reset (status 0).
    pub fn new(device: D, interrupt: Box<dyn Interrupt>) -> Result<Self, TransportError> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .enumerate()
            .map(|(index, &size)| {
                Queue::new(size).map_err(|_| TransportError::QueueSize { index, size })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            interrupt,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            unknown_features_acked: false,
            queue_sel: 0,
            queues,
            interrupt_status: 0,
            config_generation: 0,
            interrupt_failures: 0,
            driver_error: None,
        })
    }

    /// The transport's state (its device's is the device's own to save).
    pub fn state(&self) -> TransportState {
        TransportState {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            unknown_features_acked: self.unknown_features_acked,
            queue_sel: self.queue_sel,
            queues: self
                .queues
                .iter()
                .map(|q| {
                    let s = q.state();
                    QueueSnapshot {
                        max_size: s.max_size,
                        size: s.size,
                        ready: s.ready,
                        desc_table: s.desc_table,
                        avail_ring: s.avail_ring,
                        used_ring: s.used_ring,
                        next_avail: s.next_avail,
                        next_used: s.next_used,
                        event_idx_enabled: s.event_idx_enabled,
                    }
                })
                .collect(),
            interrupt_status: self.interrupt_status,
            config_generation: self.config_generation,
            driver_error: self.driver_error.as_ref().map(|e| e.0.clone()),
        }
    }

    /// The transport for `device` (restored by its own means), in `state`, raising its
    /// interrupt through `interrupt`. Refused if the queues do not match what the device
    /// offers (their number or maximum sizes) or a queue's state is one virtio-queue refuses;
    /// the interrupt is not raised (a pending one is in `state.interrupt_status`, and in the
    /// interrupt controller's own state).
    pub fn restore(
        device: D,
        interrupt: Box<dyn Interrupt>,
        state: &TransportState,
    ) -> Result<Self, TransportError> {
        let bad = |why: String| TransportError::State(why);
        let offered = device.queue_max_sizes();
        if offered.len() != state.queues.len() {
            return Err(bad(format!(
                "{} queues saved; the device has {}",
                state.queues.len(),
                offered.len()
            )));
        }
        let mut queues = Vec::with_capacity(offered.len());
        for (index, (saved, &max)) in state.queues.iter().zip(offered).enumerate() {
            if saved.max_size != max {
                return Err(bad(format!(
                    "queue {index} was saved with maximum size {}; the device offers {max}",
                    saved.max_size
                )));
            }
            let queue = Queue::try_from(QueueState {
                max_size: saved.max_size,
                next_avail: saved.next_avail,
                next_used: saved.next_used,
                event_idx_enabled: saved.event_idx_enabled,
                size: saved.size,
                ready: saved.ready,
                desc_table: saved.desc_table,
                avail_ring: saved.avail_ring,
                used_ring: saved.used_ring,
            })
            .map_err(|e| bad(format!("queue {index}: {e}")))?;
            queues.push(queue);
        }
        Ok(MmioTransport {
            device,
            interrupt,
            status: state.status,
            device_features_sel: state.device_features_sel,
            driver_features_sel: state.driver_features_sel,
            driver_features: state.driver_features,
            unknown_features_acked: state.unknown_features_acked,
            queue_sel: state.queue_sel,
            queues,
            interrupt_status: state.interrupt_status,
            config_generation: state.config_generation,
            interrupt_failures: 0,
            driver_error: state.driver_error.clone().map(DriverError),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, to change. A change of its configuration space made here is not announced
    /// to the driver; call [`config_changed`](Self::config_changed) after one.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The device status the driver reads.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device is in the error state (`DEVICE_NEEDS_RESET`).
    pub fn needs_reset(&self) -> bool {
        self.status & status::DEVICE_NEEDS_RESET != 0
    }

    /// The driver error that put the device in `DEVICE_NEEDS_RESET`, until the driver resets it.
    pub fn driver_error(&self) -> Option<&DriverError> {
        self.driver_error.as_ref()
    }

    /// The features the driver accepted (valid once `FEATURES_OK` is set).
    pub fn acked_features(&self) -> u64 {
        self.driver_features
    }

    /// The bits of `InterruptStatus` not yet acknowledged by the driver.
    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    /// The configuration generation the driver reads.
    pub fn config_generation(&self) -> u32 {
        self.config_generation
    }

    /// How many times raising the interrupt failed.
    pub fn interrupt_failures(&self) -> u64 {
        self.interrupt_failures
    }

    /// Announces a change of the device's configuration space: a new configuration
    /// generation and, once the driver is running (`DRIVER_OK`), a configuration-change
    /// interrupt.
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.status & status::DRIVER_OK != 0 {
            self.raise(INTERRUPT_CONFIG_CHANGE);
        }
    }

    fn raise(&mut self, bits: u32) {
        self.interrupt_status |= bits;
        if self.interrupt.trigger().is_err() {
            self.interrupt_failures += 1;
        }
    }

    /// Puts the device in `DEVICE_NEEDS_RESET` for `error` and tells a running driver.
    fn fail(&mut self, error: DriverError) {
        self.status |= status::DEVICE_NEEDS_RESET;
        self.driver_error = Some(error);
        if self.status & status::DRIVER_OK != 0 {
            self.raise(INTERRUPT_CONFIG_CHANGE);
        }
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// A vCPU read of `data.len()` bytes at `offset` in the device's window. Control
    /// registers answer 4-byte aligned reads only; the configuration space (from
    /// [`CONFIG_OFFSET`]) any width. Anything else reads as zeros.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= CONFIG_OFFSET {
            if offset < MMIO_WINDOW_SIZE {
                self.device.read_config(offset - CONFIG_OFFSET, data);
            }
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return;
        }
        let Ok(register) = u32::try_from(offset) else {
            return;
        };
        let value = match register {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_id(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => low(self.device.features()),
                1 => high(self.device.features()),
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status,
            // No shared memory regions: a length and a base of all ones.
            VIRTIO_MMIO_SHM_LEN_LOW
            | VIRTIO_MMIO_SHM_LEN_HIGH
            | VIRTIO_MMIO_SHM_BASE_LOW
            | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// A vCPU write of `data` at `offset` in the device's window. Control registers take
    /// 4-byte aligned writes only; anything else is ignored.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_OFFSET {
            if offset < MMIO_WINDOW_SIZE {
                self.device.write_config(offset - CONFIG_OFFSET, data);
            }
            return;
        }
        let (Ok(bytes), true) = (<[u8; 4]>::try_from(data), offset.is_multiple_of(4)) else {
            return;
        };
        let Ok(register) = u32::try_from(offset) else {
            return;
        };
        let value = u32::from_le_bytes(bytes);
        match register {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(value),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            VIRTIO_MMIO_QUEUE_NUM => self.write_queue_num(value),
            VIRTIO_MMIO_QUEUE_READY => self.write_queue_ready(value),
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(value),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !value,
            VIRTIO_MMIO_STATUS => self.write_status(value),
            VIRTIO_MMIO_QUEUE_DESC_LOW => self.write_queue_address(Ring::Desc, Some(value), None),
            VIRTIO_MMIO_QUEUE_DESC_HIGH => self.write_queue_address(Ring::Desc, None, Some(value)),
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => self.write_queue_address(Ring::Avail, Some(value), None),
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.write_queue_address(Ring::Avail, None, Some(value))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => self.write_queue_address(Ring::Used, Some(value), None),
            VIRTIO_MMIO_QUEUE_USED_HIGH => self.write_queue_address(Ring::Used, None, Some(value)),
            _ => {}
        }
    }

    /// Whether the driver may still configure queues: it has not set `DRIVER_OK`, and the
    /// device is not waiting for a reset.
    fn setting_up(&self) -> bool {
        self.status & (status::DRIVER_OK | status::DEVICE_NEEDS_RESET) == 0
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features are accepted between DRIVER and FEATURES_OK only.
        if self.status & (status::DRIVER | status::FEATURES_OK) != status::DRIVER {
            return;
        }
        match self.driver_features_sel {
            0 => self.driver_features = set_low(self.driver_features, value),
            1 => self.driver_features = set_high(self.driver_features, value),
            _ => self.unknown_features_acked |= value != 0,
        }
    }

    fn write_queue_ready(&mut self, value: u32) {
        if !self.setting_up() {
            return;
        }
        if let Some(q) = self.selected_queue() {
            q.set_ready(value == 1);
        }
    }

    fn write_queue_num(&mut self, value: u32) {
        if !self.setting_up() {
            return;
        }
        let Some(q) = self.selected_queue() else {
            return;
        };
        if q.ready() {
            return;
        }
        let result = u16::try_from(value)
            .map_err(|_| ())
            .and_then(|size| q.try_set_size(size).map_err(|_| ()));
        if result.is_err() {
            let max = q.max_size();
            self.fail(DriverError(format!(
                "queue {}: size {value} is not a power of two between 1 and {max}",
                self.queue_sel
            )));
        }
    }

    fn write_queue_address(&mut self, ring: Ring, low: Option<u32>, high: Option<u32>) {
        if !self.setting_up() {
            return;
        }
        let index = self.queue_sel;
        let Some(q) = self.selected_queue() else {
            return;
        };
        if q.ready() {
            return;
        }
        let old = match ring {
            Ring::Desc => q.desc_table(),
            Ring::Avail => q.avail_ring(),
            Ring::Used => q.used_ring(),
        };
        let mut address = old;
        if let Some(low) = low {
            address = set_low(address, low);
        }
        if let Some(high) = high {
            address = set_high(address, high);
        }
        let address = GuestAddress(address);
        let result = match ring {
            Ring::Desc => q.try_set_desc_table_address(address),
            Ring::Avail => q.try_set_avail_ring_address(address),
            Ring::Used => q.try_set_used_ring_address(address),
        };
        if result.is_err() {
            self.fail(DriverError(format!(
                "queue {index}: {} address {:#x} is misaligned",
                ring.name(),
                address.0
            )));
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // DEVICE_NEEDS_RESET is the device's to set; the driver only adds its own bits.
        let value = value & !status::DEVICE_NEEDS_RESET;
        let current = self.status & !status::DEVICE_NEEDS_RESET;
        if value & current != current {
            // Clearing a bit without a reset is not allowed: ignore the write.
            return;
        }
        let mut new = self.status;
        if value & status::FAILED != 0 {
            new |= status::FAILED;
        }
        // Each step needs the one before it; FEATURES_OK only if the features are acceptable.
        if value & status::ACKNOWLEDGE != 0 {
            new |= status::ACKNOWLEDGE;
        }
        if value & status::DRIVER != 0 && new & status::ACKNOWLEDGE != 0 {
            new |= status::DRIVER;
        }
        if value & status::FEATURES_OK != 0
            && new & status::DRIVER != 0
            && (current & status::FEATURES_OK != 0 || self.features_acceptable())
        {
            new |= status::FEATURES_OK;
        }
        let driver_ok = value & status::DRIVER_OK != 0
            && new & status::FEATURES_OK != 0
            && current & status::DRIVER_OK == 0;
        if driver_ok {
            new |= status::DRIVER_OK;
        }
        self.status = new;
        if driver_ok && !self.needs_reset() {
            if let Err(e) = self.device.activate(self.driver_features) {
                self.fail(e);
            }
        }
    }

    fn features_acceptable(&self) -> bool {
        let acked = self.driver_features;
        !self.unknown_features_acked
            && acked & !self.device.features() == 0
            && acked & F_VERSION_1 != 0
            && self.device.accept_features(acked)
    }

    fn notify(&mut self, value: u32) {
        if self.status & status::DRIVER_OK == 0 || self.needs_reset() {
            return;
        }
        let index = value as usize;
        let Some(queue) = self.queues.get_mut(index) else {
            return;
        };
        if !queue.ready() {
            return;
        }
        match self.device.process_queue(index, queue) {
            Ok(outcome) => {
                if outcome.config_changed {
                    self.config_generation = self.config_generation.wrapping_add(1);
                }
                if outcome.used_buffers {
                    self.raise(INTERRUPT_USED_BUFFER);
                }
            }
            Err(e) => self.fail(e),
        }
    }

    /// The driver wrote 0 to `Status`: registers, negotiated features, queues and interrupt
    /// status go back to their initial values, and the device is told.
    fn reset(&mut self) {
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.unknown_features_acked = false;
        self.queue_sel = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt_status = 0;
        self.driver_error = None;
        self.device.reset();
    }
}

#[derive(Clone, Copy)]
enum Ring {
    Desc,
    Avail,
    Used,
}

impl Ring {
    fn name(self) -> &'static str {
        match self {
            Ring::Desc => "descriptor table",
            Ring::Avail => "driver (available) ring",
            Ring::Used => "device (used) ring",
        }
    }
}

#[cfg(test)]
mod tests;
