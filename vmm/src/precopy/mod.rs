//! The pre-copy engine: a running VM's memory copied in rounds while it runs, then a pause for
//! what is left and the vCPUs' state. It is named for what it does, not for its users: a
//! migration (`migration`, its stream to another VMM) and a live snapshot (`snapshot::live`,
//! its two files) are two [`Sink`]s above it.
//!
//! - [`rounds`]: the run on a thread of its own ([`PreCopy`]): rounds, convergence, the pause,
//!   the reader of the dirty log it harvests with ([`Reader`]), and the vCPUs it pauses
//!   ([`PreCopyVcpu`]);
//! - [`sink`]: where the pages and the state go ([`Sink`]), and what the run's waits answer to
//!   ([`Waits`]);
//! - [`progress`]: where a run is ([`Phase`], [`Progress`]);
//! - [`error`](mod@error): why a run ended without completing ([`PreCopyError`]).
//!
//! The engine knows no guest kind (a guest kind hands over its vCPUs), no destination (the
//! sink carries the pages) and no request (its caller turns one into [`Rounds`]).

mod error;
mod progress;
mod rounds;
mod sink;

pub(crate) use error::PreCopyError;
pub(crate) use progress::{Phase, Progress};
pub use rounds::OnTimeout;
pub(crate) use rounds::{PreCopy, PreCopyVcpu, Reader, Rounds, SourceVm};
pub(crate) use sink::{Next, Sink, Waits};
