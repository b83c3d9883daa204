//! The virtio-mem device (virtio device id 24): a region of guest-physical address space split
//! into blocks that the guest's driver plugs and unplugs on request, each plugged block one
//! region (and one KVM slot) of a [`MemoryManager`].
//!
//! See the crate documentation for how blocks map to KVM slots and why.

use std::fmt;
use std::sync::Arc;

use kvm_memslots::{
    AddressRange, GuestMemorySlots, GuestMemorySnapshot, KvmMemory, MemoryManager, RegionId,
    RegionSpec, PAGE_SIZE,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_MEM;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::mmio::{DriverError, Interrupt, MmioTransport, QueueOutcome, VirtioDevice, F_VERSION_1};

/// Feature bit number: `node_id` is an ACPI proximity domain (not offered).
pub const VIRTIO_MEM_F_ACPI_PXM: u32 = 0;
/// Feature bit number: the driver must not touch unplugged memory (offered and required).
pub const VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE: u32 = 1;

/// Request type: plug consecutive blocks.
pub const VIRTIO_MEM_REQ_PLUG: u16 = 0;
/// Request type: unplug consecutive blocks.
pub const VIRTIO_MEM_REQ_UNPLUG: u16 = 1;
/// Request type: unplug every block and shrink the usable region.
pub const VIRTIO_MEM_REQ_UNPLUG_ALL: u16 = 2;
/// Request type: the state of consecutive blocks.
pub const VIRTIO_MEM_REQ_STATE: u16 = 3;

/// Response type: done.
pub const VIRTIO_MEM_RESP_ACK: u16 = 0;
/// Response type: refused (a plug beyond the requested size).
pub const VIRTIO_MEM_RESP_NACK: u16 = 1;
/// Response type: cannot be done now, try again later.
pub const VIRTIO_MEM_RESP_BUSY: u16 = 2;
/// Response type: the request is wrong (range, alignment, block states).
pub const VIRTIO_MEM_RESP_ERROR: u16 = 3;

/// STATE answer: every block plugged.
pub const VIRTIO_MEM_STATE_PLUGGED: u16 = 0;
/// STATE answer: every block unplugged.
pub const VIRTIO_MEM_STATE_UNPLUGGED: u16 = 1;
/// STATE answer: some of each.
pub const VIRTIO_MEM_STATE_MIXED: u16 = 2;

/// Bytes of a request (`struct virtio_mem_req`).
pub const REQUEST_SIZE: usize = 24;
/// Bytes of a response (`struct virtio_mem_resp`).
pub const RESPONSE_SIZE: usize = 10;
/// Bytes of the configuration space (`struct virtio_mem_config`).
pub const CONFIG_SIZE: usize = 56;

/// Offsets of the configuration fields (all little-endian).
mod config {
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
}

impl VirtioMemOptions {
    /// A region of `region_size` bytes at `addr` in blocks of `block_size` bytes, nothing
    /// requested, [`DEFAULT_USABLE_HEADROOM`] and [`DEFAULT_QUEUE_SIZE`].
    pub fn new(addr: GuestAddress, region_size: u64, block_size: u64) -> Self {
        VirtioMemOptions {
            addr,
            region_size,
            block_size,
            requested_size: 0,
            usable_headroom: DEFAULT_USABLE_HEADROOM,
            queue_size: DEFAULT_QUEUE_SIZE,
        }
    }
}

/// Why a device could not be made or changed. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The block size is not a power of two of at least a page.
    #[error("block size {0:#x} is not a power of two of at least 4 KiB")]
    BlockSize(u64),
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
    /// Plugging every block would need more KVM slots than the manager has free.
    #[error("the device region needs {needed} KVM slots (one per block) but only {free} are free")]
    NotEnoughSlots {
        /// Blocks in the region.
        needed: u64,
        /// Slots free.
        free: u64,
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
}

/// A request from the driver, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    Plug { addr: u64, blocks: u16 },
    Unplug { addr: u64, blocks: u16 },
    UnplugAll,
    State { addr: u64, blocks: u16 },
    Unknown(u16),
}

impl Request {
    fn decode(bytes: &[u8; REQUEST_SIZE]) -> Self {
        let le16 = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&bytes[8..16]);
        let addr = u64::from_le_bytes(addr);
        let blocks = le16(16);
        match le16(0) {
            VIRTIO_MEM_REQ_PLUG => Request::Plug { addr, blocks },
            VIRTIO_MEM_REQ_UNPLUG => Request::Unplug { addr, blocks },
            VIRTIO_MEM_REQ_UNPLUG_ALL => Request::UnplugAll,
            VIRTIO_MEM_REQ_STATE => Request::State { addr, blocks },
            other => Request::Unknown(other),
        }
    }
}

/// A response: its type and, for an acknowledged STATE request, the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Response {
    kind: u16,
    state: u16,
}

impl Response {
    const ACK: Response = Response::of(VIRTIO_MEM_RESP_ACK);
    const NACK: Response = Response::of(VIRTIO_MEM_RESP_NACK);
    const BUSY: Response = Response::of(VIRTIO_MEM_RESP_BUSY);
    const ERROR: Response = Response::of(VIRTIO_MEM_RESP_ERROR);

    const fn of(kind: u16) -> Self {
        Response { kind, state: 0 }
    }

    fn encode(self) -> [u8; RESPONSE_SIZE] {
        let mut out = [0u8; RESPONSE_SIZE];
        out[0..2].copy_from_slice(&self.kind.to_le_bytes());
        out[8..10].copy_from_slice(&self.state.to_le_bytes());
        out
    }
}

/// A plugged block: its guest address and the manager region (one KVM slot) behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluggedBlock {
    /// Guest-physical base of the block.
    pub gpa: GuestAddress,
    /// The manager's region holding it.
    pub region: RegionId,
}

/// Counts of the requests answered, by response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// Answered ACK.
    pub ack: u64,
    /// Answered NACK.
    pub nack: u64,
    /// Answered BUSY (the host could not change its memory; nothing changed).
    pub busy: u64,
    /// Answered ERROR.
    pub error: u64,
}

/// The virtio-mem device. Put it behind an [`MmioTransport`] ([`into_mmio`](Self::into_mmio)).
pub struct VirtioMem<K: KvmMemory> {
    memory: Arc<MemoryManager<K>>,
    addr: u64,
    region_size: u64,
    block_size: u64,
    headroom: u64,
    queue_sizes: [u16; 1],
    usable_region_size: u64,
    requested_size: u64,
    /// One entry per block: the region behind it while plugged.
    blocks: Vec<Option<RegionId>>,
    plugged: u64,
    counts: RequestCounts,
}

impl<K: KvmMemory> fmt::Debug for VirtioMem<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtioMem")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("region_size", &format_args!("{:#x}", self.region_size))
            .field("block_size", &format_args!("{:#x}", self.block_size))
            .field(
                "usable_region_size",
                &format_args!("{:#x}", self.usable_region_size),
            )
            .field(
                "requested_size",
                &format_args!("{:#x}", self.requested_size),
            )
            .field("plugged_size", &format_args!("{:#x}", self.plugged_size()))
            .finish_non_exhaustive()
    }
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

impl<K: KvmMemory> VirtioMem<K> {
    /// A device for the region `options` describes, adding plugged blocks to `memory`. Nothing
    /// is plugged.
    ///
    /// Refused if the options are inconsistent, if the region overlaps one of `memory`'s
    /// regions, or if `memory` has fewer free KVM slots than the region has blocks (each
    /// plugged block takes one).
    pub fn new(memory: Arc<MemoryManager<K>>, options: VirtioMemOptions) -> Result<Self, Error> {
        let VirtioMemOptions {
            addr,
            region_size,
            block_size,
            requested_size,
            usable_headroom,
            queue_size,
        } = options;
        if !block_size.is_power_of_two() || block_size < PAGE_SIZE {
            return Err(Error::BlockSize(block_size));
        }
        check_aligned("region base", addr.0, block_size)?;
        check_aligned("region size", region_size, block_size)?;
        check_aligned("requested size", requested_size, block_size)?;
        if region_size == 0 {
            return Err(Error::EmptyRegion);
        }
        let end = addr.0.checked_add(region_size).ok_or(Error::WrapAround {
            addr: addr.0,
            size: region_size,
        })?;
        if requested_size > region_size {
            return Err(Error::RequestedTooLarge {
                requested: requested_size,
                region_size,
            });
        }
        if queue_size == 0 || !queue_size.is_power_of_two() || queue_size > 32768 {
            return Err(Error::QueueSize(queue_size));
        }
        let range = AddressRange { start: addr.0, end };
        if let Some(other) = memory
            .regions()
            .into_iter()
            .find(|r| r.gpa.0 < end && addr.0 < r.gpa.0 + r.size)
        {
            return Err(Error::Overlap {
                range,
                other: other.id,
                other_gpa: other.gpa.0,
                other_size: other.size,
            });
        }
        let needed = region_size / block_size;
        let free = memory.slot_usage().free as u64;
        if needed > free {
            return Err(Error::NotEnoughSlots { needed, free });
        }
        let mut device = VirtioMem {
            memory,
            addr: addr.0,
            region_size,
            block_size,
            headroom: usable_headroom,
            queue_sizes: [queue_size],
            usable_region_size: 0,
            requested_size,
            blocks: vec![None; needed as usize],
            plugged: 0,
            counts: RequestCounts::default(),
        };
        device.usable_region_size = device.usable_for(requested_size);
        Ok(device)
    }

    /// The device behind a virtio-mmio transport that raises `interrupt`.
    pub fn into_mmio(self, interrupt: Box<dyn Interrupt>) -> MmioTransport<Self> {
        MmioTransport::new(self, interrupt).expect("the queue size was checked by `new`")
    }

    /// The manager plugged blocks are added to.
    pub fn memory(&self) -> &Arc<MemoryManager<K>> {
        &self.memory
    }

    /// The device's region of guest-physical address space.
    pub fn region(&self) -> AddressRange {
        AddressRange {
            start: self.addr,
            end: self.addr + self.region_size,
        }
    }

    /// The block size.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Bytes plugged.
    pub fn plugged_size(&self) -> u64 {
        self.plugged * self.block_size
    }

    /// The size the device asks the driver to plug.
    pub fn requested_size(&self) -> u64 {
        self.requested_size
    }

    /// How much of the region (from its base) the driver may plug blocks in.
    ///
    /// The rule: the requested size plus the headroom ([`VirtioMemOptions::usable_headroom`]),
    /// rounded up to a block and capped at the region size. It grows when the requested size
    /// does, and shrinks only when the driver unplugs everything (UNPLUG_ALL) or the VMM calls
    /// [`unplug_all`](Self::unplug_all), as the specification requires; so it is at least the
    /// requested size, and every plugged block lies inside it.
    pub fn usable_region_size(&self) -> u64 {
        self.usable_region_size
    }

    /// The plugged blocks, lowest address first, each with the manager region (one KVM slot)
    /// behind it.
    pub fn plugged_blocks(&self) -> Vec<PluggedBlock> {
        self.blocks
            .iter()
            .enumerate()
            .filter_map(|(i, region)| {
                region.map(|region| PluggedBlock {
                    gpa: GuestAddress(self.addr + i as u64 * self.block_size),
                    region,
                })
            })
            .collect()
    }

    /// Whether the block holding `gpa` is plugged (false outside the region).
    pub fn is_plugged(&self, gpa: GuestAddress) -> bool {
        gpa.0
            .checked_sub(self.addr)
            .and_then(|offset| self.blocks.get((offset / self.block_size) as usize))
            .is_some_and(Option::is_some)
    }

    /// The requests answered so far, by response.
    pub fn request_counts(&self) -> RequestCounts {
        self.counts
    }

    fn usable_for(&self, requested: u64) -> u64 {
        let wanted = requested
            .saturating_add(self.headroom)
            .checked_next_multiple_of(self.block_size)
            .unwrap_or(u64::MAX);
        wanted.min(self.region_size)
    }

    /// Asks the driver for `bytes` of plugged memory: sets `requested_size` and grows the
    /// usable region to fit it. The change is announced to the driver by
    /// [`MmioTransport::set_requested_size`], which a VMM calls instead of this.
    ///
    /// Refused, changing nothing, unless `bytes` is a multiple of the block size and at most
    /// the region size.
    pub fn set_requested_size(&mut self, bytes: u64) -> Result<(), Error> {
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

    /// Unplugs every block and shrinks the usable region to fit the requested size, as an
    /// UNPLUG_ALL request does: for a VMM resetting the whole VM (the specification asks that
    /// a system reset unplug all memory; a device reset alone does not).
    ///
    /// All or nothing: if the manager refuses to remove a block's region, the blocks removed
    /// before it are plugged again (with fresh memory) and the error is returned.
    pub fn unplug_all(&mut self) -> Result<(), kvm_memslots::Error> {
        let all: Vec<usize> = (0..self.blocks.len())
            .filter(|&i| self.blocks[i].is_some())
            .collect();
        self.unplug_blocks(&all)?;
        self.usable_region_size = self.usable_for(self.requested_size);
        Ok(())
    }

    fn block_gpa(&self, index: usize) -> GuestAddress {
        GuestAddress(self.addr + index as u64 * self.block_size)
    }

    /// Adds a region for each block in `indices`; on a failure, removes the ones added.
    fn plug_blocks(&mut self, indices: &[usize]) -> Result<(), kvm_memslots::Error> {
        for (done, &i) in indices.iter().enumerate() {
            let spec = RegionSpec::new(self.block_gpa(i), self.block_size);
            match self.memory.add_region(spec) {
                Ok(region) => {
                    self.blocks[i] = Some(region);
                    self.plugged += 1;
                }
                Err(e) => {
                    // Best effort: a block whose removal fails stays recorded as plugged, as
                    // it is (only possible once the manager is broken).
                    let _ = self.unplug_blocks_partial(&indices[..done]);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Removes the region of each block in `indices`; on a failure, plugs the removed ones
    /// again.
    fn unplug_blocks(&mut self, indices: &[usize]) -> Result<(), kvm_memslots::Error> {
        let removed = self.unplug_blocks_partial(indices);
        match removed {
            Ok(()) => Ok(()),
            Err((done, e)) => {
                // The driver asked to unplug these, so it does not use them: their contents
                // need not survive, and they come back as fresh memory.
                let _ = self.plug_blocks(&indices[..done]);
                Err(e)
            }
        }
    }

    /// Removes regions in order until one fails; on failure returns how many were removed.
    fn unplug_blocks_partial(
        &mut self,
        indices: &[usize],
    ) -> Result<(), (usize, kvm_memslots::Error)> {
        for (done, &i) in indices.iter().enumerate() {
            let Some(region) = self.blocks[i] else {
                continue;
            };
            if let Err(e) = self.memory.remove_region(region) {
                return Err((done, e));
            }
            self.blocks[i] = None;
            self.plugged -= 1;
        }
        Ok(())
    }

    /// The block indices a PLUG, UNPLUG or STATE request covers, if it is well-formed: `addr`
    /// block-aligned, at least one block, every block inside the usable region.
    fn covered(&self, addr: u64, blocks: u16) -> Option<std::ops::Range<usize>> {
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

    /// Answers one request. Returns the response and whether the configuration changed.
    fn handle(&mut self, request: Request) -> (Response, bool) {
        let plugged_before = self.plugged;
        let usable_before = self.usable_region_size;
        let response = match request {
            Request::Plug { addr, blocks } => match self.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) if self.blocks[range.clone()].iter().any(Option::is_some) => {
                    Response::ERROR
                }
                Some(range) => {
                    let after = (self.plugged + range.len() as u64) * self.block_size;
                    if after > self.requested_size {
                        Response::NACK
                    } else {
                        let indices: Vec<usize> = range.collect();
                        match self.plug_blocks(&indices) {
                            Ok(()) => Response::ACK,
                            Err(_) => Response::BUSY,
                        }
                    }
                }
            },
            Request::Unplug { addr, blocks } => match self.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) if self.blocks[range.clone()].iter().any(Option::is_none) => {
                    Response::ERROR
                }
                Some(range) => {
                    let indices: Vec<usize> = range.collect();
                    match self.unplug_blocks(&indices) {
                        Ok(()) => Response::ACK,
                        Err(_) => Response::BUSY,
                    }
                }
            },
            Request::UnplugAll => match self.unplug_all() {
                Ok(()) => Response::ACK,
                Err(_) => Response::BUSY,
            },
            Request::State { addr, blocks } => match self.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) => {
                    let plugged = self.blocks[range.clone()]
                        .iter()
                        .filter(|b| b.is_some())
                        .count();
                    let state = if plugged == range.len() {
                        VIRTIO_MEM_STATE_PLUGGED
                    } else if plugged == 0 {
                        VIRTIO_MEM_STATE_UNPLUGGED
                    } else {
                        VIRTIO_MEM_STATE_MIXED
                    };
                    Response {
                        kind: VIRTIO_MEM_RESP_ACK,
                        state,
                    }
                }
            },
            // Not a request the specification defines: the driver is told it is wrong.
            Request::Unknown(_) => Response::ERROR,
        };
        match response.kind {
            VIRTIO_MEM_RESP_ACK => self.counts.ack += 1,
            VIRTIO_MEM_RESP_NACK => self.counts.nack += 1,
            VIRTIO_MEM_RESP_BUSY => self.counts.busy += 1,
            _ => self.counts.error += 1,
        }
        let changed = self.plugged != plugged_before || self.usable_region_size != usable_before;
        (response, changed)
    }

    /// Takes one descriptor chain apart: reads the request, and returns it with the
    /// device-writable buffers the response goes to.
    fn read_request(
        &self,
        chain: DescriptorChain<GuestMemorySnapshot>,
        mem: &GuestMemorySlots,
    ) -> Result<(Request, Vec<Buffer>), DriverError> {
        let head = chain.head_index();
        let mut request = [0u8; REQUEST_SIZE];
        let mut have = 0usize;
        let mut readable = 0u64;
        let mut writable = Vec::new();
        let mut written_to = 0u64;
        // `chain` stops after the queue size's worth of descriptors, so a loop ends too.
        let descriptors: Vec<_> = chain.collect();
        for desc in descriptors {
            let (addr, len) = (desc.addr(), desc.len());
            if !GuestMemoryBackend::check_range(mem, addr, len as usize) {
                return Err(DriverError(format!(
                    "chain {head}: buffer at {:#x} of {len} bytes is outside guest memory",
                    addr.0
                )));
            }
            if desc.is_write_only() {
                writable.push(Buffer { addr, len });
                written_to += u64::from(len);
                continue;
            }
            if !writable.is_empty() {
                return Err(DriverError(format!(
                    "chain {head}: a device-readable buffer follows a device-writable one"
                )));
            }
            readable += u64::from(len);
            let take = (REQUEST_SIZE - have).min(len as usize);
            if take > 0 {
                mem.read_slice(&mut request[have..have + take], addr)
                    .map_err(|e| DriverError(format!("chain {head}: reading the request: {e}")))?;
                have += take;
            }
        }
        if readable < REQUEST_SIZE as u64 {
            return Err(DriverError(format!(
                "chain {head}: {readable} device-readable bytes, a request needs {REQUEST_SIZE}"
            )));
        }
        if written_to < RESPONSE_SIZE as u64 {
            return Err(DriverError(format!(
                "chain {head}: {written_to} device-writable bytes, a response needs {RESPONSE_SIZE}"
            )));
        }
        Ok((Request::decode(&request), writable))
    }
}

/// A device-writable buffer of a chain.
#[derive(Debug, Clone, Copy)]
struct Buffer {
    addr: GuestAddress,
    len: u32,
}

impl<K: KvmMemory> VirtioDevice for VirtioMem<K> {
    fn device_id(&self) -> u32 {
        VIRTIO_ID_MEM
    }

    fn features(&self) -> u64 {
        F_VERSION_1 | (1 << VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE)
    }

    /// Unplugged blocks have no KVM slot, so the device cannot let a driver read them, as it
    /// would have to without VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE: a driver that does not
    /// accept the feature is refused (the specification allows a device to stop there).
    fn accept_features(&self, acked: u64) -> bool {
        acked & (1 << VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE) != 0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut space = [0u8; CONFIG_SIZE];
        let mut put = |at: usize, v: u64| space[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(config::BLOCK_SIZE, self.block_size);
        put(config::ADDR, self.addr);
        put(config::REGION_SIZE, self.region_size);
        put(config::USABLE_REGION_SIZE, self.usable_region_size);
        put(config::PLUGGED_SIZE, self.plugged_size());
        put(config::REQUESTED_SIZE, self.requested_size);
        // node_id stays 0: VIRTIO_MEM_F_ACPI_PXM is not offered.
        debug_assert_eq!(space[config::NODE_ID], 0);
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

    /// The configuration space is read-only for the driver: writes are ignored.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, _features: u64) -> Result<(), DriverError> {
        Ok(())
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
    ) -> Result<QueueOutcome, DriverError> {
        let mut outcome = QueueOutcome::default();
        if index != 0 {
            return Ok(outcome);
        }
        if !queue.is_valid(&*self.memory.snapshot()) {
            return Err(DriverError(
                "the request queue's rings are outside guest memory or misplaced".into(),
            ));
        }
        loop {
            // A fresh snapshot per request: one request may plug memory the next one uses,
            // and a snapshot held across an unplug would keep its mapping alive.
            let mem = self.memory.snapshot();
            let chain = queue
                .iter(mem.clone())
                .map_err(|e| DriverError(format!("reading the available ring: {e}")))?
                .next();
            let Some(chain) = chain else {
                break;
            };
            let head = chain.head_index();
            let (request, buffers) = self.read_request(chain, &mem)?;
            drop(mem);
            let (response, changed) = self.handle(request);
            outcome.config_changed |= changed;
            let mem = self.memory.snapshot();
            let bytes = response.encode();
            let mut at = 0;
            for buffer in buffers {
                if at == bytes.len() {
                    break;
                }
                let take = (bytes.len() - at).min(buffer.len as usize);
                mem.write_slice(&bytes[at..at + take], buffer.addr)
                    .map_err(|e| DriverError(format!("chain {head}: writing the response: {e}")))?;
                at += take;
            }
            queue
                .add_used(&*mem, head, RESPONSE_SIZE as u32)
                .map_err(|e| DriverError(format!("chain {head}: updating the used ring: {e}")))?;
            outcome.used_buffers = true;
        }
        Ok(outcome)
    }

    /// Plugged blocks stay plugged and keep their contents (the specification forbids a device
    /// reset to change them); the driver unplugs them with UNPLUG_ALL when it starts again.
    fn reset(&mut self) {}
}

impl<K: KvmMemory> MmioTransport<VirtioMem<K>> {
    /// Asks the driver for `bytes` of plugged memory ([`VirtioMem::set_requested_size`]) and
    /// tells it: a new configuration generation and a configuration-change interrupt (once
    /// the driver is running). Refused, changing nothing, if `bytes` is not a multiple of the
    /// block size or is larger than the region.
    pub fn set_requested_size(&mut self, bytes: u64) -> Result<(), Error> {
        self.device_mut().set_requested_size(bytes)?;
        self.config_changed();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots::testing::{FakeKvm, Faulty, KvmCall};

    const MIB: u64 = 1 << 20;
    const BASE: u64 = 1 << 32;

    fn device(kvm_slots: u32) -> VirtioMem<Faulty<FakeKvm>> {
        let memory = Arc::new(MemoryManager::new(Faulty::new(FakeKvm::new(
            kvm_slots, true,
        ))));
        let mut options = VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB);
        options.usable_headroom = 8 * MIB;
        VirtioMem::new(memory, options).expect("valid device")
    }

    fn plug(addr: u64, blocks: u16) -> Request {
        Request::Plug { addr, blocks }
    }

    #[test]
    fn options_are_checked() {
        let memory = Arc::new(MemoryManager::new(FakeKvm::new(64, true)));
        let new = |o| VirtioMem::new(Arc::clone(&memory), o).map(drop);
        let o = VirtioMemOptions::new(GuestAddress(BASE), 64 * MIB, 2 * MIB);
        assert_eq!(
            new(VirtioMemOptions {
                block_size: 3 * MIB,
                ..o
            }),
            Err(Error::BlockSize(3 * MIB))
        );
        assert_eq!(
            new(VirtioMemOptions {
                block_size: 2048,
                ..o
            }),
            Err(Error::BlockSize(2048))
        );
        assert!(matches!(
            new(VirtioMemOptions {
                addr: GuestAddress(BASE + MIB),
                ..o
            }),
            Err(Error::Unaligned {
                what: "region base",
                ..
            })
        ));
        assert_eq!(
            new(VirtioMemOptions {
                region_size: 0,
                ..o
            }),
            Err(Error::EmptyRegion)
        );
        assert!(matches!(
            new(VirtioMemOptions {
                addr: GuestAddress(u64::MAX - 2 * MIB + 1),
                region_size: 4 * MIB,
                ..o
            }),
            Err(Error::WrapAround { .. })
        ));
        assert_eq!(
            new(VirtioMemOptions {
                queue_size: 100,
                ..o
            }),
            Err(Error::QueueSize(100))
        );
        let err = new(VirtioMemOptions {
            region_size: 130 * MIB,
            ..o
        })
        .unwrap_err();
        assert_eq!(
            err,
            Error::NotEnoughSlots {
                needed: 65,
                free: 64
            }
        );
        assert_eq!(
            err.to_string(),
            "the device region needs 65 KVM slots (one per block) but only 64 are free"
        );
        memory
            .add_region(RegionSpec::new(GuestAddress(BASE + 62 * MIB), 4 * MIB))
            .expect("add a region");
        assert!(matches!(new(o), Err(Error::Overlap { .. })));
    }

    #[test]
    fn requests_are_answered_as_the_specification_says() {
        let mut d = device(64);
        d.set_requested_size(8 * MIB).expect("aligned and in range");
        assert_eq!(d.usable_region_size(), 16 * MIB);
        assert_eq!(d.handle(plug(BASE, 2)), (Response::ACK, true));
        assert_eq!(d.plugged_size(), 4 * MIB);
        assert_eq!(
            d.handle(plug(BASE, 1)).0,
            Response::ERROR,
            "already plugged"
        );
        assert_eq!(
            d.handle(plug(BASE + MIB, 1)).0,
            Response::ERROR,
            "unaligned"
        );
        assert_eq!(
            d.handle(plug(BASE + 4 * MIB, 0)).0,
            Response::ERROR,
            "no blocks"
        );
        assert_eq!(
            d.handle(plug(BASE - 2 * MIB, 1)).0,
            Response::ERROR,
            "below"
        );
        assert_eq!(
            d.handle(plug(BASE + 16 * MIB, 1)).0,
            Response::ERROR,
            "past usable"
        );
        assert_eq!(
            d.handle(plug(BASE + 14 * MIB, 2)).0,
            Response::ERROR,
            "straddles"
        );
        assert_eq!(
            d.handle(plug(BASE + 4 * MIB, 3)),
            (Response::NACK, false),
            "past requested"
        );
        assert_eq!(d.handle(plug(BASE + 4 * MIB, 2)).0, Response::ACK);
        assert_eq!(
            d.handle(Request::State {
                addr: BASE,
                blocks: 5
            })
            .0,
            Response {
                kind: VIRTIO_MEM_RESP_ACK,
                state: VIRTIO_MEM_STATE_MIXED
            }
        );
        assert_eq!(
            d.handle(Request::State {
                addr: BASE + 4 * MIB,
                blocks: 2
            })
            .0
            .state,
            VIRTIO_MEM_STATE_PLUGGED
        );
        assert_eq!(
            d.handle(Request::State {
                addr: BASE + 8 * MIB,
                blocks: 4
            })
            .0
            .state,
            VIRTIO_MEM_STATE_UNPLUGGED
        );
        assert_eq!(
            d.handle(Request::Unplug {
                addr: BASE + 6 * MIB,
                blocks: 2
            })
            .0,
            Response::ERROR
        );
        assert_eq!(
            d.handle(Request::Unplug {
                addr: BASE + 2 * MIB,
                blocks: 1
            })
            .0,
            Response::ACK
        );
        assert_eq!(d.plugged_size(), 6 * MIB);
        assert_eq!(d.handle(Request::Unknown(9)).0, Response::ERROR);
        d.set_requested_size(0).expect("zero is fine");
        assert_eq!(
            d.usable_region_size(),
            16 * MIB,
            "the usable region does not shrink"
        );
        assert_eq!(d.handle(Request::UnplugAll), (Response::ACK, true));
        assert_eq!(d.plugged_size(), 0);
        assert_eq!(d.usable_region_size(), 8 * MIB, "UNPLUG_ALL shrinks it");
        assert!(d.memory().regions().is_empty());
        assert_eq!(
            d.request_counts(),
            RequestCounts {
                ack: 7,
                nack: 1,
                busy: 0,
                error: 8
            }
        );
    }

    #[test]
    fn set_requested_size_checks_and_names_the_values() {
        let mut d = device(64);
        let err = d.set_requested_size(MIB).unwrap_err();
        assert_eq!(
            err.to_string(),
            "requested size 0x100000 is not a multiple of the block size 0x200000"
        );
        let err = d.set_requested_size(66 * MIB).unwrap_err();
        assert_eq!(
            err.to_string(),
            "requested size 0x4200000 is larger than the region size 0x4000000"
        );
        assert_eq!(d.requested_size(), 0);
        d.set_requested_size(60 * MIB).expect("fits");
        assert_eq!(d.usable_region_size(), 64 * MIB, "capped at the region");
    }

    #[test]
    fn a_kvm_failure_mid_plug_or_unplug_changes_nothing() {
        let mut d = device(64);
        d.set_requested_size(16 * MIB).expect("fits");
        assert_eq!(d.handle(plug(BASE, 1)).0, Response::ACK);
        let before = d.memory().kvm().inner().slots();
        // The third block's slot is refused.
        d.memory().kvm().fail(KvmCall::SetRegion, 2, libc_eio());
        assert_eq!(d.handle(plug(BASE + 2 * MIB, 4)), (Response::BUSY, false));
        assert!(!d.memory().kvm().failure_pending());
        assert_eq!(d.memory().kvm().inner().slots(), before);
        assert_eq!(d.plugged_blocks().len(), 1);
        assert_eq!(d.plugged_size(), 2 * MIB);
        assert_eq!(d.handle(plug(BASE + 2 * MIB, 4)).0, Response::ACK);
        let ranges = |d: &VirtioMem<Faulty<FakeKvm>>| {
            let mut r: Vec<_> = d
                .memory()
                .kvm()
                .inner()
                .slots()
                .iter()
                .map(|s| (s.gpa, s.size))
                .collect();
            r.sort();
            r
        };
        let before = ranges(&d);
        d.memory().kvm().fail(KvmCall::SetRegion, 3, libc_eio());
        assert_eq!(
            d.handle(Request::Unplug {
                addr: BASE + 2 * MIB,
                blocks: 4
            })
            .0,
            Response::BUSY
        );
        assert_eq!(ranges(&d), before);
        assert_eq!(d.plugged_size(), 10 * MIB);
        d.memory().kvm().fail(KvmCall::SetRegion, 1, libc_eio());
        assert_eq!(d.handle(Request::UnplugAll), (Response::BUSY, false));
        assert_eq!(ranges(&d), before);
        assert_eq!(d.handle(Request::UnplugAll).0, Response::ACK);
        assert!(d.memory().kvm().inner().slots().is_empty());
    }

    fn libc_eio() -> i32 {
        5
    }

    #[test]
    fn config_space_layout() {
        let mut d = device(64);
        d.set_requested_size(4 * MIB).expect("fits");
        assert_eq!(d.handle(plug(BASE, 1)).0, Response::ACK);
        let mut space = [0xaau8; 64];
        d.read_config(0, &mut space);
        let le = |at: usize| u64::from_le_bytes(space[at..at + 8].try_into().expect("8 bytes"));
        assert_eq!(le(0), 2 * MIB);
        assert_eq!(&space[8..16], &[0; 8], "node_id and padding");
        assert_eq!(le(16), BASE);
        assert_eq!(le(24), 64 * MIB);
        assert_eq!(le(32), 12 * MIB);
        assert_eq!(le(40), 2 * MIB);
        assert_eq!(le(48), 4 * MIB);
        assert_eq!(&space[56..], &[0; 8], "past the end");
        let mut word = [0u8; 4];
        d.read_config(20, &mut word);
        assert_eq!(u32::from_le_bytes(word), 1, "high half of addr");
        d.read_config(u64::MAX, &mut word);
        assert_eq!(word, [0; 4]);
    }
}
