//! Memory files on hugetlbfs: a template that clones map privately in 2 MiB pages.
//!
//! hugetlbfs refuses `write`/`pwrite` and sizes its files in whole 2 MiB pages, so a memory
//! file there is written through a shared mapping of it instead ([`HugetlbfsFile`]). Each
//! 2 MiB page that gets data is first allocated with `fallocate`, which fails cleanly
//! (`ENOSPC`) when the hugetlb pool has no free page; the mapping itself is `MAP_NORESERVE`
//! (nothing reserved for the pages that stay holes) and is never touched on a page that
//! `fallocate` did not allocate, so no access can find the pool empty and raise `SIGBUS`.
//! Pages that get no data stay holes, at 2 MiB granularity: hugetlbfs reports every byte of
//! its files as data (`SEEK_DATA` sees no holes), so a reader of such a file reads its holes
//! as zeros, and a Diff, which says which pages it holds by its holes, cannot live there.

use std::fs::File;
use std::os::fd::AsRawFd;

use kvm_memslots::{hugetlb_pages_available, RegionMemory, HUGE_PAGE_SIZE};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory};

use crate::error::{io, SnapshotError};

/// Whether `file` is on hugetlbfs (2 MiB pages), where it must be written through a
/// [`HugetlbfsFile`].
pub(crate) fn is_hugetlbfs(file: &File) -> Result<bool, SnapshotError> {
    kvm_memslots::on_hugetlbfs(file).map_err(io("asking the memory file's file system (fstatfs)"))
}

/// Refuses a Diff's memory file (`what`) on hugetlbfs: a Diff holds the pages it has data
/// for and holes elsewhere, and hugetlbfs reports no holes.
pub(crate) fn refuse_diff(file: &File, what: &str) -> Result<(), SnapshotError> {
    if is_hugetlbfs(file)? {
        return Err(diff_on_hugetlbfs(what));
    }
    Ok(())
}

/// Refuses to start a Diff in `file` on hugetlbfs: an empty file there. Dirty pages written
/// into a file that has its size already (a live Full's later rounds, over its first) are a
/// full file's, which hugetlbfs keeps.
pub(crate) fn refuse_new_diff(file: &File, what: &str) -> Result<(), SnapshotError> {
    let empty = || -> Result<bool, SnapshotError> {
        Ok(file
            .metadata()
            .map_err(io("reading the memory file's size"))?
            .len()
            == 0)
    };
    if is_hugetlbfs(file)? && empty()? {
        return Err(diff_on_hugetlbfs(what));
    }
    Ok(())
}

fn diff_on_hugetlbfs(what: &str) -> SnapshotError {
    SnapshotError::Unsupported(format!(
        "{what} is on hugetlbfs: a Diff says which pages it holds by the file's holes, and \
         hugetlbfs reports none (every byte of its files reads as data); write Diffs to \
         another file system and merge the chain into a file on hugetlbfs"
    ))
}

/// A memory file on hugetlbfs being written: sized to whole 2 MiB pages and mapped shared,
/// each page allocated (`fallocate`) before its first byte is written.
pub(crate) struct HugetlbfsFile<'a> {
    file: &'a File,
    /// The whole file, shared and `MAP_NORESERVE`; `None` for an empty file.
    mapping: Option<MmapRegion<()>>,
    /// Per 2 MiB page of the file: allocated by this writer.
    allocated: Vec<bool>,
    /// The file was empty: a page this writer did not allocate is a hole.
    fresh: bool,
}

impl<'a> HugetlbfsFile<'a> {
    /// Sizes `file` (on hugetlbfs) to `size` bytes, which must be whole 2 MiB pages, and maps
    /// it. Pages of a file that was empty are known to be holes; those of one that had data
    /// may hold some, so they are written over, zeros included (each allocated first all the
    /// same: `fallocate` of a page the file has already is a no-op).
    pub(crate) fn new(file: &'a File, size: u64) -> Result<Self, SnapshotError> {
        if !size.is_multiple_of(HUGE_PAGE_SIZE) {
            return Err(SnapshotError::Unsupported(format!(
                "the memory file is on hugetlbfs, whose files are whole 2 MiB pages, and the \
                 layout's {size:#x} bytes are not: put every region on the 2 MiB grid (or \
                 write the file to another file system)"
            )));
        }
        let before = file
            .metadata()
            .map_err(io("reading the memory file's size"))?
            .len();
        file.set_len(size)
            .map_err(io("sizing the memory file on hugetlbfs"))?;
        let len = usize::try_from(size)
            .map_err(|_| SnapshotError::Unsupported(format!("a memory file of {size:#x} bytes")))?;
        let mapping = if len == 0 {
            None
        } else {
            let dup = file
                .try_clone()
                .map_err(io("duplicating the memory file"))?;
            let mapping = MmapRegionBuilder::<()>::new(len)
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
                .with_file_offset(FileOffset::new(dup, 0))
                .with_hugetlbfs(true)
                .build()
                .map_err(|e| {
                    io("mapping the memory file on hugetlbfs")(std::io::Error::other(e))
                })?;
            Some(mapping)
        };
        Ok(HugetlbfsFile {
            file,
            mapping,
            allocated: vec![false; (size / HUGE_PAGE_SIZE) as usize],
            fresh: before == 0,
        })
    }

    /// Writes `buf` at `at`. A buffer of zeros over pages that are holes (of a file that was
    /// empty) is not written: they read zeros already, and stay holes.
    pub(crate) fn write(&mut self, buf: &[u8], at: u64) -> Result<(), SnapshotError> {
        let end = at + buf.len() as u64;
        let pages = at / HUGE_PAGE_SIZE..end.div_ceil(HUGE_PAGE_SIZE);
        let holes = self.fresh && pages.clone().all(|p| !self.allocated[p as usize]);
        if buf.is_empty() || (holes && buf.iter().all(|b| *b == 0)) {
            return Ok(());
        }
        for page in pages {
            if !self.allocated[page as usize] {
                self.allocate(page)?;
            }
        }
        let mapping = self
            .mapping
            .as_ref()
            .expect("a file with pages to write is mapped");
        let slice = mapping
            .get_slice(at as usize, buf.len())
            .map_err(|e| SnapshotError::Format(format!("a write outside the memory file: {e}")))?;
        slice.copy_from(buf);
        Ok(())
    }

    /// Copies `len` bytes of guest memory at `offset` in `memory` to `at`, with volatile reads
    /// (the guest may be running: a live snapshot), through a buffer of one huge page.
    pub(crate) fn write_memory(
        &mut self,
        memory: &RegionMemory,
        offset: u64,
        len: u64,
        at: u64,
    ) -> Result<(), SnapshotError> {
        let mut buffer = vec![0u8; len.min(HUGE_PAGE_SIZE) as usize];
        let mut done = 0;
        while done < len {
            // Up to the next huge page boundary of the file, so a buffer of zeros that covers
            // a whole hole is seen as one.
            let to_boundary = HUGE_PAGE_SIZE - (at + done) % HUGE_PAGE_SIZE;
            let n = (len - done).min(to_boundary).min(buffer.len() as u64) as usize;
            memory
                .read_volatile(offset + done, &mut buffer[..n])
                .map_err(|e| SnapshotError::Format(format!("reading guest memory: {e}")))?;
            self.write(&buffer[..n], at + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// Allocates the file's 2 MiB page `page` from the hugetlb pool.
    fn allocate(&mut self, page: u64) -> Result<(), SnapshotError> {
        let at = page * HUGE_PAGE_SIZE;
        // SAFETY: fallocate only allocates blocks of the file behind the descriptor, which
        // `self.file` keeps open for the call; no memory of this process is involved.
        let done = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                0,
                at as libc::off_t,
                HUGE_PAGE_SIZE as libc::off_t,
            )
        };
        if done != 0 {
            let e = std::io::Error::last_os_error();
            let what = if e.raw_os_error() == Some(libc::ENOSPC) {
                format!(
                    "allocating the memory file's 2 MiB page at {at:#x} on hugetlbfs (the \
                     hugetlb pool has {} free, unreserved pages; reserve more in \
                     /proc/sys/vm/nr_hugepages, or write the file elsewhere)",
                    hugetlb_pages_available()
                )
            } else {
                format!("allocating the memory file's 2 MiB page at {at:#x} on hugetlbfs")
            };
            return Err(io(what)(e));
        }
        self.allocated[page as usize] = true;
        Ok(())
    }
}
