//! Publishing map versions to concurrent readers (read-copy-update).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::{ArcSwap, Guard};

use crate::error::BatchError;
use crate::map::{Change, MemslotMap};

/// The current version of a map, shared by any number of readers and writers.
///
/// Readers call [`load`](Self::load) and get a consistent version without taking a lock or
/// waiting for a writer: they never see half of a change. Writers are serialised by one mutex
/// that readers never touch; each builds the next version from the current one (sharing all
/// unchanged nodes) and publishes it with one atomic pointer swap.
///
/// The writer mutex guards a writer state `W` (nothing by default): whatever a writer keeps
/// beside the map (its own records of what the slots stand for, say) lives there, so that the
/// one lock which serialises publication also serialises changes to that state, and a writer
/// reads the map, changes its state and publishes the next version as one step. Take it with
/// [`write`](Self::write).
///
/// ```
/// use std::sync::Arc;
/// use std::thread;
/// use memslot_map::{Change, GuestAddress, HostAddress, MapConfig, MemslotMap, SharedMap, Slot, SlotFlags, SlotId};
///
/// let shared = Arc::new(SharedMap::new(MemslotMap::new(MapConfig::default())));
/// let slot = Slot::new(SlotId(0), GuestAddress(0), 0x1000, HostAddress(0x7f00_0000_0000), SlotFlags::default(), ());
/// shared.apply([Change::Insert(slot)]).unwrap();
///
/// // A reader takes the current version without a lock; a later change does not alter it.
/// let reader = Arc::clone(&shared);
/// let seen = thread::spawn(move || {
///     let version = reader.load_full();
///     version.find_by_gpa(GuestAddress(0x800)).map(|s| s.id())
/// })
/// .join()
/// .unwrap();
/// assert_eq!(seen, Some(SlotId(0)));
/// let before = shared.load_full();
/// shared.apply([Change::Remove(SlotId(0))]).unwrap();
/// assert_eq!((before.len(), shared.load().len()), (1, 0));
/// ```
pub struct SharedMap<P, W = ()> {
    current: ArcSwap<MemslotMap<P>>,
    writer: Mutex<W>,
}

impl<P> SharedMap<P> {
    /// Publishes `map` as the first version, with no writer state.
    pub fn new(map: MemslotMap<P>) -> Self {
        SharedMap::with_writer_state(map, ())
    }
}

impl<P, W> SharedMap<P, W> {
    /// Publishes `map` as the first version; `state` is the writer state, kept behind the
    /// writer lock.
    pub fn with_writer_state(map: MemslotMap<P>, state: W) -> Self {
        SharedMap {
            current: ArcSwap::from_pointee(map),
            writer: Mutex::new(state),
        }
    }

    /// The current version, lock-free. Hold the guard briefly (it may pin the version); use
    /// [`load_full`](Self::load_full) to keep a version.
    pub fn load(&self) -> Guard<Arc<MemslotMap<P>>> {
        self.current.load()
    }

    /// The current version as an `Arc` the caller may keep as long as it likes.
    pub fn load_full(&self) -> Arc<MemslotMap<P>> {
        self.current.load_full()
    }

    /// Takes the writer lock, waiting for the writer that holds it, and returns it as a
    /// [`MapWriter`]: the writer state, the current version, and the right to publish the
    /// next one. Readers are never blocked.
    ///
    /// A writer that panicked while holding the lock does not stop later writers: a version is
    /// published whole or not at all, so the map is never half-changed. Whether the writer
    /// state is usable after such a panic is for its owner to judge.
    pub fn write(&self) -> MapWriter<'_, P, W> {
        let state = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Only a holder of the lock publishes, so this stays the current version until the
        // writer publishes another.
        let current = self.current.load_full();
        MapWriter {
            shared: self,
            state,
            current,
        }
    }
}

impl<P: Clone, W> SharedMap<P, W> {
    /// Runs one writer's update: `f` gets the current version and either returns the next
    /// version (published when `f` returns) with a result, or an error, in which case nothing
    /// is published. Writers run one at a time; readers are never blocked.
    pub fn update<T, E>(
        &self,
        f: impl FnOnce(&Arc<MemslotMap<P>>) -> Result<(MemslotMap<P>, T), E>,
    ) -> Result<T, E> {
        let mut writer = self.write();
        let (next, value) = f(writer.current())?;
        writer.publish(next);
        Ok(value)
    }

    /// Applies `changes` as one batch and publishes the result, or publishes nothing if any
    /// change is refused.
    pub fn apply(
        &self,
        changes: impl IntoIterator<Item = Change<P>>,
    ) -> Result<Arc<MemslotMap<P>>, BatchError> {
        let mut writer = self.write();
        let next = writer.current().with_changes(changes)?;
        Ok(Arc::clone(writer.publish(next)))
    }
}

impl<P, W> fmt::Debug for SharedMap<P, W> {
    /// The current version (its size and generation); the writer state is left out, since
    /// reading it would mean waiting for the writer lock.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMap")
            .field("current", &**self.load())
            .finish_non_exhaustive()
    }
}

/// The writer lock of a [`SharedMap`], held: the writer state (through `Deref`/`DerefMut`),
/// the current version, and the right to publish the next one. Other writers wait until it is
/// dropped; readers never do.
pub struct MapWriter<'a, P, W = ()> {
    shared: &'a SharedMap<P, W>,
    state: MutexGuard<'a, W>,
    current: Arc<MemslotMap<P>>,
}

impl<P, W> MapWriter<'_, P, W> {
    /// The current version: the one published when the lock was taken, or the last one this
    /// writer published since. No one else publishes while the lock is held, so it is also the
    /// version readers load.
    pub fn current(&self) -> &Arc<MemslotMap<P>> {
        &self.current
    }

    /// Publishes `next` as the current version: readers that load from now on get it. Returns
    /// it as published.
    pub fn publish(&mut self, next: MemslotMap<P>) -> &Arc<MemslotMap<P>> {
        self.current = Arc::new(next);
        self.shared.current.store(Arc::clone(&self.current));
        &self.current
    }
}

impl<P, W> Deref for MapWriter<'_, P, W> {
    type Target = W;

    fn deref(&self) -> &W {
        &self.state
    }
}

impl<P, W> DerefMut for MapWriter<'_, P, W> {
    fn deref_mut(&mut self) -> &mut W {
        &mut self.state
    }
}

impl<P, W: fmt::Debug> fmt::Debug for MapWriter<'_, P, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapWriter")
            .field("current", &*self.current)
            .field("state", &*self.state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use vm_memory::GuestAddress;

    use super::*;
    use crate::map::MapConfig;
    use crate::slot::{HostAddress, Slot, SlotFlags, SlotId};

    fn page(n: u32) -> Change<u32> {
        let at = u64::from(n) * 0x1000;
        Change::Insert(Slot::new(
            SlotId(n),
            GuestAddress(at),
            0x1000,
            HostAddress(0x7000_0000 + at),
            SlotFlags::default(),
            n,
        ))
    }

    #[test]
    fn a_writer_sees_its_own_publications_and_readers_see_them_at_once() {
        let shared = SharedMap::with_writer_state(MemslotMap::new(MapConfig::default()), 0u32);
        let first = shared.load_full();
        let mut writer = shared.write();
        assert!(Arc::ptr_eq(writer.current(), &first));
        for n in 0..2 {
            let next = writer.current().with_changes([page(n)]).unwrap();
            let published = Arc::clone(writer.publish(next));
            *writer += 1;
            assert!(Arc::ptr_eq(writer.current(), &published));
            assert!(Arc::ptr_eq(&shared.load(), &published), "readers lag");
        }
        drop(writer);
        assert_eq!(*shared.write(), 2);
        assert_eq!(shared.load().len(), 2);
    }

    #[test]
    fn a_writer_that_publishes_nothing_changes_nothing() {
        let shared = SharedMap::new(MemslotMap::new(MapConfig::default()));
        shared.apply([page(0)]).unwrap();
        let before = shared.load_full();
        drop(shared.write());
        assert!(shared.apply([page(0)]).is_err(), "a duplicate id");
        let refused: Result<(), &str> = shared.update(|_| Err("no"));
        assert_eq!(refused, Err("no"));
        assert!(Arc::ptr_eq(&shared.load_full(), &before));
    }

    /// Each writer reads the next slot number from the writer state and inserts that slot: a
    /// state read or published apart from the map would hand one number out twice (a
    /// duplicate id) or lose one.
    #[test]
    fn the_writer_state_and_the_map_change_under_one_lock() {
        const WRITERS: u32 = 4;
        const EACH: u32 = 200;
        let config = MapConfig::new(0x1000, (WRITERS * EACH) as usize).unwrap();
        let shared = SharedMap::with_writer_state(MemslotMap::new(config), 0u32);
        thread::scope(|scope| {
            for _ in 0..WRITERS {
                scope.spawn(|| {
                    for _ in 0..EACH {
                        let mut writer = shared.write();
                        let n = *writer;
                        let next = writer.current().with_changes([page(n)]).unwrap();
                        thread::yield_now();
                        writer.publish(next);
                        *writer = n + 1;
                    }
                });
            }
        });
        let map = shared.load();
        assert_eq!(*shared.write(), WRITERS * EACH);
        assert_eq!(map.len(), (WRITERS * EACH) as usize);
        assert!((0..WRITERS * EACH).all(|n| map.get(SlotId(n)).is_some()));
    }
}
