//! Batches of changes: [`MemslotMap::with_changes`] checks each run of neighbouring changes
//! of one kind one by one and writes the run to every index in one sorted pass.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::change::overlap;
use super::{next_generation, Change, Index, MemslotMap};
use crate::error::{BatchError, MapError};
use crate::slot::{Slot, SlotId};

impl<P: Clone> MemslotMap<P> {
    /// A new version with all `changes` applied in order, or, if any is refused, the error of
    /// the first refused one and no new version. `self` is never changed.
    ///
    /// Neighbouring changes of one kind (a region's slots added, removed or given new flags)
    /// are checked one by one, exactly as [`apply`](Self::apply) checks them, and then written
    /// to each index in one sorted pass, which visits every node on the way once rather than
    /// once per slot. Moves are applied one by one.
    ///
    /// ```
    /// use memslot_map::{Change, GuestAddress, HostAddress, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
    ///
    /// let slot = |id: u32, gpa: u64| {
    ///     let hva = HostAddress(0x7f00_0000_0000 + gpa);
    ///     Slot::new(SlotId(id), GuestAddress(gpa), 0x1000, hva, SlotFlags::default(), ())
    /// };
    /// let map = MemslotMap::new(MapConfig::default());
    /// // A region of four slots, added as one batch.
    /// let next = map
    ///     .with_changes((0..4).map(|i| Change::Insert(slot(i, u64::from(i) * 0x1000))))
    ///     .unwrap();
    /// assert_eq!((map.len(), next.len()), (0, 4), "the old version is unchanged");
    ///
    /// // All or nothing: the second change overlaps slot 1, so neither is applied.
    /// let err = next
    ///     .with_changes([Change::Remove(SlotId(0)), Change::Insert(slot(9, 0x1000))])
    ///     .unwrap_err();
    /// assert_eq!(err.index, 1);
    /// ```
    pub fn with_changes(
        &self,
        changes: impl IntoIterator<Item = Change<P>>,
    ) -> Result<Self, BatchError> {
        let mut next = self.clone();
        let mut changes = changes.into_iter().enumerate().peekable();
        while let Some((index, change)) = changes.next() {
            let kind = std::mem::discriminant(&change);
            let same_kind = |(_, c): &(usize, Change<P>)| std::mem::discriminant(c) == kind;
            if matches!(change, Change::Move { .. }) || !changes.peek().is_some_and(same_kind) {
                next.apply(change)
                    .map_err(|source| BatchError { index, source })?;
                continue;
            }
            let rest = std::iter::from_fn(|| changes.next_if(same_kind));
            next.apply_run(std::iter::once((index, change)).chain(rest))?;
        }
        Ok(next)
    }

    /// Applies `run`: two or more changes of one kind other than a move, in batch order (with
    /// their indexes in the batch), taken one at a time.
    fn apply_run(
        &mut self,
        run: impl Iterator<Item = (usize, Change<P>)>,
    ) -> Result<(), BatchError> {
        let fail = |index| move |source| BatchError { index, source };
        let mut run = run.peekable();
        let mut slots: Vec<Arc<Slot<P>>> = Vec::new();
        let Some((_, first)) = run.peek() else {
            return Ok(());
        };
        let put = match first {
            Change::Insert(_) => {
                // The run's earlier slots and ids, for the checks of later ones.
                let mut ids = Seen::default();
                let mut added = Added::default();
                for (index, change) in run {
                    let Change::Insert(slot) = change else {
                        unreachable!("a run holds changes of one kind")
                    };
                    let id = slot.id();
                    if self.get(id).is_some() || !ids.insert(id) {
                        return Err(fail(index)(MapError::DuplicateId { id }));
                    }
                    if self.len() + slots.len() >= self.config.max_slots {
                        return Err(fail(index)(MapError::SlotLimit {
                            id,
                            limit: self.config.max_slots,
                        }));
                    }
                    self.check_shape(id, slot.gpa(), slot.size(), slot.hva())
                        .map_err(fail(index))?;
                    // The last slot starting below the end, in the map or the run (see
                    // `check_no_overlap`; the id is new, so it cannot be the slot itself).
                    let range = slot.gpa_range();
                    let in_map = self.floor_gpa(range.end - 1);
                    let in_run = added.floor(range.end - 1);
                    let candidate = match (in_map, in_run) {
                        (Some(m), Some(r)) => Some(if r.gpa() > m.gpa() { r } else { m }),
                        (m, r) => m.or(r),
                    };
                    if let Some(other) = candidate {
                        overlap(id, range.start, range.end, other).map_err(fail(index))?;
                    }
                    let slot = Arc::new(slot);
                    added.push(&slot);
                    slots.push(slot);
                }
                true
            }
            Change::Remove(_) => {
                let mut gone = Seen::default();
                for (index, change) in run {
                    let Change::Remove(id) = change else {
                        unreachable!("a run holds changes of one kind")
                    };
                    let slot = self
                        .get(id)
                        .filter(|_| gone.insert(id))
                        .ok_or(MapError::UnknownId { id })
                        .map_err(fail(index))?;
                    slots.push(Arc::clone(slot));
                }
                false
            }
            Change::SetFlags { .. } => {
                // A slot named twice ends with the flags it was given last.
                let mut seen = Seen::default();
                let mut position = HashMap::new();
                for (index, change) in run {
                    let Change::SetFlags { id, flags } = change else {
                        unreachable!("a run holds changes of one kind")
                    };
                    let old = self
                        .get(id)
                        .ok_or(MapError::UnknownId { id })
                        .map_err(fail(index))?;
                    let new = Arc::new(old.with_flags(flags));
                    if seen.insert(id) {
                        if !position.is_empty() {
                            position.insert(id, slots.len());
                        }
                        slots.push(new);
                    } else {
                        // Named before (rare): index the run's slots by id, once.
                        if position.is_empty() {
                            position.extend(slots.iter().enumerate().map(|(i, s)| (s.id(), i)));
                        }
                        slots[position[&id]] = new;
                    }
                }
                true
            }
            Change::Move { .. } => unreachable!("moves are applied one at a time"),
        };
        self.write_slots(&slots, put);
        Ok(())
    }

    /// Puts `slots` into the three indexes (replacing what they hold under the slots' keys), or
    /// removes them: one sorted pass per index.
    fn write_slots(&mut self, slots: &[Arc<Slot<P>>], put: bool) {
        match &mut self.index {
            Index::Trees(trees) => trees.write_slots(slots, put),
            // The array and the slab are rebuilt whole (in the form for the new number of
            // slots): slots put under an id in use replace a slot (new flags), the others are
            // added.
            Index::Flat(_) | Index::Slab(_) => {
                let mut ids: Vec<SlotId> = slots.iter().map(|s| s.id()).collect();
                ids.sort_unstable();
                let mut kept: Vec<Arc<Slot<P>>> = self
                    .iter()
                    .filter(|s| ids.binary_search(&s.id()).is_err())
                    .cloned()
                    .collect();
                if put {
                    kept.extend(slots.iter().cloned());
                }
                self.index = Index::of_slots(kept);
            }
        }
        self.settle();
        self.generation = next_generation();
    }
}

/// The ids a run of changes named so far. While they ascend (a region's slots, say), a list
/// answers; a set is built only once they stop.
#[derive(Default)]
struct Seen {
    ascending: Vec<SlotId>,
    set: Option<HashSet<SlotId>>,
}

impl Seen {
    /// Records `id`; false if it was named before.
    fn insert(&mut self, id: SlotId) -> bool {
        if self.set.is_none() {
            if self.ascending.last().is_none_or(|last| *last < id) {
                self.ascending.push(id);
                return true;
            }
            self.set = Some(self.ascending.drain(..).collect());
        }
        self.set.as_mut().is_some_and(|set| set.insert(id))
    }
}

/// The slots a run of inserts added so far, for overlap checks. While their guest bases
/// ascend, a list searched by halving answers; a tree is built only once they stop.
struct Added<P> {
    ascending: Vec<Arc<Slot<P>>>,
    tree: Option<BTreeMap<u64, Arc<Slot<P>>>>,
}

impl<P> Default for Added<P> {
    fn default() -> Self {
        Added {
            ascending: Vec::new(),
            tree: None,
        }
    }
}

impl<P> Added<P> {
    fn push(&mut self, slot: &Arc<Slot<P>>) {
        if self.tree.is_none() {
            if self
                .ascending
                .last()
                .is_none_or(|last| last.gpa() < slot.gpa())
            {
                self.ascending.push(Arc::clone(slot));
                return;
            }
            self.tree = Some(self.ascending.drain(..).map(|s| (s.gpa().0, s)).collect());
        }
        if let Some(tree) = &mut self.tree {
            tree.insert(slot.gpa().0, Arc::clone(slot));
        }
    }

    /// The added slot that starts last at or below `addr`.
    fn floor(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        match &self.tree {
            Some(tree) => tree.range(..=addr).next_back().map(|(_, s)| s),
            None => {
                let below = self.ascending.partition_point(|s| s.gpa().0 <= addr);
                below.checked_sub(1).map(|i| &self.ascending[i])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::tests::{check_indexes, slot};
    use crate::map::MapConfig;
    use crate::slot::SlotFlags;

    #[test]
    fn a_refused_batch_leaves_the_map_and_reports_the_index() {
        let mut map = MemslotMap::new(MapConfig::default());
        map.insert(slot(0, 0x0, 0x1000, 0x0)).unwrap();
        let err = map
            .with_changes([
                Change::Insert(slot(1, 0x1000, 0x1000, 0x0)),
                Change::Remove(SlotId(0)),
                Change::SetFlags {
                    id: SlotId(0),
                    flags: SlotFlags::default(),
                },
            ])
            .unwrap_err();
        assert_eq!(err.index, 2);
        assert_eq!(
            err.to_string(),
            "change 2 of the batch was refused: no slot has id 0"
        );
        assert_eq!(map.len(), 1);
        assert!(map.get(SlotId(1)).is_none());
        // Within a batch, later changes see earlier ones: remove then reuse the id and range.
        let next = map
            .with_changes([
                Change::Remove(SlotId(0)),
                Change::Insert(slot(0, 0x0, 0x2000, 0x5000)),
                Change::SetFlags {
                    id: SlotId(0),
                    flags: SlotFlags {
                        log_dirty: true,
                        read_only: false,
                    },
                },
            ])
            .unwrap();
        assert_eq!(next.get(SlotId(0)).unwrap().size(), 0x2000);
        assert!(next.get(SlotId(0)).unwrap().flags().log_dirty);
        assert_eq!(map.get(SlotId(0)).unwrap().size(), 0x1000);
        check_indexes(&next);
    }
}
