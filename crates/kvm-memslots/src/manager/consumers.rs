//! Readers of the dirty log that read independently: each [`DirtyConsumer`] gets every page
//! dirtied since its own last harvest, whatever the others harvest, and keeps logging on in
//! the regions it logs, whatever the others stop.
//!
//! A harvest takes a region's pending bits (what KVM, the rings and the VMM's bitmap reported)
//! as before; when the manager has more than one consumer, it then adds them to every other
//! consumer's *stash* for that region and hands over its own stash with them. A region's stashes
//! are allocated with the region or with the consumer (fallibly), so a harvest never allocates
//! for another consumer and never drops a bit for want of room. With the default consumer
//! alone there are no stashes at all: harvests cost what they cost before.

use std::collections::BTreeSet;
use std::sync::MutexGuard;

use super::{reserve, MemoryManager, Target};
use crate::dirty::DirtyConsumer;
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::pending::PendingBits;

/// One consumer's bits of one region: taken from the region's pending bits by another
/// consumer's harvest and not yet handed to this one.
pub(super) struct Stash {
    pub(super) consumer: DirtyConsumer,
    pub(super) bits: Vec<u64>,
}

/// Zeroed stashes of `words` words for `consumers`, fallibly.
pub(super) fn new_stashes(
    consumers: &BTreeSet<DirtyConsumer>,
    words: usize,
) -> Result<Vec<Stash>, Error> {
    let mut stashes = Vec::new();
    stashes
        .try_reserve_exact(consumers.len())
        .map_err(|_| out_of_memory(consumers.len()))?;
    for &consumer in consumers {
        let mut bits = Vec::new();
        reserve(&mut bits, words, "a dirty-log consumer's bits")?;
        bits.resize(words, 0);
        stashes.push(Stash { consumer, bits });
    }
    Ok(stashes)
}

fn out_of_memory(n: usize) -> Error {
    Error::OutOfMemory {
        what: "the dirty-log consumers' bits",
        bytes: (n as u64).saturating_mul(size_of::<Stash>() as u64),
    }
}

/// Hands `consumer` its bits of a region: `taken` holds what it took from the region's pending
/// bits; every other consumer's stash gets those too, and `taken` gets `consumer`'s stash.
pub(super) fn share(stashes: &mut [Stash], consumer: DirtyConsumer, taken: &mut [u64]) {
    // The others first: they get what was taken, not `consumer`'s own stash.
    for stash in stashes.iter_mut().filter(|s| s.consumer != consumer) {
        for (s, t) in stash.bits.iter_mut().zip(taken.iter()) {
            *s |= *t;
        }
    }
    if let Some(own) = stashes.iter_mut().find(|s| s.consumer == consumer) {
        for (t, s) in taken.iter_mut().zip(own.bits.iter_mut()) {
            *t |= std::mem::take(s);
        }
    }
}

/// Puts the bits of `stash` back into `pending` (for the consumers left).
fn give_back(stash: &Stash, pending: &PendingBits) {
    pending.or_bits(0, &stash.bits, pending.pages());
}

impl<K: KvmMemory> MemoryManager<K> {
    /// A new reader of the dirty log. From now on its harvests
    /// ([`harvest_dirty_for`](Self::harvest_dirty_for)) report every page dirtied since its own
    /// last harvest (the first: since now, or earlier), however the other consumers harvest;
    /// and regions it logs ([`start_dirty_log_for`](Self::start_dirty_log_for)) keep logging
    /// until it stops, whatever the others stop. The manager starts with one consumer,
    /// [`DirtyConsumer::DEFAULT`], the one [`harvest_dirty`](Self::harvest_dirty) and
    /// [`start_dirty_log`](Self::start_dirty_log) read and log for.
    ///
    /// Costs one bit per page of guest memory for each consumer while there is more than one.
    ///
    /// ```
    /// use kvm_memslots::testing::FakeKvm;
    /// use kvm_memslots::{DirtyConsumer, MemoryManager, RegionSpec, Target};
    /// use vm_memory::GuestAddress;
    ///
    /// let memory = MemoryManager::new(FakeKvm::new(8, true));
    /// let ram = memory.add_region(RegionSpec::new(GuestAddress(0), 1 << 20))?;
    /// let chain = memory.add_dirty_consumer()?;
    /// memory.start_dirty_log_for(chain, Target::All)?;
    /// memory.harvest_dirty_for(chain, Target::All)?; // every page, as logging started
    /// memory.kvm().guest_write(0x3000);
    /// // A client harvests (and stops logging): the chain still gets the page, and its
    /// // logging stays on.
    /// memory.start_dirty_log(Target::All)?;
    /// memory.harvest_dirty(Target::All)?;
    /// memory.stop_dirty_log(Target::All)?;
    /// assert_eq!(memory.dirty_log_holders(ram), Some(vec![chain]));
    /// memory.kvm().guest_write(0x5000);
    /// let pages: Vec<u64> =
    ///     memory.harvest_dirty_for(chain, Target::All)?[0].addresses().map(|a| a.0).collect();
    /// assert_eq!(pages, [0x3000, 0x5000]);
    /// # Ok::<(), kvm_memslots::Error>(())
    /// ```
    ///
    /// # KVM calls
    ///
    /// None.
    pub fn add_dirty_consumer(&self) -> Result<DirtyConsumer, Error> {
        let mut state = self.state_for_change()?;
        // No harvest runs while the stashes change.
        let _serial = self.harvests.lock().unwrap_or_else(|p| p.into_inner());
        let consumer = DirtyConsumer(state.next_consumer);
        let mut registry = self.consumers();
        let mut consumers = registry.clone();
        consumers.insert(consumer);
        // Every region gets stashes for every consumer now (the default's too, when it was
        // alone); built whole before any is installed, so a failure changes nothing.
        let alone = registry.len() == 1;
        let directory = self.directory();
        let mut built = Vec::with_capacity(directory.len());
        for (id, region) in directory.iter() {
            let words = region.pending.pages().div_ceil(64) as usize;
            let wanted: BTreeSet<DirtyConsumer> = if alone {
                consumers.clone()
            } else {
                BTreeSet::from([consumer])
            };
            built.push((*id, new_stashes(&wanted, words)?));
        }
        for (id, stashes) in built {
            let region = &directory[&id];
            region.stash().extend(stashes);
        }
        drop(directory);
        state.next_consumer += 1;
        *registry = consumers;
        Ok(consumer)
    }

    /// Ends a consumer: regions only it logged stop logging (as
    /// [`stop_dirty_log_for`](Self::stop_dirty_log_for) does, which may fail and then ends
    /// nothing), and its bits are dropped. The default consumer cannot be ended.
    ///
    /// # KVM calls
    ///
    /// As [`stop_dirty_log_for`](Self::stop_dirty_log_for) for every region.
    pub fn remove_dirty_consumer(&self, consumer: DirtyConsumer) -> Result<(), Error> {
        if consumer == DirtyConsumer::DEFAULT {
            return Err(Error::UnknownConsumer(consumer));
        }
        // (The stop refuses an unknown consumer.)
        self.stop_dirty_log_for(consumer, Target::All)?;
        let mut state = self.state_for_change()?;
        let _serial = self.harvests.lock().unwrap_or_else(|p| p.into_inner());
        let mut registry = self.consumers();
        if !registry.remove(&consumer) {
            return Err(Error::UnknownConsumer(consumer));
        }
        state.followers.remove(&consumer);
        let last = registry.len() == 1;
        for region in self.directory().values() {
            let mut stashes = region.stash();
            stashes.retain(|s| s.consumer != consumer);
            if last {
                // The default consumer alone again: its bits go back to pending, where its
                // harvests find them without stashes.
                for stash in stashes.drain(..) {
                    give_back(&stash, &region.pending);
                }
            }
        }
        Ok(())
    }

    /// Makes every region added from now on log for `consumer` from the start (`on`), or stops
    /// that; regions in place are not changed. With [`start_dirty_log_for`] on every region, a
    /// consumer that must see all guest memory change (a snapshot chain, a migration) misses no
    /// region added later: its first harvest after the add reports the new region's every
    /// page. [`remove_dirty_consumer`](Self::remove_dirty_consumer) ends it too.
    ///
    /// [`start_dirty_log_for`]: Self::start_dirty_log_for
    ///
    /// # KVM calls
    ///
    /// None.
    pub fn log_new_regions_for(&self, consumer: DirtyConsumer, on: bool) -> Result<(), Error> {
        let mut state = self.state_for_change()?;
        self.check_consumer(consumer)?;
        if on {
            state.followers.insert(consumer);
        } else {
            state.followers.remove(&consumer);
        }
        Ok(())
    }

    /// The consumers logging region `id` (KVM logs its writes while there is one), or `None`
    /// if there is no such region.
    pub fn dirty_log_holders(&self, id: crate::RegionId) -> Option<Vec<DirtyConsumer>> {
        let state = self.state();
        state
            .regions
            .get(&id)
            .map(|r| r.loggers.iter().copied().collect())
    }

    /// The consumers there are, the default first.
    pub fn dirty_consumers(&self) -> Vec<DirtyConsumer> {
        self.consumers().iter().copied().collect()
    }

    /// The consumer registry. Poisoning is ignored: it is changed by single insertions and
    /// removals.
    pub(super) fn consumers(&self) -> MutexGuard<'_, BTreeSet<DirtyConsumer>> {
        self.consumers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn check_consumer(&self, consumer: DirtyConsumer) -> Result<(), Error> {
        if self.consumers().contains(&consumer) {
            Ok(())
        } else {
            Err(Error::UnknownConsumer(consumer))
        }
    }
}
