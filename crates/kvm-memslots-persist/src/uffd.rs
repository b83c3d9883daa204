//! Lazy restore with userfaultfd: a snapshot's regions are fresh anonymous memory registered
//! for missing-page faults, and a handler thread fills each page the first time anything
//! touches it (a vCPU through KVM, or the VMM), from the memory file (`UFFDIO_COPY`) or, for a
//! hole, with zeros (`UFFDIO_ZEROPAGE`). Nothing is read up front.
//!
//! A discarded page reads zeros afterwards, as a discard promises, whether the handler had
//! filled it or not: the loader asks for `UFFD_FEATURE_EVENT_REMOVE`, so a discard of
//! registered memory (`MADV_DONTNEED`, `MADV_REMOVE`) first tells the handler its range, which
//! the handler then treats as filled (and a page filled once that faults again is one that was
//! discarded since). The discard waits until the handler has read the event, and the handler
//! serves events in order, so no fault after the discard is served before it. libc has only
//! the system call's number, so the ioctl structures are declared here from the kernel's
//! `include/uapi/linux/userfaultfd.h`.
//!
//! # Example
//!
//! A snapshot restored lazily: nothing is read until the first touch (here the VMM's own read;
//! a vCPU's access through KVM faults the same way). Needs userfaultfd (Linux 4.3+, and root or
//! `vm.unprivileged_userfaultfd`).
//!
//! ```
//! use kvm_memslots::testing::FakeKvm;
//! use kvm_memslots::{MemoryManager, RegionSpec};
//! use kvm_memslots_persist::{write_memory_file, LazyLoader, MemoryLayout};
//! use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
//!
//! let vm = MemoryManager::new(FakeKvm::new(64, true));
//! vm.add_region(RegionSpec::new(GuestAddress(0), 2 << 20))?;
//! vm.handle().memory().write_obj(7u64, GuestAddress(0x1000))?;
//! let layout = MemoryLayout::of(&vm);
//! # let path = std::env::temp_dir().join(format!("kvm-memslots-persist-uffd-doc-{}", std::process::id()));
//! # let memory_file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
//! # std::fs::remove_file(&path)?;
//! write_memory_file(&vm, &layout, &memory_file)?;
//!
//! let restored = MemoryManager::new(FakeKvm::new(64, true));
//! layout.build(&restored)?;
//! let loader = LazyLoader::start(&restored, &layout, &memory_file)?;
//! assert_eq!(restored.handle().memory().read_obj::<u64>(GuestAddress(0x1000))?, 7);
//! drop(loader);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::ioctl_with_mut_ref;

use kvm_memslots::{KvmMemory, MemoryManager, RegionMemory, PAGE_SIZE};

use crate::error::SnapshotError;
use crate::layout::MemoryLayout;
use crate::memory_file::regions_with_data;

const UFFDIO: u32 = 0xAA;
const UFFD_API: u64 = 0xAA;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

/// The ioctl numbers (the macros make public functions: kept in a private module).
mod nr {
    use super::{UffdioApi, UffdioCopy, UffdioRange, UffdioRegister, UffdioZeropage, UFFDIO};
    use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

    ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, UffdioApi);
    ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, UffdioRegister);
    ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, UffdioRange);
    ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
    ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);
}
use nr::{UFFDIO_API, UFFDIO_COPY, UFFDIO_REGISTER, UFFDIO_UNREGISTER, UFFDIO_ZEROPAGE};

/// One registered region: its mapping, its place in the file, the file's data runs in it, and
/// the pages filled so far (a later fault there follows a discard: zeros).
struct Lazy {
    memory: Arc<RegionMemory>,
    file_offset: u64,
    data: Vec<std::ops::Range<u64>>,
    filled: Vec<AtomicU64>,
}

impl Lazy {
    fn holds(&self, hva: u64) -> bool {
        let base = self.memory.host_address();
        hva >= base && hva - base < self.memory.size()
    }

    /// Marks page `page` filled; whether it was filled before.
    fn fill(&self, page: u64) -> bool {
        let bit = 1 << (page % 64);
        self.filled[(page / 64) as usize].fetch_or(bit, Ordering::AcqRel) & bit != 0
    }

    /// Marks the pages of host range `[start, end)` (clipped to the region) filled: they were
    /// discarded, so they read zeros from now on.
    fn discarded(&self, start: u64, end: u64) {
        let base = self.memory.host_address();
        let first = start.max(base) - base;
        let last = end.min(base + self.memory.size()).saturating_sub(base);
        for page in first / PAGE_SIZE..last.div_ceil(PAGE_SIZE) {
            self.fill(page);
        }
    }

    fn has_data(&self, offset: u64) -> bool {
        let at = self.data.partition_point(|r| r.end <= offset);
        self.data.get(at).is_some_and(|r| r.start <= offset)
    }
}

/// The handler of a lazily restored manager's page faults; stops (and unregisters the
/// memory) when dropped. Keep it as long as the VM runs.
#[derive(Debug)]
pub struct LazyLoader {
    uffd: Arc<OwnedFd>,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<LoaderStats>,
    ranges: Vec<UffdioRangeDebug>,
}

#[derive(Debug, Clone, Copy)]
struct UffdioRangeDebug {
    start: u64,
    len: u64,
}

/// What the handler did.
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Pages filled from the file (counted before the faulting thread is woken).
    pub copied: AtomicU64,
    /// Pages filled with zeros (holes, or pages discarded after their first fill).
    pub zeroed: AtomicU64,
    /// Set when the handler met an error it could not serve a fault past (it stops; the
    /// faulting thread then waits for ever, so this is also printed).
    pub failed: AtomicBool,
}

fn os_error(what: &str) -> SnapshotError {
    SnapshotError::Io {
        what: what.into(),
        source: std::io::Error::last_os_error(),
    }
}

impl LazyLoader {
    /// Registers every region of `layout` in `memory` (built with [`MemoryLayout::build`]:
    /// anonymous or memfd) for missing-page faults and starts the handler that fills them from
    /// `memory_file`.
    pub fn start<K: KvmMemory>(
        memory: &MemoryManager<K>,
        layout: &MemoryLayout,
        memory_file: &File,
    ) -> Result<Self, SnapshotError> {
        let regions = regions_with_data(memory, layout, memory_file)?;
        // SAFETY: userfaultfd(2) takes flags only and returns a new descriptor or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(os_error("userfaultfd"));
        }
        // SAFETY: `fd` is a new descriptor this function owns from here on.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_EVENT_REMOVE,
            ..Default::default()
        };
        // SAFETY: UFFDIO_API on a userfaultfd with a valid `uffdio_api`, which outlives the call.
        if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_API(), &mut api) } < 0 {
            return Err(os_error("UFFDIO_API"));
        }
        let mut lazies = Vec::with_capacity(regions.len());
        let mut ranges = Vec::with_capacity(regions.len());
        for region in regions {
            let mut register = UffdioRegister {
                range: UffdioRange {
                    start: region.memory.host_address(),
                    len: region.memory.size(),
                },
                mode: UFFDIO_REGISTER_MODE_MISSING,
                ioctls: 0,
            };
            // SAFETY: UFFDIO_REGISTER with a valid structure naming the region's own mapping,
            // which `region.memory` keeps mapped; faults there now wait for this loader.
            if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_REGISTER(), &mut register) } < 0 {
                return Err(os_error("UFFDIO_REGISTER"));
            }
            ranges.push(UffdioRangeDebug {
                start: register.range.start,
                len: register.range.len,
            });
            let pages = region.memory.size() / PAGE_SIZE;
            lazies.push(Lazy {
                memory: region.memory,
                file_offset: region.file_offset,
                data: region.data,
                filled: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            });
        }
        let uffd = Arc::new(uffd);
        let stop =
            Arc::new(
                EventFd::new(libc::EFD_NONBLOCK).map_err(|source| SnapshotError::Io {
                    what: "an eventfd for the fault handler".into(),
                    source,
                })?,
            );
        let stats = Arc::new(LoaderStats::default());
        let file = memory_file
            .try_clone()
            .map_err(|source| SnapshotError::Io {
                what: "duplicating the memory file".into(),
                source,
            })?;
        let thread = {
            let (uffd, stop, stats) = (Arc::clone(&uffd), Arc::clone(&stop), Arc::clone(&stats));
            std::thread::Builder::new()
                .name("uffd".into())
                .spawn(move || serve(&uffd, &stop, &stats, &lazies, &file))
                .map_err(|source| SnapshotError::Io {
                    what: "starting the fault handler".into(),
                    source,
                })?
        };
        Ok(LazyLoader {
            uffd,
            stop,
            thread: Some(thread),
            stats,
            ranges,
        })
    }

    /// What the handler did so far.
    pub fn stats(&self) -> &LoaderStats {
        &self.stats
    }
}

impl Drop for LazyLoader {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for r in &self.ranges {
            let mut range = UffdioRange {
                start: r.start,
                len: r.len,
            };
            // SAFETY: UFFDIO_UNREGISTER with a valid range this loader registered; the memory
            // behaves as ordinary anonymous memory afterwards.
            unsafe { ioctl_with_mut_ref(self.uffd.as_ref(), UFFDIO_UNREGISTER(), &mut range) };
        }
    }
}

/// The handler: waits for faults (or the stop eventfd) and fills each faulting page once.
fn serve(uffd: &OwnedFd, stop: &EventFd, stats: &LoaderStats, lazies: &[Lazy], file: &File) {
    let mut page = vec![0u8; PAGE_SIZE as usize];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll(2) on two valid pollfds in a local array.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        if fds[1].revents != 0 {
            return;
        }
        let mut msg = [0u8; 32];
        // SAFETY: reading one 32-byte `uffd_msg` into a local buffer of that size.
        let n = unsafe { libc::read(uffd.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len()) };
        if n != 32 {
            continue; // EAGAIN: another wake-up took it.
        }
        if msg[0] == UFFD_EVENT_REMOVE {
            // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 start; u64 end; } }
            let start = u64::from_le_bytes(msg[8..16].try_into().expect("8 bytes"));
            let end = u64::from_le_bytes(msg[16..24].try_into().expect("8 bytes"));
            for lazy in lazies {
                lazy.discarded(start, end);
            }
            continue;
        }
        if msg[0] != UFFD_EVENT_PAGEFAULT {
            continue;
        }
        // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 flags; u64 address; } }
        let address = u64::from_le_bytes(msg[16..24].try_into().expect("8 bytes"));
        let hva = address & !(PAGE_SIZE - 1);
        let Some(lazy) = lazies.iter().find(|l| l.holds(hva)) else {
            continue;
        };
        let offset = hva - lazy.memory.host_address();
        let again = lazy.fill(offset / PAGE_SIZE);
        // EEXIST: another fault on the page was served first; that one was counted.
        let filled_or_raced = |r: i32, count: &AtomicU64| {
            if r >= 0 {
                return true;
            }
            let raced = std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST);
            count.fetch_sub(1, Ordering::AcqRel);
            raced
        };
        let ok = if !again && lazy.has_data(offset) {
            let read = file.read_exact_at(&mut page, lazy.file_offset + offset);
            let mut copy = UffdioCopy {
                dst: hva,
                src: page.as_ptr() as u64,
                len: PAGE_SIZE,
                ..Default::default()
            };
            // Counted before the ioctl wakes the faulting thread, so that it sees the count.
            stats.copied.fetch_add(1, Ordering::AcqRel);
            read.is_ok() && {
                // SAFETY: UFFDIO_COPY of one page from a local buffer to the faulting page of
                // a registered region; the kernel copies and wakes the faulting thread.
                let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_COPY(), &mut copy) };
                filled_or_raced(r, &stats.copied)
            }
        } else {
            let mut zero = UffdioZeropage {
                range: UffdioRange {
                    start: hva,
                    len: PAGE_SIZE,
                },
                ..Default::default()
            };
            // Counted before the ioctl wakes the faulting thread, so that it sees the count.
            stats.zeroed.fetch_add(1, Ordering::AcqRel);
            // SAFETY: UFFDIO_ZEROPAGE of the faulting page of a registered region.
            let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_ZEROPAGE(), &mut zero) };
            filled_or_raced(r, &stats.zeroed)
        };
        if !ok {
            stats.failed.store(true, Ordering::Release);
            eprintln!("kvm-memslots-persist: the userfaultfd handler could not fill {hva:#x}");
            return;
        }
    }
}
