//! A manager's memory layout: every region (guest range, slots, flags, backing) in
//! guest-address order with its offset in the memory file, where the regions lie end to end.
//! The memory files ([`crate::memory_file`]), the stream ([`crate::stream`]) and the lazy
//! loader ([`crate::uffd`]) all address memory by it.
//!
//! [`MemoryLayout::of`] takes a manager's layout; [`MemoryLayout::validate`] checks one against
//! itself; [`MemoryLayout::to_bytes`] and [`MemoryLayout::from_bytes`] write and read the layout
//! file (its JSON in a [`frame`]: a truncated, corrupted, foreign or inconsistent file is refused
//! with the reason, before anything is built); [`MemoryLayout::build`] and its variants give a
//! fresh manager the layout's regions.

use std::collections::HashMap;
use std::fs::File;
use std::sync::Arc;

use kvm_memslots::{
    Backing, DirtyPages, Error, KvmMemory, MemoryManager, PageSize, RegionId, RegionMemory,
    RegionSpec, KVM_MAX_SLOT_SIZE, PAGE_SIZE,
};
use serde::{Deserialize, Serialize};
use vm_memory::{FileOffset, GuestAddress};

use crate::error::{io, SnapshotError};
use crate::frame::{frame, unframe};

/// The layout format's version; a file of another version is refused.
pub const LAYOUT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"KVMSLYT\0";

/// How a region's memory is backed, as a layout records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutBacking {
    /// Private anonymous memory.
    Anonymous,
    /// A shared mapping (a memfd, or a file of the VMM's); restored as a new memfd.
    Shared,
}

/// The size of the host pages behind a region, as a layout records it (kvm-memslots'
/// [`PageSize`]). Absent from the file for 4 KiB pages, so a layout of base pages reads as it
/// always did; a build that does not know the field refuses a layout that has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum LayoutPageSize {
    /// 4 KiB pages.
    #[default]
    #[serde(rename = "4k")]
    Base,
    /// 2 MiB hugetlb pages.
    #[serde(rename = "2m")]
    Huge2M,
    /// Transparent huge pages.
    #[serde(rename = "thp")]
    Transparent,
}

impl LayoutPageSize {
    fn is_base(&self) -> bool {
        *self == LayoutPageSize::Base
    }
}

impl From<PageSize> for LayoutPageSize {
    fn from(page_size: PageSize) -> Self {
        match page_size {
            PageSize::Base => LayoutPageSize::Base,
            PageSize::Huge2M => LayoutPageSize::Huge2M,
            PageSize::Transparent => LayoutPageSize::Transparent,
        }
    }
}

impl From<LayoutPageSize> for PageSize {
    fn from(page_size: LayoutPageSize) -> Self {
        match page_size {
            LayoutPageSize::Base => PageSize::Base,
            LayoutPageSize::Huge2M => PageSize::Huge2M,
            LayoutPageSize::Transparent => PageSize::Transparent,
        }
    }
}

/// One region of a [`MemoryLayout`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionLayout {
    /// The region's id when it was saved; a restored or received manager gives it the same id.
    pub id: u64,
    /// Guest-physical base.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes per KVM slot (the last slot may be smaller).
    pub slot_size: u64,
    /// Read-only for the guest.
    pub read_only: bool,
    /// Its writes are logged.
    pub log_dirty: bool,
    /// Its backing.
    pub backing: LayoutBacking,
    /// Where its pages are in the memory file.
    pub file_offset: u64,
    /// Its KVM slots as `[start, end)` byte ranges of it, where they are not the whole region
    /// cut into `slot_size` pieces: a region with holes (no slot, no guest memory) or
    /// re-slotted ([`MemoryManager::reslot`]). `None` (and absent from the file) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_ranges: Option<Vec<[u64; 2]>>,
    /// The size of the host pages behind it (absent: 4 KiB).
    #[serde(default, skip_serializing_if = "LayoutPageSize::is_base")]
    pub page_size: LayoutPageSize,
}

impl RegionLayout {
    /// The region's slots cut by `slot_size`, the layout a region gets by default.
    fn default_slots(&self) -> impl Iterator<Item = [u64; 2]> + '_ {
        (0..self.size)
            .step_by(self.slot_size.max(1) as usize)
            .map(|start| [start, (start + self.slot_size).min(self.size)])
    }

    /// The region's slots as byte ranges of it: its `slot_ranges`, else cut by `slot_size`.
    pub fn slots(&self) -> Vec<std::ops::Range<u64>> {
        match &self.slot_ranges {
            Some(slots) => slots.iter().map(|&[start, end]| start..end).collect(),
            None => self
                .default_slots()
                .map(|[start, end]| start..end)
                .collect(),
        }
    }
}

/// A manager's memory layout: every region with its slot size, flags and backing, in
/// guest-address order, and where each one's pages are in the memory file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryLayout {
    /// [`LAYOUT_VERSION`].
    pub version: u32,
    /// The regions, by guest address.
    pub regions: Vec<RegionLayout>,
}

impl MemoryLayout {
    /// The index of the region a harvest `d` is of: the one with its id and size (a harvest
    /// taken before a move still finds it).
    pub(crate) fn harvested_region(&self, d: &DirtyPages) -> Option<usize> {
        self.regions
            .iter()
            .position(|r| r.id == d.region.0 && r.size == d.pages * PAGE_SIZE)
    }

    /// The layout of `memory` now.
    pub fn of<K: KvmMemory>(memory: &MemoryManager<K>) -> Self {
        let mut regions = memory.regions();
        regions.sort_by_key(|r| r.gpa);
        let mut offset = 0;
        let regions = regions
            .into_iter()
            .map(|r| {
                let mut layout = RegionLayout {
                    id: r.id.0,
                    gpa: r.gpa.0,
                    size: r.size,
                    slot_size: r.slot_size,
                    read_only: r.flags.read_only,
                    log_dirty: r.flags.log_dirty,
                    backing: if r.shared {
                        LayoutBacking::Shared
                    } else {
                        LayoutBacking::Anonymous
                    },
                    file_offset: offset,
                    slot_ranges: None,
                    page_size: r.page_size.into(),
                };
                let slots: Vec<[u64; 2]> = memory
                    .slot_ranges(r.id)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|s| [s.start, s.end])
                    .collect();
                if !slots.iter().copied().eq(layout.default_slots()) {
                    layout.slot_ranges = Some(slots);
                }
                offset += r.size;
                layout
            })
            .collect();
        MemoryLayout {
            version: LAYOUT_VERSION,
            regions,
        }
    }

    /// This layout with every region in pages of `page_size`: a restore that overrides the
    /// page size the snapshot was taken with (4 KiB pages for a memory file that is not on
    /// hugetlbfs, say, or 2 MiB pages for one taken with 4 KiB). Refused, naming the region, where
    /// a region does not fit the new page size's alignment.
    pub fn with_page_size(&self, page_size: PageSize) -> Result<MemoryLayout, SnapshotError> {
        let mut layout = self.clone();
        for r in &mut layout.regions {
            r.page_size = page_size.into();
        }
        layout.validate()?;
        Ok(layout)
    }

    /// The memory file's size: every region's pages.
    pub fn memory_file_size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// The layout file: magic, version, length, the layout as JSON, its CRC-32 ([`frame`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a layout serialises");
        frame(MAGIC, self.version, &json)
    }

    /// Reads a layout file, refusing (with the reason) a wrong magic or version, a truncated
    /// or corrupted file, and a layout that [`validate`](Self::validate) refuses.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let bad = |why: String| SnapshotError::Format(why);
        let json = unframe(MAGIC, LAYOUT_VERSION, bytes).map_err(bad)?;
        let layout: MemoryLayout = serde_json::from_slice(json).map_err(|e| bad(format!("{e}")))?;
        if layout.version != LAYOUT_VERSION {
            return Err(bad("the header's and the layout's versions differ".into()));
        }
        layout.validate()?;
        Ok(layout)
    }

    /// Checks the layout against itself, as [`from_bytes`](Self::from_bytes) does after reading
    /// one, so that a layout that was built, edited or deserialised some other way need not be
    /// written out and read back to be checked. Refuses, with the first problem and its region:
    /// another [`version`](Self::version) than [`LAYOUT_VERSION`]; an empty region, or a guest
    /// base, size or slot size that is not page-aligned; a slot size over KVM's limit
    /// ([`KVM_MAX_SLOT_SIZE`]); a region that wraps around the address space; regions that are
    /// not in guest-address order or overlap; two regions with one id; and file offsets that
    /// are not the regions laid end to end.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        let bad = |why: String| Err(SnapshotError::Format(why));
        if self.version != LAYOUT_VERSION {
            return bad(format!(
                "layout version {}; this build reads version {LAYOUT_VERSION}",
                self.version
            ));
        }
        let mut offset = 0u64;
        let mut end = 0u64;
        let mut ids = std::collections::BTreeSet::new();
        for r in &self.regions {
            if !ids.insert(r.id) {
                return bad(format!("two regions have id {}", r.id));
            }
            let page = PageSize::from(r.page_size).alignment();
            let aligned = [r.gpa, r.size, r.slot_size].iter().all(|v| v % page == 0);
            if !aligned || r.size == 0 || r.slot_size == 0 {
                return bad(format!(
                    "region {} (guest {:#x}, size {:#x}, slot size {:#x}) is empty or not \
                     page-aligned (pages of {page:#x} bytes)",
                    r.id, r.gpa, r.size, r.slot_size
                ));
            }
            if r.slot_size > KVM_MAX_SLOT_SIZE {
                return bad(format!(
                    "region {} has slots of {:#x} bytes, over KVM's limit of \
                     {KVM_MAX_SLOT_SIZE:#x}",
                    r.id, r.slot_size
                ));
            }
            if let Some(slots) = &r.slot_ranges {
                let mut after = 0;
                for &[start, slot_end] in slots {
                    let fits = start >= after
                        && start < slot_end
                        && slot_end <= r.size
                        && slot_end - start <= KVM_MAX_SLOT_SIZE
                        && start % page == 0
                        && slot_end % page == 0;
                    if !fits {
                        return bad(format!(
                            "region {} has a slot at [{start:#x}, {slot_end:#x}) that is empty, \
                             unaligned, over KVM's limit, out of order or outside its {:#x} bytes",
                            r.id, r.size
                        ));
                    }
                    after = slot_end;
                }
            }
            if r.gpa < end {
                return bad(format!(
                    "region {} at {:#x} overlaps the one before or is not in guest-address order \
                     (the one before ends at {end:#x})",
                    r.id, r.gpa
                ));
            }
            if r.file_offset != offset {
                return bad(format!(
                    "region {} at {:#x} is at file offset {:#x}, not at {offset:#x} where the \
                     regions before it end",
                    r.id, r.gpa, r.file_offset
                ));
            }
            end = match r.gpa.checked_add(r.size) {
                Some(end) => end,
                None => return bad(format!("region {} wraps around", r.id)),
            };
            offset += r.size;
        }
        Ok(())
    }

    /// Gives `memory` (a manager with no region in the way, nor any of the layout's region ids
    /// in use) this layout's regions, with their ids, slot sizes and flags, in fresh memory;
    /// returns their ids, in layout order. All or nothing. Load their contents with
    /// [`load_memory_file`](crate::memory_file::load_memory_file).
    ///
    /// # KVM calls
    ///
    /// One [`MemoryManager::add_regions`] of every region, in layout (guest-address) order:
    /// for each shared one `memfd_create` and `ftruncate`, then one `mmap` each, then
    /// `KVM_SET_USER_MEMORY_REGION` creating every slot, region by region, lowest guest address
    /// first. All or nothing: on a refusal the slots created are deleted again and the
    /// mappings unmapped (see there); the map never shows part of the layout.
    pub fn build<K: KvmMemory>(&self, memory: &MemoryManager<K>) -> Result<Vec<RegionId>, Error> {
        self.build_with(memory, fresh_backing)
    }

    /// As [`build`](Self::build), each region mapped privately from `memory_file` at its
    /// offset instead: pages load from the file when first touched, with nothing copied up
    /// front, and the guest's writes never reach the file. Every region is private then, shared
    /// ones included. A region of transparent huge pages maps in 4 KiB pages (a private
    /// mapping of a file has no transparent huge pages; its `RegionInfo` then says so); 2 MiB
    /// hugetlb regions need the file on hugetlbfs. A file on hugetlbfs (a template for clones)
    /// maps in 2 MiB pages only, so there every region is a 2 MiB one whatever the layout says
    /// (refused, naming the region, where one is off the 2 MiB grid), and each clone's mapping
    /// reserves its whole size in the hugetlb pool for its copies on write (refused before
    /// anything is mapped when the pool's free pages cannot hold it): a write never finds the
    /// pool empty, at the cost of a pool that holds every clone's reservation.
    ///
    /// # KVM calls
    ///
    /// 1. `statx` (or `fstat`) of `memory_file` for its size, `fstatfs` for its file system,
    ///    then one `fcntl(F_DUPFD_CLOEXEC)`; a wrong size or a failed duplicate makes no KVM
    ///    call.
    /// 2. As [`build`](Self::build), with no memfd: each region's one `mmap` is a
    ///    `MAP_PRIVATE` mapping of that one duplicate at the region's file offset (one open file
    ///    whatever the region count). The same undo on a refusal; the duplicate is closed with
    ///    the last region's mapping.
    pub fn build_from_file<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
        memory_file: &File,
    ) -> Result<Vec<RegionId>, SnapshotError> {
        self.check_file_size(memory_file)?;
        let hugetlbfs = crate::hugetlbfs::is_hugetlbfs(memory_file)?;
        let mut layout = self.clone();
        for r in &mut layout.regions {
            r.page_size = match r.page_size {
                _ if hugetlbfs => LayoutPageSize::Huge2M,
                LayoutPageSize::Transparent => LayoutPageSize::Base,
                size => size,
            };
        }
        if hugetlbfs {
            layout.validate().map_err(|e| {
                SnapshotError::Format(format!(
                    "the memory file is on hugetlbfs, which maps every region in 2 MiB pages: \
                     {e}"
                ))
            })?;
        }
        // A hugetlbfs file maps only at offsets on its 2 MiB pages.
        for r in &layout.regions {
            let page = PageSize::from(r.page_size).alignment();
            if r.file_offset % page != 0 {
                return Err(SnapshotError::Format(format!(
                    "region {} of {page:#x}-byte pages starts at file offset {:#x}, which is \
                     not on its pages: restore it with another page size",
                    r.id, r.file_offset
                )));
            }
        }
        // One duplicate shared by every region's mapping: the open-file count does not grow
        // with the region count (a layout of 1,100 regions restores under a limit of 1,024).
        let file = Arc::new(
            memory_file
                .try_clone()
                .map_err(io("duplicating the memory file"))?,
        );
        Ok(layout.build_with(memory, |r| {
            Backing::PrivateFile(FileOffset::from_arc(Arc::clone(&file), r.file_offset))
        })?)
    }

    /// Adds the layout's regions to `memory` as [`build`](Self::build) does, except that
    /// region `i` maps `handed[&i]` (a file or memfd another process handed over, shared) instead
    /// of fresh memory: its contents are the other process's, nothing to copy. All or nothing.
    ///
    /// # KVM calls
    ///
    /// As [`build`](Self::build); a handed-over region's `mmap` is a shared mapping of its file.
    pub fn build_handed_over<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
        handed: &HashMap<usize, FileOffset>,
    ) -> Result<Vec<RegionId>, Error> {
        let mut index = 0;
        self.build_with(memory, |r| {
            let backing = match handed.get(&index) {
                Some(file) => Backing::File(file.clone()),
                None => fresh_backing(r),
            };
            index += 1;
            backing
        })
    }

    fn build_with<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
        mut backing: impl FnMut(&RegionLayout) -> Backing,
    ) -> Result<Vec<RegionId>, Error> {
        let specs = self.regions.iter().map(|r| {
            let mut spec = RegionSpec::new(GuestAddress(r.gpa), r.size)
                .with_slot_size(r.slot_size)
                .with_backing(backing(r))
                .with_page_size(r.page_size.into())
                .with_id(RegionId(r.id));
            spec.read_only = r.read_only;
            spec.log_dirty = r.log_dirty;
            if let Some(slots) = &r.slot_ranges {
                spec = spec.with_slot_ranges(slots.iter().map(|&[a, b]| a..b).collect());
            }
            spec
        });
        memory.add_regions(specs)
    }
}

/// Fresh memory of the kind a layout region had.
fn fresh_backing(r: &RegionLayout) -> Backing {
    match r.backing {
        LayoutBacking::Anonymous => Backing::Anonymous,
        LayoutBacking::Shared => Backing::Memfd,
    }
}

/// What the memory files, the stream and the lazy loader need of a layout.
impl MemoryLayout {
    /// Each region's mapping in `memory` now, in layout order: the region at the layout
    /// region's guest base, of its size. Refuses a manager that lacks one.
    pub(crate) fn mappings<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
    ) -> Result<Vec<Arc<RegionMemory>>, SnapshotError> {
        // By guest base and size, not by slot: a region with a hole at its start has no slot
        // there, and one with no slot at all still has memory.
        let regions: HashMap<(u64, u64), RegionId> = memory
            .regions()
            .iter()
            .map(|r| ((r.gpa.0, r.size), r.id))
            .collect();
        self.regions
            .iter()
            .map(|r| {
                regions
                    .get(&(r.gpa, r.size))
                    .and_then(|id| memory.region_memory(*id))
                    .ok_or_else(|| {
                        SnapshotError::Format(format!(
                            "no region of {:#x} bytes at guest {:#x} in this manager",
                            r.size, r.gpa
                        ))
                    })
            })
            .collect()
    }

    /// The size of `file`, which must be [`memory_file_size`](Self::memory_file_size): a memory
    /// file of another size is not of this layout.
    pub(crate) fn check_file_size(&self, file: &File) -> Result<u64, SnapshotError> {
        let found = file
            .metadata()
            .map_err(io("reading the memory file's size"))?
            .len();
        let expected = self.memory_file_size();
        if found != expected {
            return Err(SnapshotError::FileSize { found, expected });
        }
        Ok(found)
    }
}
