//! A scalable map of guest memory slots for virtual machine monitors.
//!
//! The userspace counterpart of the kernel's scalable memslots: every slot is indexed three
//! ways, by guest-physical address (slots never overlap there), by host-virtual address (an
//! interval tree: host ranges may overlap) and by id, and all three indexes are persistent
//! B+trees that share structure between versions. A change costs O(log n) and copies only the
//! nodes on the changed paths; lookups are O(log n). Up to 1024 slots (where most VMMs live) a
//! map keeps them instead in arrays, which is cheaper at that size: up to 32 slots one array
//! copied whole for a new version, like vm-memory's `GuestMemoryMmap`; beyond that an array of
//! the keys (plain data, one block copy) and the slots in shared chunks of 16, of which a change
//! copies one. [`SharedMap`] publishes versions to
//! lock-free readers (read-copy-update on `arc-swap`), and a per-reader [`LookupHint`] makes
//! repeated lookups in the same slot constant-time without any shared write.
//!
//! The crate is pure data structure: it knows nothing of KVM or of mappings. The payload `P`
//! carried by each slot is the caller's (for example an `Arc` of the backing region).

#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod error;
mod map;
mod ptree;
mod search;
mod shared;
mod slot;

pub use error::{AddressKind, BatchError, ConfigError, MapError};
pub use map::{Change, LookupHint, MapConfig, MemoryUsage, MemslotMap};
pub use shared::{MapWriter, SharedMap};
pub use slot::{AddressRange, HostAddress, Slot, SlotFlags, SlotId};
pub use vm_memory::GuestAddress;
