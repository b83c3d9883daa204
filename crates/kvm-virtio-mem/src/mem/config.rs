//! The device's configuration: the options a VMM makes it with, their checks, and the
//! configuration space the driver reads (`struct virtio_mem_config`), with the rules by which
//! the requested size and the usable region change.

use kvm_memslots::{AddressRange, PageSize, RegionId, KVM_MAX_SLOT_SIZE, PAGE_SIZE};
use vm_memory::GuestAddress;

/// Bytes of the configuration space (`struct virtio_mem_config`).
pub const CONFIG_SIZE: usize = 56;

/// Offsets of the configuration fields (all little-endian).
mod field {
    pub const BLOCK_SIZE: usize = 0;
    pub const NODE_ID: usize = 8;
    pub const ADDR: usize = 16;
    pub const REGION_SIZE: usize = 24;
    pub const USABLE_REGION_SIZE: usize = 32;
    pub const PLUGGED_SIZE: usize = 40;
    pub const REQUESTED_SIZE: usize = 48;
}

/// How far past the requested size the usable region reaches by default: two of Linux's
/// 128 MiB x86 memory blocks, so that its driver, which adds memory to the kernel in whole
/// memory blocks that must lie inside the usable region, has room to choose blocks.
pub const DEFAULT_USABLE_HEADROOM: u64 = 256 << 20;
/// Default size of the request queue.
pub const DEFAULT_QUEUE_SIZE: u16 = 128;
/// The largest KVM slot plugged blocks share by default: 128 MiB, Linux's x86 memory block,
/// which its driver plugs whole in the common case (and the slot size Firecracker uses).
pub const DEFAULT_MAX_SLOT_SIZE: u64 = 128 << 20;

/// What a virtio-mem device manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMemOptions {
    /// Guest-physical base of the device's region (a multiple of the block size).
    pub addr: GuestAddress,
    /// Size of the region in bytes (a multiple of the block size, not zero).
    pub region_size: u64,
    /// Size and alignment of a block: a power of two of at least 4 KiB.
    pub block_size: u64,
    /// The requested size the device starts with (a multiple of the block size).
    pub requested_size: u64,
    /// How far the usable region reaches past the requested size (rounded up to a block).
    pub usable_headroom: u64,
    /// Size of the request queue (a power of two, at most 32768).
    pub queue_size: u16,
    /// The largest KVM slot neighbouring plugged blocks share (a multiple of the block size):
    /// the region is cut into pieces of this size, each a manager region while a block of it
    /// is plugged, and each run of plugged blocks in a piece one KVM slot. The block size gives
    /// each plugged block a region and a slot of its own.
    pub max_slot_size: u64,
    /// The host pages behind plugged blocks: with 2 MiB hugetlb pages the block size must be
    /// a multiple of 2 MiB (so that plugging and unplugging a block maps and frees whole huge
    /// pages), and the host's pool must hold a piece when its first block is plugged.
    pub page_size: PageSize,
}

impl VirtioMemOptions {
    /// A region of `region_size` bytes at `addr` in blocks of `block_size` bytes, nothing
    /// requested, [`DEFAULT_USABLE_HEADROOM`], [`DEFAULT_QUEUE_SIZE`] and
    /// [`DEFAULT_MAX_SLOT_SIZE`] (or the block size, if that is larger).
    pub fn new(addr: GuestAddress, region_size: u64, block_size: u64) -> Self {
        VirtioMemOptions {
            addr,
            region_size,
            block_size,
            requested_size: 0,
            usable_headroom: DEFAULT_USABLE_HEADROOM,
            queue_size: DEFAULT_QUEUE_SIZE,
            max_slot_size: DEFAULT_MAX_SLOT_SIZE.max(block_size),
            page_size: PageSize::Base,
        }
    }

    /// The same options with plugged blocks in host pages of `page_size`
    /// ([`page_size`](Self::page_size)).
    pub fn with_page_size(self, page_size: PageSize) -> Self {
        VirtioMemOptions { page_size, ..self }
    }

    /// The same options with plugged blocks sharing KVM slots of up to `bytes`
    /// ([`max_slot_size`](Self::max_slot_size)).
    pub fn with_max_slot_size(self, bytes: u64) -> Self {
        VirtioMemOptions {
            max_slot_size: bytes,
            ..self
        }
    }

    /// Checks the options on their own, as [`VirtioMem::new`](super::VirtioMem::new) does
    /// before anything else: the block size (a power of two of at least 4 KiB, whole host
    /// pages of [`page_size`](Self::page_size)), the region's base, size and the requested
    /// size multiples of it, the region neither empty nor wrapping around the address space,
    /// the requested size within it, the queue size, and the maximum slot size. What depends
    /// on the memory the device is made over (overlaps, free KVM slots) is checked there.
    pub fn validate(&self) -> Result<(), Error> {
        let VirtioMemOptions {
            addr,
            region_size,
            block_size,
            requested_size,
            usable_headroom: _,
            queue_size,
            max_slot_size,
            page_size,
        } = *self;
        if !block_size.is_power_of_two() || block_size < PAGE_SIZE {
            return Err(Error::BlockSize(block_size));
        }
        if !block_size.is_multiple_of(page_size.alignment()) {
            return Err(Error::BlockPageSize {
                block_size,
                page_size: page_size.name(),
                alignment: page_size.alignment(),
            });
        }
        check_aligned("region base", addr.0, block_size)?;
        check_aligned("region size", region_size, block_size)?;
        check_aligned("requested size", requested_size, block_size)?;
        if region_size == 0 {
            return Err(Error::EmptyRegion);
        }
        if addr.0.checked_add(region_size).is_none() {
            return Err(Error::WrapAround {
                addr: addr.0,
                size: region_size,
            });
        }
        if requested_size > region_size {
            return Err(Error::RequestedTooLarge {
                requested: requested_size,
                region_size,
            });
        }
        if queue_size == 0 || !queue_size.is_power_of_two() || queue_size > 32768 {
            return Err(Error::QueueSize(queue_size));
        }
        if max_slot_size == 0
            || !max_slot_size.is_multiple_of(block_size)
            || max_slot_size > KVM_MAX_SLOT_SIZE
        {
            return Err(Error::MaxSlotSize {
                max_slot_size,
                block_size,
            });
        }
        Ok(())
    }
}

/// Why a device could not be made or changed. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The block size is not a power of two of at least a page.
    #[error("block size {0:#x} is not a power of two of at least 4 KiB")]
    BlockSize(u64),
    /// The block size is not a multiple of the host page size behind the blocks.
    #[error("block size {block_size:#x} is not a multiple of the {page_size} host pages behind the blocks ({alignment:#x})")]
    BlockPageSize {
        /// The block size.
        block_size: u64,
        /// The page size's name.
        page_size: &'static str,
        /// The page size in bytes.
        alignment: u64,
    },
    /// A value is not a multiple of the block size.
    #[error("{what} {value:#x} is not a multiple of the block size {block_size:#x}")]
    Unaligned {
        /// Which value.
        what: &'static str,
        /// The value.
        value: u64,
        /// The block size.
        block_size: u64,
    },
    /// The region is empty.
    #[error("the device region is empty")]
    EmptyRegion,
    /// The region does not fit below 2^64.
    #[error("the device region at {addr:#x} of size {size:#x} wraps around the address space")]
    WrapAround {
        /// Its base.
        addr: u64,
        /// Its size.
        size: u64,
    },
    /// The region overlaps a region the manager already has.
    #[error("the device region {range} overlaps region {other} at {other_gpa:#x} (size {other_size:#x})")]
    Overlap {
        /// The device region.
        range: AddressRange,
        /// The manager's region in the way.
        other: RegionId,
        /// Its base.
        other_gpa: u64,
        /// Its size.
        other_size: u64,
    },
    /// Plugging every block would need more KVM slots than the manager has free (each block
    /// its own slot: the maximum slot size is the block size).
    #[error("the device region needs {needed} KVM slots (one per block) but only {free} are free")]
    NotEnoughSlots {
        /// Blocks in the region.
        needed: u64,
        /// Slots free.
        free: u64,
    },
    /// The most KVM slots the plugged blocks could need (every other block plugged) is more
    /// than the manager has free.
    #[error("the device region may need {needed} KVM slots (one per run of plugged blocks, runs of at most {max_slot_size:#x} bytes) but only {free} are free")]
    NotEnoughSlotsForRuns {
        /// The most slots the region's blocks could need.
        needed: u64,
        /// Slots free.
        free: u64,
        /// The largest slot.
        max_slot_size: u64,
    },
    /// A maximum slot size that is not a multiple of the block size, or above KVM's limit.
    #[error("maximum slot size {max_slot_size:#x} is not a non-zero multiple of the block size {block_size:#x} within KVM's per-slot limit")]
    MaxSlotSize {
        /// The maximum slot size asked for.
        max_slot_size: u64,
        /// The block size.
        block_size: u64,
    },
    /// A requested size larger than the region.
    #[error("requested size {requested:#x} is larger than the region size {region_size:#x}")]
    RequestedTooLarge {
        /// The requested size.
        requested: u64,
        /// The region size.
        region_size: u64,
    },
    /// A queue size that is not a power of two between 1 and 32768.
    #[error("queue size {0} is not a power of two between 1 and 32768")]
    QueueSize(u16),
    /// A saved state that does not fit the device or the memory it is restored over.
    #[error("the saved virtio-mem state: {0}")]
    State(String),
}

fn check_aligned(what: &'static str, value: u64, block_size: u64) -> Result<(), Error> {
    if !value.is_multiple_of(block_size) {
        return Err(Error::Unaligned {
            what,
            value,
            block_size,
        });
    }
    Ok(())
}

/// The configuration the driver sees, but for the plugged size (the device's block state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Config {
    addr: u64,
    region_size: u64,
    block_size: u64,
    headroom: u64,
    usable_region_size: u64,
    requested_size: u64,
    max_slot_size: u64,
    page_size: PageSize,
}

impl Config {
    /// The configuration `options` describe, once every option is checked
    /// ([`VirtioMemOptions::validate`]).
    pub(super) fn new(options: &VirtioMemOptions) -> Result<Self, Error> {
        options.validate()?;
        let VirtioMemOptions {
            addr,
            region_size,
            block_size,
            requested_size,
            usable_headroom,
            queue_size: _,
            max_slot_size,
            page_size,
        } = *options;
        let mut config = Config {
            addr: addr.0,
            region_size,
            block_size,
            headroom: usable_headroom,
            usable_region_size: 0,
            requested_size,
            max_slot_size,
            page_size,
        };
        config.usable_region_size = config.usable_for(requested_size);
        Ok(config)
    }

    /// The device's region of guest-physical address space.
    pub(super) fn region(&self) -> AddressRange {
        AddressRange {
            start: self.addr,
            end: self.addr + self.region_size,
        }
    }

    /// Blocks in the region.
    pub(super) fn blocks(&self) -> u64 {
        self.region_size / self.block_size
    }

    pub(super) fn block_size(&self) -> u64 {
        self.block_size
    }

    /// The host pages behind plugged blocks.
    pub(super) fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// Blocks per piece of the region that shares slots (see
    /// [`VirtioMemOptions::max_slot_size`]).
    pub(super) fn blocks_per_piece(&self) -> usize {
        (self.max_slot_size / self.block_size) as usize
    }

    pub(super) fn max_slot_size(&self) -> u64 {
        self.max_slot_size
    }

    pub(super) fn requested_size(&self) -> u64 {
        self.requested_size
    }

    pub(super) fn usable_region_size(&self) -> u64 {
        self.usable_region_size
    }

    /// Guest-physical base of block `index`.
    pub(super) fn block_gpa(&self, index: usize) -> GuestAddress {
        GuestAddress(self.addr + index as u64 * self.block_size)
    }

    fn usable_for(&self, requested: u64) -> u64 {
        let wanted = requested
            .saturating_add(self.headroom)
            .checked_next_multiple_of(self.block_size)
            .unwrap_or(u64::MAX);
        wanted.min(self.region_size)
    }

    /// Sets the requested size to `bytes` and grows the usable region to fit it; refused,
    /// changing nothing, unless `bytes` is a multiple of the block size and at most the
    /// region size.
    pub(super) fn set_requested_size(&mut self, bytes: u64) -> Result<(), Error> {
        check_aligned("requested size", bytes, self.block_size)?;
        if bytes > self.region_size {
            return Err(Error::RequestedTooLarge {
                requested: bytes,
                region_size: self.region_size,
            });
        }
        self.requested_size = bytes;
        self.usable_region_size = self.usable_region_size.max(self.usable_for(bytes));
        Ok(())
    }

    /// Shrinks the usable region to fit the requested size (once every block is unplugged).
    /// Sets the usable region as saved (checked by the caller against the block size, the
    /// requested size and the region).
    pub(super) fn set_usable_region_size(&mut self, bytes: u64) {
        self.usable_region_size = bytes;
    }

    pub(super) fn shrink_usable_region(&mut self) {
        self.usable_region_size = self.usable_for(self.requested_size);
    }

    /// The block indices a PLUG, UNPLUG or STATE request covers, if it is well-formed: `addr`
    /// block-aligned, at least one block, every block inside the usable region.
    pub(super) fn covered(&self, addr: u64, blocks: u16) -> Option<std::ops::Range<usize>> {
        if blocks == 0 || !addr.is_multiple_of(self.block_size) {
            return None;
        }
        let first = addr.checked_sub(self.addr)? / self.block_size;
        let end = first.checked_add(u64::from(blocks))?;
        if end.checked_mul(self.block_size)? > self.usable_region_size {
            return None;
        }
        Some(first as usize..end as usize)
    }

    /// Reads the configuration space, with `plugged_size` bytes plugged, from byte `offset`
    /// into `data` (zeros past its end).
    pub(super) fn read(&self, plugged_size: u64, offset: u64, data: &mut [u8]) {
        let mut space = [0u8; CONFIG_SIZE];
        let mut put = |at: usize, v: u64| space[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(field::BLOCK_SIZE, self.block_size);
        put(field::ADDR, self.addr);
        put(field::REGION_SIZE, self.region_size);
        put(field::USABLE_REGION_SIZE, self.usable_region_size);
        put(field::PLUGGED_SIZE, plugged_size);
        put(field::REQUESTED_SIZE, self.requested_size);
        // node_id stays 0: VIRTIO_MEM_F_ACPI_PXM is not offered.
        debug_assert_eq!(space[field::NODE_ID], 0);
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        for (i, byte) in data.iter_mut().enumerate() {
            match start.checked_add(i).and_then(|at| space.get(at)) {
                Some(b) => *byte = *b,
                None => break,
            }
        }
    }
}
