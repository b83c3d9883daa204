//! The device: which blocks are plugged (runs of them sharing KVM slots in regions of the
//! manager), the requests that change them, and the device's side of the virtio-mmio
//! transport.

use std::fmt;
use std::sync::Arc;

use std::collections::BTreeMap;

use std::ops::Range;

use kvm_memslots::{AddressRange, KvmMemory, MemoryManager, RegionChange, RegionId, RegionSpec};
use virtio_bindings::virtio_ids::VIRTIO_ID_MEM;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestAddress;

use super::config::{Config, Error, VirtioMemOptions};
use super::request::{
    read_request, write_response, Request, Response, RESPONSE_SIZE, VIRTIO_MEM_RESP_ACK,
    VIRTIO_MEM_RESP_BUSY, VIRTIO_MEM_RESP_NACK, VIRTIO_MEM_STATE_MIXED, VIRTIO_MEM_STATE_PLUGGED,
    VIRTIO_MEM_STATE_UNPLUGGED,
};
use super::slots::{most_runs, piece_change, plugged_runs};
use crate::mmio::{DriverError, Interrupt, MmioTransport, QueueOutcome, VirtioDevice, F_VERSION_1};

/// Feature bit number: `node_id` is an ACPI proximity domain (not offered).
pub const VIRTIO_MEM_F_ACPI_PXM: u32 = 0;
/// Feature bit number: the driver must not touch unplugged memory (offered and required).
pub const VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE: u32 = 1;

/// A plugged block: its guest address and the manager region behind it (the region of its
/// piece of the device region, shared with the piece's other blocks; one block's own region
/// where the maximum slot size is the block size).
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
    pub(super) config: Config,
    queue_sizes: [u16; 1],
    /// One entry per block: whether it is plugged.
    pub(super) blocks: Vec<bool>,
    /// One entry per piece of the region (`max_slot_size` long, the last one maybe shorter):
    /// the manager region behind it while a block of it is plugged. It has one KVM slot over
    /// the whole piece; its unplugged blocks are unreachable (protected `PROT_NONE`, their
    /// memory given back), unless the piece is isolated.
    pieces: Vec<Option<RegionId>>,
    /// One entry per piece: whether it is *isolated*, its slots the runs of its plugged blocks
    /// ([`plugged_runs`]) instead of one slot over it all, so that a guest access to one of
    /// its unplugged blocks finds no slot and exits as absent memory
    /// ([`isolate_unplugged`](VirtioMem::isolate_unplugged)). Its next plug or unplug gives it
    /// its one slot back.
    pub(super) isolated: Vec<bool>,
    plugged: u64,
    pub(super) counts: RequestCounts,
    /// Why the device last answered BUSY: the manager's refusal (a slot budget, a memory
    /// limit, KVM's error), for whoever watches the device; the guest learns only BUSY.
    last_busy: Option<String>,
}

impl<K: KvmMemory> fmt::Debug for VirtioMem<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let region = self.region();
        f.debug_struct("VirtioMem")
            .field("addr", &format_args!("{:#x}", region.start))
            .field(
                "region_size",
                &format_args!("{:#x}", region.end - region.start),
            )
            .field("block_size", &format_args!("{:#x}", self.block_size()))
            .field(
                "usable_region_size",
                &format_args!("{:#x}", self.usable_region_size()),
            )
            .field(
                "requested_size",
                &format_args!("{:#x}", self.requested_size()),
            )
            .field("plugged_size", &format_args!("{:#x}", self.plugged_size()))
            .finish_non_exhaustive()
    }
}

impl<K: KvmMemory> VirtioMem<K> {
    /// A device for the region `options` describes, adding plugged blocks to `memory`. Nothing
    /// is plugged.
    ///
    /// Refused if the options are inconsistent, if the region overlaps one of `memory`'s
    /// regions, or if `memory` has fewer free KVM slots than the plugged blocks could need at
    /// most (one per block where the maximum slot size is the block size; one per run of
    /// plugged blocks otherwise, every other block plugged at worst).
    pub fn new(memory: Arc<MemoryManager<K>>, options: VirtioMemOptions) -> Result<Self, Error> {
        let config = Config::new(&options)?;
        let range = config.region();
        if let Some(other) = memory
            .regions()
            .into_iter()
            .find(|r| r.gpa.0 < range.end && range.start < r.gpa.0 + r.size)
        {
            return Err(Error::Overlap {
                range,
                other: other.id,
                other_gpa: other.gpa.0,
                other_size: other.size,
            });
        }
        let blocks = config.blocks();
        let per_piece = config.blocks_per_piece() as u64;
        let pieces = blocks.div_ceil(per_piece);
        let needed = (blocks / per_piece) * most_runs(per_piece) + most_runs(blocks % per_piece);
        let free = memory.slot_usage().free as u64;
        if needed > free {
            return Err(if per_piece == 1 {
                Error::NotEnoughSlots { needed, free }
            } else {
                Error::NotEnoughSlotsForRuns {
                    needed,
                    free,
                    max_slot_size: config.max_slot_size(),
                }
            });
        }
        Ok(VirtioMem {
            memory,
            config,
            queue_sizes: [options.queue_size],
            blocks: vec![false; blocks as usize],
            pieces: vec![None; pieces as usize],
            isolated: vec![false; pieces as usize],
            plugged: 0,
            counts: RequestCounts::default(),
            last_busy: None,
        })
    }

    /// A device of parts checked by the caller (`state.rs`'s restore).
    pub(super) fn from_parts(
        memory: Arc<MemoryManager<K>>,
        config: Config,
        queue_size: u16,
        blocks: Vec<bool>,
        pieces: Vec<Option<RegionId>>,
        isolated: Vec<bool>,
        counts: RequestCounts,
    ) -> Self {
        let plugged = blocks.iter().filter(|b| **b).count() as u64;
        VirtioMem {
            memory,
            config,
            queue_sizes: [queue_size],
            blocks,
            pieces,
            isolated,
            plugged,
            counts,
            last_busy: None,
        }
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
        self.config.region()
    }

    /// The block size.
    pub fn block_size(&self) -> u64 {
        self.config.block_size()
    }

    /// Bytes plugged.
    pub fn plugged_size(&self) -> u64 {
        self.plugged * self.block_size()
    }

    /// The size the device asks the driver to plug.
    pub fn requested_size(&self) -> u64 {
        self.config.requested_size()
    }

    /// How much of the region (from its base) the driver may plug blocks in.
    ///
    /// The rule: the requested size plus the headroom ([`VirtioMemOptions::usable_headroom`]),
    /// rounded up to a block and capped at the region size. It grows when the requested size
    /// does, and shrinks only when the driver unplugs everything (UNPLUG_ALL) or the VMM calls
    /// [`unplug_all`](Self::unplug_all), as the specification requires; so it is at least the
    /// requested size, and every plugged block lies inside it.
    pub fn usable_region_size(&self) -> u64 {
        self.config.usable_region_size()
    }

    /// The plugged blocks, lowest address first, each with the manager region behind it.
    pub fn plugged_blocks(&self) -> Vec<PluggedBlock> {
        let per_piece = self.config.blocks_per_piece();
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, plugged)| **plugged)
            .filter_map(|(i, _)| {
                self.pieces[i / per_piece].map(|region| PluggedBlock {
                    gpa: self.block_gpa(i),
                    region,
                })
            })
            .collect()
    }

    /// The largest KVM slot plugged blocks share ([`VirtioMemOptions::max_slot_size`]).
    pub fn max_slot_size(&self) -> u64 {
        self.config.max_slot_size()
    }

    /// The host pages behind plugged blocks.
    pub fn page_size(&self) -> kvm_memslots::PageSize {
        self.config.page_size()
    }

    /// The KVM slots the plugged blocks use: one per piece with a plugged block (one per run
    /// of plugged blocks in an isolated piece: [`isolate_unplugged`](Self::isolate_unplugged)).
    pub fn slots(&self) -> usize {
        let per_piece = self.config.blocks_per_piece();
        self.blocks
            .chunks(per_piece)
            .zip(&self.isolated)
            .map(
                |(piece, isolated)| match (isolated, piece.contains(&true)) {
                    (_, false) => 0,
                    (false, true) => 1,
                    (true, true) => plugged_runs(piece.iter().copied(), 1).len(),
                },
            )
            .sum()
    }

    /// The unplugged block at `gpa`, if one is there, in a piece that has a slot over it:
    /// where a guest access faults inside KVM (the block is unreachable) instead of exiting.
    pub fn unplugged_under_slot(&self, gpa: GuestAddress) -> Option<GuestAddress> {
        let region = self.region();
        if !(region.start..region.end).contains(&gpa.0) {
            return None;
        }
        let index = ((gpa.0 - region.start) / self.block_size()) as usize;
        let piece = index / self.config.blocks_per_piece();
        (!self.blocks[index] && self.pieces[piece].is_some() && !self.isolated[piece])
            .then(|| self.block_gpa(index))
    }

    /// Isolates the pieces that hold `gpa` (all pieces with an unplugged block under their
    /// slot, if `None`: a fault that did not say where): each gets the runs of its plugged
    /// blocks as its slots, so that a guest access to one of its unplugged blocks finds no slot
    /// and exits to the VMM as absent memory, as it does outside any piece. For a VMM whose
    /// vCPU faulted on an unplugged block (`KVM_RUN` failed with `EFAULT`, or a
    /// `KVM_EXIT_MEMORY_FAULT`): isolate, then run the vCPU again. Returns how many pieces it
    /// isolated (0: nothing at `gpa` to isolate, the fault is not the device's). The next plug
    /// or unplug in a piece gives it back its one slot. Plugged memory stays where it is
    /// (the manager's re-slot: an access to it during the change waits or is retried).
    pub fn isolate_unplugged(
        &mut self,
        gpa: Option<GuestAddress>,
    ) -> Result<usize, kvm_memslots::Error> {
        let per_piece = self.config.blocks_per_piece();
        let block = self.block_size();
        let wanted: Vec<usize> = match gpa {
            Some(gpa) => self
                .unplugged_under_slot(gpa)
                .map(|b| vec![((b.0 - self.region().start) / block) as usize / per_piece])
                .unwrap_or_default(),
            None => (0..self.pieces.len())
                .filter(|&p| self.pieces[p].is_some() && !self.isolated[p])
                .filter(|&p| self.piece_blocks(p).contains(&false))
                .collect(),
        };
        let changes: Vec<RegionChange> = wanted
            .iter()
            .map(|&p| {
                let blocks = self.piece_blocks(p);
                let first = p * per_piece;
                // A live piece has a plugged block: a re-slot over its runs.
                piece_change(
                    self.pieces[p],
                    self.block_gpa(first),
                    blocks.len() as u64 * block,
                    plugged_runs(blocks.iter().copied(), block),
                )
            })
            .collect();
        if changes.is_empty() {
            return Ok(0);
        }
        self.memory.apply(changes)?;
        for &p in &wanted {
            self.isolated[p] = true;
        }
        Ok(wanted.len())
    }

    /// The blocks of piece `piece`: whether each is plugged.
    fn piece_blocks(&self, piece: usize) -> &[bool] {
        let per_piece = self.config.blocks_per_piece();
        let first = piece * per_piece;
        &self.blocks[first..(first + per_piece).min(self.blocks.len())]
    }

    /// The requests answered so far, by response.
    pub fn request_counts(&self) -> RequestCounts {
        self.counts
    }

    /// Why the device last answered BUSY (the memory manager's refusal, which names a slot
    /// budget or a limit), if it ever did since it was made or restored.
    pub fn last_busy(&self) -> Option<&str> {
        self.last_busy.as_deref()
    }

    /// ACK if the change `done` went through; otherwise BUSY, its reason kept for
    /// [`last_busy`](Self::last_busy).
    fn busy_unless(&mut self, done: Result<(), kvm_memslots::Error>) -> Response {
        match done {
            Ok(()) => Response::ACK,
            Err(e) => {
                self.last_busy = Some(e.to_string());
                Response::BUSY
            }
        }
    }

    /// Asks the driver for `bytes` of plugged memory: sets `requested_size` and grows the
    /// usable region to fit it, without telling the driver: a VMM calls
    /// [`MmioTransport::set_requested_size`], which does.
    ///
    /// Refused, changing nothing, unless `bytes` is a multiple of the block size and at most
    /// the region size.
    pub(crate) fn set_requested_size(&mut self, bytes: u64) -> Result<(), Error> {
        self.config.set_requested_size(bytes)
    }

    /// Unplugs every block and shrinks the usable region to fit the requested size, as an
    /// UNPLUG_ALL request does: for a VMM resetting the whole VM (the specification asks that
    /// a system reset unplug all memory; a device reset alone does not).
    ///
    /// All or nothing: the blocks' regions go in one change of the manager; if it refuses,
    /// every block stays plugged, its memory untouched, and the error is returned.
    pub fn unplug_all(&mut self) -> Result<(), kvm_memslots::Error> {
        let all: Vec<usize> = (0..self.blocks.len()).filter(|&i| self.blocks[i]).collect();
        self.unplug_blocks(&all)?;
        self.config.shrink_usable_region();
        Ok(())
    }

    fn block_gpa(&self, index: usize) -> GuestAddress {
        self.config.block_gpa(index)
    }

    /// Plugs the blocks in `indices`, all in one change of the manager: all of them or none.
    fn plug_blocks(&mut self, indices: &[usize]) -> Result<(), kvm_memslots::Error> {
        self.set_blocks(indices, true)
    }

    /// Unplugs the plugged blocks in `indices`, all in one change of the manager: all of them
    /// or none. Their memory goes back to the host.
    fn unplug_blocks(&mut self, indices: &[usize]) -> Result<(), kvm_memslots::Error> {
        self.set_blocks(indices, false)
    }

    /// Plugs (`plug`) or unplugs the blocks in `indices` as one change: all of them or none.
    /// A piece that gets its first plugged block is added as a region with one slot over the
    /// whole piece, its other blocks unreachable from the start; one that loses its last is
    /// removed (unmapped). Inside a piece that stays, a plug makes its blocks reachable and an
    /// unplug makes them unreachable (`mprotect`, no KVM call), then gives their memory back;
    /// an isolated piece also gets its one slot back (a re-slot).
    fn set_blocks(&mut self, indices: &[usize], plug: bool) -> Result<(), kvm_memslots::Error> {
        let per_piece = self.config.blocks_per_piece();
        let block = self.block_size();
        let mut touched: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &i in indices.iter().filter(|&&i| self.blocks[i] != plug) {
            touched.entry(i / per_piece).or_default().push(i);
        }
        let mut changes = Vec::with_capacity(touched.len());
        let mut added = Vec::new();
        // The pieces that stay, with the byte ranges (of the piece) whose blocks change.
        let mut flips: Vec<(RegionId, Vec<Range<u64>>)> = Vec::new();
        for (&piece, changed) in &touched {
            let first = piece * per_piece;
            let end = (first + per_piece).min(self.blocks.len());
            let mut plugged = self.blocks[first..end].to_vec();
            for &i in changed {
                plugged[i - first] = plug;
            }
            let size = (end - first) as u64 * block;
            let mut changing = vec![false; end - first];
            for &i in changed {
                changing[i - first] = true;
            }
            let changing = plugged_runs(changing, block);
            match self.pieces[piece] {
                None => {
                    added.push(piece);
                    let unplugged = plugged_runs(plugged.iter().map(|p| !p), block);
                    changes.push(RegionChange::Add(
                        RegionSpec::new(self.block_gpa(first), size)
                            .with_slot_ranges(std::iter::once(0..size).collect())
                            .with_inaccessible(unplugged)
                            .with_page_size(self.config.page_size()),
                    ));
                }
                Some(region) if !plugged.contains(&true) => {
                    changes.push(RegionChange::Remove(region));
                }
                Some(region) => {
                    if self.isolated[piece] {
                        changes.push(piece_change(
                            Some(region),
                            self.block_gpa(first),
                            size,
                            std::iter::once(0..size).collect(),
                        ));
                    }
                    flips.push((region, changing));
                }
            }
        }
        if changes.is_empty() && flips.is_empty() {
            return Ok(());
        }
        // Protection first, so that a piece's one slot never covers an unplugged block that
        // is reachable; undone (the contents kept: nothing is discarded yet) if the manager
        // then refuses its change.
        for (done, (region, ranges)) in flips.iter().enumerate() {
            if let Err(e) = self.memory.set_accessible(*region, ranges, plug) {
                self.undo_flips(&flips[..done], plug);
                return Err(e);
            }
        }
        let regions = match changes.is_empty() {
            true => Vec::new(),
            false => match self.memory.apply(changes) {
                Ok(regions) => regions,
                Err(e) => {
                    self.undo_flips(&flips, plug);
                    return Err(e);
                }
            },
        };
        for (piece, region) in added.into_iter().zip(regions) {
            self.pieces[piece] = Some(region);
        }
        for (&piece, changed) in &touched {
            for &i in changed {
                self.blocks[i] = plug;
            }
            self.isolated[piece] = false;
            if plug {
                self.plugged += changed.len() as u64;
            } else {
                self.plugged -= changed.len() as u64;
                if !self.piece_blocks(piece).contains(&true) {
                    self.pieces[piece] = None;
                }
            }
        }
        if !plug {
            // Give the unplugged blocks' memory back (a later plug finds zeros, as in a fresh
            // mapping). Best effort: the blocks are unplugged and unreachable whatever madvise
            // says, and their memory is the device's to reuse.
            for (region, ranges) in &flips {
                for range in ranges {
                    let _ = self.memory.discard_region(*region, range.clone());
                }
            }
        }
        Ok(())
    }

    /// Puts back the protection `flips` changed to `plug`.
    fn undo_flips(&self, flips: &[(RegionId, Vec<Range<u64>>)], plug: bool) {
        for (region, ranges) in flips {
            let _ = self.memory.set_accessible(*region, ranges, !plug);
        }
    }

    /// Answers one request. Returns the response and whether the configuration changed.
    pub(super) fn handle(&mut self, request: Request) -> (Response, bool) {
        let plugged_before = self.plugged;
        let usable_before = self.usable_region_size();
        let response = match request {
            Request::Plug { addr, blocks } => match self.config.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) if self.blocks[range.clone()].contains(&true) => Response::ERROR,
                Some(range) => {
                    let after = (self.plugged + range.len() as u64) * self.block_size();
                    if after > self.requested_size() {
                        Response::NACK
                    } else {
                        let indices: Vec<usize> = range.collect();
                        let plugged = self.plug_blocks(&indices);
                        self.busy_unless(plugged)
                    }
                }
            },
            Request::Unplug { addr, blocks } => match self.config.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) if self.blocks[range.clone()].contains(&false) => Response::ERROR,
                Some(range) => {
                    let indices: Vec<usize> = range.collect();
                    let unplugged = self.unplug_blocks(&indices);
                    self.busy_unless(unplugged)
                }
            },
            Request::UnplugAll => {
                let unplugged = self.unplug_all();
                self.busy_unless(unplugged)
            }
            Request::State { addr, blocks } => match self.config.covered(addr, blocks) {
                None => Response::ERROR,
                Some(range) => {
                    let plugged = self.blocks[range.clone()].iter().filter(|b| **b).count();
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
        let changed = self.plugged != plugged_before || self.usable_region_size() != usable_before;
        (response, changed)
    }
}

impl<K: KvmMemory> VirtioDevice for VirtioMem<K> {
    fn device_id(&self) -> u32 {
        VIRTIO_ID_MEM
    }

    fn features(&self) -> u64 {
        F_VERSION_1 | (1 << VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE)
    }

    /// Unplugged blocks are unreachable (no KVM slot, or protected under their piece's slot),
    /// so the device cannot let a driver read them, as it would have to without
    /// VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE: a driver that does not accept the feature is
    /// refused (the specification allows a device to stop there).
    fn accept_features(&self, acked: u64) -> bool {
        acked & (1 << VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE) != 0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.config.read(self.plugged_size(), offset, data);
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
        if !queue.is_valid(&*self.memory.current()) {
            return Err(DriverError(
                "the request queue's rings are outside guest memory or misplaced".into(),
            ));
        }
        loop {
            // A fresh snapshot per request: one request may plug memory the next one uses,
            // and a snapshot held across an unplug would keep its mapping alive.
            let mem = self.memory.current();
            let chain = queue
                .iter(mem.clone())
                .map_err(|e| DriverError(format!("reading the available ring: {e}")))?
                .next();
            let Some(chain) = chain else {
                break;
            };
            let head = chain.head_index();
            let (request, buffers) = read_request(chain, &mem)?;
            drop(mem);
            let (response, changed) = self.handle(request);
            outcome.config_changed |= changed;
            let mem = self.memory.current();
            write_response(&mem, head, buffers, response)?;
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
    /// Asks the driver for `bytes` of plugged memory and tells it: sets the requested size,
    /// grows the usable region to fit it ([`VirtioMem::usable_region_size`]), and announces the
    /// change with a new configuration generation and a configuration-change interrupt (once
    /// the driver is running). Refused, changing nothing, if `bytes` is not a multiple of the
    /// block size or is larger than the region.
    pub fn set_requested_size(&mut self, bytes: u64) -> Result<(), Error> {
        self.device_mut().set_requested_size(bytes)?;
        self.config_changed();
        Ok(())
    }
}
