//! Guest memory for Rust VMMs: regions of host memory kept in a scalable memslot map and
//! mirrored exactly to KVM's memory slots.
//!
//! [`MemoryManager`] owns a VM's memory. Each region is one host mapping split into one or more
//! KVM slots; the slots live in a [`memslot_map`] map whose versions readers get lock-free
//! through [`GuestMemoryHandle`] (a vm-memory `GuestAddressSpace`, so linux-loader,
//! virtio-queue and every other vm-memory user work with it). Every change is planned as KVM
//! requests, applied, and published only if KVM accepted all of them; a refused request undoes
//! the ones before it. Dirty logging is switched per region with flags-only updates and
//! harvested from KVM's log and the VMM's own write bitmap.

#![doc = include_str!("../README.md")]

mod dirty;
mod error;
mod kvm;
mod limits;
mod manager;
mod memory;
mod pending;
mod region_memory;
mod ring;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use dirty::{DirtyConsumer, DirtyPages};
pub use error::{Error, ErrorKind};
pub use kvm::{KvmMemory, KvmSlot, KvmVm};
pub use limits::{metadata_bytes, Limit, MemoryLimits, MemoryUse};
pub use manager::GuestMemoryHandle;
pub use manager::{
    HvaMatch, MemoryManager, RegionChange, RegionInfo, RegionSpec, Reslot, SlotUsage, Target,
    KVM_MAX_SLOT_SIZE,
};
pub use memory::{GuestMemorySlots, GuestMemoryView, GuestSlot, GuestSlotData, SlotBacking};
pub use region_memory::{
    hugetlb_pages_available, on_hugetlbfs, split_by, Access, Backing, MappingError, PageSize,
    RegionId, RegionMemory, HUGE_PAGE_SIZE,
};
pub use ring::{RingCollection, RingError, MIN_RING_ENTRIES};

pub use memslot_map::{AddressRange, HostAddress, SlotFlags, SlotId};

/// The page size of guest memory and of KVM's dirty logs on x86_64.
pub const PAGE_SIZE: u64 = 4096;

/// One version of a manager's memory map: the type vCPU exit handlers look slots up in (by
/// guest address, host address or slot id; [`MemoryManager::load`] gives the current one).
/// Each slot's payload is its [`SlotBacking`].
pub type GuestMemoryMap = memslot_map::MemslotMap<SlotBacking>;

/// A short-lived, lock-free hold on the current [`GuestMemoryMap`], from
/// [`MemoryManager::load`] (arc-swap's guard, so that users need no arc-swap dependency).
/// Dereferences to `Arc<GuestMemoryMap>`.
pub type MapGuard = arc_swap::Guard<std::sync::Arc<GuestMemoryMap>>;
