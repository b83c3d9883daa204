//! Memory files: every region's pages at its [`RegionLayout::file_offset`], the regions laid
//! end to end in guest-address order as the [`MemoryLayout`] says.
//!
//! Only pages that hold data are written, so pages the guest never touched and pages that were
//! discarded stay holes: a full snapshot ([`write_memory_file`]) writes the pages the host has
//! (present or swapped, from `/proc/self/pagemap`, and those a lazy restore's loader still
//! owes: [`data_runs`]) that are not all zeros (a
//! transparent huge page makes 511 untouched neighbours present), a diff snapshot
//! ([`write_dirty_pages`]) writes the pages a harvest reported into a new file at the same
//! offsets, and [`merge_memory_files`] applies diffs onto a base ([`merge_snapshots`] when the
//! layouts changed in between). Loading ([`load_memory_file`]) copies the file's data runs
//! (`SEEK_DATA`/`SEEK_HOLE`) into the regions; holes read as zeros in fresh memory. Guest memory
//! moves between file and mapping with `pread`/`pwrite`: the kernel copies, and no Rust
//! reference to guest memory is made. A memory file on hugetlbfs (a template whose clones map
//! it in 2 MiB pages) is written through a shared mapping instead, a 2 MiB page allocated
//! before its first byte (the crate's `hugetlbfs` module); a Diff cannot live there.
//!
//! [`RegionLayout::file_offset`]: crate::RegionLayout::file_offset

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use kvm_memslots::{DirtyPages, KvmMemory, MemoryManager, RegionMemory, PAGE_SIZE};

use crate::error::{io, SnapshotError};
use crate::hugetlbfs::{is_hugetlbfs, refuse_diff, refuse_new_diff, HugetlbfsFile};
use crate::layout::MemoryLayout;
use crate::sparse::file_data_runs;

/// The byte ranges of `memory` that may hold data: pages present in memory or swapped out,
/// from `/proc/self/pagemap`; for memory under a lazy restore ([`LazyLoader`]), also the pages
/// its loader has not filled yet that are data in the restore's memory file (they have no page
/// table entry until first touched, and touching one fills it: reading guest memory there
/// reads the file's data); and for memory mapped from a file (a file-backed restore's private
/// mapping, a memfd another process handed over) also the file's data there: a page this
/// process never touched reads the file's bytes, yet its page table has nothing. Pages never
/// touched of anonymous memory are not data; a discarded page of a file mapping reads zeros,
/// which `content_runs` leaves out.
///
/// [`LazyLoader`]: crate::LazyLoader
pub fn data_runs(memory: &RegionMemory) -> Result<Vec<Range<u64>>, SnapshotError> {
    let present = present_runs(memory)?;
    // A lazy restore's pages not filled yet: the loader knows them, the page table does not.
    let owed = crate::uffd::owed_runs(memory)?;
    let Some(backing) = memory.file_offset() else {
        return Ok(if owed.is_empty() {
            present
        } else {
            union(present.into_iter().chain(owed))
        });
    };
    let start = backing.start();
    let end = start.saturating_add(memory.size());
    let size = backing
        .file()
        .metadata()
        .map_err(io("reading the size of guest memory's file"))?
        .len();
    // Only the file's part under this region: a file-backed restore maps one memory file for
    // every region, so a scan from the file's start per region would cost regions × runs.
    let in_file = file_data_runs(backing.file(), start.min(size)..size.min(end))?
        .into_iter()
        .map(|run| {
            // Whole pages of the region.
            let from = (run.start.max(start) - start) / PAGE_SIZE * PAGE_SIZE;
            let to = (run.end.min(end) - start).div_ceil(PAGE_SIZE) * PAGE_SIZE;
            from..to.min(memory.size())
        });
    Ok(union(present.into_iter().chain(owed).chain(in_file)))
}

/// The union of `runs`, as ordered, disjoint ranges.
fn union(runs: impl Iterator<Item = Range<u64>>) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = runs.filter(|r| r.start < r.end).collect();
    all.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(all.len());
    for run in all {
        match merged.last_mut() {
            Some(last) if run.start <= last.end => last.end = last.end.max(run.end),
            _ => merged.push(run),
        }
    }
    merged
}

/// The pages of `memory` present in memory or swapped out, from `/proc/self/pagemap`.
fn present_runs(memory: &RegionMemory) -> Result<Vec<Range<u64>>, SnapshotError> {
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
/// ever made. Ranges of `memory` that are inaccessible ([`RegionMemory::access`]: unplugged
/// blocks under a live slot) are never touched: they are written to the file as zeros (what
/// their discarded pages hold) and not loaded from it; the protection is held steady for the
/// call.
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
    let access = memory.access();
    for (part, accessible) in kvm_memslots::split_by(offset..offset + len, access.inaccessible()) {
        let file_at = at + (part.start - offset);
        let part_len = part.end - part.start;
        match (accessible, to_file) {
            (true, _) => transfer_run(file, memory, part.start, part_len, file_at, to_file)?,
            (false, true) => write_zeros(file, part_len, file_at)?,
            (false, false) => {}
        }
    }
    drop(access);
    Ok(())
}

/// Writes `len` zero bytes to `file` at `at`.
fn write_zeros(file: &File, len: u64, at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], at + done)?;
        done += n as u64;
    }
    Ok(())
}

/// [`transfer`] of a run that is all accessible (the caller holds the protection steady).
fn transfer_run(
    file: &File,
    memory: &RegionMemory,
    offset: u64,
    len: u64,
    at: u64,
    to_file: bool,
) -> std::io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let ptr = (memory.host_address() + offset + done) as *mut libc::c_void;
        let count = (len - done).min(1 << 30) as usize;
        let pos = (at + done) as libc::off_t;
        let n = if to_file {
            // SAFETY: `[ptr, ptr + count)` lies inside the region's mapping (asserted by
            // `transfer`), which `memory` keeps mapped for the call, and is accessible (the
            // caller holds the protection steady); the kernel only reads it.
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

/// A memory file written in slices ([`write_memory_file_sliced`], [`write_dirty_pages_sliced`]):
/// no write system call carries more than `bytes`, and `between` is asked each time another
/// `bytes` have been written, with the bytes written so far, before the next one. An error it
/// returns stops the write there ([`SnapshotError::Stopped`], with that reason): a caller
/// that must be able to give up (a cancel, a stop) waits for one slice at most, however slow
/// the file system is, rather than for the whole file.
pub struct Slices<'a> {
    /// The most a write system call carries (at least one page; a smaller figure is taken as
    /// one page).
    pub bytes: u64,
    /// Asked between slices with the bytes written so far; an error stops the write.
    pub between: &'a mut dyn FnMut(u64) -> Result<(), String>,
}

impl std::fmt::Debug for Slices<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slices")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// A memory file being written: the layout's regions as mapped in the manager, and the file,
/// sized to the layout; in slices, if asked.
struct Writer<'a, 's> {
    file: &'a File,
    /// The file, if it is on hugetlbfs: written through its mapping.
    hugetlbfs: Option<HugetlbfsFile<'a>>,
    layout: &'a MemoryLayout,
    regions: Vec<Arc<RegionMemory>>,
    stats: WriteStats,
    slices: Option<Slices<'s>>,
    /// Bytes written since `between` was last asked (or since the start).
    since: u64,
}

impl<'a, 's> Writer<'a, 's> {
    fn new<K: KvmMemory>(
        memory: &MemoryManager<K>,
        layout: &'a MemoryLayout,
        file: &'a File,
        slices: Option<Slices<'s>>,
    ) -> Result<Self, SnapshotError> {
        let regions = layout.mappings(memory)?;
        let hugetlbfs = if is_hugetlbfs(file)? {
            Some(HugetlbfsFile::new(file, layout.memory_file_size())?)
        } else {
            file.set_len(layout.memory_file_size())
                .map_err(io("sizing the memory file"))?;
            None
        };
        Ok(Writer {
            file,
            hugetlbfs,
            layout,
            regions,
            stats: WriteStats::default(),
            slices: slices.map(|s| Slices {
                bytes: s.bytes.max(PAGE_SIZE),
                between: s.between,
            }),
            since: 0,
        })
    }

    /// Writes `run` (byte offsets in the layout's region `index`) at its place in the file, in
    /// slices if asked.
    fn write(&mut self, index: usize, run: Range<u64>) -> Result<(), SnapshotError> {
        let (len, at) = (
            run.end - run.start,
            self.layout.regions[index].file_offset + run.start,
        );
        let mut done = 0;
        while done < len {
            let part = match self.slices.as_mut() {
                None => len,
                Some(slices) => {
                    if self.since >= slices.bytes {
                        (slices.between)(self.stats.bytes).map_err(SnapshotError::Stopped)?;
                        self.since = 0;
                    }
                    (len - done).min(slices.bytes - self.since)
                }
            };
            let memory = &self.regions[index];
            match self.hugetlbfs.as_mut() {
                Some(out) => out.write_memory(memory, run.start + done, part, at + done)?,
                None => transfer(self.file, memory, run.start + done, part, at + done, true)
                    .map_err(io(format!(
                        "writing {part} bytes at offset {:#x} of the memory file",
                        at + done
                    )))?,
            }
            done += part;
            self.since += part;
            self.stats.bytes += part;
        }
        self.stats.runs += 1;
        Ok(())
    }
}

/// A full snapshot of `memory`'s pages into `file` (created empty by the caller): the file is
/// sized to the layout, and every page that holds data is written at its offset; the rest are
/// holes. Pause the vCPUs first for a consistent image. On hugetlbfs, the layout's size must
/// be whole 2 MiB pages, every 2 MiB page with data takes a page of the hugetlb pool (refused,
/// naming the pool's free pages, when it has none) and holes are 2 MiB ones.
pub fn write_memory_file<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
) -> Result<WriteStats, SnapshotError> {
    full(Writer::new(memory, layout, file, None)?)
}

/// As [`write_memory_file`], in [`Slices`]: `slices.between` may stop it between two, and the
/// file then holds part of the snapshot (the caller removes it).
pub fn write_memory_file_sliced<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
    slices: Slices<'_>,
) -> Result<WriteStats, SnapshotError> {
    full(Writer::new(memory, layout, file, Some(slices))?)
}

/// Every page of the writer's regions that holds data.
fn full(mut out: Writer<'_, '_>) -> Result<WriteStats, SnapshotError> {
    let layout = out.layout;
    for index in 0..layout.regions.len() {
        for run in content_runs(&out.regions[index])? {
            out.write(index, run)?;
        }
    }
    Ok(out.stats)
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
/// harvested region the layout no longer has (removed since) has nothing to keep. Refused into
/// an empty file on hugetlbfs ([`SnapshotError::Unsupported`]): its files have no holes to
/// tell a Diff's pages by. Into a full file there (sized already: a live Full's later rounds
/// over its first), the pages are written as [`write_memory_file`] writes them.
pub fn write_dirty_pages<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    dirty: &[DirtyPages],
    file: &File,
) -> Result<WriteStats, SnapshotError> {
    refuse_new_diff(file, "the Diff's memory file")?;
    dirty_pages(Writer::new(memory, layout, file, None)?, dirty)
}

/// Refuses, before any page is written, a file that cannot hold a Diff
/// ([`SnapshotError::Unsupported`]: an empty file on hugetlbfs, whose files have no holes to
/// tell a Diff's pages by), as [`write_dirty_pages`] would once it starts: a caller that
/// writes a Diff later (a live one, after its rounds) refuses it up front.
pub fn check_diff_file(file: &File) -> Result<(), SnapshotError> {
    refuse_new_diff(file, "the Diff's memory file")
}

/// As [`write_dirty_pages`], in [`Slices`]: `slices.between` may stop it between two, and the
/// file then holds part of the Diff (the caller removes it).
pub fn write_dirty_pages_sliced<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    dirty: &[DirtyPages],
    file: &File,
    slices: Slices<'_>,
) -> Result<WriteStats, SnapshotError> {
    refuse_new_diff(file, "the Diff's memory file")?;
    dirty_pages(Writer::new(memory, layout, file, Some(slices))?, dirty)
}

/// The pages of `dirty`, through the writer.
fn dirty_pages(mut out: Writer<'_, '_>, dirty: &[DirtyPages]) -> Result<WriteStats, SnapshotError> {
    let layout = out.layout;
    for d in dirty {
        let Some(index) = layout.harvested_region(d) else {
            continue;
        };
        for run in d.ranges() {
            // From the harvest's own base: the region may have moved since.
            out.write(index, run.start - d.gpa.0..run.end - d.gpa.0)?;
        }
    }
    Ok(out.stats)
}

/// One layout region of a memory file being loaded: its mapping in the manager, its place in
/// the file, and the file's data runs inside it (byte offsets in the region; the rest are
/// holes).
pub(crate) struct RegionData {
    /// The region's mapping.
    pub(crate) memory: Arc<RegionMemory>,
    /// Where the region starts in the file.
    pub(crate) file_offset: u64,
    /// The file's data in the region, in order.
    pub(crate) data: Vec<Range<u64>>,
}

/// What loading `file` (a memory file of `layout`) into `memory` needs, region by region in
/// layout order. Refuses a file of another size than the layout's and a manager without the
/// layout's regions.
pub(crate) fn regions_with_data<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
) -> Result<Vec<RegionData>, SnapshotError> {
    let size = layout.check_file_size(file)?;
    let regions = layout.mappings(memory)?;
    let runs = file_data_runs(file, 0..size)?;
    Ok(layout
        .regions
        .iter()
        .zip(regions)
        .map(|(r, memory)| {
            // A run may span regions: cut it at their boundaries.
            let end = r.file_offset + r.size;
            let data = runs
                .iter()
                .filter(|run| run.start < end && r.file_offset < run.end)
                .map(|run| {
                    run.start.max(r.file_offset) - r.file_offset..run.end.min(end) - r.file_offset
                })
                .collect();
            RegionData {
                memory,
                file_offset: r.file_offset,
                data,
            }
        })
        .collect())
}

/// Copies the data of `file` (a memory file of `layout`) into `memory`'s regions, which
/// [`MemoryLayout::build`] made; holes are left as the fresh memory's zeros. Returns the bytes
/// copied. Load before any vCPU runs.
pub fn load_memory_file<K: KvmMemory>(
    memory: &MemoryManager<K>,
    layout: &MemoryLayout,
    file: &File,
) -> Result<u64, SnapshotError> {
    let mut loaded = 0;
    for region in regions_with_data(memory, layout, file)? {
        for run in &region.data {
            let (at, len) = (region.file_offset + run.start, run.end - run.start);
            transfer(file, &region.memory, run.start, len, at, false)
                .map_err(io(format!("reading the memory file at {at:#x}")))?;
            loaded += len;
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
/// reports every page first). Returns the bytes copied. `out` may be on hugetlbfs (as
/// [`write_memory_file`] says), the diffs may not ([`write_dirty_pages`]).
pub fn merge_snapshots(chain: &[(&MemoryLayout, &File)], out: &File) -> Result<u64, SnapshotError> {
    let Some((last, _)) = chain.last() else {
        return Err(SnapshotError::Format("no snapshot to merge".into()));
    };
    for (i, (_, diff)) in chain.iter().enumerate().skip(1) {
        refuse_diff(diff, &format!("snapshot {i} of the chain (a Diff)"))?;
    }
    let mut out = Out::new(
        out,
        last.memory_file_size(),
        "sizing the merged memory file",
    )?;
    let mut copied = 0;
    let mut buffer = vec![0u8; 1 << 20];
    for (layout, file) in chain {
        let size = layout.check_file_size(file)?;
        let runs = file_data_runs(file, 0..size)?;
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
                    out.write(&buffer[..n], target.file_offset + (at - from))
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
    layout.check_file_size(base)?;
    for (i, diff) in diffs.iter().enumerate() {
        refuse_diff(diff, &format!("diff {i}"))?;
    }
    let mut base = Out::new(base, layout.memory_file_size(), "sizing the base")?;
    let mut merged = 0;
    let mut buffer = vec![0u8; 1 << 20];
    for diff in diffs {
        let size = layout.check_file_size(diff)?;
        for run in file_data_runs(diff, 0..size)? {
            let mut at = run.start;
            while at < run.end {
                let n = ((run.end - at) as usize).min(buffer.len());
                diff.read_exact_at(&mut buffer[..n], at)
                    .map_err(io("reading a diff"))?;
                base.write(&buffer[..n], at)
                    .map_err(io("writing the base"))?;
                at += n as u64;
                merged += n as u64;
            }
        }
    }
    Ok(merged)
}

/// A merge's output: a file written with `pwrite`, or one on hugetlbfs through its mapping.
enum Out<'a> {
    Plain(&'a File),
    Hugetlbfs(HugetlbfsFile<'a>),
}

impl<'a> Out<'a> {
    /// `file`, sized to `size` bytes (`what` names that step in an error).
    fn new(file: &'a File, size: u64, what: &str) -> Result<Self, SnapshotError> {
        if is_hugetlbfs(file)? {
            return Ok(Out::Hugetlbfs(HugetlbfsFile::new(file, size)?));
        }
        file.set_len(size).map_err(io(what))?;
        Ok(Out::Plain(file))
    }

    /// Writes `buf` at `at`.
    fn write(&mut self, buf: &[u8], at: u64) -> std::io::Result<()> {
        match self {
            Out::Plain(file) => file.write_all_at(buf, at),
            Out::Hugetlbfs(file) => file.write(buf, at).map_err(std::io::Error::other),
        }
    }
}
