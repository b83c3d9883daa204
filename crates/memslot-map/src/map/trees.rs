//! The indexes of a large map: three persistent B+trees over the same slots, by guest address,
//! by host range (an interval tree) and by id.

use std::sync::Arc;

use super::{hva_key, HvaKey};
use crate::ptree::{Iter, PTree, Summary, Visit};
use crate::slot::{Slot, SlotId};

/// The largest host range end in a subtree of the host-address index.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct MaxHvaEnd(u64);

impl<V> Summary<HvaKey, V> for MaxHvaEnd {
    fn of_entry(key: &HvaKey, _: &V) -> Self {
        MaxHvaEnd(key.end)
    }
    fn merge(self, other: Self) -> Self {
        MaxHvaEnd(self.0.max(other.0))
    }
}

/// Three persistent B+trees over the same slots. Cloning is O(1); a change copies the nodes on
/// its paths that another version shares.
#[derive(Clone)]
pub(super) struct Trees<P> {
    by_gpa: PTree<u64, Arc<Slot<P>>, ()>,
    by_hva: PTree<HvaKey, Arc<Slot<P>>, MaxHvaEnd>,
    by_id: PTree<SlotId, Arc<Slot<P>>, ()>,
}

impl<P> Default for Trees<P> {
    fn default() -> Self {
        Trees {
            by_gpa: PTree::default(),
            by_hva: PTree::default(),
            by_id: PTree::default(),
        }
    }
}

/// The slots of the guest-address index from a point on, in guest-address order.
pub(super) type GpaIter<'a, P> = Iter<'a, u64, Arc<Slot<P>>, ()>;

impl<P> Trees<P> {
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The slot with the largest guest base at most `addr`.
    pub(super) fn floor_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        self.by_gpa.floor(&addr).map(|(_, slot)| slot)
    }

    pub(super) fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        self.by_id.get(&id)
    }

    /// Calls `f` on every slot whose host range overlaps `[lo, hi)` (not empty), in host-range
    /// order.
    #[inline(never)]
    pub(super) fn for_each_hva_overlap<'a>(
        &'a self,
        lo: u64,
        hi: u64,
        mut f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        self.by_hva.search(
            |key, max_end| {
                if key.start >= hi {
                    Visit::Stop
                } else if max_end.0 <= lo {
                    Visit::Skip
                } else {
                    Visit::Enter
                }
            },
            |_, slot| f(slot),
        );
    }

    pub(super) fn iter(&self) -> GpaIter<'_, P> {
        self.by_gpa.iter()
    }

    /// The slots whose guest base is at least `from`, in guest-address order.
    pub(super) fn iter_from(&self, from: u64) -> GpaIter<'_, P> {
        self.by_gpa.iter_from(&from)
    }

    /// Puts `slot` into all three indexes, replacing whatever they hold under its keys.
    pub(super) fn put(&mut self, slot: Arc<Slot<P>>) {
        self.by_gpa.insert(slot.gpa().0, Arc::clone(&slot));
        self.by_hva.insert(hva_key(&slot), Arc::clone(&slot));
        self.by_id.insert(slot.id(), slot);
    }

    /// Removes the slot with id `id` from all three indexes.
    pub(super) fn remove(&mut self, id: SlotId) -> Option<Arc<Slot<P>>> {
        let slot = self.by_id.remove(&id)?;
        self.by_gpa.remove(&slot.gpa().0);
        self.by_hva.remove(&hva_key(&slot));
        Some(slot)
    }

    /// Puts `slot` in place of the slot with its id, which starts at guest address `old_gpa`
    /// (the host range is the same).
    pub(super) fn replace(&mut self, old_gpa: u64, slot: Arc<Slot<P>>) {
        if slot.gpa().0 != old_gpa {
            self.by_gpa.remove(&old_gpa);
        }
        self.put(slot);
    }

    /// Puts `slots` into the three indexes (replacing what they hold under the slots' keys), or
    /// removes them: one sorted pass per index.
    pub(super) fn write_slots(&mut self, slots: &[Arc<Slot<P>>], put: bool) {
        let value = |s: &Arc<Slot<P>>| put.then(|| Arc::clone(s));
        let mut by_id: Vec<_> = slots.iter().map(|s| (s.id(), value(s))).collect();
        by_id.sort_unstable_by_key(|w| w.0);
        self.by_id.write_sorted(&mut by_id);
        let mut by_gpa: Vec<_> = slots.iter().map(|s| (s.gpa().0, value(s))).collect();
        by_gpa.sort_unstable_by_key(|w| w.0);
        self.by_gpa.write_sorted(&mut by_gpa);
        let mut by_hva: Vec<_> = slots.iter().map(|s| (hva_key(s), value(s))).collect();
        by_hva.sort_unstable_by_key(|w| w.0);
        self.by_hva.write_sorted(&mut by_hva);
    }

    /// The trees of `slots`, given in the order of each index: guest address, host range and
    /// id.
    pub(super) fn from_sorted<'a>(
        by_gpa: impl Iterator<Item = &'a Arc<Slot<P>>>,
        by_hva: impl Iterator<Item = &'a Arc<Slot<P>>>,
        by_id: impl Iterator<Item = &'a Arc<Slot<P>>>,
    ) -> Self
    where
        P: 'a,
    {
        let mut trees = Trees::default();
        let put = |s: &Arc<Slot<P>>| Some(Arc::clone(s));
        let mut writes: Vec<_> = by_gpa.map(|s| (s.gpa().0, put(s))).collect();
        trees.by_gpa.write_sorted(&mut writes);
        let mut writes: Vec<_> = by_hva.map(|s| (hva_key(s), put(s))).collect();
        trees.by_hva.write_sorted(&mut writes);
        let mut writes: Vec<_> = by_id.map(|s| (s.id(), put(s))).collect();
        trees.by_id.write_sorted(&mut writes);
        trees
    }

    /// Bytes of the three trees' nodes.
    pub(super) fn heap_bytes(&self) -> usize {
        self.by_gpa.heap_bytes() + self.by_hva.heap_bytes() + self.by_id.heap_bytes()
    }

    /// Checks every tree's invariants and that they hold as many slots. For tests.
    #[cfg(test)]
    pub(super) fn check(&self) {
        self.by_gpa.check();
        self.by_hva.check();
        self.by_id.check();
        assert_eq!(self.by_gpa.len(), self.by_id.len());
        assert_eq!(self.by_hva.len(), self.by_id.len());
    }
}
