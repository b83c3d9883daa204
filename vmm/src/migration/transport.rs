//! Where a migration goes: `unix:PATH` or `tcp:HOST:PORT`, the connection between the two
//! VMMs, and a listener that gives up when the process is asked to stop.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The most file descriptors one message carries (the kernel's `SCM_MAX_FD`).
const MAX_FDS: usize = 253;

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
    /// Connects to a listening `tinyvmm receive`, trying for at most `timeout`.
    pub fn connect(&self, timeout: Duration) -> io::Result<Connection> {
        match self {
            Endpoint::Unix(path) => UnixStream::connect(path).map(Connection::unix),
            Endpoint::Tcp(address) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                for addr in address.to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(stream) => {
                            stream.set_nodelay(true)?;
                            return Ok(Connection::Tcp(stream));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }

    /// Listens here (a stale Unix socket at the path is replaced).
    pub fn listen(&self) -> io::Result<Listener> {
        match self {
            Endpoint::Unix(path) => {
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
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

/// A listening endpoint; a Unix socket's file goes when it is dropped.
#[derive(Debug)]
pub enum Listener {
    /// On a Unix socket.
    Unix(UnixListener, PathBuf),
    /// On TCP.
    Tcp(TcpListener),
}

impl Listener {
    /// Waits for one connection; `None` once `stop` is set.
    pub fn accept(&self, stop: &AtomicBool) -> io::Result<Option<Connection>> {
        loop {
            let accepted = match self {
                Listener::Unix(l, _) => l.accept().map(|(s, _)| Connection::unix(s)),
                Listener::Tcp(l) => l.accept().map(|(s, _)| Connection::Tcp(s)),
            };
            match accepted {
                Ok(connection) => {
                    connection.set_nonblocking(false)?;
                    if let Connection::Tcp(s) = &connection {
                        s.set_nodelay(true)?;
                    }
                    return Ok(Some(connection));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if stop.load(Ordering::Acquire) {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(20));
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

/// A connection between the two VMMs.
#[derive(Debug)]
pub enum Connection {
    /// Over a Unix socket, which can carry file descriptors beside the bytes.
    Unix(UnixConnection),
    /// Over TCP.
    Tcp(TcpStream),
}

/// A Unix socket connection: file descriptors that arrive beside the bytes are kept, in order,
/// for whoever reads the record they came with; some can be attached to the next write.
#[derive(Debug)]
pub struct UnixConnection {
    stream: UnixStream,
    received: Arc<Mutex<VecDeque<OwnedFd>>>,
    attach: Vec<OwnedFd>,
}

impl Connection {
    fn unix(stream: UnixStream) -> Self {
        Connection::Unix(UnixConnection {
            stream,
            received: Arc::default(),
            attach: Vec::new(),
        })
    }

    /// A second handle on the same connection (one reads while the other writes); file
    /// descriptors either receives land in the same queue.
    pub fn try_clone(&self) -> io::Result<Connection> {
        Ok(match self {
            Connection::Unix(c) => Connection::Unix(UnixConnection {
                stream: c.stream.try_clone()?,
                received: Arc::clone(&c.received),
                attach: Vec::new(),
            }),
            Connection::Tcp(s) => Connection::Tcp(s.try_clone()?),
        })
    }

    /// Sends `fds` beside the next write (at most 253; Unix sockets only).
    pub fn attach_fds(&mut self, fds: Vec<OwnedFd>) -> io::Result<()> {
        match self {
            Connection::Unix(c) if fds.len() <= MAX_FDS => {
                c.attach = fds;
                Ok(())
            }
            Connection::Unix(_) => Err(io::Error::other(format!(
                "{} file descriptors in one message; at most {MAX_FDS}",
                fds.len()
            ))),
            Connection::Tcp(_) => Err(io::Error::other(
                "file descriptors travel only over a Unix socket",
            )),
        }
    }

    /// The next `count` file descriptors that arrived, in order, or `None` if fewer did.
    pub fn take_fds(&self, count: usize) -> Option<Vec<OwnedFd>> {
        let Connection::Unix(c) = self else {
            return (count == 0).then(Vec::new);
        };
        let mut received = c.received.lock().unwrap_or_else(|p| p.into_inner());
        if received.len() < count {
            return None;
        }
        Some(received.drain(..count).collect())
    }

    /// Sets how long a read may wait (`None`: for ever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Connection::Unix(c) => c.stream.set_read_timeout(timeout),
            Connection::Tcp(s) => s.set_read_timeout(timeout),
        }
    }

    /// Sets how long a write may wait (`None`: for ever).
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Connection::Unix(c) => c.stream.set_write_timeout(timeout),
            Connection::Tcp(s) => s.set_write_timeout(timeout),
        }
    }

    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Connection::Unix(c) => c.stream.set_nonblocking(nonblocking),
            Connection::Tcp(s) => s.set_nonblocking(nonblocking),
        }
    }
}

fn errno(e: vmm_sys_util::errno::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl Read for UnixConnection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut fds: [RawFd; MAX_FDS] = [-1; MAX_FDS];
        let mut iovecs = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the one iovec covers `buf`, borrowed mutably for the call, where any bytes
        // may be written; `fds` has room for the most a message carries.
        let (n, count) =
            unsafe { self.stream.recv_with_fds(&mut iovecs, &mut fds) }.map_err(errno)?;
        let mut received = self.received.lock().unwrap_or_else(|p| p.into_inner());
        for &fd in &fds[..count] {
            // SAFETY: recvmsg installed these descriptors for this process just now; nothing
            // else owns them.
            received.push_back(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        Ok(n)
    }
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
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(c) => c.read(buf),
            Connection::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(c) => c.write(buf),
            Connection::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Connection::Unix(c) => c.flush(),
            Connection::Tcp(s) => s.flush(),
        }
    }
}

/// Reads from a connection with a read timeout set, giving up once `stop` is set (a signal)
/// or when nothing came for `stall` (the other side hangs): a blocked read can then never
/// hold the process.
#[derive(Debug)]
pub struct Patient<'a, R> {
    /// The connection (with a short read timeout).
    pub inner: R,
    /// Set when the process should stop.
    pub stop: &'a AtomicBool,
    /// How long to wait for a byte.
    pub stall: Duration,
}

impl<R: Read> Read for Patient<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let start = std::time::Instant::now();
        loop {
            // Before every read, not only when one times out: a source that streams without a
            // pause would otherwise keep a signalled receiver reading.
            if self.stop.load(Ordering::Acquire) {
                return Err(io::Error::other("stopped by a signal"));
            }
            match self.inner.read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) =>
                {
                    if start.elapsed() >= self.stall {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("nothing came for {:?}", self.stall),
                        ));
                    }
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_name_what_is_wrong() {
        assert_eq!(
            "unix:/tmp/m.sock".parse::<Endpoint>(),
            Ok(Endpoint::Unix("/tmp/m.sock".into()))
        );
        assert_eq!(
            "tcp:127.0.0.1:4444".parse::<Endpoint>(),
            Ok(Endpoint::Tcp("127.0.0.1:4444".into()))
        );
        assert_eq!(
            "tcp:[::1]:4444".parse::<Endpoint>(),
            Ok(Endpoint::Tcp("[::1]:4444".into()))
        );
        for bad in ["unix:", "tcp:host", "tcp::80", "tcp:h:99999", "/tmp/x", ""] {
            let e = bad.parse::<Endpoint>().expect_err(bad);
            assert!(e.contains("unix:") || e.contains("HOST:PORT"), "{bad}: {e}");
        }
        assert_eq!(
            Endpoint::Unix("/a".into()).to_string(),
            "unix:/a",
            "Display is the parse's inverse"
        );
    }

    #[test]
    fn file_descriptors_travel_beside_the_bytes_in_order() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (mut a, mut b) = (Connection::unix(a), Connection::unix(b));
        let files: Vec<OwnedFd> = (0..3).map(|_| OwnedFd::from(tempfile_like())).collect();
        let inodes: Vec<u64> = files.iter().map(inode).collect();
        a.attach_fds(files).expect("attach");
        a.write_all(b"with fds").expect("send");
        a.write_all(b", without").expect("send");
        let mut got = [0u8; 17];
        b.read_exact(&mut got).expect("receive");
        assert_eq!(&got, b"with fds, without");
        assert!(b.take_fds(4).is_none(), "three came");
        let fds = b.take_fds(3).expect("three came");
        assert_eq!(fds.iter().map(inode).collect::<Vec<_>>(), inodes);
        assert_eq!(b.take_fds(1).map(|f| f.len()), None);
        let mut tcp_less = Connection::unix(UnixStream::pair().expect("pair").0);
        let too_many = (0..MAX_FDS + 1)
            .map(|_| OwnedFd::from(tempfile_like()))
            .collect();
        assert!(tcp_less.attach_fds(too_many).is_err());
    }

    fn tempfile_like() -> std::fs::File {
        std::fs::File::open("/proc/self/exe").expect("a file")
    }

    fn inode(fd: &OwnedFd) -> u64 {
        let file = std::fs::File::from(fd.try_clone().expect("dup"));
        std::os::unix::fs::MetadataExt::ino(&file.metadata().expect("stat"))
    }

    #[test]
    fn a_patient_read_gives_up_on_a_stall_and_on_stop() {
        let (a, _b) = UnixStream::pair().expect("pair");
        a.set_read_timeout(Some(Duration::from_millis(10)))
            .expect("timeout");
        let stop = AtomicBool::new(false);
        let mut patient = Patient {
            inner: &a,
            stop: &stop,
            stall: Duration::from_millis(50),
        };
        let e = patient.read(&mut [0u8; 4]).expect_err("stall");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        stop.store(true, Ordering::Release);
        let e = patient.read(&mut [0u8; 4]).expect_err("stop");
        assert!(e.to_string().contains("signal"), "{e}");
    }
}
