//! Recording the pages a lazily restored VM touches first ([`Recording`]), into a
//! [`WorkingSet`] handed to the caller once.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::working_set::WorkingSet;

/// A recording of the pages a lazily restored VM touches first, in that order: the first
/// fills of faults (a vCPU's through KVM, or the VMM's own accesses), not the pages a prefetch
/// filled.
pub struct Recording {
    pub(super) snapshot: u128,
    pub(super) until: Option<Duration>,
    pub(super) done: Box<dyn FnOnce(WorkingSet) + Send>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("snapshot", &self.snapshot)
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}

impl Recording {
    /// Records until [`LazyLoader::stop_recording`](crate::LazyLoader::stop_recording), until
    /// the loader is dropped, or (given `until`) for that long after the loader starts,
    /// whichever comes first; then hands the list, of snapshot `snapshot`
    /// ([`WorkingSet::snapshot`]), to `done`, once. `done` runs on the thread that ends the
    /// recording (the handler's, for a set time): keep it short.
    pub fn new(
        snapshot: u128,
        until: Option<Duration>,
        done: impl FnOnce(WorkingSet) + Send + 'static,
    ) -> Self {
        Recording {
            snapshot,
            until,
            done: Box::new(done),
        }
    }
}

/// A recording under way: the list so far and where it goes.
pub(super) struct Recorder {
    pub(super) set: WorkingSet,
    pub(super) done: Box<dyn FnOnce(WorkingSet) + Send>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("pages", &self.set.pages())
            .finish_non_exhaustive()
    }
}

/// Where a loader's recording is kept, shared by the handler and the loader.
pub(super) type RecorderSlot = Arc<Mutex<Option<Recorder>>>;

/// Ends the recording in `slot`, if one is under way: hands its list over (outside the lock).
/// Whether there was one.
pub(super) fn finish_recording(slot: &Mutex<Option<Recorder>>) -> bool {
    let recorder = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    match recorder {
        Some(recorder) => {
            (recorder.done)(recorder.set);
            true
        }
        None => false,
    }
}
