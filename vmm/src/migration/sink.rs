//! A migration's destination as the pre-copy rounds see it: another VMM on the memory stream
//! ([`StreamSink`], a `precopy::Sink`), the State record it receives last ([`StateRecord`]),
//! and how a migration fails on the way ([`MigrationError`]).

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvm_memslots::{DirtyPages, KvmVm, MemoryManager, RegionId, Target};
use kvm_memslots_persist::stream::{
    read_answer, shared_files, StreamError, StreamWriter, MAX_HANDOVER,
};
use kvm_memslots_persist::{LayoutBacking, MemoryLayout};

use super::transport::{Connection, Endpoint, Limits, WaitEnd, WaitError, Watch};
use crate::precopy::{Next, PreCopyError, Sink, Waits};
use crate::vm::state::VcpuState;

/// How long connecting may wait (within the timeout).
const CONNECT_STALL: Duration = Duration::from_secs(10);
/// The shortest and the longest a wait may see nothing move on the connection: `timeout_s`
/// between the two. (From the pause on, the destination also restores the VM before it
/// answers: a short timeout must not make a healthy destination look dead.)
const MIN_STALL: Duration = Duration::from_secs(10);
const MAX_STALL: Duration = Duration::from_secs(60);
/// How long a destination that broke the connection may take to say why.
const REASON_STALL: Duration = Duration::from_millis(500);

type Memory = MemoryManager<KvmVm>;

/// How a migration fails on its way to the destination.
#[derive(Debug, thiserror::Error)]
enum MigrationError {
    /// The destination could not be reached.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: String,
        /// The system's error.
        source: io::Error,
    },
    /// The destination refused the VM.
    #[error("the destination refused: {0}")]
    Refused(String),
    /// Sending or the destination's answer failed.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// Nothing moved on the connection for too long while waiting for the destination.
    #[error("the destination stopped responding: {0}")]
    Stalled(WaitError),
    /// Everything went out, but the destination's answer did not come: it may run the VM.
    #[error(
        "the destination got the whole VM but did not answer ({0}): it may be running the VM, \
         so the VM stays paused here; if the destination does not run it, PATCH /vm \
         {{\"state\": \"Resumed\"}} runs it here again"
    )]
    Unconfirmed(StreamError),
}

impl From<MigrationError> for PreCopyError {
    fn from(error: MigrationError) -> Self {
        match error {
            MigrationError::Unconfirmed(_) => PreCopyError::Unconfirmed(Box::new(error)),
            _ => PreCopyError::Sink(Box::new(error)),
        }
    }
}

/// The State record a migration sends last: the guest kind's own bytes (the destination of
/// the same guest kind reads them), made once the vCPUs are paused.
pub trait StateRecord: std::fmt::Debug + Send + 'static {
    /// The record for memory laid out as `layout` and the vCPUs' `states`, by index; an error
    /// says what of the VM could not be saved (the migration then fails and the VM goes on).
    fn to_bytes(&self, layout: &MemoryLayout, states: Vec<VcpuState>) -> Result<Vec<u8>, String>;
}

/// What a wait that a watch ended means for the run: a client's cancel or a signal cancels
/// it; the timeout (before the pause) cancels it as "not converged"; a stall fails it.
fn ended(waits: &Waits, wait: &WaitError) -> PreCopyError {
    match wait.end {
        WaitEnd::Cancelled => PreCopyError::Cancelled("a client cancelled it".into()),
        WaitEnd::Interrupted => PreCopyError::Cancelled("the VMM is stopping".into()),
        WaitEnd::Deadline(_) => PreCopyError::Cancelled(format!(
            "not converged within {:?} (timeout_s): still waiting for {}",
            waits.timeout, wait.what
        )),
        WaitEnd::Stalled(_) => MigrationError::Stalled(wait.clone()).into(),
    }
}

/// Counts the bytes written (the connection watches the waits).
struct Counted {
    inner: Connection,
    bytes: Arc<AtomicU64>,
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The connection once open: the stream out and the destination's answers in.
struct Open {
    writer: StreamWriter<Counted>,
    answers: Connection,
    waits: Waits,
}

/// A migration's destination: a `tinyvmm receive` process at `endpoint`, on the memory stream.
pub(super) struct StreamSink {
    endpoint: Endpoint,
    /// Hand shared memory over instead of copying it.
    local: bool,
    /// What the State record holds besides the layout and the vCPUs' states.
    state: Box<dyn StateRecord>,
    open: Option<Open>,
}

impl std::fmt::Debug for StreamSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSink")
            .field("endpoint", &self.endpoint)
            .field("local", &self.local)
            .field("open", &self.open.is_some())
            .finish()
    }
}

impl StreamSink {
    /// A migration to `endpoint` (handing memfd-backed memory over if `local`), ending with
    /// `state`'s record.
    pub(super) fn new(endpoint: Endpoint, local: bool, state: Box<dyn StateRecord>) -> Self {
        StreamSink {
            endpoint,
            local,
            state,
            open: None,
        }
    }

    fn open(&mut self) -> &mut Open {
        self.open.as_mut().expect("the rounds open the sink first")
    }

    /// From now on the connection's waits are for `what`: until the run's timeout if
    /// `by_timeout`, and as long as something moves.
    fn wait_for(&self, what: &str, by_timeout: bool) {
        if let Some(open) = &self.open {
            open.answers
                .watch()
                .expect(what, limits(&open.waits, by_timeout));
        }
    }
}

impl Open {
    /// A step on the connection failed: a watched wait that ended, or the connection broke,
    /// in which case the destination may have said why before it closed; prefer that.
    fn explain(&mut self, error: StreamError) -> PreCopyError {
        if let Some(wait) = ended_wait(&error) {
            return ended(&self.waits, wait);
        }
        self.answers.watch().expect(
            "the destination's reason for closing",
            Limits {
                deadline: None,
                stall: REASON_STALL,
            },
        );
        match read_answer(&mut self.answers) {
            Ok(Err(reason)) => MigrationError::Refused(reason),
            _ => MigrationError::Stream(error),
        }
        .into()
    }

    /// Hands every shared region's file over beside Handover records.
    fn hand_over(&mut self, memory: &Memory, layout: &MemoryLayout) -> Result<(), StreamError> {
        let files = shared_files(memory, layout)?;
        for chunk in files.chunks(MAX_HANDOVER) {
            let fds = chunk
                .iter()
                .map(|(_, file)| file.file().try_clone().map(OwnedFd::from))
                .collect::<io::Result<Vec<_>>>()
                .map_err(|source| StreamError::Io {
                    what: "duplicating a region's file descriptor".into(),
                    source,
                })?;
            self.writer
                .get_mut()
                .inner
                .attach_fds(fds)
                .map_err(|source| StreamError::Io {
                    what: "handing memory over".into(),
                    source,
                })?;
            let regions: Vec<(u32, u64)> = chunk.iter().map(|(i, f)| (*i, f.start())).collect();
            self.writer.handover(&regions)?;
        }
        Ok(())
    }
}

impl Sink for StreamSink {
    /// Connects, sends the layout, and (local mode) hands shared memory over: only the rest
    /// is logged and copied.
    fn open(
        &mut self,
        waits: &Waits,
        memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, PreCopyError> {
        // Every wait from here on ends on a cancel or a signal, and until the pause at the
        // timeout: the connection watches it.
        let watch = Watch::new(
            waits.interrupt,
            Some(Arc::clone(&waits.cancel)),
            format!("a connection to {}", self.endpoint),
            Limits {
                deadline: Some(waits.started + waits.timeout),
                stall: CONNECT_STALL,
            },
        );
        let connect_failed = |source: io::Error| match WaitError::of(&source) {
            Some(wait) => ended(waits, wait),
            None => MigrationError::Connect {
                endpoint: self.endpoint.to_string(),
                source,
            }
            .into(),
        };
        let connection = self
            .endpoint
            .connect(watch.clone())
            .map_err(connect_failed)?;
        let answers = connection.try_clone().map_err(connect_failed)?;
        let local = self.local;
        let open = self.open.insert(Open {
            writer: StreamWriter::new(Counted {
                inner: connection,
                bytes: Arc::clone(&waits.bytes),
            }),
            answers,
            waits: waits.clone(),
        });
        let expect = |what: &str| {
            watch.expect(what, limits(waits, true));
        };
        expect("the destination to take the memory layout");
        if !local {
            open.writer.hello(layout).map_err(|e| open.explain(e))?;
            return Ok(vec![Target::All]);
        }
        // Memory the destination maps too needs no copy and no log: only the rest does.
        open.writer
            .hello_handing_over(layout)
            .map_err(|e| open.explain(e))?;
        open.hand_over(memory, layout)
            .map_err(|e| open.explain(e))?;
        Ok(layout
            .regions
            .iter()
            .filter(|r| r.backing != LayoutBacking::Shared)
            .map(|r| Target::Region(RegionId(r.id)))
            .collect())
    }

    fn accepted(&mut self) -> Result<(), PreCopyError> {
        self.wait_for("the destination's answer to the memory layout", true);
        let open = self.open();
        match read_answer(&mut open.answers) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(MigrationError::Refused(reason).into()),
            Err(e) => Err(match ended_wait(&e) {
                Some(wait) => ended(&open.waits, wait),
                None => MigrationError::Stream(e).into(),
            }),
        }
    }

    fn expect(&self, next: Next, by_timeout: bool) {
        let what = match next {
            Next::Round(round) => format!("the destination to take round {round}'s pages"),
            Next::LastPages => "the destination to take the last pages and the VM's state".into(),
        };
        self.wait_for(&what, by_timeout);
    }

    /// Every page: the destination has no memory before.
    fn send_all(&mut self, memory: &Memory) -> Result<u64, PreCopyError> {
        let open = self.open();
        let sent = open.writer.send_all(memory).map_err(|e| open.explain(e))?;
        Ok(sent.bytes)
    }

    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, PreCopyError> {
        let open = self.open();
        let sent = open
            .writer
            .send_dirty(memory, dirty)
            .map_err(|e| open.explain(e))?;
        Ok(sent.bytes)
    }

    fn end_round(&mut self) -> Result<(), PreCopyError> {
        let open = self.open();
        open.writer.end_round().map_err(|e| open.explain(e))
    }

    /// Sends the State record and Done, and waits for the destination's word that it runs
    /// the VM: without it, the VM may run there ([`MigrationError::Unconfirmed`], which the
    /// rounds see as [`PreCopyError::Unconfirmed`]).
    fn finish(
        &mut self,
        _memory: &Memory,
        layout: &MemoryLayout,
        states: Vec<VcpuState>,
    ) -> Result<(), PreCopyError> {
        let state = self
            .state
            .to_bytes(layout, states)
            .map_err(PreCopyError::State)?;
        let open = self.open();
        open.writer.state(&state).map_err(|e| open.explain(e))?;
        // A failed write leaves Done incomplete, and a destination runs nothing without it.
        open.writer.done().map_err(|e| open.explain(e))?;
        self.wait_for("the destination's word that the VM runs there", false);
        match read_answer(&mut self.open().answers) {
            Ok(Ok(())) => Ok(()),
            // It says it does not run the VM: the VM goes on here.
            Ok(Err(reason)) => Err(MigrationError::Refused(reason).into()),
            Err(e) => Err(MigrationError::Unconfirmed(e).into()),
        }
    }

    fn stays(&self) -> bool {
        false
    }
}

/// A wait's limits: until the run's timeout if `by_timeout`, and as long as something moves.
fn limits(waits: &Waits, by_timeout: bool) -> Limits {
    Limits {
        deadline: by_timeout.then(|| waits.started + waits.timeout),
        stall: waits.timeout.clamp(MIN_STALL, MAX_STALL),
    }
}

/// The watched wait behind a stream error, if one ended it.
fn ended_wait(error: &StreamError) -> Option<&WaitError> {
    match error {
        StreamError::Io { source, .. } => WaitError::of(source),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounds see a migration's failures as the engine's, with the stream's words: only
    /// an unconfirmed ending leaves the vCPUs held, and a wait a cancel or the timeout ended
    /// is a cancel, which keeps the VM running here.
    #[test]
    fn a_migrations_failures_keep_their_words_and_their_kind() {
        let refused = PreCopyError::from(MigrationError::Refused("no room".into()));
        assert!(matches!(refused, PreCopyError::Sink(_)));
        assert_eq!(refused.to_string(), "the destination refused: no room");
        let closed = || StreamError::Io {
            what: "reading the answer".into(),
            source: io::Error::from(io::ErrorKind::UnexpectedEof),
        };
        let unconfirmed = PreCopyError::from(MigrationError::Unconfirmed(closed()));
        assert!(matches!(unconfirmed, PreCopyError::Unconfirmed(_)));
        assert!(
            unconfirmed
                .to_string()
                .starts_with("the destination got the whole VM but did not answer"),
            "{unconfirmed}"
        );
        static NEVER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let waits = Waits {
            cancel: Arc::default(),
            interrupt: &NEVER,
            started: std::time::Instant::now(),
            timeout: Duration::from_secs(5),
            bytes: Arc::default(),
        };
        let wait = |end| WaitError {
            what: "the destination's answer".into(),
            end,
        };
        let deadline = ended(&waits, &wait(WaitEnd::Deadline(Duration::from_secs(5))));
        assert!(matches!(deadline, PreCopyError::Cancelled(_)), "{deadline}");
        assert_eq!(
            deadline.to_string(),
            "cancelled: not converged within 5s (timeout_s): still waiting for the \
             destination's answer"
        );
        let stalled = ended(&waits, &wait(WaitEnd::Stalled(Duration::from_secs(10))));
        assert!(matches!(stalled, PreCopyError::Sink(_)), "{stalled}");
        assert!(
            stalled
                .to_string()
                .starts_with("the destination stopped responding: waiting for"),
            "{stalled}"
        );
    }
}
