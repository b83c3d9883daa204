//! Why a pre-copy run ended without completing.

use crate::vm::vcpu::PauseError;

/// An error a sink returns, in its own type (a migration's stream, a live snapshot's files).
type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// Why a pre-copy run failed, was cancelled, or ended unconfirmed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PreCopyError {
    /// A client cancelled it, the timeout came, or the VMM is stopping: the VM goes on here.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// Harvesting or switching dirty logging failed.
    #[error(transparent)]
    Memory(#[from] kvm_memslots::Error),
    /// A vCPU could not be paused or its state read.
    #[error("vCPU {vcpu}: {error}")]
    Vcpu {
        /// The vCPU.
        vcpu: usize,
        /// Why.
        error: PauseError,
    },
    /// The VM's state (its devices', say) could not be saved; the guest kind says why.
    #[error("saving the VM's state failed: {0}")]
    State(String),
    /// The sink could not carry the pages or the state: its own error says why.
    #[error(transparent)]
    Sink(SinkError),
    /// The sink carried the whole VM but its other side did not confirm it took it (a
    /// migration's destination that did not answer): the VM may run there, so its vCPUs stay
    /// paused here.
    #[error(transparent)]
    Unconfirmed(SinkError),
}
