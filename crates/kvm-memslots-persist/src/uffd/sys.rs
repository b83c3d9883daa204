//! The kernel's userfaultfd interface, as the loader uses it: a userfaultfd that agreed to
//! the API with some features, the ranges it serves (`UFFDIO_REGISTER`, `UFFDIO_UNREGISTER`),
//! the fills (`UFFDIO_COPY`, `UFFDIO_ZEROPAGE`, `UFFDIO_WAKE`) and the messages it reads
//! (faults and discards). libc has only the system call's number, so the structures and ioctl
//! numbers are declared here from the kernel's `include/uapi/linux/userfaultfd.h`; why not the
//! `userfaultfd` crate: `docs/decisions/uffd-interface.md`. Every `unsafe` of the lazy restore
//! but the handler's `poll` is here.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use vmm_sys_util::ioctl::ioctl_with_mut_ref;

use crate::error::SnapshotError;

const UFFDIO: u32 = 0xAA;
const UFFD_API: u64 = 0xAA;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMOVE: u8 = 0x15;
pub(super) const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub(super) const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
pub(super) const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
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
    ioctl_ior_nr!(UFFDIO_WAKE, UFFDIO, 0x02, UffdioRange);
    ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
    ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);
}
use nr::{
    UFFDIO_API, UFFDIO_COPY, UFFDIO_REGISTER, UFFDIO_UNREGISTER, UFFDIO_WAKE, UFFDIO_ZEROPAGE,
};

/// A new userfaultfd (close-on-exec, non-blocking) that has agreed to the API with `features`,
/// and the features the kernel offers.
pub(super) fn new_uffd(features: u64) -> Result<(OwnedFd, u64), SnapshotError> {
    // SAFETY: userfaultfd(2) takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(os_error("userfaultfd"));
    }
    // SAFETY: `fd` is a new descriptor this function owns from here on.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ..Default::default()
    };
    // SAFETY: UFFDIO_API on a userfaultfd with a valid `uffdio_api`, which outlives the call;
    // the kernel writes the features it offers back into it.
    if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_API(), &mut api) } < 0 {
        return Err(os_error("UFFDIO_API"));
    }
    Ok((uffd, api.features))
}

fn os_error(what: &str) -> SnapshotError {
    SnapshotError::Io {
        what: what.into(),
        source: std::io::Error::last_os_error(),
    }
}

/// Registers the `len` bytes at host address `start` with `uffd` for missing-page faults: a
/// fault there waits until this userfaultfd's reader fills the page.
pub(super) fn register(uffd: &OwnedFd, start: u64, len: u64) -> Result<(), SnapshotError> {
    let mut register = UffdioRegister {
        range: UffdioRange { start, len },
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER on a userfaultfd with a valid `uffdio_register`, which outlives
    // the call; the kernel checks the range against this process's mappings and writes only
    // the structure. Faults there now wait for this userfaultfd: the caller registers only
    // memory it serves (a loader's region, which it keeps mapped for the call).
    if unsafe { ioctl_with_mut_ref(uffd, UFFDIO_REGISTER(), &mut register) } < 0 {
        return Err(os_error("UFFDIO_REGISTER"));
    }
    Ok(())
}

/// Ends the registration of the `len` bytes at host address `start` with `uffd`: the memory
/// behaves as ordinary memory afterwards (a page not filled reads zeros).
pub(super) fn unregister(uffd: &OwnedFd, start: u64, len: u64) {
    let mut range = UffdioRange { start, len };
    // SAFETY: UFFDIO_UNREGISTER with a valid `uffdio_range`, which outlives the call; the
    // kernel only ends the registration of the range's mappings (the caller keeps the memory
    // mapped for the call), and writes nothing into guest memory.
    unsafe { ioctl_with_mut_ref(uffd, UFFDIO_UNREGISTER(), &mut range) };
}

/// The result of one fill ioctl.
pub(super) enum Filled {
    /// This many bytes from the start (all, or fewer where the next page could not be filled).
    Bytes(u64),
    /// The first page was filled already (`EEXIST`).
    Exists,
    /// The kernel asks to try again (`EAGAIN`: a discard is under way).
    Later,
    /// Another error.
    Failed(std::io::Error),
}

/// What an ioctl that returned `r` and reported `done` bytes (or a negative errno) did.
fn filled(r: i32, done: i64, len: u64) -> Filled {
    if r >= 0 {
        return Filled::Bytes(len);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        _ if done > 0 => Filled::Bytes(done as u64),
        Some(libc::EEXIST) => Filled::Exists,
        Some(libc::EAGAIN) => Filled::Later,
        _ => Filled::Failed(e),
    }
}

/// `UFFDIO_COPY` of `src` to the registered range at `dst`.
pub(super) fn uffd_copy(uffd: &OwnedFd, dst: u64, src: &[u8]) -> Filled {
    let mut copy = UffdioCopy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        ..Default::default()
    };
    // SAFETY: UFFDIO_COPY from a buffer of this thread (valid for `len` bytes for the call) to
    // pages of a registered region, which the loader keeps mapped; the kernel copies and wakes
    // the threads that fault there.
    let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_COPY(), &mut copy) };
    filled(r, copy.copy, copy.len)
}

/// `UFFDIO_ZEROPAGE` of the `len` bytes (whole base pages) of a registered region at `dst`.
pub(super) fn uffd_zeropage(uffd: &OwnedFd, dst: u64, len: u64) -> Filled {
    let mut zero = UffdioZeropage {
        range: UffdioRange { start: dst, len },
        ..Default::default()
    };
    // SAFETY: UFFDIO_ZEROPAGE of pages of a registered region; the kernel checks the range
    // against the registration and maps the zero page there, nothing else is written.
    let r = unsafe { ioctl_with_mut_ref(uffd, UFFDIO_ZEROPAGE(), &mut zero) };
    filled(r, zero.zeropage, len)
}

/// Wakes the threads waiting on the `len` bytes at `hva` (filled by someone else meanwhile).
pub(super) fn uffd_wake(uffd: &OwnedFd, hva: u64, len: u64) {
    let mut range = UffdioRange { start: hva, len };
    // SAFETY: UFFDIO_WAKE of a range of a registered region; it only wakes waiters.
    unsafe { ioctl_with_mut_ref(uffd, UFFDIO_WAKE(), &mut range) };
}

/// A message read from a userfaultfd.
pub(super) enum Event {
    /// A missing-page fault at this host address (not page-aligned).
    PageFault { address: u64 },
    /// A discard (`MADV_DONTNEED`, `MADV_REMOVE`) of the host range `[start, end)`, which waits
    /// until the message is read.
    Remove { start: u64, end: u64 },
    /// Another event (none is asked for).
    Other,
}

/// Reads one message from `uffd` (non-blocking); `None` if there was none to read (another
/// wake-up took it).
pub(super) fn read_event(uffd: &OwnedFd) -> Option<Event> {
    let mut msg = [0u8; 32];
    // SAFETY: reading one 32-byte `uffd_msg` into a local buffer of that size.
    let n = unsafe { libc::read(uffd.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len()) };
    if n != 32 {
        return None; // EAGAIN: another wake-up took it.
    }
    let word = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
    Some(match msg[0] {
        // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 start; u64 end; } }
        UFFD_EVENT_REMOVE => Event::Remove {
            start: word(8),
            end: word(16),
        },
        // struct uffd_msg { u8 event; u8 r1; u16 r2; u32 r3; { u64 flags; u64 address; } }
        UFFD_EVENT_PAGEFAULT => Event::PageFault { address: word(16) },
        _ => Event::Other,
    })
}
