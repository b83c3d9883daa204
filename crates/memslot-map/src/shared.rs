//! Publishing map versions to concurrent readers (read-copy-update).

use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::{ArcSwap, Guard};

use crate::error::BatchError;
use crate::map::{Change, MemslotMap};

/// The current version of a map, shared by any number of readers and writers.
///
/// Readers call [`load`](Self::load) and get a consistent version without taking a lock or
/// waiting for a writer: they never see half of a change. Writers are serialised by a mutex
/// that readers never touch; each builds the next version from the current one (sharing all
/// unchanged nodes) and publishes it with one atomic pointer swap.
pub struct SharedMap<P> {
    current: ArcSwap<MemslotMap<P>>,
    writer: Mutex<()>,
}

impl<P: Clone> SharedMap<P> {
    /// Publishes `map` as the first version.
    pub fn new(map: MemslotMap<P>) -> Self {
        SharedMap {
            current: ArcSwap::from_pointee(map),
            writer: Mutex::new(()),
        }
    }

    /// The current version, lock-free. Hold the guard briefly (it may pin the version); use
    /// [`snapshot`](Self::snapshot) to keep a version.
    pub fn load(&self) -> Guard<Arc<MemslotMap<P>>> {
        self.current.load()
    }

    /// The current version as an `Arc` the caller may keep as long as it likes.
    pub fn snapshot(&self) -> Arc<MemslotMap<P>> {
        self.current.load_full()
    }

    /// Runs one writer's update: `f` gets the current version and either returns the next
    /// version (published when `f` returns) with a result, or an error, in which case nothing
    /// is published. Writers run one at a time; readers are never blocked.
    pub fn update<T, E>(
        &self,
        f: impl FnOnce(&Arc<MemslotMap<P>>) -> Result<(MemslotMap<P>, T), E>,
    ) -> Result<T, E> {
        let _writer = self.lock_writer();
        let current = self.current.load_full();
        let (next, value) = f(&current)?;
        self.current.store(Arc::new(next));
        Ok(value)
    }

    /// Applies `changes` as one batch and publishes the result, or publishes nothing if any
    /// change is refused.
    pub fn apply(
        &self,
        changes: impl IntoIterator<Item = Change<P>>,
    ) -> Result<Arc<MemslotMap<P>>, BatchError> {
        self.update(|current| {
            let next = current.with_changes(changes)?;
            let published = Arc::new(next.clone());
            Ok((next, published))
        })
    }

    fn lock_writer(&self) -> MutexGuard<'_, ()> {
        // The mutex guards no data (the versions are immutable), so a writer that panicked
        // left nothing half-done: take the lock anyway.
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
