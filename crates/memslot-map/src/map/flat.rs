//! The index of a small map: one array of rows in guest-address order, owned by the map
//! version, each row holding its slot's keys inline.
//!
//! This is vm-memory's design (a sorted `Vec` of `Arc`s, copied whole for a new version) with
//! the keys beside each `Arc`: cloning the map copies the array (one allocation and one
//! reference-count increment per slot) and a change then inserts or removes one row in place.
//! With at most [`FLAT_MAX`] rows the other two orders are not kept: a search by id or host
//! range reads every row's inline keys, which costs less than keeping two more orders up to
//! date on every change and never loads a slot. For a few dozen slots that costs less than
//! copying the root-to-leaf paths of three trees (a full-capacity node allocated per level and
//! index, one reference-count increment per entry of each) and, being one allocation, less
//! than the slab form (`super::slab`), which takes over past [`FLAT_MAX`] slots, where the
//! increments dominate. The map switches between the forms with hysteresis (see [`FLAT_MAX`]
//! and [`FLAT_MIN`]).

use std::mem::size_of;
use std::sync::Arc;

use arrayvec::ArrayVec;

use super::HvaKey;
use crate::search::count_prefix;
use crate::slot::{Slot, SlotId};

/// The most slots a map keeps in the flat form: one more, and it turns into the slab.
pub(super) const FLAT_MAX: usize = 32;
const _: () = assert!(
    FLAT_MAX <= 64,
    "a host-range search keeps one bit per row in a u64"
);
/// A map in slab form with fewer slots than this turns back into the flat form. Well below
/// [`FLAT_MAX`], so that a map whose size wanders around either bound does not convert back and
/// forth on every change.
pub(super) const FLAT_MIN: usize = 16;

/// Row `i` of the array: the `i`-th slot in guest-address order with its guest range, host
/// range and id inline.
pub(super) struct Row<P> {
    gpa_start: u64,
    hva_start: u64,
    /// The guest range ends as far after its start as this after `hva_start` (neither wraps):
    /// host-range scans compare both host ends of every row, a guest lookup only the end of
    /// the row it found.
    hva_end: u64,
    id: SlotId,
    slot: Arc<Slot<P>>,
}

// Five words: cloning the rows is most of a change, and a sixth word (the guest end, which
// the lookups derive) made guest lookups at 10 and 32 slots a tenth slower.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(size_of::<Row<()>>() == 40);

impl<P> Clone for Row<P> {
    #[inline]
    fn clone(&self) -> Self {
        Row {
            slot: Arc::clone(&self.slot),
            ..*self
        }
    }
}

impl<P> Row<P> {
    fn new(slot: Arc<Slot<P>>) -> Self {
        let gpa = slot.gpa_range();
        let hva = slot.hva_range();
        Row {
            gpa_start: gpa.start,
            hva_start: hva.start,
            hva_end: hva.end,
            id: slot.id(),
            slot,
        }
    }

    pub(super) fn slot(&self) -> &Arc<Slot<P>> {
        &self.slot
    }

    #[inline]
    fn gpa_end(&self) -> u64 {
        self.gpa_start + (self.hva_end - self.hva_start)
    }

    /// Whether the row's host range overlaps `[lo, hi)` (both comparisons made, no branch).
    #[inline]
    fn hva_overlaps(&self, lo: u64, hi: u64) -> bool {
        (self.hva_start < hi) & (self.hva_end > lo)
    }

    /// Whether the row's host range holds `hva` (both comparisons made, no branch).
    #[inline]
    fn holds_hva(&self, hva: u64) -> bool {
        (self.hva_start <= hva) & (hva < self.hva_end)
    }

    /// The row's place in the host-range order.
    fn hva_key(&self) -> HvaKey {
        HvaKey {
            start: self.hva_start,
            end: self.hva_end,
            id: self.id,
        }
    }
}

/// All slots of a small map.
pub(super) struct Flat<P> {
    store: Store<P>,
    /// Whether two rows' host ranges may overlap (slots aliasing host memory). False means no
    /// two do, so a single host address matches at most one row and a search for it can stop
    /// at the first.
    /// Set when an insert adds an overlap and cleared only when at most one row is left: a
    /// removal does not look for the overlaps that remain, so true may be stale, never false.
    aliased: bool,
}

/// Where the rows are: a map of one slot (a VM with one memory region) keeps its row inline,
/// so that building, cloning and dropping it allocates nothing beyond the slot.
enum Store<P> {
    One(Row<P>),
    /// Any other number of rows, none included.
    Many(Vec<Row<P>>),
}

impl<P> Clone for Flat<P> {
    /// Copies the rows, with room for one more: a clone is most often made to be changed.
    #[inline]
    fn clone(&self) -> Self {
        let store = match &self.store {
            Store::One(row) => Store::One(row.clone()),
            Store::Many(rows) if rows.is_empty() => Store::Many(Vec::new()),
            Store::Many(rows) => {
                let mut copy = Vec::with_capacity(rows.len() + 1);
                copy.extend(rows.iter().cloned());
                Store::Many(copy)
            }
        };
        Flat {
            store,
            aliased: self.aliased,
        }
    }
}

impl<P> Default for Flat<P> {
    fn default() -> Self {
        Flat {
            store: Store::Many(Vec::new()),
            aliased: false,
        }
    }
}

impl<P> Flat<P> {
    #[inline]
    pub(super) fn rows(&self) -> &[Row<P>] {
        match &self.store {
            Store::One(row) => std::slice::from_ref(row),
            Store::Many(rows) => rows,
        }
    }

    /// The rows as a `Vec`, to add or remove some.
    fn vec(&mut self) -> &mut Vec<Row<P>> {
        if let Store::One(_) = self.store {
            let Store::One(row) = std::mem::replace(&mut self.store, Store::Many(Vec::new()))
            else {
                unreachable!("matched above")
            };
            let mut rows = Vec::with_capacity(2);
            rows.push(row);
            self.store = Store::Many(rows);
        }
        match &mut self.store {
            Store::Many(rows) => rows,
            Store::One(_) => unreachable!("turned into a vector above"),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.rows().len()
    }

    /// The slot with the largest guest base at most `addr`.
    #[inline]
    pub(super) fn floor_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        let i = self.rows_at_or_below(addr);
        Some(&self.rows()[i.checked_sub(1)?].slot)
    }

    /// The number of rows whose guest base is at most `addr`.
    #[inline]
    fn rows_at_or_below(&self, addr: u64) -> usize {
        count_prefix(self.rows(), |r| r.gpa_start <= addr)
    }

    /// The slot that holds guest address `addr`.
    #[inline]
    pub(super) fn find_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        if let Store::One(row) = &self.store {
            return (row.gpa_start <= addr && addr < row.gpa_end()).then_some(&row.slot);
        }
        let i = self.rows_at_or_below(addr);
        let row = &self.rows()[i.checked_sub(1)?];
        (addr < row.gpa_end()).then_some(&row.slot)
    }

    /// The row of the slot with id `id`.
    #[inline]
    fn id_row(&self, id: SlotId) -> Option<usize> {
        self.rows().iter().position(|r| r.id == id)
    }

    #[inline]
    pub(super) fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        Some(&self.rows()[self.id_row(id)?].slot)
    }

    /// The first slot in host-range order whose host range holds `hva`: while no two rows'
    /// host ranges overlap, the first row that holds it; otherwise the first of all that do.
    #[inline]
    pub(super) fn find_hva(&self, hva: u64) -> Option<&Arc<Slot<P>>> {
        match &self.store {
            Store::One(row) => row.holds_hva(hva).then_some(&row.slot),
            Store::Many(rows) if !self.aliased => {
                rows.iter().find(|r| r.holds_hva(hva)).map(Row::slot)
            }
            Store::Many(rows) => Self::first_aliased(rows, hva),
        }
    }

    /// [`find_hva`](Self::find_hva) where host ranges may overlap: of the rows that hold `hva`,
    /// the one first in host-range order.
    #[cold]
    #[inline(never)]
    fn first_aliased(rows: &[Row<P>], hva: u64) -> Option<&Arc<Slot<P>>> {
        rows.iter()
            .filter(|r| r.holds_hva(hva))
            .min_by_key(|r| r.hva_key())
            .map(Row::slot)
    }

    /// Calls `f` on every slot whose host range overlaps `[lo, hi)` (not empty), in host-range
    /// order.
    #[inline]
    pub(super) fn for_each_hva_overlap<'a>(
        &'a self,
        lo: u64,
        hi: u64,
        mut f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        let overlaps = |r: &Row<P>| r.hva_overlaps(lo, hi);
        let rows = match &self.store {
            Store::One(row) => {
                if overlaps(row) {
                    f(&row.slot);
                }
                return;
            }
            Store::Many(rows) => rows,
        };
        if !self.aliased && hi - lo == 1 {
            // No two rows share a host address, so at most one holds this one.
            if let Some(slot) = self.find_hva(lo) {
                f(slot);
            }
            return;
        }
        // One bit per row that overlaps, gathered without a branch per row.
        let mut mask: u64 = 0;
        for (i, row) in rows.iter().enumerate() {
            mask |= u64::from(overlaps(row)) << i;
        }
        if mask & (mask.wrapping_sub(1)) == 0 {
            if mask != 0 {
                f(&rows[mask.trailing_zeros() as usize].slot);
            }
            return;
        }
        Self::report_in_hva_order(rows, mask, f);
    }

    /// Calls `f` on the slots of the rows in `mask` (one bit per row, several set), in
    /// host-range order: host ranges may overlap. Out of line, so that the common search (at
    /// most one slot found) keeps a small frame.
    #[cold]
    #[inline(never)]
    fn report_in_hva_order<'a>(
        rows: &'a [Row<P>],
        mut mask: u64,
        mut f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        let mut found: ArrayVec<&'a Row<P>, FLAT_MAX> = ArrayVec::new();
        while mask != 0 {
            found.push(&rows[mask.trailing_zeros() as usize]);
            mask &= mask - 1;
        }
        found.sort_unstable_by_key(|r| r.hva_key());
        for row in found {
            f(&row.slot);
        }
    }

    /// The slots whose guest base is at least `from`, in guest-address order.
    pub(super) fn iter_from(&self, from: u64) -> std::slice::Iter<'_, Row<P>> {
        self.rows()[self.rows().partition_point(|r| r.gpa_start < from)..].iter()
    }

    /// Adds `slot`; its id must be new and its guest base unused.
    pub(super) fn insert(&mut self, slot: Arc<Slot<P>>) {
        // The row is built where it goes in each case: built once before them, it was written
        // field by field to the stack and read back in wider loads, which stalled.
        if self.len() == 0 {
            self.store = Store::One(Row::new(slot));
            return;
        }
        if !self.aliased {
            let hva = slot.hva_range();
            self.aliased = self
                .rows()
                .iter()
                .any(|r| r.hva_overlaps(hva.start, hva.end));
        }
        let gpa = slot.gpa().0;
        let g = self.rows().partition_point(|r| r.gpa_start < gpa);
        self.vec().insert(g, Row::new(slot));
    }

    /// Removes the slot with id `id` and returns it.
    pub(super) fn remove(&mut self, id: SlotId) -> Option<Arc<Slot<P>>> {
        let g = self.id_row(id)?;
        match &mut self.store {
            Store::One(_) => {
                let Store::One(row) = std::mem::take(self).store else {
                    unreachable!("matched above")
                };
                Some(row.slot)
            }
            // The other row becomes the only one, kept inline.
            Store::Many(rows) if rows.len() == 2 => {
                let removed = rows.swap_remove(g);
                let kept = rows.pop().expect("two rows");
                self.store = Store::One(kept);
                self.aliased = false;
                Some(removed.slot)
            }
            Store::Many(rows) => Some(rows.remove(g).slot),
        }
    }

    /// Puts `slot` in place of the slot with its id, whose guest base and host range it keeps.
    pub(super) fn replace_in_place(&mut self, slot: Arc<Slot<P>>) {
        let g = self.id_row(slot.id()).expect("the slot is in the map");
        match &mut self.store {
            Store::One(row) => row.slot = slot,
            Store::Many(rows) => rows[g].slot = slot,
        }
    }

    /// The array of `slots` (any order, each id once, guest ranges disjoint).
    pub(super) fn from_slots(mut slots: Vec<Arc<Slot<P>>>) -> Self {
        slots.sort_unstable_by_key(|s| s.gpa().0);
        let store = if slots.len() == 1 {
            Store::One(Row::new(slots.pop().expect("one slot")))
        } else {
            Store::Many(slots.into_iter().map(Row::new).collect())
        };
        let mut flat = Flat {
            store,
            aliased: false,
        };
        flat.aliased = flat.any_aliased();
        flat
    }

    /// Whether any two rows' host ranges overlap (at most [`FLAT_MAX`] rows: every pair).
    fn any_aliased(&self) -> bool {
        let rows = self.rows();
        rows.iter().enumerate().any(|(i, a)| {
            rows[i + 1..]
                .iter()
                .any(|b| b.hva_overlaps(a.hva_start, a.hva_end))
        })
    }

    /// Bytes of the array.
    pub(super) fn heap_bytes(&self) -> usize {
        match &self.store {
            Store::One(_) => 0,
            Store::Many(rows) => rows.capacity() * size_of::<Row<P>>(),
        }
    }

    /// Checks that the rows are in guest-address order without overlaps, that their keys agree
    /// with their slots, that every id is there once, and that one row is kept inline. For
    /// tests.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let rows = self.rows();
        if let Store::Many(rows) = &self.store {
            assert_ne!(rows.len(), 1, "a single row not kept inline");
        }
        if !self.aliased {
            assert!(
                !self.any_aliased(),
                "host ranges overlap in a map marked unaliased"
            );
        }
        let mut ids: Vec<SlotId> = rows.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), rows.len(), "an id twice");
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(row.gpa_start, row.slot.gpa().0);
            assert_eq!(row.gpa_end(), row.slot.gpa_range().end);
            assert_eq!(row.hva_key(), super::hva_key(&row.slot));
            if i > 0 {
                assert!(
                    rows[i - 1].gpa_end() <= row.gpa_start,
                    "guest order or overlap"
                );
            }
        }
    }
}
