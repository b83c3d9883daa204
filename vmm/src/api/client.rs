//! A small blocking client for the API socket, for tests, benchmarks and scripts.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::host::{self, Ready};

/// Why a call failed (not a 4xx or 5xx: those are answers).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, sending or receiving failed.
    #[error("talking to the API socket failed: {0}")]
    Io(#[from] std::io::Error),
    /// The answer was not HTTP with a JSON body.
    #[error("the API answered something unexpected: {0}")]
    Answer(String),
    /// The server closed the connection before its whole answer came (after that many
    /// bytes of it).
    #[error("the connection closed after {0} bytes of an answer")]
    Closed(usize),
    /// No whole answer came within the wait set (`Client::set_timeout`): the server may
    /// still carry the request out.
    #[error("no answer within {} (the request may still be carried out)", seconds(.0))]
    TimedOut(Duration),
}

impl ClientError {
    /// Whether the connection to the server failed or was cut (refused, reset, closed before
    /// the whole answer): a server that is alive answers, even to refuse a client (503).
    pub(crate) fn connection_lost(&self) -> bool {
        matches!(self, ClientError::Io(_) | ClientError::Closed(_))
    }
}

/// A wait as a person reads it: `60 s`, `0.5 s`.
fn seconds(wait: &Duration) -> String {
    format!("{} s", wait.as_secs_f64())
}

/// One connection to the API socket.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    /// Bytes read past the last answer (the start of the next, when requests were pipelined).
    unread: Vec<u8>,
    /// The longest a request waits for its whole answer (`None`: for ever).
    timeout: Option<Duration>,
}

/// What [`Client::connect`] waits for an answer: long, for tests and benchmarks whose requests
/// may copy a lot of memory (`tinyvmm client` sets its own, `--timeout`).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Client {
    /// Connects to the socket at `path`; each request waits `DEFAULT_TIMEOUT` at most for its
    /// answer.
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path)?;
        Ok(Client {
            stream,
            unread: Vec::new(),
            timeout: Some(DEFAULT_TIMEOUT),
        })
    }

    /// Sets the longest each request (its sending and its whole answer, however it trickles
    /// in) may take from now on; `None` waits for ever. A request that takes longer fails with
    /// [`ClientError::TimedOut`].
    pub(crate) fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Sets the socket's timeouts to what is left until `deadline` (none without one); the
    /// error once it has passed.
    fn until(&self, deadline: Option<Instant>) -> Result<(), ClientError> {
        let left = match deadline {
            None => None,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(self.timed_out());
                }
                Some(left)
            }
        };
        self.stream.set_read_timeout(left)?;
        self.stream.set_write_timeout(left)?;
        Ok(())
    }

    fn timed_out(&self) -> ClientError {
        ClientError::TimedOut(self.timeout.unwrap_or_default())
    }

    /// An I/O error as the client's: a socket timeout is the request's.
    fn io(&self, e: std::io::Error) -> ClientError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => self.timed_out(),
            _ => ClientError::Io(e),
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| Instant::now() + t)
    }

    /// Sends raw bytes and reads one answer: the status and the JSON body (`Null` if none).
    pub fn raw(&mut self, request: &[u8]) -> Result<(u16, Value), ClientError> {
        let deadline = self.deadline();
        self.until(deadline)?;
        if let Err(e) = self.stream.write_all(request) {
            // A server that refuses a client (503: too many, or out of descriptors) answers and
            // closes at once, possibly before the request is written: its answer is still there
            // to read.
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return self.read_until(deadline).map_err(|_| ClientError::Io(e));
            }
            return Err(self.io(e));
        }
        self.read_until(deadline)
    }

    /// Sends `method path` with an optional JSON body on this (kept-alive) connection.
    pub fn call(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ClientError> {
        let body = body.map(Value::to_string).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.raw(request.as_bytes())
    }

    /// Sends raw bytes without waiting for an answer.
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.until(self.deadline())?;
        self.stream.write_all(bytes).map_err(|e| self.io(e))
    }

    /// Whether an answer (or the end of the connection) is there to read now, without
    /// reading it or waiting.
    pub fn answer_waiting(&self) -> Result<bool, ClientError> {
        if !self.unread.is_empty() {
            return Ok(true);
        }
        use std::os::fd::AsFd;
        Ok(host::poll_one(
            self.stream.as_fd(),
            Ready::Read,
            Duration::ZERO,
        )?)
    }

    /// Half-closes the connection: the server sees the end of the request stream.
    pub fn finish_sending(&self) -> Result<(), ClientError> {
        Ok(self.stream.shutdown(std::net::Shutdown::Write)?)
    }

    /// Reads one answer: the status and the JSON body (`Null` if none; a `String` for a
    /// plain-text body, `GET /metrics`').
    pub fn read_response(&mut self) -> Result<(u16, Value), ClientError> {
        self.read_until(self.deadline())
    }

    /// Reads one answer, all of it by `deadline`.
    fn read_until(&mut self, deadline: Option<Instant>) -> Result<(u16, Value), ClientError> {
        let mut data = std::mem::take(&mut self.unread);
        let mut chunk = [0u8; 64 * 1024];
        loop {
            if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&data[..end]).to_string();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| ClientError::Answer(format!("no Content-Length in {head}")))?;
                if data.len() >= end + 4 + length {
                    let status = head
                        .get(9..12)
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| ClientError::Answer(head.clone()))?;
                    self.unread = data.split_off(end + 4 + length);
                    let body = &data[end + 4..end + 4 + length];
                    let text = head
                        .lines()
                        .any(|l| l.to_ascii_lowercase().starts_with("content-type: text/"));
                    let json = if body.is_empty() {
                        Value::Null
                    } else if text {
                        Value::String(String::from_utf8_lossy(body).into_owned())
                    } else {
                        serde_json::from_slice(body)
                            .map_err(|e| ClientError::Answer(e.to_string()))?
                    };
                    return Ok((status, json));
                }
            }
            self.until(deadline)?;
            // A signal that comes to this process during the read (one the test harness or a
            // caller handles without SA_RESTART) is no answer: read again, within the deadline.
            let n = match self.stream.read(&mut chunk) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                read => read.map_err(|e| self.io(e))?,
            };
            if n == 0 {
                return Err(ClientError::Closed(data.len()));
            }
            data.extend_from_slice(&chunk[..n]);
        }
    }
}
