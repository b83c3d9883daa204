//! The virtio-mem device (virtio device id 24): a region of guest-physical address space split
//! into blocks that the guest's driver plugs and unplugs on request; neighbouring plugged
//! blocks share a KVM slot (up to a maximum slot size), unplugged ones have none, through
//! the regions of a [`MemoryManager`](kvm_memslots::MemoryManager).
//!
//! See the crate documentation for how blocks map to KVM slots and why. The parts:
//! `request.rs` has the requests and responses as they travel in the queue, `config.rs` the
//! options and the configuration space, `slots.rs` which slots plugged blocks get, `device.rs`
//! the device ([`VirtioMem`]) that answers the requests.

mod config;
mod device;
mod request;
mod slots;
mod state;
#[cfg(test)]
mod tests;

pub use config::{
    Error, VirtioMemOptions, CONFIG_SIZE, DEFAULT_MAX_SLOT_SIZE, DEFAULT_QUEUE_SIZE,
    DEFAULT_USABLE_HEADROOM,
};
pub use device::{
    PluggedBlock, RequestCounts, VirtioMem, VIRTIO_MEM_F_ACPI_PXM,
    VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE,
};
pub use request::{
    REQUEST_SIZE, RESPONSE_SIZE, VIRTIO_MEM_REQ_PLUG, VIRTIO_MEM_REQ_STATE, VIRTIO_MEM_REQ_UNPLUG,
    VIRTIO_MEM_REQ_UNPLUG_ALL, VIRTIO_MEM_RESP_ACK, VIRTIO_MEM_RESP_BUSY, VIRTIO_MEM_RESP_ERROR,
    VIRTIO_MEM_RESP_NACK, VIRTIO_MEM_STATE_MIXED, VIRTIO_MEM_STATE_PLUGGED,
    VIRTIO_MEM_STATE_UNPLUGGED,
};
pub use slots::{piece_change, plugged_runs};
pub use state::VirtioMemState;
