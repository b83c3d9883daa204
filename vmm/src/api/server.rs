//! The API socket on the VMM's event loop: accepts clients, frames their requests, hands them
//! to the controller and writes the answers. Transport only: the `serve` job builds the VM.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::timerfd::TimerFd;

use crate::api::http::{self, Parsed, Response, MAX_BODY_BYTES, MAX_HEADER_BYTES};
use crate::api::metrics::Labelled;
use crate::api::routes::{respond, route};
use crate::control::{Apply, Outcome, Reply, Ticket};
use crate::host;
use crate::lifecycle::{log, logs, LogLevel};

/// Why the API socket could not be created.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket path is taken by something that is not a socket.
    #[error("{0} exists and is not a socket: refusing to replace it")]
    NotASocket(PathBuf),
    /// Another process answers on the socket.
    #[error("{0} is in use by another process")]
    InUse(PathBuf),
    /// Creating the socket failed.
    #[error("cannot create the API socket {path}: {source}")]
    Socket {
        /// The path.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
}

/// Creates the API socket at `path`, readable and writable by its owner only. A stale socket
/// (nobody answers) is replaced; anything else at the path is refused.
fn bind_api_socket(path: &Path) -> Result<UnixListener, SocketError> {
    let socket_error = |source| SocketError::Socket {
        path: path.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(SocketError::NotASocket(path.to_owned()))
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(SocketError::InUse(path.to_owned())),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(socket_error)?;
            }
            Err(e) => return Err(socket_error(e)),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(socket_error(e)),
    }
    // The mask makes the socket 0600 from the moment it exists.
    let bound = host::with_umask(0o177, || UnixListener::bind(path));
    let listener = bound.map_err(socket_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(socket_error)?;
    listener.set_nonblocking(true).map_err(socket_error)?;
    Ok(listener)
}

/// The API socket, bound: its listener, and its file, which goes when the VMM's run ends.
#[derive(Debug)]
pub(crate) struct ApiSocket {
    /// The listener, for the server.
    pub(crate) listener: UnixListener,
    /// The socket's file.
    pub(crate) file: SocketFile,
}

impl ApiSocket {
    /// Binds the API socket at `path` ([`bind_api_socket`]).
    pub(crate) fn bind(path: &Path) -> Result<Self, SocketError> {
        Ok(ApiSocket {
            listener: bind_api_socket(path)?,
            file: SocketFile(path.to_owned()),
        })
    }
}

/// A bound API socket's file: removed when this is dropped, however the run ends.
#[derive(Debug)]
pub(crate) struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[derive(Debug)]
struct Connection {
    stream: UnixStream,
    buffer: Vec<u8>,
    /// When the client last sent something or was answered.
    last_active: Instant,
    /// The request whose answer the controller deferred, and whether to keep the connection
    /// open after it. Until it comes, the connection is not watched and nothing more of it is
    /// served (answers keep the requests' order).
    waiting: Option<(Ticket, bool)>,
    /// Whether the request being received was sent `100 Continue` already.
    continued: bool,
    /// The deferred request's method and path and when it came, for the request log.
    deferred: Option<(String, Instant)>,
}

/// Whether every request is logged on stderr ([`log_requests`]).
static LOG_REQUESTS: AtomicBool = AtomicBool::new(false);

/// Logs every request of every API socket of the process on stderr from now on (`on`), with
/// its status, time and, for a refusal, its message; or stops. The log level `debug`
/// ([`LogLevel::Debug`]) logs them too.
pub(crate) fn log_requests(on: bool) {
    LOG_REQUESTS.store(on, Ordering::Relaxed);
}

/// Logs `request` (method and path) answered with `response` after `since`, if asked to.
fn log_request(request: &str, response: &Response, since: Instant) {
    if !LOG_REQUESTS.load(Ordering::Relaxed) && !logs(LogLevel::Debug) {
        return;
    }
    let fault = response
        .body
        .as_ref()
        .and_then(|b| b["fault_message"].as_str())
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    eprintln!(
        "tinyvmm: api: {request} -> {} in {:.1} ms{fault}",
        response.status,
        since.elapsed().as_secs_f64() * 1e3
    );
}

/// What serving a connection's requests left it as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// Open, watched for more.
    Open,
    /// To be closed.
    Close,
    /// Waiting for a deferred answer.
    Waiting,
}

/// How long a connection may stay open with nothing from its client, by default.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Most clients connected at once; more get a 503 and are closed.
pub const MAX_CONNECTIONS: usize = 128;

/// Bytes a connection may hold unparsed before the server stops reading from it for a while.
const READ_LIMIT: usize = 2 * (MAX_HEADER_BYTES + MAX_BODY_BYTES);

/// The API socket's subscriber: the listener and every client connection.
#[derive(Debug)]
pub(crate) struct ApiServer<C> {
    listener: UnixListener,
    connections: HashMap<RawFd, Connection>,
    controller: C,
    /// A file descriptor held in reserve. When the process runs out (`EMFILE`), a waiting client
    /// can be neither served nor left waiting (the listener would stay readable and the event
    /// loop spin): the server gives this one up to take the client, answers 503 and closes it.
    spare: Option<File>,
    /// Out of descriptors with no spare: the listener is not watched until a client leaves.
    paused: bool,
    /// A connection with nothing from its client for this long is answered 408 and closed, so
    /// that idle clients cannot hold every connection slot for ever.
    idle_timeout: Duration,
    /// Fires a few times per idle timeout to close idle connections.
    sweep: Option<TimerFd>,
    /// The controller's notifier (see [`Apply::notifier`]), once watched.
    notifier: Option<RawFd>,
    /// Connections waiting for a deferred answer, by its ticket.
    waiting: HashMap<Ticket, RawFd>,
    /// Answers given, by status (`GET /metrics`).
    answered: BTreeMap<u16, u64>,
    /// The process's own counters for `GET /metrics`, read when it is asked.
    counters: Option<fn() -> Vec<Labelled>>,
}

impl<C: Apply> ApiServer<C> {
    /// Serves `listener` with `controller`.
    pub(crate) fn new(listener: UnixListener, controller: C) -> Self {
        ApiServer {
            listener,
            connections: HashMap::new(),
            controller,
            spare: File::open("/dev/null").ok(),
            paused: false,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            sweep: None,
            notifier: None,
            waiting: HashMap::new(),
            answered: BTreeMap::new(),
            counters: None,
        }
    }

    /// Adds the counters `counters` gives to `GET /metrics`' answer.
    pub(crate) fn with_counters(self, counters: fn() -> Vec<Labelled>) -> Self {
        ApiServer {
            counters: Some(counters),
            ..self
        }
    }

    /// Closes connections whose client sent nothing for `timeout` (after a 408).
    pub(crate) fn with_idle_timeout(self, timeout: Duration) -> Self {
        ApiServer {
            idle_timeout: timeout,
            ..self
        }
    }

    /// Answers 408 to every connection idle for the idle timeout and closes it.
    fn close_idle(&mut self, ops: &mut EventOps) {
        let now = Instant::now();
        let timeout = self.idle_timeout;
        let idle: Vec<RawFd> = self
            .connections
            .iter()
            // A client waiting for a deferred answer is not idle.
            .filter(|(_, c)| c.waiting.is_none() && now.duration_since(c.last_active) >= timeout)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in idle {
            let mut connection = self.connections.remove(&fd).expect("listed above");
            let message = format!(
                "the connection was idle for {} s: closed (send a request within that time)",
                timeout.as_secs_f64()
            );
            Self::send(
                &mut self.answered,
                &mut connection.stream,
                &Response::fault(408, message),
                false,
            );
            let _ = ops.remove(Events::new(&connection.stream, EventSet::IN));
            self.connection_closed(ops);
        }
    }

    /// A connection went: if the listener was paused for want of descriptors, listen again.
    fn connection_closed(&mut self, ops: &mut EventOps) {
        if self.paused {
            // A descriptor is free again: take the spare back and listen again.
            if self.spare.is_none() {
                self.spare = File::open("/dev/null").ok();
            }
            self.paused = ops.add(Events::new(&self.listener, EventSet::IN)).is_err();
        }
    }

    /// The controller.
    pub(crate) fn controller_mut(&mut self) -> &mut C {
        &mut self.controller
    }

    /// Requests whose answer the controller deferred and has not given yet.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Answers every request still waiting for a deferred answer with a 503 saying `why`,
    /// and closes its connection: the VMM is going.
    pub(crate) fn abandon_waiting(&mut self, why: &str) {
        for (_, fd) in self.waiting.drain() {
            if let Some(mut connection) = self.connections.remove(&fd) {
                Self::send(
                    &mut self.answered,
                    &mut connection.stream,
                    &Response::fault(503, why),
                    false,
                );
            }
        }
    }

    /// Hands the controller's ready deferred answers to the clients waiting for them, and
    /// serves what those clients sent meanwhile.
    fn deliver(&mut self, ops: &mut EventOps) {
        for (ticket, outcome) in self.controller.settle() {
            self.answer(ticket, outcome, ops);
        }
    }

    fn answer(&mut self, ticket: Ticket, outcome: Outcome, ops: &mut EventOps) {
        let Some(fd) = self.waiting.remove(&ticket) else {
            return;
        };
        let Some(connection) = self.connections.get_mut(&fd) else {
            return;
        };
        let keep_alive = connection.waiting.take().is_some_and(|(_, keep)| keep);
        connection.last_active = Instant::now();
        let response = respond(outcome);
        if let Some((request, since)) = connection.deferred.take() {
            log_request(&request, &response, since);
        }
        if !Self::send(
            &mut self.answered,
            &mut connection.stream,
            &response,
            keep_alive,
        ) || !keep_alive
            || ops
                .add(Events::new(&connection.stream, EventSet::IN))
                .is_err()
        {
            self.close(fd, ops);
            return;
        }
        // Requests the client sent meanwhile are in the buffer already: no event will come
        // for them.
        self.handle(fd, ops);
    }

    /// Serves connection `fd` and watches, parks or closes it as that left it.
    fn handle(&mut self, fd: RawFd, ops: &mut EventOps) {
        match self.serve(fd) {
            Served::Open => {}
            Served::Waiting => {
                if let Some(connection) = self.connections.get(&fd) {
                    let _ = ops.remove(Events::new(&connection.stream, EventSet::IN));
                }
            }
            Served::Close => self.close(fd, ops),
        }
    }

    fn close(&mut self, fd: RawFd, ops: &mut EventOps) {
        if let Some(connection) = self.connections.remove(&fd) {
            if let Some((ticket, _)) = connection.waiting {
                self.waiting.remove(&ticket);
            }
            let _ = ops.remove(Events::new(&connection.stream, EventSet::IN));
        }
        self.connection_closed(ops);
    }

    fn accept(&mut self, ops: &mut EventOps) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    if self.connections.len() >= MAX_CONNECTIONS {
                        let busy = Response::fault(
                            503,
                            format!("too many clients: at most {MAX_CONNECTIONS} at once"),
                        );
                        Self::send(&mut self.answered, &mut stream, &busy, false);
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    if ops.add(Events::new(&stream, EventSet::IN)).is_ok() {
                        self.connections.insert(
                            fd,
                            Connection {
                                stream,
                                buffer: Vec::new(),
                                last_active: Instant::now(),
                                waiting: None,
                                continued: false,
                                deferred: None,
                            },
                        );
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Linux refuses an accept for want of a descriptor whether or not a client waits.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    match self.shed() {
                        Some(true) => {}
                        Some(false) => return,
                        None => {
                            log(
                                LogLevel::Warn,
                                format_args!(
                                    "the API socket stops accepting until a client leaves: {e}"
                                ),
                            );
                            let _ = ops.remove(Events::new(&self.listener, EventSet::IN));
                            self.paused = true;
                            return;
                        }
                    }
                }
                Err(_) => return,
            }
        }
    }

    /// Out of file descriptors: gives up the spare one to take the next waiting client, tells
    /// it so and closes it. Whether a client was there; `None` if there was no spare.
    fn shed(&mut self) -> Option<bool> {
        drop(self.spare.take()?);
        let shed = match self.listener.accept() {
            Ok((mut stream, _)) => {
                let busy = Response::fault(
                    503,
                    "the VMM is out of file descriptors: try again when other clients have left",
                );
                Self::send(&mut self.answered, &mut stream, &busy, false);
                true
            }
            Err(_) => false,
        };
        self.spare = File::open("/dev/null").ok();
        Some(shed)
    }

    /// Reads what is there; returns whether the client closed its end.
    fn read(connection: &mut Connection) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        while connection.buffer.len() < READ_LIMIT {
            match connection.stream.read(&mut chunk) {
                Ok(0) => return true,
                Ok(n) => {
                    connection.buffer.extend_from_slice(&chunk[..n]);
                    connection.last_active = Instant::now();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }

    /// Sends `response`, counting it in `answered` by status.
    fn send(
        answered: &mut BTreeMap<u16, u64>,
        stream: &mut UnixStream,
        response: &Response,
        keep_alive: bool,
    ) -> bool {
        *answered.entry(response.status).or_default() += 1;
        Self::send_bytes(stream, &response.to_bytes(keep_alive))
    }

    fn send_bytes(stream: &mut UnixStream, bytes: &[u8]) -> bool {
        // Answers are small: write them whole, but never wait long for a client that does not
        // read.
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        let sent = stream.write_all(bytes).is_ok();
        let _ = stream.set_nonblocking(true);
        sent
    }

    /// `GET /metrics`' answer, from the controller's replies to the metrics' sources.
    fn metrics(&mut self) -> Response {
        let replies: Vec<Option<serde_json::Value>> = crate::api::metrics::sources()
            .into_iter()
            .map(|request| {
                let response = respond(self.controller.apply(request));
                response.body.filter(|_| response.status == 200)
            })
            .collect();
        let counters = self.counters.map(|counters| counters()).unwrap_or_default();
        Response::text(crate::api::metrics::render(
            &replies,
            &self.answered,
            self.connections.len(),
            &counters,
        ))
    }

    /// Serves the requests buffered on connection `fd`, up to one whose answer is deferred.
    fn serve(&mut self, fd: RawFd) -> Served {
        let Some(connection) = self.connections.get_mut(&fd) else {
            return Served::Close;
        };
        if connection.waiting.is_some() {
            return Served::Waiting;
        }
        let closed = Self::read(connection);
        loop {
            let connection = self.connections.get_mut(&fd).expect("present above");
            match http::parse(&connection.buffer) {
                Ok(Parsed::Incomplete) => break,
                Ok(Parsed::ExpectsContinue) => {
                    if !connection.continued {
                        connection.continued = true;
                        if !Self::send_bytes(&mut connection.stream, http::CONTINUE) {
                            return Served::Close;
                        }
                    }
                    break;
                }
                Ok(Parsed::Complete(request, used)) => {
                    connection.buffer.drain(..used);
                    connection.continued = false;
                    let since = Instant::now();
                    let outcome = if request.method == "GET"
                        && request.path.trim_end_matches('/') == "/metrics"
                    {
                        Err(self.metrics())
                    } else {
                        route(&request).map(|r| self.controller.apply(r))
                    };
                    let connection = self.connections.get_mut(&fd).expect("present above");
                    connection.last_active = Instant::now();
                    let response = match outcome {
                        Ok(Ok(Reply::Deferred(ticket))) => {
                            // The answer comes later (`deliver`); nothing more of this
                            // connection is served until then.
                            connection.waiting = Some((ticket, request.keep_alive));
                            connection.deferred =
                                Some((format!("{} {}", request.method, request.path), since));
                            self.waiting.insert(ticket, fd);
                            return Served::Waiting;
                        }
                        Ok(outcome) => respond(outcome),
                        Err(refusal) => refusal,
                    };
                    log_request(
                        &format!("{} {}", request.method, request.path),
                        &response,
                        since,
                    );
                    if !Self::send(
                        &mut self.answered,
                        &mut connection.stream,
                        &response,
                        request.keep_alive,
                    ) || !request.keep_alive
                    {
                        return Served::Close;
                    }
                }
                Err(e) => {
                    let refusal = Response::fault(e.status(), &e);
                    log_request(
                        "(a request that cannot be framed)",
                        &refusal,
                        Instant::now(),
                    );
                    Self::send(&mut self.answered, &mut connection.stream, &refusal, false);
                    return Served::Close;
                }
            }
        }
        if closed {
            let connection = self.connections.get_mut(&fd).expect("present above");
            if let Err(e) = http::at_close(&connection.buffer) {
                // The client may have closed only its sending side: tell it what went wrong.
                Self::send(
                    &mut self.answered,
                    &mut connection.stream,
                    &Response::fault(e.status(), &e),
                    false,
                );
            }
            return Served::Close;
        }
        Served::Open
    }
}

impl<C: Apply> MutEventSubscriber for ApiServer<C> {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.listener.as_raw_fd() {
            self.accept(ops);
        } else if self.sweep.as_ref().is_some_and(|t| t.as_raw_fd() == fd) {
            if let Some(timer) = self.sweep.as_mut() {
                let _ = timer.wait();
            }
            self.close_idle(ops);
        } else if self.notifier == Some(fd) {
            self.deliver(ops);
        } else {
            self.handle(fd, ops);
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        ops.add(Events::new(&self.listener, EventSet::IN))
            .expect("watching the API socket");
        if let Some(fd) = self.controller.notifier() {
            ops.add(Events::new_raw(fd, EventSet::IN))
                .expect("watching the controller's notifier");
            self.notifier = Some(fd);
        }
        // Sweep a few times per timeout, so that a connection goes at most a quarter of the
        // timeout late.
        let every =
            (self.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let timer = TimerFd::new().and_then(|mut t| t.reset(every, Some(every)).map(|()| t));
        match timer {
            Ok(timer) => {
                ops.add(Events::new(&timer, EventSet::IN))
                    .expect("watching the idle sweep's timer");
                self.sweep = Some(timer);
            }
            Err(e) => log(
                LogLevel::Warn,
                format_args!("idle API connections will not be closed: {e}"),
            ),
        }
    }
}
