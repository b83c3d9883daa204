//! The host operating system's calls the VMM makes, outside KVM and guest memory: each a small
//! safe wrapper that says what it relies on and answers an [`io::Error`] when the call fails.
//! The open-file limit, the file-creation mask, waiting for one descriptor (poll(2)), the
//! terminal in raw mode and unbuffered reads of it, non-blocking sockets and their connect,
//! file descriptors received beside a Unix socket's bytes (`SCM_RIGHTS`), a signal to one
//! thread, and random bytes from the kernel (getrandom(2)).
//!
//! Where vmm-sys-util has the wrapper it is used, here or by the caller: signal handlers,
//! `SCM_RIGHTS` messages, eventfds, reads of the terminal. What stays elsewhere: KVM's ioctls
//! (kvm-ioctls), guest memory's mappings (kvm-memslots), and the calls inside signal handlers
//! (`vm::memory_gone`'s `SIGBUS` handler and the termination handler of `lifecycle`), which
//! keep to async-signal-safe code beside the statics they use.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use vmm_sys_util::terminal::Terminal;

/// The process's limit on open files (`RLIMIT_NOFILE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileLimit {
    /// The soft limit: how many files the process may have open now.
    pub(crate) soft: u64,
    /// The hard limit: how far the soft one may be raised.
    pub(crate) hard: u64,
}

/// The process's open-file limit (getrlimit(2)).
pub(crate) fn open_file_limit() -> io::Result<FileLimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into `limit`, valid and borrowed mutably for the
    // call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(FileLimit {
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}

/// Raises the soft open-file limit to the hard one (setrlimit(2)); an unlimited hard limit
/// still stops at the kernel's per-process cap (`/proc/sys/fs/nr_open`). The limit before and
/// after, or `None` when the soft limit could not go higher.
pub(crate) fn raise_open_file_limit() -> io::Result<Option<(FileLimit, FileLimit)>> {
    let before = open_file_limit()?;
    if before.soft >= before.hard {
        return Ok(None);
    }
    let cap = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(before.hard);
    let after = FileLimit {
        soft: before.hard.min(cap),
        hard: before.hard,
    };
    if after.soft <= before.soft {
        return Ok(None);
    }
    let limit = libc::rlimit {
        rlim_cur: after.soft,
        rlim_max: after.hard,
    };
    // SAFETY: setrlimit reads one `rlimit` from `limit`, valid for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some((before, after)))
}

/// Runs `create` with the process's file-creation mask set to `mask` (umask(2)) and sets the
/// old mask back after it: what `create` makes lacks the permissions in `mask` from the moment
/// it exists. The mask is the process's, so a file another thread makes meanwhile gets it too.
pub(crate) fn with_umask<T>(mask: u32, create: impl FnOnce() -> T) -> T {
    // SAFETY: umask(2) only changes the process's file-creation mask: it takes no pointers and
    // cannot fail.
    let old = unsafe { libc::umask(mask) };
    let made = create();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    made
}

/// What [`poll_one`] waits for a descriptor to be ready for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ready {
    /// Reading (`POLLIN`).
    Read,
    /// Writing (`POLLOUT`).
    Write,
}

/// Waits up to `timeout` (rounded up to whole milliseconds; zero: no wait) for `fd` to be
/// ready (poll(2)); whether it is. A hang-up or an error on it counts as ready (the next read
/// or write says which). A signal that interrupts the wait is the error `Interrupted`.
pub(crate) fn poll_one(fd: BorrowedFd<'_>, ready: Ready, timeout: Duration) -> io::Result<bool> {
    let mut pollfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: match ready {
            Ready::Read => libc::POLLIN,
            Ready::Write => libc::POLLOUT,
        },
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid `pollfd`, borrowed mutably for the call, naming `fd`, which is open
    // while it is borrowed.
    let ready = unsafe { libc::poll(&mut pollfd, 1, ms) };
    if ready < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ready > 0)
}

/// Reads what the process's stdin has now, without std's buffer (bytes left in it would wait
/// for the next key without epoll saying so): vmm-sys-util's unbuffered terminal read, under
/// std's stdin lock for the call (nothing else in the VMM reads stdin).
pub(crate) fn read_stdin_unbuffered(buffer: &mut [u8]) -> io::Result<usize> {
    io::stdin()
        .lock()
        .read_raw(buffer)
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))
}

/// The host terminal on stdin in raw mode (no line editing or echo; Ctrl-C still signals, and
/// output still turns `\n` into `\r\n`) while it is the guest's console; its old mode comes
/// back on drop. (vmm-sys-util's raw mode turns signals off and does not keep the old mode.)
pub(crate) struct RawTerminal {
    saved: libc::termios,
}

impl std::fmt::Debug for RawTerminal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTerminal").finish_non_exhaustive()
    }
}

impl RawTerminal {
    /// Puts stdin in raw mode if it is a terminal; `None` if it is not, or its mode cannot be
    /// read or set.
    pub(crate) fn on_stdin() -> Option<Self> {
        let fd = libc::STDIN_FILENO;
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(fd) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; all zeros is a valid value to be overwritten.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios for tcgetattr to fill, borrowed mutably for the
        // call.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only changes the flags of the termios it is given, valid and
        // borrowed mutably for the call.
        unsafe { libc::cfmakeraw(&mut raw) };
        raw.c_lflag |= libc::ISIG;
        raw.c_oflag |= libc::OPOST | libc::ONLCR;
        // SAFETY: `raw` is a valid termios, read during the call.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawTerminal { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: `saved` is the termios read from stdin, valid, read during the call.
        unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &self.saved) };
    }
}

/// Where a stream socket connects to, as connect(2) takes it: a Unix socket's path or an IP
/// address.
pub(crate) enum SocketAddress {
    /// A Unix socket's path.
    Unix(libc::sockaddr_un),
    /// An IPv4 address and port.
    V4(libc::sockaddr_in),
    /// An IPv6 address and port.
    V6(libc::sockaddr_in6),
}

impl std::fmt::Debug for SocketAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = match self {
            SocketAddress::Unix(_) => "Unix",
            SocketAddress::V4(_) => "V4",
            SocketAddress::V6(_) => "V6",
        };
        f.debug_tuple(family).finish_non_exhaustive()
    }
}

impl SocketAddress {
    /// The Unix socket at `path`; refused (`InvalidInput`) when the path does not fit a
    /// `sockaddr_un` or holds a NUL.
    pub(crate) fn unix(path: &Path) -> io::Result<Self> {
        let bytes = path.as_os_str().as_bytes();
        let mut addr = libc::sockaddr_un {
            sun_family: libc::AF_UNIX as libc::sa_family_t,
            sun_path: [0; 108],
        };
        if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a Unix socket path has at most {} bytes and no NUL: {}",
                    addr.sun_path.len() - 1,
                    path.display()
                ),
            ));
        }
        for (to, &from) in addr.sun_path.iter_mut().zip(bytes) {
            *to = from as libc::c_char;
        }
        Ok(SocketAddress::Unix(addr))
    }

    /// The IP address and port `addr`.
    pub(crate) fn inet(addr: SocketAddr) -> Self {
        match addr {
            SocketAddr::V4(a) => SocketAddress::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            }),
            SocketAddr::V6(a) => SocketAddress::V6(libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            }),
        }
    }

    fn family(&self) -> libc::c_int {
        match self {
            SocketAddress::Unix(_) => libc::AF_UNIX,
            SocketAddress::V4(_) => libc::AF_INET,
            SocketAddress::V6(_) => libc::AF_INET6,
        }
    }
}

/// A new non-blocking stream socket of `addr`'s family, closed on exec (socket(2)).
pub(crate) fn stream_socket(addr: &SocketAddress) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; it returns a new descriptor or -1.
    let fd = unsafe {
        libc::socket(
            addr.family(),
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socket(2) just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// connect(2) of `socket` to `addr`: the error as is (`EAGAIN`, `EINPROGRESS` included).
pub(crate) fn connect(socket: BorrowedFd<'_>, addr: &SocketAddress) -> io::Result<()> {
    /// connect(2) with the socket address `addr`, whose size is `A`'s.
    fn raw<A>(socket: BorrowedFd<'_>, addr: &A) -> libc::c_int {
        let len = size_of::<A>() as libc::socklen_t;
        // SAFETY: `addr` is a live, initialised socket address (the callers below pass only
        // `sockaddr_un`, `sockaddr_in` and `sockaddr_in6`) of `len` bytes, read only during the
        // call; `socket` is an open descriptor while it is borrowed.
        unsafe { libc::connect(socket.as_raw_fd(), (addr as *const A).cast(), len) }
    }
    let done = match addr {
        SocketAddress::Unix(a) => raw(socket, a),
        SocketAddress::V4(a) => raw(socket, a),
        SocketAddress::V6(a) => raw(socket, a),
    };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The error pending on `socket` (`SO_ERROR`, which reading clears): how a non-blocking
/// connect ended once the socket is writable. `Ok(None)`: it connected.
pub(crate) fn take_socket_error(socket: BorrowedFd<'_>) -> io::Result<Option<io::Error>> {
    let mut error: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_ERROR writes one c_int into `error`, whose size `len` gives, both borrowed
    // mutably for the call; `socket` is an open descriptor while it is borrowed.
    let got = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut error as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((error != 0).then(|| io::Error::from_raw_os_error(error)))
}

/// The most file descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub(crate) const SCM_MAX_FD: usize = 253;

/// Reads into `buf` from the Unix stream socket `stream`, with the file descriptors that came
/// beside the bytes (`SCM_RIGHTS`, at most [`SCM_MAX_FD`]), now this process's own: vmm-sys-util's
/// `recvmsg`. Where the kernel could install only some of them (the open-file limit) the error
/// is `ENOBUFS`, those that came closed.
pub(crate) fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut fds: [RawFd; SCM_MAX_FD] = [-1; SCM_MAX_FD];
    let mut iovecs = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the one iovec covers `buf`, borrowed mutably for the call, where any bytes may
    // be written; `fds` has room for the most a message carries.
    let (n, count) = unsafe { stream.recv_with_fds(&mut iovecs, &mut fds) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    let received = fds[..count]
        .iter()
        // SAFETY: recvmsg installed these descriptors for this process just now; nothing else
        // owns them.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    Ok((n, received))
}

/// A thread of this process, as pthreads names it: where [`signal_thread`] sends a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ThreadId(libc::pthread_t);

/// The calling thread.
pub(crate) fn current_thread() -> ThreadId {
    // SAFETY: pthread_self has no preconditions and cannot fail.
    ThreadId(unsafe { libc::pthread_self() })
}

/// Sends `signal` to `thread` (pthread_kill(3)).
///
/// # Safety
///
/// `thread` must still name a live thread: one that has not returned (a joined thread's id
/// may name another thread, or nothing).
pub(crate) unsafe fn signal_thread(thread: ThreadId, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: the caller guarantees that `thread` names a thread that has not returned.
    match unsafe { libc::pthread_kill(thread.0, signal) } {
        0 => Ok(()),
        error => Err(io::Error::from_raw_os_error(error)),
    }
}

/// Fills `buf` with random bytes from the kernel's pool (getrandom(2), blocking only until the
/// pool is first initialised), retrying a call a signal interrupts or the kernel cut short.
pub(crate) fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`, which is valid
        // and exclusively borrowed for the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_unix_path_too_long_or_with_a_nul_is_refused() {
        let long = "x".repeat(108);
        let e = SocketAddress::unix(Path::new(&long)).expect_err("too long");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e
            .to_string()
            .starts_with("a Unix socket path has at most 107 bytes"));
        assert!(SocketAddress::unix(Path::new(&"x".repeat(107))).is_ok());
    }

    #[test]
    fn poll_says_when_a_socket_has_something_to_read() {
        let (a, mut b) = UnixStream::pair().expect("a pair");
        assert!(!poll_one(a.as_fd(), Ready::Read, Duration::ZERO).expect("poll"));
        assert!(poll_one(a.as_fd(), Ready::Write, Duration::ZERO).expect("poll"));
        io::Write::write_all(&mut b, b"x").expect("write");
        assert!(poll_one(a.as_fd(), Ready::Read, Duration::from_millis(100)).expect("poll"));
    }

    #[test]
    fn descriptors_sent_beside_the_bytes_arrive_as_owned_ones() {
        let (a, b) = UnixStream::pair().expect("a pair");
        let file = std::fs::File::open("/dev/null").expect("/dev/null");
        a.send_with_fds(&[&b"hi"[..]], &[file.as_raw_fd()])
            .expect("send");
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(&b, &mut buf).expect("receive");
        assert_eq!(&buf[..n], b"hi");
        assert_eq!(fds.len(), 1);
        assert_ne!(fds[0].as_raw_fd(), file.as_raw_fd());
    }

    #[test]
    fn the_open_file_limit_reads() {
        let limit = open_file_limit().expect("getrlimit");
        assert!(limit.soft <= limit.hard && limit.soft > 0);
    }

    #[test]
    fn random_bytes_fill_the_buffer_and_differ() {
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        fill_random(&mut a).expect("getrandom");
        fill_random(&mut b).expect("getrandom");
        assert_ne!(a, b);
        fill_random(&mut []).expect("nothing to fill");
    }
}
