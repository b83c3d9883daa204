//! Where a run's rounds go ([`Sink`]): a migration's destination, another VMM on a stream
//! ([`StreamSink`]), or a live snapshot's files (`snapshot::live`). The rounds
//! ([`super::source`]) decide what to copy and when to pause; the sink carries the pages and the
//! state, and says whether the VM moves away or goes on here once it has them all.

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{DirtyPages, KvmVm, MemoryManager, RegionId, Target};
use kvm_memslots_persist::stream::{
    read_answer, shared_files, StreamError, StreamWriter, MAX_HANDOVER,
};
use kvm_memslots_persist::{LayoutBacking, MemoryLayout};

use super::source::{MigrationError, StateRecord};
use super::transport::{Connection, Endpoint, Limits, WaitEnd, WaitError, Watch};
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

/// What a run's waits answer to, shared by the rounds and their sink: a client's cancel, the
/// process's stop flag, the run's start and timeout, and the bytes carried so far (for
/// progress).
#[derive(Debug, Clone)]
pub struct Waits {
    /// A client's cancel.
    pub cancel: Arc<AtomicBool>,
    /// The process's stop flag (SIGINT/SIGTERM).
    pub interrupt: &'static AtomicBool,
    /// When the run started.
    pub started: Instant,
    /// How long its rounds may take.
    pub timeout: Duration,
    /// Bytes of pages carried so far.
    pub bytes: Arc<AtomicU64>,
}

impl Waits {
    /// Why the run must stop now, if a client cancelled it or the VMM is stopping.
    pub fn check_cancel(&self) -> Result<(), MigrationError> {
        if self.cancel.load(Ordering::Acquire) {
            return Err(MigrationError::Cancelled("a client cancelled it".into()));
        }
        if self.interrupt.load(Ordering::Acquire) {
            return Err(MigrationError::Cancelled("the VMM is stopping".into()));
        }
        Ok(())
    }

    /// What a wait that a watch ended means for the run: a client's cancel or a signal
    /// cancels it; the timeout (before the pause) cancels it as "not converged"; a stall
    /// fails it.
    pub fn ended(&self, ended: &WaitError) -> MigrationError {
        match ended.end {
            WaitEnd::Cancelled => MigrationError::Cancelled("a client cancelled it".into()),
            WaitEnd::Interrupted => MigrationError::Cancelled("the VMM is stopping".into()),
            WaitEnd::Deadline(_) => MigrationError::Cancelled(format!(
                "not converged within {:?} (timeout_s): still waiting for {}",
                self.timeout, ended.what
            )),
            WaitEnd::Stalled(_) => MigrationError::Stalled(ended.clone()),
        }
    }
}

/// Where the rounds' pages and the VM's state go. The rounds call, in order: [`open`], then
/// (once logging is on) [`accepted`]; for each round [`expect`], a [`send_all`] or
/// [`send_dirty`]s, and [`end_round`]; with the vCPUs paused, the last pages, an
/// [`end_round`] and [`finish`]; and, for a sink that [`stays`], [`settle`] once the vCPUs run
/// again. Every harvest's pages go to [`took`] first, the moment the rounds have them.
///
/// [`open`]: Sink::open
/// [`took`]: Sink::took
/// [`accepted`]: Sink::accepted
/// [`expect`]: Sink::expect
/// [`send_all`]: Sink::send_all
/// [`send_dirty`]: Sink::send_dirty
/// [`end_round`]: Sink::end_round
/// [`finish`]: Sink::finish
/// [`stays`]: Sink::stays
/// [`settle`]: Sink::settle
pub trait Sink: Send + 'static {
    /// Where the VM goes, for its progress (`unix:PATH`, a memory file's path).
    fn destination(&self) -> String;
    /// Gets ready for memory laid out as `layout`; returns what the rounds must log and
    /// copy (every region, or those a local migration does not hand over).
    fn open(
        &mut self,
        waits: &Waits,
        memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, MigrationError>;
    /// Waits until the other side took the layout (logging is on by now).
    fn accepted(&mut self) -> Result<(), MigrationError>;
    /// The rounds took `harvest` from their reader of the dirty log, and nothing can fail
    /// between that harvest and this call: a sink that owes those pages to the reader's owner
    /// unless it saves them (a live Diff, whose chain's next Diff needs them) keeps them from
    /// here on, whatever step ends the rounds. A migration's sink needs nothing of them.
    fn took(&mut self, _harvest: &[DirtyPages]) {}
    /// From now on its waits are for `what`: until the run's timeout if `by_timeout`, and as
    /// long as something moves.
    fn expect(&self, what: &str, by_timeout: bool);
    /// Carries round 1: every page of `memory` that holds data, or, for a sink that carries
    /// only what changed since a point before (a live Diff), the pages it [`took`](Sink::took)
    /// so far (what the rounds' reader had logged when they began, and those it carried in);
    /// returns its bytes.
    fn send_all(&mut self, memory: &Memory) -> Result<u64, MigrationError>;
    /// Carries the pages of `dirty`; returns their bytes.
    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, MigrationError>;
    /// Ends a round.
    fn end_round(&mut self) -> Result<(), MigrationError>;
    /// With the vCPUs paused and every page carried: carries the VM's state (`layout`, the
    /// vCPUs' `states`; `memory` as it is at the point) and, for a migration, waits for the
    /// destination's word that it runs the VM.
    fn finish(
        &mut self,
        memory: &Memory,
        layout: &MemoryLayout,
        states: Vec<VcpuState>,
    ) -> Result<(), MigrationError>;
    /// Whether the VM goes on here once finished (a live snapshot) rather than on the
    /// destination (a migration).
    fn stays(&self) -> bool;
    /// For a sink that stays, once the vCPUs run again: what is left to do off the pause.
    fn settle(&mut self) -> Result<(), MigrationError> {
        Ok(())
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
pub struct StreamSink {
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
    pub fn new(endpoint: Endpoint, local: bool, state: Box<dyn StateRecord>) -> Self {
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
}

impl Open {
    /// A step on the connection failed: a watched wait that ended, or the connection broke,
    /// in which case the destination may have said why before it closed; prefer that.
    fn explain(&mut self, error: StreamError) -> MigrationError {
        if let Some(ended) = ended_wait(&error) {
            return self.waits.ended(ended);
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
    fn destination(&self) -> String {
        self.endpoint.to_string()
    }

    /// Connects, sends the layout, and (local mode) hands shared memory over: only the rest
    /// is logged and copied.
    fn open(
        &mut self,
        waits: &Waits,
        memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, MigrationError> {
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
            Some(ended) => waits.ended(ended),
            None => MigrationError::Connect {
                endpoint: self.endpoint.to_string(),
                source,
            },
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

    fn accepted(&mut self) -> Result<(), MigrationError> {
        self.expect("the destination's answer to the memory layout", true);
        let open = self.open();
        match read_answer(&mut open.answers) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(MigrationError::Refused(reason)),
            Err(e) => Err(match ended_wait(&e) {
                Some(ended) => open.waits.ended(ended),
                None => e.into(),
            }),
        }
    }

    fn expect(&self, what: &str, by_timeout: bool) {
        if let Some(open) = &self.open {
            open.answers
                .watch()
                .expect(what, limits(&open.waits, by_timeout));
        }
    }

    /// Every page: the destination has no memory before.
    fn send_all(&mut self, memory: &Memory) -> Result<u64, MigrationError> {
        let open = self.open();
        let sent = open.writer.send_all(memory).map_err(|e| open.explain(e))?;
        Ok(sent.bytes)
    }

    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, MigrationError> {
        let open = self.open();
        let sent = open
            .writer
            .send_dirty(memory, dirty)
            .map_err(|e| open.explain(e))?;
        Ok(sent.bytes)
    }

    fn end_round(&mut self) -> Result<(), MigrationError> {
        let open = self.open();
        open.writer.end_round().map_err(|e| open.explain(e))
    }

    /// Sends the State record and Done, and waits for the destination's word that it runs
    /// the VM: without it, the VM may run there ([`MigrationError::Unconfirmed`]).
    fn finish(
        &mut self,
        _memory: &Memory,
        layout: &MemoryLayout,
        states: Vec<VcpuState>,
    ) -> Result<(), MigrationError> {
        let state = self
            .state
            .to_bytes(layout, states)
            .map_err(MigrationError::State)?;
        let open = self.open();
        open.writer.state(&state).map_err(|e| open.explain(e))?;
        // A failed write leaves Done incomplete, and a destination runs nothing without it.
        open.writer.done().map_err(|e| open.explain(e))?;
        self.expect("the destination's word that the VM runs there", false);
        match read_answer(&mut self.open().answers) {
            Ok(Ok(())) => Ok(()),
            // It says it does not run the VM: the VM goes on here.
            Ok(Err(reason)) => Err(MigrationError::Refused(reason)),
            Err(e) => Err(MigrationError::Unconfirmed(e)),
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
