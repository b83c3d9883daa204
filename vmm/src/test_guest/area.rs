//! The test area: one region of guest memory split evenly into many KVM slots, as the kernel's
//! memslot tests lay it out (512 MiB at 256 MiB by default), and the two-way check of every
//! slot in it that the check job and the API's new regions use.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvm_memslots::{Backing, KvmMemory, MemoryManager, PageSize, RegionId, RegionSpec};
use vm_memory::{Bytes, GuestAddress};

use super::vcpus::{expect_pattern, GuestError, TestVm, Vcpus};
use super::{pattern, Command, Op};

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
    pub(crate) slot_size: u64,
    /// Number of slots.
    pub slots: u64,
}

/// Why a test area cannot be laid out.
#[derive(Debug, thiserror::Error)]
pub enum AreaError {
    /// Fewer bytes than pages for the slots.
    #[error(
        "a test area of {size:#x} bytes cannot be split into {slots} slots of at least one \
         page of {page:#x} bytes"
    )]
    TooSmall {
        /// The area's size.
        size: u64,
        /// Slots asked for.
        slots: u64,
        /// The area's page size, in bytes.
        page: u64,
    },
    /// With huge pages, a size or slot size off the 2 MiB grid (the area is not trimmed to
    /// fit: the caller asked for an exact layout).
    #[error("with {page_size} pages, the test area's {what} {value:#x} must be a multiple of {alignment:#x}")]
    OffGrid {
        /// Which value: "size" or "slot size".
        what: &'static str,
        /// The value.
        value: u64,
        /// The page size's name.
        page_size: &'static str,
        /// What it must be a multiple of.
        alignment: u64,
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
        Self::add_backed(memory, gpa, size, slots, Backing::Anonymous)
    }

    /// As [`add`](Self::add), in memory of `backing` (a memfd, say, that a local migration
    /// can hand over).
    fn add_backed<K: KvmMemory>(
        memory: &MemoryManager<K>,
        gpa: u64,
        size: u64,
        slots: u64,
        backing: Backing,
    ) -> Result<Self, AreaError> {
        Self::add_paged(memory, gpa, size, slots, backing, PageSize::Base)
    }

    /// As `add_backed`, in pages of `page_size` (each slot a whole number
    /// of them: 2 MiB hugetlb pages take a `size` of at least 2 MiB a slot).
    pub fn add_paged<K: KvmMemory>(
        memory: &MemoryManager<K>,
        gpa: u64,
        size: u64,
        slots: u64,
        backing: Backing,
        page_size: PageSize,
    ) -> Result<Self, AreaError> {
        let page = page_size.alignment();
        let slot_size = size.checked_div(slots).unwrap_or(0) / page * page;
        if slot_size == 0 {
            return Err(AreaError::TooSmall { size, slots, page });
        }
        let spec = RegionSpec::new(GuestAddress(gpa), slot_size * slots)
            .with_slot_size(slot_size)
            .with_backing(backing)
            .with_page_size(page_size);
        let region = memory.add_region(spec)?;
        Ok(TestArea {
            region,
            gpa,
            slot_size,
            slots,
        })
    }

    /// The slot size of an area of about `size` bytes split into `slots` slots of pages of
    /// `page_size`, for a caller that wants the layout asked for (`serve --page-size`): with
    /// 4 KiB pages (and transparent huge pages), whole pages, the area trimmed to a multiple
    /// of the slot size, as [`add_paged`](Self::add_paged) does; with 2 MiB pages, the size
    /// and the slot size exactly, each a multiple of 2 MiB (refused, named, otherwise), where
    /// `add_paged` would trim the area to whole huge pages a slot.
    pub(crate) fn check_layout(
        size: u64,
        slots: u64,
        page_size: PageSize,
    ) -> Result<u64, AreaError> {
        let alignment = page_size.alignment();
        let off_grid = |what, value| AreaError::OffGrid {
            what,
            value,
            page_size: page_size.name(),
            alignment,
        };
        if page_size == PageSize::Huge2M {
            if !size.is_multiple_of(alignment) {
                return Err(off_grid("size", size));
            }
            let exact = size.checked_div(slots).unwrap_or(0);
            if exact > 0 && (exact * slots != size || !exact.is_multiple_of(alignment)) {
                return Err(off_grid("slot size", exact));
            }
        }
        let slot_size = size.checked_div(slots).unwrap_or(0) / alignment * alignment;
        if slot_size == 0 {
            return Err(AreaError::TooSmall {
                size,
                slots,
                page: alignment,
            });
        }
        Ok(slot_size)
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

/// The first and last u64 of every slot.
fn addresses(area: &TestArea) -> impl Iterator<Item = u64> + '_ {
    (0..area.slots).flat_map(|i| [area.slot_gpa(i), area.slot_gpa(i + 1) - 8])
}

/// Runs `op` with `seed` on both ends of every slot, the slots shared among the vCPUs.
fn guest_pass(
    vcpus: &mut Vcpus,
    area: &TestArea,
    op: Op,
    seed: u64,
) -> Result<Duration, GuestError> {
    let start = Instant::now();
    for offset in [0, area.slot_size - 8] {
        for v in 0..vcpus.count() {
            let (first, last) = area.share(v, vcpus.count());
            vcpus.start(
                v,
                Command {
                    op,
                    start: area.slot_gpa(first) + offset,
                    end: area.slot_gpa(last),
                    stride: area.slot_size,
                    seed,
                },
            );
        }
        for v in 0..vcpus.count() {
            vcpus.wait(v)?;
        }
    }
    Ok(start.elapsed())
}

/// How long each step of [`check_area`] took: guest write, host check, host write, guest check.
type Times = (Duration, Duration, Duration, Duration);

/// Checks every slot of `area` both ways: the guest writes both ends of every slot and the host
/// reads them through the memory map, then the host writes a new pattern and the guest checks
/// it. `stop` interrupts between steps.
pub(crate) fn check_area(
    vm: &TestVm,
    vcpus: &mut Vcpus,
    area: &TestArea,
    stop: &AtomicBool,
) -> Result<Times, GuestError> {
    let interrupted = || stop.load(Ordering::Acquire);
    let guest_seed = 0x5eed_0000_6e57_0001;
    let guest_write = guest_pass(vcpus, area, Op::Write, guest_seed)?;
    if interrupted() {
        return Err(GuestError::Interrupted);
    }
    let memory = vm.memory().current();
    let start = Instant::now();
    for gpa in addresses(area) {
        expect_pattern(&*memory, gpa, guest_seed)?;
    }
    let host_check = start.elapsed();
    if interrupted() {
        return Err(GuestError::Interrupted);
    }
    let host_seed = 0x5eed_0000_4057_0002;
    let start = Instant::now();
    for gpa in addresses(area) {
        memory
            .write_obj(pattern(gpa, host_seed), GuestAddress(gpa))
            .map_err(|source| GuestError::HostWrite { gpa, source })?;
    }
    let host_write = start.elapsed();
    let guest_check = guest_pass(vcpus, area, Op::Verify, host_seed)?;
    Ok((guest_write, host_check, host_write, guest_check))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn huge_pages_take_the_exact_layout_on_the_2m_grid() {
        let huge = |size, slots| TestArea::check_layout(size, slots, PageSize::Huge2M);
        assert_eq!(huge(8 * MIB, 2).expect("two 4 MiB slots"), 4 * MIB);
        assert_eq!(huge(8 * MIB, 4).expect("four 2 MiB slots"), 2 * MIB);
        for (size, slots, what, value) in [
            (3 * MIB, 1, "size", 3 * MIB),
            (8 * MIB, 8, "slot size", MIB),
            (8 * MIB, 3, "slot size", 8 * MIB / 3),
        ] {
            let why = huge(size, slots).expect_err("off the grid").to_string();
            assert_eq!(
                why,
                format!(
                    "with 2m pages, the test area's {what} {value:#x} must be a multiple of 0x200000"
                )
            );
        }
        // 4 KiB pages (and THP): whole pages, the area trimmed.
        for page_size in [PageSize::Base, PageSize::Transparent] {
            assert_eq!(
                TestArea::check_layout(8 * MIB, 3, page_size).expect("trimmed"),
                8 * MIB / 3 / 4096 * 4096
            );
            assert!(matches!(
                TestArea::check_layout(4096, 2, page_size),
                Err(AreaError::TooSmall { .. })
            ));
        }
    }
}
