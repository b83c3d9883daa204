//! Why a change to a map was refused.

use crate::slot::{AddressRange, SlotId};

/// Which address of a slot a check is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressKind {
    /// The guest-physical base.
    Guest,
    /// The host-virtual base.
    Host,
    /// The size.
    Size,
}

impl std::fmt::Display for AddressKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AddressKind::Guest => "guest address",
            AddressKind::Host => "host address",
            AddressKind::Size => "size",
        })
    }
}

/// A change the map refused. A refused change leaves the map exactly as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// The slot would hold no memory.
    #[error("slot {id}: size is zero")]
    ZeroSize {
        /// The slot at fault.
        id: SlotId,
    },
    /// An address or the size is not a multiple of the map's page size.
    #[error("slot {id}: {what} {value:#x} is not a multiple of the page size {page_size:#x}")]
    Unaligned {
        /// The slot at fault.
        id: SlotId,
        /// Which value is unaligned.
        what: AddressKind,
        /// The unaligned value.
        value: u64,
        /// The map's page size.
        page_size: u64,
    },
    /// `base + size` does not fit in 64 bits.
    #[error("slot {id}: {what} {base:#x} + size {size:#x} wraps around the address space")]
    WrapAround {
        /// The slot at fault.
        id: SlotId,
        /// Which range wraps.
        what: AddressKind,
        /// The range's base.
        base: u64,
        /// The slot's size.
        size: u64,
    },
    /// The slot's guest range overlaps another slot's.
    #[error("slot {id}: guest range {range} overlaps slot {other} at {other_range}")]
    Overlap {
        /// The slot being inserted or moved.
        id: SlotId,
        /// Its guest range.
        range: AddressRange,
        /// The slot already there.
        other: SlotId,
        /// That slot's guest range.
        other_range: AddressRange,
    },
    /// A slot with this id is already in the map.
    #[error("slot {id} already exists")]
    DuplicateId {
        /// The id in use.
        id: SlotId,
    },
    /// No slot has this id.
    #[error("no slot has id {id}")]
    UnknownId {
        /// The id asked for.
        id: SlotId,
    },
    /// The map already holds as many slots as it was configured for.
    #[error("slot {id}: the map is full ({limit} slots)")]
    SlotLimit {
        /// The slot that did not fit.
        id: SlotId,
        /// The configured limit.
        limit: usize,
    },
}

/// A batch of changes was refused because one of them was; none of the batch was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("change {index} of the batch was refused: {source}")]
pub struct BatchError {
    /// Position of the refused change in the batch, from 0.
    pub index: usize,
    /// Why it was refused (checked against the map as the changes before it left it).
    #[source]
    pub source: MapError,
}

/// A map configuration that makes no sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The page size must be a power of two.
    #[error("page size {0:#x} is not a power of two")]
    PageSize(u64),
}
