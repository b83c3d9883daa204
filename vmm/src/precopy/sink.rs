//! Where a pre-copy run's pages and the VM's state go ([`Sink`]): a migration's destination,
//! another VMM on a stream (`migration::sink::StreamSink`), or a live snapshot's files
//! (`snapshot::live::FileSink`). The rounds ([`super::rounds`]) decide what to copy and when to
//! pause; the sink carries the pages and the state, and says whether the VM moves away or goes
//! on here once it has them all. What the run's waits answer to ([`Waits`]) is shared by both.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::{DirtyPages, KvmVm, MemoryManager, Target};
use kvm_memslots_persist::MemoryLayout;

use super::error::PreCopyError;
use crate::vm::state::VcpuState;

type Memory = MemoryManager<KvmVm>;

/// What a run's waits answer to, shared by the rounds and their sink: a client's cancel, the
/// process's stop flag, the run's start and timeout, and the bytes carried so far (for
/// progress).
#[derive(Debug, Clone)]
pub(crate) struct Waits {
    /// A client's cancel.
    pub(crate) cancel: Arc<AtomicBool>,
    /// The process's stop flag (SIGINT/SIGTERM).
    pub(crate) interrupt: &'static AtomicBool,
    /// When the run started.
    pub(crate) started: Instant,
    /// How long its rounds may take.
    pub(crate) timeout: Duration,
    /// Bytes of pages carried so far.
    pub(crate) bytes: Arc<AtomicU64>,
}

impl Waits {
    /// Why the run must stop now, if a client cancelled it or the VMM is stopping.
    pub(crate) fn check_cancel(&self) -> Result<(), PreCopyError> {
        if self.cancel.load(Ordering::Acquire) {
            return Err(PreCopyError::Cancelled("a client cancelled it".into()));
        }
        if self.interrupt.load(Ordering::Acquire) {
            return Err(PreCopyError::Cancelled("the VMM is stopping".into()));
        }
        Ok(())
    }
}

/// What the rounds have the sink carry next, for what its waits say they wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// A round's pages (round 1: every page that holds data).
    Round(u32),
    /// With the vCPUs paused: the last pages and the VM's state.
    LastPages,
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
pub(crate) trait Sink: Send + 'static {
    /// Gets ready for memory laid out as `layout`; returns what the rounds must log and
    /// copy (every region, or those a local migration does not hand over).
    fn open(
        &mut self,
        waits: &Waits,
        memory: &Memory,
        layout: &MemoryLayout,
    ) -> Result<Vec<Target>, PreCopyError>;
    /// Waits until the other side took the layout (logging is on by now).
    fn accepted(&mut self) -> Result<(), PreCopyError>;
    /// The rounds took `harvest` from their reader of the dirty log, and nothing can fail
    /// between that harvest and this call: a sink that owes those pages to the reader's owner
    /// unless it saves them (a live Diff, whose chain's next Diff needs them) keeps them from
    /// here on, whatever step ends the rounds. A migration's sink needs nothing of them.
    fn took(&mut self, _harvest: &[DirtyPages]) {}
    /// From now on its waits are for `next`: until the run's timeout if `by_timeout`, and as
    /// long as something moves.
    fn expect(&self, next: Next, by_timeout: bool);
    /// Carries round 1: every page of `memory` that holds data, or, for a sink that carries
    /// only what changed since a point before (a live Diff), the pages it [`took`](Sink::took)
    /// so far (what the rounds' reader had logged when they began, and those it carried in);
    /// returns its bytes.
    fn send_all(&mut self, memory: &Memory) -> Result<u64, PreCopyError>;
    /// Carries the pages of `dirty`; returns their bytes.
    fn send_dirty(&mut self, memory: &Memory, dirty: &[DirtyPages]) -> Result<u64, PreCopyError>;
    /// Ends a round.
    fn end_round(&mut self) -> Result<(), PreCopyError>;
    /// With the vCPUs paused and every page carried: carries the VM's state (`layout`, the
    /// vCPUs' `states`; `memory` as it is at the point) and, for a migration, waits for the
    /// destination's word that it runs the VM. Once the other side may run the VM, a failure
    /// is [`PreCopyError::Unconfirmed`]: the rounds then leave the vCPUs paused.
    fn finish(
        &mut self,
        memory: &Memory,
        layout: &MemoryLayout,
        states: Vec<VcpuState>,
    ) -> Result<(), PreCopyError>;
    /// Whether the VM goes on here once finished (a live snapshot) rather than on the
    /// destination (a migration).
    fn stays(&self) -> bool;
    /// For a sink that stays, once the vCPUs run again: what is left to do off the pause.
    fn settle(&mut self) -> Result<(), PreCopyError> {
        Ok(())
    }
}
