//! What a VMM needs from the manager to snapshot and restore guest memory: a versioned,
//! checksummed description of the memory layout that a new manager is built from, and a
//! sparse memory file that holds every region's pages at fixed offsets.
//!
//! **The memory file** lays the regions end to end in guest-address order (each region at its
//! [`RegionLayout::file_offset`]). Only pages that hold data are written, so pages the guest
//! never touched and pages that were discarded stay holes: a full snapshot writes the pages
//! the host has (present or swapped, from `/proc/self/pagemap`) that are not all zeros (a
//! transparent huge page makes 511 untouched neighbours present), a diff snapshot writes the
//! pages a harvest reported into a new file at the same offsets, and [`merge_memory_files`]
//! applies diffs onto a base. Loading ([`load_memory_file`]) copies the file's data runs
//! (`SEEK_DATA`/`SEEK_HOLE`) into the regions; holes read as zeros in fresh memory.
//!
//! **The layout file** ([`MemoryLayout::to_bytes`]) is a magic, the format version, the JSON of
//! the layout and its CRC-32: a truncated, corrupted or foreign file is refused with the reason,
//! before anything is built.
//!
//! # Example
//!
//! A full snapshot of one manager restored into another (on the fake KVM; a VMM pauses its
//! vCPUs first and saves their state beside these two files):
//!
//! ```
//! use kvm_memslots::snapshot::{load_memory_file, write_memory_file, MemoryLayout};
//! use kvm_memslots::testing::FakeKvm;
//! use kvm_memslots::{MemoryManager, RegionSpec};
//! use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
//!
//! let vm = MemoryManager::new(FakeKvm::new(64, true));
//! vm.add_region(RegionSpec::new(GuestAddress(0), 4 << 20).with_slot_size(1 << 20))?;
//! vm.handle().memory().write_obj(42u64, GuestAddress(0x20_0000))?;
//!
//! let layout_bytes = MemoryLayout::of(&vm).to_bytes(); // the layout file's contents
//! let memory_file = tempfile()?;
//! write_memory_file(&vm, &MemoryLayout::of(&vm), &memory_file)?;
//!
//! let restored = MemoryManager::new(FakeKvm::new(64, true));
//! let layout = MemoryLayout::from_bytes(&layout_bytes)?; // checked before anything is built
//! layout.build(&restored)?;
//! load_memory_file(&restored, &layout, &memory_file)?;
//! assert_eq!(restored.handle().memory().read_obj::<u64>(GuestAddress(0x20_0000))?, 42);
//! assert_eq!(restored.slot_usage().used, 4);
//! # fn tempfile() -> std::io::Result<std::fs::File> {
//! #     let path = std::env::temp_dir().join(format!("kvm-memslots-doc-{}", std::process::id()));
//! #     let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
//! #     std::fs::remove_file(&path)?;
//! #     Ok(file)
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::{FileOffset, GuestAddress};

use crate::dirty::DirtyPages;
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::manager::{MemoryManager, RegionSpec};
use crate::memory::{Backing, RegionId, RegionMemory};
use crate::PAGE_SIZE;

/// The layout format's version; a file of another version is refused.
pub const LAYOUT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"KVMSLYT\0";

/// How a region's memory is backed, as a layout records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackingKind {
    /// Private anonymous memory.
    Anonymous,
    /// A shared mapping (a memfd, or a file of the VMM's); restored as a new memfd.
    Shared,
}

/// One region of a [`MemoryLayout`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionLayout {
    /// The region's id when it was saved (a restored manager numbers its own).
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
    pub backing: BackingKind,
    /// Where its pages are in the memory file.
    pub file_offset: u64,
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

/// Why a snapshot could not be written, read or restored.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A file operation failed.
    #[error("{what} failed: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The layout file is not one this version reads.
    #[error("invalid memory layout: {0}")]
    Format(String),
    /// The memory file does not fit the layout.
    #[error("the memory file is {found} bytes; the layout needs {expected}")]
    FileSize {
        /// The file's size.
        found: u64,
        /// The layout's.
        expected: u64,
    },
    /// The manager refused a region.
    #[error(transparent)]
    Memory(#[from] Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}

/// Frames `payload` for a file: the 8-byte `magic`, the format `version` (u32), the payload's
/// length (u64), the payload, and its CRC-32 (all little-endian), so that a reader can refuse a
/// foreign, truncated or corrupted file before it parses anything ([`unframe`]).
pub fn frame(magic: &[u8; 8], version: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 24);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out
}

/// The payload of a file [`frame`] made with `magic` and `version`, or why it is not one: no
/// such magic, another version, a length that does not match the file's (truncated or
/// padded), or a checksum that does not match (corrupted).
pub fn unframe<'a>(magic: &[u8; 8], version: u32, bytes: &'a [u8]) -> Result<&'a [u8], String> {
    let name = String::from_utf8_lossy(magic.split(|b| *b == 0).next().unwrap_or(magic));
    if bytes.len() < 24 || &bytes[..8] != magic {
        return Err(format!("not a file of this kind (no {name} magic)"));
    }
    let found = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if found != version {
        return Err(format!(
            "format version {found}; this build reads version {version}"
        ));
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let end = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(24))
        .filter(|total| *total == bytes.len())
        .ok_or_else(|| {
            format!(
                "{} bytes, but its header announces {len} bytes of content (truncated or padded)",
                bytes.len()
            )
        })?;
    let payload = &bytes[20..end - 4];
    let stored = u32::from_le_bytes(bytes[end - 4..].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(payload);
    if stored != computed {
        return Err(format!(
            "checksum {computed:#010x} does not match the stored {stored:#010x} (corrupted)"
        ));
    }
    Ok(payload)
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
                let layout = RegionLayout {
                    id: r.id.0,
                    gpa: r.gpa.0,
                    size: r.size,
                    slot_size: r.slot_size,
                    read_only: r.flags.read_only,
                    log_dirty: r.flags.log_dirty,
                    backing: if r.shared {
                        BackingKind::Shared
                    } else {
                        BackingKind::Anonymous
                    },
                    file_offset: offset,
                };
                offset += r.size;
                layout
            })
            .collect();
        MemoryLayout {
            version: LAYOUT_VERSION,
            regions,
        }
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
    /// or corrupted file, and a layout whose regions overlap, are not page-aligned, or whose
    /// file offsets are not the regions laid end to end.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let bad = |why: String| SnapshotError::Format(why);
        let json = unframe(MAGIC, LAYOUT_VERSION, bytes).map_err(bad)?;
        let layout: MemoryLayout = serde_json::from_slice(json).map_err(|e| bad(format!("{e}")))?;
        if layout.version != LAYOUT_VERSION {
            return Err(bad("the header's and the layout's versions differ".into()));
        }
        layout.check()?;
        Ok(layout)
    }

    fn check(&self) -> Result<(), SnapshotError> {
        let mut offset = 0u64;
        let mut end = 0u64;
        for r in &self.regions {
            let aligned = [r.gpa, r.size, r.slot_size]
                .iter()
                .all(|v| v % PAGE_SIZE == 0);
            if !aligned || r.size == 0 || r.slot_size == 0 {
                return Err(SnapshotError::Format(format!(
                    "region {} (guest {:#x}, size {:#x}, slot size {:#x}) is empty or not page-aligned",
                    r.id, r.gpa, r.size, r.slot_size
                )));
            }
            if r.gpa < end || r.file_offset != offset {
                return Err(SnapshotError::Format(format!(
                    "region {} at {:#x} overlaps the one before or is not at file offset {offset:#x}",
                    r.id, r.gpa
                )));
            }
            end = r
                .gpa
                .checked_add(r.size)
                .ok_or_else(|| SnapshotError::Format(format!("region {} wraps around", r.id)))?;
            offset += r.size;
        }
        Ok(())
    }

    /// Gives `memory` (a manager with no region in the way) this layout's regions, with their
    /// slot sizes and flags, in fresh memory; returns their new ids, in layout order. On a
    /// refusal, the regions added so far are removed again. Load their contents with
    /// [`load_memory_file`].
    ///
    /// # KVM calls
    ///
    /// 1. [`MemoryManager::add_region`] for each region, in layout (guest-address) order: for a
    ///    shared one `memfd_create` and `ftruncate`; one `mmap`; `KVM_SET_USER_MEMORY_REGION`
    ///    creating its slots, lowest guest address first (see there, with its own undo).
    ///
    /// On a refusal: [`MemoryManager::remove_region`] of each region added so far, last first
    /// (its slots deleted, lowest guest address first, after its logs are read in bitmap mode
    /// or the rings drained in ring mode; then its mapping unmapped). A remove that fails is
    /// ignored: its region stays, and the add's error is returned.
    pub fn build<K: KvmMemory>(&self, memory: &MemoryManager<K>) -> Result<Vec<RegionId>, Error> {
        self.build_with(memory, fresh_backing)
    }

    /// As [`build`](Self::build), each region mapped privately from `memory_file` at its
    /// offset instead: pages load from the file when first touched, with nothing copied up
    /// front, and the guest's writes never reach the file. Every region is private then, shared
    /// ones included.
    ///
    /// # KVM calls
    ///
    /// 1. `statx` (or `fstat`) of `memory_file` for its size, then one `fcntl(F_DUPFD_CLOEXEC)` per
    ///    region; a wrong size or a failed duplicate makes no KVM call (duplicates are closed).
    /// 2. As [`build`](Self::build), with no memfd: each region's one `mmap` is a
    ///    `MAP_PRIVATE` mapping of its duplicate at the region's file offset. The same undo on
    ///    a refusal; each duplicate is closed with its region's mapping.
    pub fn build_from_file<K: KvmMemory>(
        &self,
        memory: &MemoryManager<K>,
        memory_file: &File,
    ) -> Result<Vec<RegionId>, SnapshotError> {
        let found = memory_file
            .metadata()
            .map_err(io("reading the memory file's size"))?
            .len();
        if found != self.memory_file_size() {
            return Err(SnapshotError::FileSize {
                found,
                expected: self.memory_file_size(),
            });
        }
        let mut clones = Vec::with_capacity(self.regions.len());
        for _ in &self.regions {
            clones.push(
                memory_file
                    .try_clone()
                    .map_err(io("duplicating the memory file"))?,
            );
        }
        let mut clones = clones.into_iter();
        Ok(self.build_with(memory, |r| {
            let file = clones.next().expect("one per region");
            Backing::PrivateFile(FileOffset::new(file, r.file_offset))
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
        handed: &std::collections::HashMap<usize, FileOffset>,
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
        let mut added = Vec::with_capacity(self.regions.len());
        for r in &self.regions {
            let mut spec = RegionSpec::new(GuestAddress(r.gpa), r.size)
                .with_slot_size(r.slot_size)
                .with_backing(backing(r));
            spec.read_only = r.read_only;
            spec.log_dirty = r.log_dirty;
            match memory.add_region(spec) {
                Ok(id) => added.push(id),
                Err(failed) => {
                    let mut left = Vec::new();
                    let mut undo = None;
                    for id in added.into_iter().rev() {
                        if let Err(e) = memory.remove_region(id) {
                            left.push(id);
                            undo.get_or_insert(e);
                        }
                    }
                    return Err(match undo {
                        None => failed,
                        Some(undo) => Error::PartlyUndone {
                            failed: Box::new(failed),
                            left,
                            undo: Box::new(undo),
                        },
                    });
                }
            }
        }
        Ok(added)
    }
}

/// Fresh memory of the kind a layout region had.
fn fresh_backing(r: &RegionLayout) -> Backing {
    match r.backing {
        BackingKind::Anonymous => Backing::Anonymous,
        BackingKind::Shared => Backing::Memfd,
    }
}

/// Each layout region's mapping in `memory` now (by the region's guest base).
pub(crate) fn mappings<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
) -> Result<Vec<Arc<RegionMemory>>, SnapshotError> {
    let map = memory.load();
    layout
        .regions
        .iter()
        .map(|r| {
            map.find_by_gpa(GuestAddress(r.gpa))
                .filter(|s| s.gpa().0 == r.gpa && s.payload().offset() == 0)
                .filter(|s| s.payload().memory().size() == r.size)
                .map(|s| Arc::clone(s.payload().memory()))
                .ok_or_else(|| {
                    SnapshotError::Format(format!(
                        "no region of {:#x} bytes at guest {:#x} in this manager",
                        r.size, r.gpa
                    ))
                })
        })
        .collect()
}

/// The byte ranges of `memory` that hold data: pages present in memory or swapped out, from
/// `/proc/self/pagemap`. Pages never touched and pages discarded are not data.
pub fn data_runs(memory: &RegionMemory) -> Result<Vec<Range<u64>>, SnapshotError> {
    let pagemap = File::open("/proc/self/pagemap").map_err(io("opening /proc/self/pagemap"))?;
    let pages = memory.size() / PAGE_SIZE;
    let first = memory.host_address() / PAGE_SIZE;
    let mut runs: Vec<Range<u64>> = Vec::new();
    let mut entries = vec![0u8; 8 * 4096];
    let mut page = 0;
    while page < pages {
        let batch = (pages - page).min(4096);
        let buf = &mut entries[..8 * batch as usize];
        pagemap
            .read_exact_at(buf, (first + page) * 8)
            .map_err(io("reading /proc/self/pagemap"))?;
        for (i, entry) in buf.chunks_exact(8).enumerate() {
            let entry = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
            // Bit 63: present; bit 62: swapped.
            if entry & (3 << 62) == 0 {
                continue;
            }
            let at = (page + i as u64) * PAGE_SIZE;
            match runs.last_mut() {
                Some(run) if run.end == at => run.end += PAGE_SIZE,
                _ => runs.push(at..at + PAGE_SIZE),
            }
        }
        page += batch;
    }
    Ok(runs)
}

/// What writing a memory file did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Bytes of pages written.
    pub bytes: u64,
    /// Runs of neighbouring pages (one `pwrite` each).
    pub runs: u64,
}

/// Moves `len` bytes between guest memory at `offset` in `memory` and `file` at `at`, with
/// `pwrite` (`to_file`) or `pread`: the kernel copies, so no Rust reference to guest memory is
/// ever made.
fn transfer(
    file: &File,
    memory: &RegionMemory,
    offset: u64,
    len: u64,
    at: u64,
    to_file: bool,
) -> std::io::Result<()> {
    assert!(
        offset
            .checked_add(len)
            .is_some_and(|end| end <= memory.size()),
        "a run inside its region"
    );
    let mut done = 0u64;
    while done < len {
        let ptr = (memory.host_address() + offset + done) as *mut libc::c_void;
        let count = (len - done).min(1 << 30) as usize;
        let pos = (at + done) as libc::off_t;
        let n = if to_file {
            // SAFETY: `[ptr, ptr + count)` lies inside the region's mapping (asserted above),
            // which `memory` keeps mapped for the call; the kernel only reads it.
            unsafe { libc::pwrite(file.as_raw_fd(), ptr, count, pos) }
        } else {
            // SAFETY: as above, and the mapping is writable; the kernel writes it. The guest
            // does not run while memory is loaded.
            unsafe { libc::pread(file.as_raw_fd(), ptr, count, pos) }
        };
        match n {
            n if n > 0 => done += n as u64,
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Writes `len` bytes of `memory` from `offset` to `file` at `at`.
fn write_run(
    file: &File,
    memory: &RegionMemory,
    offset: u64,
    len: u64,
    at: u64,
) -> Result<(), SnapshotError> {
    transfer(file, memory, offset, len, at, true).map_err(io(format!(
        "writing {len} bytes at offset {at:#x} of the memory file"
    )))
}

/// A full snapshot of `memory`'s pages into `file` (created empty by the caller): the file is
/// sized to the layout, and every page that holds data is written at its offset; the rest are
/// holes. Pause the vCPUs first for a consistent image.
pub fn write_memory_file<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
) -> Result<WriteStats, SnapshotError> {
    let regions = mappings(memory, layout)?;
    file.set_len(layout.memory_file_size())
        .map_err(io("sizing the memory file"))?;
    let mut stats = WriteStats::default();
    for (r, region) in layout.regions.iter().zip(&regions) {
        for run in content_runs(region)? {
            write_run(
                file,
                region,
                run.start,
                run.end - run.start,
                r.file_offset + run.start,
            )?;
            stats.bytes += run.end - run.start;
            stats.runs += 1;
        }
    }
    Ok(stats)
}

/// The byte ranges of `memory` a full copy must carry: pages the host holds ([`data_runs`])
/// that are not all zeros (fresh memory on the other side reads zeros anyway).
pub(crate) fn content_runs(memory: &RegionMemory) -> Result<Vec<Range<u64>>, SnapshotError> {
    Ok(data_runs(memory)?
        .into_iter()
        .flat_map(|present| non_zero_runs(memory, present))
        .collect())
}

/// The parts of `run` (byte offsets in `memory`, page-aligned) whose pages are not all zeros.
fn non_zero_runs(memory: &RegionMemory, run: Range<u64>) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    let mut page = [0u8; PAGE_SIZE as usize];
    for at in run.step_by(PAGE_SIZE as usize) {
        // A page that cannot be read is written, not guessed to be zeros.
        if memory.read_volatile(at, &mut page).is_ok() && page.iter().all(|b| *b == 0) {
            continue;
        }
        match runs.last_mut() {
            Some(last) if last.end == at => last.end += PAGE_SIZE,
            _ => runs.push(at..at + PAGE_SIZE),
        }
    }
    runs
}

/// A diff snapshot: the pages of `dirty` (harvests of `memory`) into `file` (created empty by
/// the caller), sized to the layout, at the same offsets as a full snapshot of it. Regions are
/// matched by id, so a harvest taken before a region moved still lands at its pages; a
/// harvested region the layout no longer has (removed since) has nothing to keep.
pub fn write_dirty_pages<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    dirty: &[DirtyPages],
    file: &File,
) -> Result<WriteStats, SnapshotError> {
    let regions = mappings(memory, layout)?;
    file.set_len(layout.memory_file_size())
        .map_err(io("sizing the memory file"))?;
    let mut stats = WriteStats::default();
    for d in dirty {
        let Some(index) = layout.harvested_region(d) else {
            continue;
        };
        let (r, region) = (&layout.regions[index], &regions[index]);
        for run in d.ranges() {
            // From the harvest's own base: the region may have moved since.
            let offset = run.start - d.gpa.0;
            write_run(
                file,
                region,
                offset,
                run.end - run.start,
                r.file_offset + offset,
            )?;
            stats.bytes += run.end - run.start;
            stats.runs += 1;
        }
    }
    Ok(stats)
}

/// The data runs of `file` (`SEEK_DATA` / `SEEK_HOLE`), as byte ranges.
pub(crate) fn file_data_runs(file: &File, size: u64) -> Result<Vec<Range<u64>>, SnapshotError> {
    let fd = file.as_raw_fd();
    let mut runs = Vec::new();
    let mut at = 0i64;
    let size = i64::try_from(size).map_err(|_| SnapshotError::Format("file too large".into()))?;
    while at < size {
        // SAFETY: lseek only moves the file's offset; no memory is involved.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // No data past `at`.
            }
            return Err(io("finding the memory file's data (SEEK_DATA)")(e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io("finding the memory file's holes (SEEK_HOLE)")(
                std::io::Error::last_os_error(),
            ));
        }
        runs.push(data as u64..hole as u64);
        at = hole;
    }
    Ok(runs)
}

pub(crate) fn check_size(file: &File, layout: &MemoryLayout) -> Result<u64, SnapshotError> {
    let found = file
        .metadata()
        .map_err(io("reading the memory file's size"))?
        .len();
    let expected = layout.memory_file_size();
    if found != expected {
        return Err(SnapshotError::FileSize { found, expected });
    }
    Ok(found)
}

/// Copies the data of `file` (a memory file of `layout`) into `memory`'s regions, which
/// [`MemoryLayout::build`] made; holes are left as the fresh memory's zeros. Returns the bytes
/// copied. Load before any vCPU runs.
pub fn load_memory_file<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
) -> Result<u64, SnapshotError> {
    let size = check_size(file, layout)?;
    let regions = mappings(memory, layout)?;
    let mut loaded = 0;
    for run in file_data_runs(file, size)? {
        // A run may span regions: cut it at their boundaries.
        for (r, region) in layout.regions.iter().zip(&regions) {
            let start = run.start.max(r.file_offset);
            let end = run.end.min(r.file_offset + r.size);
            if start >= end {
                continue;
            }
            let offset = start - r.file_offset;
            transfer(file, region, offset, end - start, start, false)
                .map_err(io(format!("reading the memory file at {start:#x}")))?;
            loaded += end - start;
        }
    }
    Ok(loaded)
}

/// Builds the full memory file of the last snapshot of a chain into `out` (created empty by the
/// caller), from the chain's files oldest first: a full snapshot, then diffs, each with the
/// layout it was taken with. The layouts may differ (regions added, removed or moved between
/// snapshots): every region of the last layout gets, in order, the data each file has of the
/// region with the same id, at its own offset in the last layout. A region added after the
/// full snapshot has all its pages in the first diff that has it (a region added while logging
/// reports every page first). Returns the bytes copied.
pub fn merge_snapshots(chain: &[(&MemoryLayout, &File)], out: &File) -> Result<u64, SnapshotError> {
    let Some((last, _)) = chain.last() else {
        return Err(SnapshotError::Format("no snapshot to merge".into()));
    };
    out.set_len(last.memory_file_size())
        .map_err(io("sizing the merged memory file"))?;
    let mut copied = 0;
    let mut buffer = vec![0u8; 1 << 20];
    for (layout, file) in chain {
        let size = check_size(file, layout)?;
        let runs = file_data_runs(file, size)?;
        for target in &last.regions {
            let Some(source) = layout
                .regions
                .iter()
                .find(|r| r.id == target.id && r.size == target.size)
            else {
                continue;
            };
            let (from, to) = (source.file_offset, source.file_offset + source.size);
            for run in &runs {
                let (start, end) = (run.start.max(from), run.end.min(to));
                let mut at = start;
                while at < end {
                    let n = ((end - at) as usize).min(buffer.len());
                    file.read_exact_at(&mut buffer[..n], at)
                        .map_err(io("reading a snapshot's memory file"))?;
                    out.write_all_at(&buffer[..n], target.file_offset + (at - from))
                        .map_err(io("writing the merged memory file"))?;
                    at += n as u64;
                    copied += n as u64;
                }
            }
        }
    }
    Ok(copied)
}

/// Applies the diff memory files `diffs`, in order, onto `base` (all of `layout`): each diff's
/// data runs overwrite the base's bytes there. The result is the full snapshot of the point the
/// last diff was taken at.
pub fn merge_memory_files(
    layout: &MemoryLayout,
    base: &File,
    diffs: &[File],
) -> Result<u64, SnapshotError> {
    check_size(base, layout)?;
    let mut merged = 0;
    let mut buffer = vec![0u8; 1 << 20];
    for diff in diffs {
        let size = check_size(diff, layout)?;
        for run in file_data_runs(diff, size)? {
            let mut at = run.start;
            while at < run.end {
                let n = ((run.end - at) as usize).min(buffer.len());
                diff.read_exact_at(&mut buffer[..n], at)
                    .map_err(io("reading a diff"))?;
                base.write_all_at(&buffer[..n], at)
                    .map_err(io("writing the base"))?;
                at += n as u64;
                merged += n as u64;
            }
        }
    }
    Ok(merged)
}
