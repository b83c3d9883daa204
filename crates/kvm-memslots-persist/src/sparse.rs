//! Where a sparse file holds data: its data runs and holes, as the kernel reports them
//! (`SEEK_DATA` / `SEEK_HOLE`). Memory files are sparse (a page that holds no data is a hole),
//! so every reader of one asks here: writing, merging and loading memory files
//! ([`memory_file`](crate::memory_file)), and the lazy loader ([`uffd`](crate::uffd)), which
//! asks block by block on first fill.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

use crate::error::{io, SnapshotError};

/// The data runs of `file` (`SEEK_DATA` / `SEEK_HOLE`) inside `within`, as byte ranges (the
/// first and last may reach past it).
pub(crate) fn file_data_runs(
    file: &File,
    within: Range<u64>,
) -> Result<Vec<Range<u64>>, SnapshotError> {
    let fd = file.as_raw_fd();
    let mut runs = Vec::new();
    let too_large = |_| SnapshotError::Format("file too large".into());
    let mut at = i64::try_from(within.start).map_err(too_large)?;
    let size = i64::try_from(within.end).map_err(too_large)?;
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
        if data >= size {
            break; // The next data is past `within`.
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

/// Whether the memory file has data (not a hole) in the `len` bytes at `at` (a page, or a
/// block of pages): one `SEEK_DATA`, for a loader that looks block by block rather than mapping
/// every run up front. A block past the file's end is an error (the file was cut since it was
/// checked), not a hole.
pub(crate) fn range_has_data(file: &File, at: u64, len: u64) -> std::io::Result<bool> {
    let offset = i64::try_from(at).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: lseek only moves the file's offset (which nothing here reads from: every read
    // is a pread); no memory is involved.
    let data = unsafe { libc::lseek(file.as_raw_fd(), offset, libc::SEEK_DATA) };
    if data >= 0 {
        return Ok((data as u64) < at + len);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::ENXIO) {
        return Err(e);
    }
    // No data from `at` on: a hole, unless the file ends before the block does.
    let size = file.metadata()?.len();
    if at + len > size {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the memory file ends at {size:#x}, before the end of the {len:#x} bytes at \
                 {at:#x}: it was cut"
            ),
        ));
    }
    Ok(false)
}
