//! Where a migration goes: `unix:PATH` or `tcp:HOST:PORT`, the connection between the two
//! VMMs, and a listener that gives up when the process is asked to stop.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
            Endpoint::Unix(path) => UnixStream::connect(path).map(Connection::Unix),
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
                Listener::Unix(l, _) => l.accept().map(|(s, _)| Connection::Unix(s)),
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
    /// Over a Unix socket.
    Unix(UnixStream),
    /// Over TCP.
    Tcp(TcpStream),
}

impl Connection {
    /// A second handle on the same connection (one reads while the other writes).
    pub fn try_clone(&self) -> io::Result<Connection> {
        Ok(match self {
            Connection::Unix(s) => Connection::Unix(s.try_clone()?),
            Connection::Tcp(s) => Connection::Tcp(s.try_clone()?),
        })
    }

    /// Sets how long a read may wait (`None`: for ever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Connection::Unix(s) => s.set_read_timeout(timeout),
            Connection::Tcp(s) => s.set_read_timeout(timeout),
        }
    }

    /// Sets how long a write may wait (`None`: for ever).
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Connection::Unix(s) => s.set_write_timeout(timeout),
            Connection::Tcp(s) => s.set_write_timeout(timeout),
        }
    }

    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Connection::Unix(s) => s.set_nonblocking(nonblocking),
            Connection::Tcp(s) => s.set_nonblocking(nonblocking),
        }
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(s) => s.read(buf),
            Connection::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(s) => s.write(buf),
            Connection::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Connection::Unix(s) => s.flush(),
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
            match self.inner.read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) =>
                {
                    if self.stop.load(Ordering::Acquire) {
                        return Err(io::Error::other("stopped by a signal"));
                    }
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
