//! Guest memory as the rust-vmm ecosystem sees it: each slot is a `GuestMemoryRegion`, a map
//! version is a `GuestMemoryBackend`, and a view of one version is what the manager's handle
//! (a `GuestAddressSpace`, in `manager`) gives.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use memslot_map::{MemslotMap, Slot};
use ref_cast::RefCast;
use vm_memory::bitmap::{AtomicBitmap, Bitmap, BS};
use vm_memory::guest_memory::Error as GuestMemoryError;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestMemoryRegionBytes,
    GuestUsize, MemoryRegionAddress, VolatileMemory, VolatileSlice,
};

use crate::pending::PendingBits;
use crate::region_memory::{RegionId, RegionMemory};
use crate::GuestMemoryMap;

/// What each slot of the map carries: the region it belongs to, and where in the region's
/// mapping the slot starts.
#[derive(Clone)]
pub struct SlotBacking {
    region: RegionId,
    memory: Arc<RegionMemory>,
    /// The region's pending dirty bits (one `Arc` for all its slots): what makes a slot of a
    /// map version lead a harvest to its region without the writer lock.
    pending: Arc<PendingBits>,
    offset: u64,
    file_offset: Option<FileOffset>,
}

impl SlotBacking {
    pub(crate) fn new(
        region: RegionId,
        memory: Arc<RegionMemory>,
        pending: Arc<PendingBits>,
        offset: u64,
    ) -> Self {
        let file_offset = memory
            .file_offset()
            .map(|fo| FileOffset::from_arc(Arc::clone(fo.arc()), fo.start() + offset));
        SlotBacking {
            region,
            memory,
            pending,
            offset,
            file_offset,
        }
    }

    /// The region the slot belongs to.
    pub fn region(&self) -> RegionId {
        self.region
    }

    /// The region's memory.
    pub fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }

    /// Offset of the slot's first byte in the region.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The region's pending dirty bits.
    pub(crate) fn pending(&self) -> &Arc<PendingBits> {
        &self.pending
    }
}

impl fmt::Debug for SlotBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotBacking")
            .field("region", &self.region)
            .field("offset", &self.offset)
            .finish()
    }
}

/// The slot type of a manager's map.
pub type GuestSlotData = Slot<SlotBacking>;

/// One slot seen as a vm-memory `GuestMemoryRegion` (a view of its region's mapping).
#[derive(Debug, RefCast)]
#[repr(transparent)]
pub struct GuestSlot(GuestSlotData);

impl GuestSlot {
    /// The slot in the map.
    pub fn slot(&self) -> &GuestSlotData {
        &self.0
    }

    /// The region the slot belongs to.
    pub fn region(&self) -> RegionId {
        self.0.payload().region
    }
}

impl GuestMemoryRegion for GuestSlot {
    type B = AtomicBitmap;

    fn len(&self) -> GuestUsize {
        self.0.size()
    }

    fn start_addr(&self) -> GuestAddress {
        self.0.gpa()
    }

    fn bitmap(&self) -> BS<'_, AtomicBitmap> {
        let backing = self.0.payload();
        backing
            .memory
            .mapping
            .bitmap()
            .slice_at(backing.offset as usize)
    }

    fn get_host_address(
        &self,
        addr: MemoryRegionAddress,
    ) -> vm_memory::guest_memory::Result<*mut u8> {
        let addr = self
            .check_address(addr)
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        // An unreachable byte is no memory for a device either (see `get_slice`).
        let offset = self.0.payload().offset + addr.0;
        if !self
            .0
            .payload()
            .memory
            .is_accessible_now(offset..offset + 1)
        {
            return Err(GuestMemoryError::InvalidGuestAddress(GuestAddress(
                self.0.gpa().0 + addr.0,
            )));
        }
        Ok((self.0.hva().0 + addr.0) as *mut u8)
    }

    fn file_offset(&self) -> Option<&FileOffset> {
        self.0.payload().file_offset.as_ref()
    }

    fn get_slice(
        &self,
        offset: MemoryRegionAddress,
        count: usize,
    ) -> vm_memory::guest_memory::Result<VolatileSlice<'_, BS<'_, AtomicBitmap>>> {
        let end = offset
            .0
            .checked_add(count as u64)
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        if end > self.len() {
            return Err(GuestMemoryError::InvalidBackendAddress);
        }
        let backing = self.0.payload();
        let start = usize::try_from(backing.offset + offset.0)
            .map_err(|_| GuestMemoryError::InvalidBackendAddress)?;
        // An inaccessible range (an unplugged block under a live slot) is refused as memory
        // that is not there. The check is not held across the slice's use: a device that
        // copies while the range turns inaccessible can still fault (see
        // `MemoryManager::set_accessible`).
        let first = backing.offset + offset.0;
        if !backing
            .memory
            .is_accessible_now(first..first + count as u64)
        {
            return Err(GuestMemoryError::InvalidGuestAddress(GuestAddress(
                self.0.gpa().0 + offset.0,
            )));
        }
        Ok(backing.memory.mapping.get_slice(start, count)?)
    }
}

impl GuestMemoryRegionBytes for GuestSlot {}

/// One version of the guest's memory map seen as a vm-memory `GuestMemoryBackend`: region
/// lookups go through the map's O(log n) guest-address index.
#[derive(Debug, RefCast)]
#[repr(transparent)]
pub struct GuestMemorySlots(MemslotMap<SlotBacking>);

impl GuestMemorySlots {
    /// A map version seen as vm-memory's guest memory (no copy).
    pub fn of(map: &GuestMemoryMap) -> &Self {
        Self::ref_cast(map)
    }

    /// The map version underneath.
    pub fn map(&self) -> &GuestMemoryMap {
        &self.0
    }
}

impl GuestMemoryBackend for GuestMemorySlots {
    type R = GuestSlot;

    fn num_regions(&self) -> usize {
        self.0.len()
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&GuestSlot> {
        self.0
            .find_by_gpa(addr)
            .map(|slot| GuestSlot::ref_cast(slot))
    }

    fn iter(&self) -> impl Iterator<Item = &GuestSlot> {
        self.0.iter().map(|slot| GuestSlot::ref_cast(slot))
    }
}

/// A view of one version of guest memory (vm-memory's `GuestAddressSpace::M`), consistent
/// while held: it keeps that version, and every mapping in it, alive. Dereferences to
/// [`GuestMemorySlots`]. (Not a snapshot in the save-and-restore sense: that is
/// kvm-memslots-persist's.)
#[derive(Debug, Clone)]
pub struct GuestMemoryView(pub(crate) Arc<MemslotMap<SlotBacking>>);

impl Deref for GuestMemoryView {
    type Target = GuestMemorySlots;

    fn deref(&self) -> &GuestMemorySlots {
        GuestMemorySlots::ref_cast(&self.0)
    }
}
