//! The test area: one region of guest memory split evenly into many KVM slots, as the kernel's
//! memslot tests lay it out (512 MiB at 256 MiB by default).

use kvm_memslots::{KvmMemory, MemoryManager, RegionId, RegionSpec, PAGE_SIZE};
use vm_memory::GuestAddress;

/// Where the test area starts, as in the kernel's memslot_perf_test.
pub const AREA_GPA: u64 = 256 << 20;

/// A test area in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestArea {
    /// Its region.
    pub region: RegionId,
    /// First guest address.
    pub gpa: u64,
    /// Bytes per slot.
    pub slot_size: u64,
    /// Number of slots.
    pub slots: u64,
}

/// Why a test area cannot be laid out.
#[derive(Debug, thiserror::Error)]
pub enum AreaError {
    /// Fewer bytes than pages for the slots.
    #[error("a test area of {size:#x} bytes cannot be split into {slots} slots of at least one 4 KiB page")]
    TooSmall {
        /// The area's size.
        size: u64,
        /// Slots asked for.
        slots: u64,
    },
    /// The manager refused the region.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
}

impl TestArea {
    /// Adds an area of about `size` bytes at `gpa` split evenly into `slots` slots (each a whole
    /// number of pages; the area is trimmed to a multiple of the slot size).
    pub fn add<K: KvmMemory>(
        memory: &MemoryManager<K>,
        gpa: u64,
        size: u64,
        slots: u64,
    ) -> Result<Self, AreaError> {
        let slot_size = size.checked_div(slots).unwrap_or(0) / PAGE_SIZE * PAGE_SIZE;
        if slot_size == 0 {
            return Err(AreaError::TooSmall { size, slots });
        }
        let spec = RegionSpec::new(GuestAddress(gpa), slot_size * slots).with_slot_size(slot_size);
        let region = memory.add_region(spec)?;
        Ok(TestArea {
            region,
            gpa,
            slot_size,
            slots,
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.slot_size * self.slots
    }

    /// First address after the area.
    pub fn end(&self) -> u64 {
        self.gpa + self.size()
    }

    /// First address of slot `i`.
    pub fn slot_gpa(&self, i: u64) -> u64 {
        self.gpa + i * self.slot_size
    }

    /// The slots `[first, last)` vCPU `vcpu` of `vcpus` takes care of.
    pub fn share(&self, vcpu: usize, vcpus: usize) -> (u64, u64) {
        let (vcpu, vcpus) = (vcpu as u64, vcpus as u64);
        (self.slots * vcpu / vcpus, self.slots * (vcpu + 1) / vcpus)
    }
}
