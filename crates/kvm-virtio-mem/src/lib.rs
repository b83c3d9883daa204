//! A virtio-mem device for VMMs built on [`kvm_memslots`]: guest memory that grows and shrinks
//! block by block at the guest driver's request, neighbouring plugged blocks sharing a KVM
//! slot.
//!
//! - [`mmio`]: the virtio-mmio transport (version 2), generic over [`VirtioDevice`]. A VMM
//!   forwards vCPU MMIO exits in the device's window to [`MmioTransport::read`] and
//!   [`MmioTransport::write`].
//! - [`mem`]: the virtio-mem device, [`VirtioMem`], which plugs and unplugs blocks by adding,
//!   re-slotting and removing regions of a [`kvm_memslots::MemoryManager`] (one region per
//!   piece of the device's region with a block plugged, one slot per run of plugged blocks).

#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod mem;
pub mod mmio;

pub use mem::{Error, PluggedBlock, RequestCounts, VirtioMem, VirtioMemOptions, VirtioMemState};
pub use mmio::{
    DriverError, Interrupt, MmioTransport, QueueOutcome, QueueSnapshot, TransportError,
    TransportState, VirtioDevice, MMIO_WINDOW_SIZE,
};
