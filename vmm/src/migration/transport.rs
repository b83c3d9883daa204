//! Where a migration goes: `unix:PATH` or `tcp:HOST:PORT`, the connection between the two
//! VMMs, and a listener that gives up when the process is asked to stop.
//!
//! Every wait on a connection is watched ([`Watch`]): connecting, reading and writing are
//! non-blocking, with poll(2) in slices of [`SLICE`] between which the watch looks at its stop
//! flags (a client's cancel, the process's signal flag) and its limits (a deadline, and how
//! long nothing may move). A wait therefore never holds a migration or the process for longer
//! than its owner allows, and its error names what was waited for ([`WaitError`]).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::host::{self, Ready, SocketAddress};

/// The most file descriptors one message carries (the kernel's `SCM_MAX_FD`).
const MAX_FDS: usize = host::SCM_MAX_FD;

/// How often a wait looks at its stop flags and limits.
const SLICE: Duration = Duration::from_millis(20);

/// How long a wait that begins past its deadline may see nothing move.
const GRACE: Duration = Duration::from_secs(1);

/// A migration's endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket's path.
    Unix(PathBuf),
    /// A TCP host and port.
    Tcp(String),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
            Endpoint::Tcp(address) => write!(f, "tcp:{address}"),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path (unix:PATH)".into());
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if let Some(address) = s.strip_prefix("tcp:") {
            let port_ok = address
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok {
                return Err(format!(
                    "'{address}' is not HOST:PORT (tcp:HOST:PORT, port 0 to 65535)"
                ));
            }
            return Ok(Endpoint::Tcp(address.to_string()));
        }
        Err(format!(
            "'{s}' is not a migration endpoint: use unix:PATH or tcp:HOST:PORT"
        ))
    }
}

impl Endpoint {
    /// Connects to a listening `tinyvmm receive`, for as long as `watch` lets it wait; the
    /// connection keeps `watch` for every later wait.
    pub(super) fn connect(&self, watch: Watch) -> io::Result<Connection> {
        match self {
            Endpoint::Unix(path) => {
                if let Ok(m) = std::fs::metadata(path) {
                    if !m.file_type().is_socket() {
                        return Err(not_a_socket(path, m.file_type()));
                    }
                }
                let stream = UnixStream::from(connect_unix(path, &watch)?);
                Ok(Connection::unix(stream, watch))
            }
            Endpoint::Tcp(address) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                for addr in address.to_socket_addrs()? {
                    match connect_tcp(addr, &watch) {
                        Ok(fd) => {
                            let stream = TcpStream::from(fd);
                            stream.set_nodelay(true)?;
                            return Ok(Connection::new(Link::Tcp(stream), watch));
                        }
                        // The watch ended it: no other address may wait longer.
                        Err(e) if WaitError::of(&e).is_some() => return Err(e),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }

    /// Listens here (a stale Unix socket at the path is replaced).
    pub(crate) fn listen(&self) -> io::Result<Listener> {
        match self {
            Endpoint::Unix(path) => {
                match std::fs::symlink_metadata(path) {
                    Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
                    Ok(m) => return Err(not_a_socket(path, m.file_type())),
                    Err(_) => {}
                }
                let listener = UnixListener::bind(path)?;
                listener.set_nonblocking(true)?;
                Ok(Listener::Unix(listener, path.clone()))
            }
            Endpoint::Tcp(address) => {
                let listener = TcpListener::bind(address)?;
                listener.set_nonblocking(true)?;
                Ok(Listener::Tcp(listener))
            }
        }
    }
}

/// What a file of type `kind` is, for messages: "a FIFO", "a device", and so on.
pub(crate) fn file_kind(kind: std::fs::FileType) -> &'static str {
    if kind.is_file() {
        "a regular file"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "a symbolic link"
    }
}

/// A Unix endpoint's path holds something else than a socket (a FIFO, a device, a file): it
/// is neither replaced nor opened.
fn not_a_socket(path: &Path, kind: std::fs::FileType) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is {}, not a Unix socket",
            path.display(),
            file_kind(kind)
        ),
    )
}

/// Connects a Unix stream socket to `path`: a listener whose backlog is full makes a
/// non-blocking connect fail with `EAGAIN`, so it is tried again every slice while `watch`
/// lets it wait.
fn connect_unix(path: &Path, watch: &Watch) -> io::Result<OwnedFd> {
    let addr = SocketAddress::unix(path)?;
    let fd = host::stream_socket(&addr)?;
    let since = Instant::now();
    loop {
        match host::connect(fd.as_fd(), &addr) {
            Ok(()) => return Ok(fd),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) => {
                let slice = watch.check(since)?;
                std::thread::sleep(slice);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connects a TCP socket to `addr`: the handshake runs while poll(2) waits in slices for the
/// socket to be writable, for as long as `watch` lets it.
fn connect_tcp(addr: SocketAddr, watch: &Watch) -> io::Result<OwnedFd> {
    let addr = SocketAddress::inet(addr);
    let fd = host::stream_socket(&addr)?;
    let started = host::connect(fd.as_fd(), &addr);
    match started {
        Ok(()) => return Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let since = Instant::now();
    while !watch.poll(fd.as_fd(), Ready::Write, since)? {}
    match host::take_socket_error(fd.as_fd())? {
        Some(error) => Err(error),
        None => Ok(fd),
    }
}

/// A listening endpoint; a Unix socket's file goes when it is dropped.
#[derive(Debug)]
pub(crate) enum Listener {
    /// On a Unix socket.
    Unix(UnixListener, PathBuf),
    /// On TCP.
    Tcp(TcpListener),
}

impl Listener {
    /// Waits for one connection, however long it takes; `None` once one of `watch`'s stop
    /// flags is set. The connection keeps `watch` for its waits.
    pub(crate) fn accept(&self, watch: Watch) -> io::Result<Option<Connection>> {
        loop {
            let accepted = match self {
                Listener::Unix(l, _) => l.accept().map(|(s, _)| Link::unix(s)),
                Listener::Tcp(l) => l.accept().map(|(s, _)| Link::Tcp(s)),
            };
            match accepted {
                Ok(link) => {
                    if let Link::Tcp(s) = &link {
                        s.set_nodelay(true)?;
                    }
                    link.set_nonblocking()?;
                    return Ok(Some(Connection { link, watch }));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if watch.stopped().is_some() {
                        return Ok(None);
                    }
                    std::thread::sleep(SLICE);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// How long a wait may take: as long as something moves on the connection at least every
/// `stall`, and until `deadline` (a wait that begins past it gets [`GRACE`]). What is ready is
/// taken whatever the limits: they end only waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// When every wait ends, whatever moves.
    pub(crate) deadline: Option<Instant>,
    /// How long one wait may see nothing move (no byte come, no byte taken).
    pub(crate) stall: Duration,
}

/// Why a watched wait ended before the other side was ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum WaitEnd {
    /// The owner's cancel flag was set (a client cancelled the migration).
    #[error("a client cancelled it")]
    Cancelled,
    /// The process's stop flag was set (SIGINT/SIGTERM).
    #[error("stopped by a signal")]
    Interrupted,
    /// The deadline came.
    #[error("the deadline came after {0:.1?} of waiting")]
    Deadline(Duration),
    /// Nothing moved for this long.
    #[error("nothing moved on the connection for {0:.1?}")]
    Stalled(Duration),
}

/// A watched wait that ended: what it waited for, and why it ended. Carried inside the
/// `io::Error` a read, a write or a connect returns ([`WaitError::of`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("waiting for {what}: {end}")]
pub(super) struct WaitError {
    /// What was waited for (as the watch's owner named it).
    pub(crate) what: String,
    /// Why it ended.
    pub(crate) end: WaitEnd,
}

impl WaitError {
    /// The ended wait behind `error`, if a [`Watch`] ended it.
    pub(super) fn of(error: &io::Error) -> Option<&WaitError> {
        error.get_ref()?.downcast_ref()
    }

    fn into_io(self) -> io::Error {
        let kind = match self.end {
            WaitEnd::Deadline(_) | WaitEnd::Stalled(_) => io::ErrorKind::TimedOut,
            // Never `Interrupted`: `read_exact` and `write_all` would try again.
            WaitEnd::Cancelled | WaitEnd::Interrupted => io::ErrorKind::Other,
        };
        io::Error::new(kind, self)
    }
}

/// Watches every wait on a connection (all its handles share it): the stop flags that cut a
/// wait short, looked at every [`SLICE`] and before every read and write, and what is waited
/// for now with its [`Limits`], which the connection's owner changes as it goes
/// ([`expect`](Self::expect)).
#[derive(Debug, Clone)]
pub(crate) struct Watch {
    cancel: Option<Arc<AtomicBool>>,
    interrupt: &'static AtomicBool,
    now: Arc<Mutex<(String, Limits)>>,
}

impl Watch {
    /// A watch that ends waits on `interrupt` (the process's signal flag) and, if given, on
    /// `cancel`; it waits for `what` within `limits` until told otherwise.
    pub(crate) fn new(
        interrupt: &'static AtomicBool,
        cancel: Option<Arc<AtomicBool>>,
        what: impl Into<String>,
        limits: Limits,
    ) -> Self {
        Watch {
            cancel,
            interrupt,
            now: Arc::new(Mutex::new((what.into(), limits))),
        }
    }

    /// From now on, waits are for `what`, within `limits`.
    pub(super) fn expect(&self, what: impl Into<String>, limits: Limits) {
        *self.now.lock().unwrap_or_else(|p| p.into_inner()) = (what.into(), limits);
    }

    /// Which stop flag is set, if one is.
    fn stopped(&self) -> Option<WaitEnd> {
        if self
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Acquire))
        {
            return Some(WaitEnd::Cancelled);
        }
        self.interrupt
            .load(Ordering::Acquire)
            .then_some(WaitEnd::Interrupted)
    }

    /// The error that ends any wait now, if a stop flag is set.
    fn stop_check(&self) -> io::Result<()> {
        match self.stopped() {
            Some(end) => {
                let what = self.now.lock().unwrap_or_else(|p| p.into_inner()).0.clone();
                Err(WaitError { what, end }.into_io())
            }
            None => Ok(()),
        }
    }

    /// For a wait that began at `since`: the error that ends it now, or how long it may
    /// sleep before looking again (a slice at most).
    fn check(&self, since: Instant) -> io::Result<Duration> {
        let (what, limits) = self.now.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let now = Instant::now();
        let stalls_at = since.checked_add(limits.stall);
        // Past the deadline a wait still gets a moment: what is ready is taken first anyway,
        // and a peer that keeps things moving is not cut off in the middle of a record.
        let late_at = limits
            .deadline
            .map(|d| since.checked_add(GRACE).map_or(d, |g| d.max(g)));
        let ends_at = match (late_at, stalls_at) {
            (Some(d), Some(s)) => Some(d.min(s)),
            (d, s) => d.or(s),
        };
        let end = match self.stopped() {
            Some(end) => Some(end),
            None => match ends_at {
                Some(at) if now >= at => Some(match late_at {
                    Some(d) if d <= at => WaitEnd::Deadline(now - since),
                    _ => WaitEnd::Stalled(limits.stall),
                }),
                _ => None,
            },
        };
        match end {
            Some(end) => Err(WaitError { what, end }.into_io()),
            None => Ok(ends_at.map_or(SLICE, |at| (at - now).min(SLICE))),
        }
    }

    /// Waits up to a slice for `fd` to be ready for `events` (poll(2)); whether it is. The
    /// error if the wait that began at `since` must end.
    fn poll(&self, fd: BorrowedFd<'_>, ready: Ready, since: Instant) -> io::Result<bool> {
        let slice = self.check(since)?;
        // Rounded up to whole milliseconds: a slice below one still waits.
        match host::poll_one(fd, ready, slice) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            ready => ready,
        }
    }
}

/// A connection between the two VMMs: non-blocking, every wait watched (`Watch`).
#[derive(Debug)]
pub(crate) struct Connection {
    link: Link,
    watch: Watch,
}

/// The socket under a connection.
#[derive(Debug)]
enum Link {
    /// A Unix socket, which can carry file descriptors beside the bytes.
    Unix(UnixConnection),
    /// TCP.
    Tcp(TcpStream),
}

/// A Unix socket connection: file descriptors that arrive beside the bytes are kept, in order,
/// for whoever reads the record they came with; some can be attached to the next write.
#[derive(Debug)]
struct UnixConnection {
    stream: UnixStream,
    received: Arc<Mutex<VecDeque<OwnedFd>>>,
    attach: Vec<OwnedFd>,
}

impl Link {
    fn unix(stream: UnixStream) -> Self {
        Link::Unix(UnixConnection {
            stream,
            received: Arc::default(),
            attach: Vec::new(),
        })
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Link::Unix(c) => c.stream.set_nonblocking(true),
            Link::Tcp(s) => s.set_nonblocking(true),
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Link::Unix(c) => c.stream.as_fd(),
            Link::Tcp(s) => s.as_fd(),
        }
    }
}

impl Connection {
    fn new(link: Link, watch: Watch) -> Self {
        Connection { link, watch }
    }

    fn unix(stream: UnixStream, watch: Watch) -> Self {
        Connection::new(Link::unix(stream), watch)
    }

    /// The watch on its waits (shared by every handle on it).
    pub(super) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// A second handle on the same connection (one reads while the other writes), with the
    /// same watch; file descriptors either receives land in the same queue.
    pub(crate) fn try_clone(&self) -> io::Result<Connection> {
        let link = match &self.link {
            Link::Unix(c) => Link::Unix(UnixConnection {
                stream: c.stream.try_clone()?,
                received: Arc::clone(&c.received),
                attach: Vec::new(),
            }),
            Link::Tcp(s) => Link::Tcp(s.try_clone()?),
        };
        Ok(Connection::new(link, self.watch.clone()))
    }

    /// Sends `fds` beside the next write (at most 253; Unix sockets only).
    pub(super) fn attach_fds(&mut self, fds: Vec<OwnedFd>) -> io::Result<()> {
        match &mut self.link {
            Link::Unix(c) if fds.len() <= MAX_FDS => {
                c.attach = fds;
                Ok(())
            }
            Link::Unix(_) => Err(io::Error::other(format!(
                "{} file descriptors in one message; at most {MAX_FDS}",
                fds.len()
            ))),
            Link::Tcp(_) => Err(io::Error::other(
                "file descriptors travel only over a Unix socket",
            )),
        }
    }

    /// The next `count` file descriptors that arrived, in order, or `None` if fewer did.
    pub(crate) fn take_fds(&self, count: usize) -> Option<Vec<OwnedFd>> {
        let Link::Unix(c) = &self.link else {
            return (count == 0).then(Vec::new);
        };
        let mut received = c.received.lock().unwrap_or_else(|p| p.into_inner());
        if received.len() < count {
            return None;
        }
        Some(received.drain(..count).collect())
    }

    /// How many file descriptors arrived that nobody took yet.
    pub(crate) fn fds_waiting(&self) -> usize {
        match &self.link {
            Link::Unix(c) => c.received.lock().unwrap_or_else(|p| p.into_inner()).len(),
            Link::Tcp(_) => 0,
        }
    }
}

fn errno(e: vmm_sys_util::errno::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl Read for UnixConnection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let (n, fds) = host::recv_with_fds(&self.stream, buf).map_err(|e| {
            // The kernel installs what it can and flags the rest cut (MSG_CTRUNC), which
            // vmm-sys-util reports as ENOBUFS, having closed those that came.
            if e.raw_os_error() == Some(libc::ENOBUFS) {
                fds_cut_short()
            } else {
                e
            }
        })?;
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(fds);
        Ok(n)
    }
}

/// File descriptors sent beside the bytes did not all arrive: what the process's open-file
/// limit allows, and how many it has open.
fn fds_cut_short() -> io::Error {
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let limits = match host::open_file_limit() {
        Ok(limit) => format!("soft limit {}, hard limit {}", limit.soft, limit.hard),
        Err(_) => "limits unknown".into(),
    };
    io::Error::other(format!(
        "the file descriptors handed over beside the stream were cut short: this process has \
         about {open} files open and may open no more than RLIMIT_NOFILE allows ({limits}); \
         raise it (ulimit -n) for a local migration of this many memfd regions"
    ))
}

impl Write for UnixConnection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.attach.is_empty() {
            return self.stream.write(buf);
        }
        let raw: Vec<RawFd> = self.attach.iter().map(AsRawFd::as_raw_fd).collect();
        let n = self.stream.send_with_fds(&[buf], &raw).map_err(errno)?;
        // The receiver has its own references now; ours close.
        self.attach.clear();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl Read for Connection {
    /// Reads what has come, waiting (watched) until something does.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let since = Instant::now();
        loop {
            // Before every read, not only when one waits: a peer that streams without a pause
            // would otherwise keep a stopped reader reading.
            self.watch.stop_check()?;
            let read = match &mut self.link {
                Link::Unix(c) => c.read(buf),
                Link::Tcp(s) => s.read(buf),
            };
            match read {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.watch.poll(self.link.fd(), Ready::Read, since)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => return other,
            }
        }
    }
}

impl Write for Connection {
    /// Writes what the socket takes now, waiting (watched) until it takes something.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let since = Instant::now();
        loop {
            self.watch.stop_check()?;
            let written = match &mut self.link {
                Link::Unix(c) => c.write(buf),
                Link::Tcp(s) => s.write(buf),
            };
            match written {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.watch.poll(self.link.fd(), Ready::Write, since)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => return other,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.link {
            Link::Unix(c) => c.flush(),
            Link::Tcp(s) => s.flush(),
        }
    }
}

#[cfg(test)]
mod tests;
