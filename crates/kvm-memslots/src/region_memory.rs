//! A region's host memory: its id, what backs it (anonymous memory, a memfd, a file), the size
//! of its pages, and its one mapping ([`RegionMemory`]), with the ranges the guest must not
//! reach and the bitmap of the VMM's own writes.

use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{RwLock, RwLockReadGuard};

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::guest_memory::Error as GuestMemoryError;
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{FileOffset, MmapRegion, VolatileMemory};

use crate::PAGE_SIZE;

/// A region's id, unique for the manager's lifetime (never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub u64);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What memory backs a region.
#[derive(Debug, Clone)]
pub enum Backing {
    /// Private anonymous memory, reserved lazily (`MAP_NORESERVE`): pages cost host memory
    /// only once touched. Discarded pages read back as zeros.
    Anonymous,
    /// A new memfd, mapped shared: the memory can be handed to another process (vhost-user).
    /// Discarding frees the memfd's pages (`MADV_REMOVE`).
    Memfd,
    /// A file (or memfd) the caller opened, mapped shared from the given offset.
    File(FileOffset),
    /// A file mapped privately (copy-on-write) from the given offset: pages load from the file
    /// (through the page cache) when first touched, and writes never reach it. A snapshot's
    /// memory file restores this way. Discarded pages read back as zeros.
    PrivateFile(FileOffset),
}

impl Backing {
    /// A word for the kind of backing, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Backing::Anonymous => "anonymous",
            Backing::Memfd => "memfd",
            Backing::File(_) => "file",
            Backing::PrivateFile(_) => "private file",
        }
    }
}

/// The size of the host pages behind a region, chosen per region
/// ([`RegionSpec::with_page_size`](crate::RegionSpec::with_page_size)).
///
/// Whatever the page size, dirty logs, harvests and the VMM's write bitmap count 4 KiB pages
/// (KVM logs a huge mapping's writes at 4 KiB); what changes is how the host backs the memory
/// and which addresses and sizes are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageSize {
    /// The host's base pages (4 KiB).
    #[default]
    Base,
    /// 2 MiB pages from the host's hugetlb pool: anonymous memory is mapped `MAP_HUGETLB`, a
    /// memfd is made `MFD_HUGETLB`, and a file (shared or private) must be on a hugetlbfs
    /// mount of 2 MiB pages. The guest address, the size, the slot size and every slot and
    /// discard boundary must be multiples of 2 MiB; the pool must hold the region's pages
    /// when it is added (the mapping reserves them: no page fault can find the pool empty).
    Huge2M,
    /// Transparent huge pages: base-page anonymous memory or memfd that the kernel may back
    /// with 2 MiB pages (`madvise(MADV_HUGEPAGE)`; for a memfd only where the host's
    /// `shmem_enabled` allows it). Accepts what [`PageSize::Base`] accepts. A caller's file
    /// takes them only shared and on tmpfs (a memfd another process handed over, say): a
    /// private file mapping has none.
    Transparent,
}

/// 2 MiB: the size of a huge page.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

impl PageSize {
    /// The unit addresses and sizes of the region must be multiples of: 2 MiB for hugetlb
    /// pages, 4 KiB otherwise.
    pub fn alignment(self) -> u64 {
        match self {
            PageSize::Huge2M => HUGE_PAGE_SIZE,
            PageSize::Base | PageSize::Transparent => PAGE_SIZE,
        }
    }

    /// A word for the page size, for messages and reports.
    pub fn name(self) -> &'static str {
        match self {
            PageSize::Base => "4k",
            PageSize::Huge2M => "2m",
            PageSize::Transparent => "thp",
        }
    }

    /// Whether memory of `backing` can have this page size: transparent huge pages are for
    /// anonymous memory and memfds, not a private file mapping (a shared one must be of a
    /// file on tmpfs, which the mapping checks).
    pub fn fits(self, backing: &Backing) -> bool {
        !(self == PageSize::Transparent && matches!(backing, Backing::PrivateFile(_)))
    }
}

/// Why a region's memory could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    /// `memfd_create` or sizing the memfd failed.
    #[error("creating a memfd of {size:#x} bytes failed: {source}")]
    Memfd {
        /// Requested size.
        size: u64,
        /// The system's error.
        source: std::io::Error,
    },
    /// The host had no memory for the region's write bitmap.
    #[error("out of host memory for the region's write bitmap ({bytes} bytes)")]
    Bitmap {
        /// The bitmap's size.
        bytes: u64,
    },
    /// A file given for 2 MiB pages is not on a hugetlbfs mount of 2 MiB pages.
    #[error("the file for 2 MiB pages is not on a hugetlbfs mount of 2 MiB pages ({found})")]
    NotHugetlbfs {
        /// What the file's file system is: another file system, or hugetlbfs of another
        /// page size.
        found: String,
    },
    /// A file given for transparent huge pages is not on tmpfs (a memfd is).
    #[error("the file for transparent huge pages is not on tmpfs, as a memfd is ({found})")]
    NotShmem {
        /// What the file's file system is.
        found: String,
    },
    /// `madvise(MADV_HUGEPAGE)` failed.
    #[error("asking for transparent huge pages (MADV_HUGEPAGE) failed: {source}")]
    Transparent {
        /// The system's error.
        source: std::io::Error,
    },
    /// `mmap` failed.
    #[error("mapping {size:#x} bytes of {backing} memory failed: {source}")]
    Mmap {
        /// Requested size.
        size: u64,
        /// The kind of backing asked for.
        backing: &'static str,
        /// vm-memory's error.
        source: MmapRegionError,
    },
}

/// The host memory of one region: one mapping, with a bitmap of the pages the VMM itself
/// writes through vm-memory's `Bytes` (KVM's dirty log sees only the guest's writes).
///
/// The mapping is unmapped when the last `Arc` to it goes; the manager keeps one for as long as
/// KVM has a slot in it.
pub struct RegionMemory {
    pub(crate) mapping: MmapRegion<AtomicBitmap>,
    page_size: PageSize,
    shared: bool,
    /// A private mapping of a file: discarding a page must replace it with a zero page, since
    /// dropping it would bring the file's page back.
    private_file: bool,
    /// The byte ranges of the mapping that are protected `PROT_NONE` (ascending, disjoint,
    /// page-aligned): memory the guest must not reach (an unplugged block under a live slot).
    /// The host's readers see zeros there (whoever made them unreachable gives the pages back
    /// too). Readers of the mapping hold the read lock while they copy, and copy zeros for
    /// these ranges instead of touching them; the manager changes the protection under the
    /// write lock only.
    inaccessible: RwLock<Vec<Range<u64>>>,
    /// Whether `inaccessible` lists any range (set under its write lock): what lets
    /// vm-memory's accesses to a region that never had one skip the lock.
    any_inaccessible: AtomicBool,
}

impl fmt::Debug for RegionMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionMemory")
            .field("host_address", &format_args!("{:#x}", self.host_address()))
            .field("size", &format_args!("{:#x}", self.size()))
            .field("shared", &self.shared)
            .field("page_size", &self.page_size)
            .finish()
    }
}

impl RegionMemory {
    /// Maps `size` bytes (a multiple of `page_size`'s [alignment](PageSize::alignment)) of
    /// `backing` in pages of `page_size`.
    pub fn new(size: u64, backing: &Backing, page_size: PageSize) -> Result<Self, MappingError> {
        let len = usize::try_from(size).map_err(|_| MappingError::Mmap {
            size,
            backing: backing.kind(),
            source: MmapRegionError::InvalidOffsetLength,
        })?;
        let hugetlb = page_size == PageSize::Huge2M;
        let file = match backing {
            Backing::Anonymous => None,
            Backing::Memfd => Some(FileOffset::new(new_memfd(size, hugetlb)?, 0)),
            Backing::File(fo) | Backing::PrivateFile(fo) => {
                if hugetlb {
                    check_hugetlbfs(fo.file())?;
                }
                if page_size == PageSize::Transparent {
                    check_shmem(fo.file())?;
                }
                Some(fo.clone())
            }
        };
        let private_file = matches!(backing, Backing::PrivateFile(_));
        let shared = file.is_some() && !private_file;
        let sharing = match (&file, shared) {
            (_, true) => libc::MAP_SHARED,
            (Some(_), false) => libc::MAP_PRIVATE,
            (None, _) => libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        };
        // vm-memory allocates the bitmap of the VMM's writes without a way to fail: make sure
        // the host has room for it first, so that a failure is an error, never an abort.
        let words = len.div_ceil(PAGE_SIZE as usize).div_ceil(64);
        Vec::<u64>::new()
            .try_reserve_exact(words)
            .map_err(|_| MappingError::Bitmap {
                bytes: words as u64 * 8,
            })?;
        let bitmap_page = std::num::NonZeroUsize::new(PAGE_SIZE as usize).expect("not zero");
        // Base pages are reserved lazily. Hugetlb pages are not: the mapping reserves them in
        // the pool now (or fails), so that no fault of the guest's can find the pool empty.
        let flags = match (hugetlb, &file) {
            (true, None) => sharing | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
            (true, Some(_)) => sharing,
            (false, _) => sharing | libc::MAP_NORESERVE,
        };
        let mut builder =
            MmapRegionBuilder::new_with_bitmap(len, AtomicBitmap::new(len, bitmap_page))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(flags)
                .with_hugetlbfs(hugetlb);
        if let Some(fo) = file {
            builder = builder.with_file_offset(fo);
        }
        let mapping = builder.build().map_err(|source| MappingError::Mmap {
            size,
            backing: backing.kind(),
            source,
        })?;
        if page_size == PageSize::Transparent {
            // SAFETY: the range is exactly the mapping just made, which `mapping` owns; the
            // advice changes how the kernel backs it, never its contents.
            let advised = unsafe {
                libc::madvise(
                    mapping.as_ptr().cast::<libc::c_void>(),
                    len,
                    libc::MADV_HUGEPAGE,
                )
            };
            if advised != 0 {
                return Err(MappingError::Transparent {
                    source: std::io::Error::last_os_error(),
                });
            }
        }
        Ok(RegionMemory {
            mapping,
            page_size,
            shared,
            private_file,
            inaccessible: RwLock::new(Vec::new()),
            any_inaccessible: AtomicBool::new(false),
        })
    }

    /// The size of the host pages behind the memory.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// Host address of the first byte.
    pub fn host_address(&self) -> u64 {
        self.mapping.as_ptr() as u64
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.mapping.size() as u64
    }

    /// Whether the mapping is shared (file or memfd backed) rather than private.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Whether the mapping is a private (copy-on-write) mapping of a file.
    pub fn is_private_file(&self) -> bool {
        self.private_file
    }

    /// Copies `buf.len()` bytes from `offset` with volatile reads (the guest may be writing),
    /// without marking anything dirty. Inaccessible ranges ([`inaccessible`](Self::inaccessible))
    /// read as zeros and are never touched, so that a protection change cannot fault the
    /// reader.
    pub fn read_volatile(&self, offset: u64, buf: &mut [u8]) -> Result<(), GuestMemoryError> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|end| *end <= self.size())
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        let access = self.access();
        for (part, accessible) in split_by(offset..end, access.inaccessible()) {
            let into = &mut buf[(part.start - offset) as usize..(part.end - offset) as usize];
            if !accessible {
                into.fill(0);
                continue;
            }
            let slice = self
                .mapping
                .get_slice(part.start as usize, into.len())
                .map_err(|_| GuestMemoryError::InvalidBackendAddress)?;
            slice.copy_to(into);
        }
        Ok(())
    }

    /// The byte ranges protected `PROT_NONE` now (see [`access`](Self::access)).
    pub fn inaccessible(&self) -> Vec<Range<u64>> {
        self.access().inaccessible().to_vec()
    }

    /// A hold on the mapping's protection: while it is held, no range changes between
    /// accessible and inaccessible, so a reader that touches the mapping through a raw pointer
    /// (`pwrite` from it, `pread` into it, a `UFFDIO_COPY`) can skip the inaccessible ranges
    /// it names and touch the rest safely. Hold it only for the copy: a plug or an unplug
    /// waits for it.
    pub fn access(&self) -> Access<'_> {
        Access(self.inaccessible.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Makes `range` (page-aligned, inside the mapping) inaccessible, `mprotect(PROT_NONE)`,
    /// or accessible again, `mprotect(PROT_READ | PROT_WRITE)`, under the write lock of
    /// [`access`](Self::access): no reader copies from the range meanwhile. The pages keep
    /// their contents: a caller that gives them back discards them once they are protected.
    pub(crate) fn set_accessible(
        &self,
        range: Range<u64>,
        accessible: bool,
    ) -> std::io::Result<()> {
        let mut inaccessible = self.inaccessible.write().unwrap_or_else(|e| e.into_inner());
        if range.end > self.size() || range.start >= range.end {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        let prot = if accessible {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_NONE
        };
        let hva = self.host_address() + range.start;
        // SAFETY: `[hva, hva + len)` lies inside the mapping (checked above), which `self` owns
        // and keeps mapped. Guest memory is only reached through volatile accesses and raw
        // pointers, never Rust references; the host's own readers go through `access`, whose
        // lock this function holds for writing, and skip inaccessible ranges.
        let ret = unsafe {
            libc::mprotect(
                hva as *mut libc::c_void,
                (range.end - range.start) as usize,
                prot,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::last_os_error());
        }
        *inaccessible = with_range(&inaccessible, range, !accessible);
        self.any_inaccessible
            .store(!inaccessible.is_empty(), Ordering::Release);
        Ok(())
    }

    /// Whether `range` holds no inaccessible byte now: a check for vm-memory's accesses, not
    /// held across them (a region that never had an inaccessible range answers without the
    /// lock).
    pub(crate) fn is_accessible_now(&self, range: Range<u64>) -> bool {
        !self.any_inaccessible.load(Ordering::Acquire) || self.access().is_accessible(range)
    }

    /// The bitmap of the pages the VMM itself wrote through vm-memory.
    pub fn vmm_dirty_bitmap(&self) -> &AtomicBitmap {
        self.mapping.bitmap()
    }

    /// The file and offset behind the mapping, if any.
    pub fn file_offset(&self) -> Option<&FileOffset> {
        self.mapping.file_offset()
    }
}

/// A read hold on a mapping's protection ([`RegionMemory::access`]).
#[derive(Debug)]
pub struct Access<'a>(RwLockReadGuard<'a, Vec<Range<u64>>>);

impl Access<'_> {
    /// The inaccessible byte ranges (ascending, disjoint, page-aligned).
    pub fn inaccessible(&self) -> &[Range<u64>] {
        &self.0
    }

    /// Whether `range` holds no inaccessible byte.
    pub fn is_accessible(&self, range: Range<u64>) -> bool {
        !self
            .0
            .iter()
            .any(|r| r.start < range.end && range.start < r.end)
    }
}

/// `range` cut at the edges of `inaccessible` (ascending, disjoint): its parts in order, each
/// with whether it is accessible.
///
/// ```
/// use kvm_memslots::split_by;
///
/// assert_eq!(
///     split_by(0..10, &[2..4, 8..12]),
///     vec![(0..2, true), (2..4, false), (4..8, true), (8..10, false)]
/// );
/// ```
pub fn split_by(range: Range<u64>, inaccessible: &[Range<u64>]) -> Vec<(Range<u64>, bool)> {
    let mut parts = Vec::new();
    let mut at = range.start;
    for r in inaccessible {
        if r.end <= at || at >= range.end {
            continue;
        }
        if r.start >= range.end {
            break;
        }
        if r.start > at {
            parts.push((at..r.start, true));
        }
        let end = r.end.min(range.end);
        parts.push((at.max(r.start)..end, false));
        at = end;
    }
    if at < range.end {
        parts.push((at..range.end, true));
    }
    parts
}

/// `ranges` (ascending, disjoint) with `range` added (`set`) or taken out, merged.
pub(crate) fn with_range(ranges: &[Range<u64>], range: Range<u64>, set: bool) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len() + 1);
    let mut push = |r: Range<u64>| {
        if r.start >= r.end {
            return;
        }
        match out.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    };
    let mut placed = !set;
    for r in ranges {
        if set && !placed && range.start <= r.start {
            push(range.clone());
            placed = true;
        }
        if set {
            push(r.clone());
        } else {
            push(r.start..r.end.min(range.start));
            push(r.start.max(range.end)..r.end);
        }
    }
    if !placed {
        push(range);
    }
    out
}

fn new_memfd(size: u64, hugetlb: bool) -> Result<File, MappingError> {
    let fail = |source| MappingError::Memfd { size, source };
    let flags = if hugetlb {
        libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB
    } else {
        libc::MFD_CLOEXEC
    };
    // SAFETY: the name is a valid NUL-terminated string; the call has no other input.
    let fd = unsafe { libc::memfd_create(c"kvm-memslots-guest".as_ptr(), flags) };
    if fd < 0 {
        return Err(fail(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(fail)?;
    Ok(file)
}

/// Checks that `file` is on hugetlbfs with 2 MiB pages.
fn check_hugetlbfs(file: &File) -> Result<(), MappingError> {
    match file_system(file) {
        Err(e) => Err(MappingError::NotHugetlbfs {
            found: format!("fstatfs failed: {e}"),
        }),
        Ok(FileSystem::Hugetlbfs2M) => Ok(()),
        Ok(FileSystem::Hugetlbfs { page_size }) => Err(MappingError::NotHugetlbfs {
            found: format!("hugetlbfs of {} KiB pages", page_size / 1024),
        }),
        Ok(FileSystem::Tmpfs) => Err(MappingError::NotHugetlbfs {
            found: "tmpfs".to_owned(),
        }),
        Ok(FileSystem::Other { magic }) => Err(MappingError::NotHugetlbfs {
            found: format!("file system type {magic:#x}"),
        }),
    }
}

/// Checks that `file` is on tmpfs (shmem: a memfd, or a file of a tmpfs mount), where a
/// shared mapping can have transparent huge pages.
fn check_shmem(file: &File) -> Result<(), MappingError> {
    match file_system(file) {
        Ok(FileSystem::Tmpfs) => Ok(()),
        Ok(FileSystem::Hugetlbfs2M | FileSystem::Hugetlbfs { .. }) => Err(MappingError::NotShmem {
            found: "hugetlbfs".to_owned(),
        }),
        Ok(FileSystem::Other { magic }) => Err(MappingError::NotShmem {
            found: format!("file system type {magic:#x}"),
        }),
        Err(e) => Err(MappingError::NotShmem {
            found: format!("fstatfs failed: {e}"),
        }),
    }
}

/// Whether `file` is on a hugetlbfs mount of 2 MiB pages (a memfd made `MFD_HUGETLB` is too),
/// which a mapping of it gets whatever it asks for, and which refuses `write`s: its pages are
/// written through a shared mapping.
pub fn on_hugetlbfs(file: &File) -> std::io::Result<bool> {
    Ok(file_system(file)? == FileSystem::Hugetlbfs2M)
}

/// What `fstatfs` says of a file's file system, as far as page sizes go.
#[derive(Debug, PartialEq, Eq)]
enum FileSystem {
    /// hugetlbfs of 2 MiB pages.
    Hugetlbfs2M,
    /// hugetlbfs of pages of another size.
    Hugetlbfs { page_size: u64 },
    /// tmpfs (shmem), where memfds live.
    Tmpfs,
    /// Any other file system, by its `f_type`.
    Other { magic: i64 },
}

fn file_system(file: &File) -> std::io::Result<FileSystem> {
    use std::os::fd::AsRawFd;
    /// hugetlbfs's `f_type` (linux/magic.h).
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    /// tmpfs's `f_type` (linux/magic.h).
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // SAFETY: an all-zero `statfs` is a valid value of the plain C struct.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `file` owns an open descriptor for the call; `fs` is a valid, writable statfs.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's type differs between C libraries.
    let magic = fs.f_type as i64;
    #[allow(clippy::unnecessary_cast)]
    let block = fs.f_bsize as u64;
    Ok(match (magic, block) {
        (HUGETLBFS_MAGIC, HUGE_PAGE_SIZE) => FileSystem::Hugetlbfs2M,
        (HUGETLBFS_MAGIC, page_size) => FileSystem::Hugetlbfs { page_size },
        (TMPFS_MAGIC, _) => FileSystem::Tmpfs,
        (magic, _) => FileSystem::Other { magic },
    })
}

/// The hugetlb pool's 2 MiB pages that are neither in use nor promised to a mapping
/// (`free_hugepages - resv_hugepages`); 0 where the host has no such pool.
pub fn hugetlb_pages_available() -> u64 {
    let read = |name: &str| -> u64 {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{name}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    read("free_hugepages").saturating_sub(read("resv_hugepages"))
}
