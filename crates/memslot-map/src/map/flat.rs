//! The indexes of a small map: one array, owned by the map version, that holds all three
//! orders (guest address, host range, id).
//!
//! This is vm-memory's design (a sorted `Vec` of `Arc`s, copied whole for a new version) with
//! the keys inline: cloning the map copies the array (one allocation and one reference-count
//! increment per slot) and a change then moves rows in place, without touching a reference
//! count. For a few dozen slots that costs less than copying the root-to-leaf paths of three
//! trees (a full-capacity node allocated per level and index, one reference-count increment per
//! entry of each) and, being one allocation, less than the slab form (`super::slab`), which
//! takes over past [`FLAT_MAX`] slots, where the increments dominate; searching a contiguous
//! array with the keys and slots inline costs less than a descent through nodes. The map
//! switches between the forms with hysteresis (see [`FLAT_MAX`] and [`FLAT_MIN`]).

use std::mem::size_of;
use std::sync::Arc;

use super::{hva_key, HvaKey};
use crate::slot::{Slot, SlotId};

/// The most slots a map keeps in the flat form: one more, and it turns into the slab.
pub(super) const FLAT_MAX: usize = 32;
/// A map in slab form with fewer slots than this turns back into the flat form. Well below
/// [`FLAT_MAX`], so that a map whose size wanders around either bound does not convert back and
/// forth on every change.
pub(super) const FLAT_MIN: usize = 16;

/// Up to this many slots, a host-address search reads the rows in order rather than halving.
const LINEAR_SCAN: usize = 16;

/// An entry of the host-range order: a host range, the largest end in this and every earlier
/// entry (it only grows, so an overlap search finds the first entry that can reach a range by
/// halving), and the row of its slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct HvaEntry {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) max_end: u64,
    pub(super) slot: u32,
}

/// An entry of the id order: an id and the row of its slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct IdEntry {
    pub(super) id: SlotId,
    pub(super) slot: u32,
}

/// Row `i` of the array: the `i`-th slot in guest-address order (with its guest range inline),
/// the `i`-th entry of the host-range order and the `i`-th entry of the id order.
pub(super) struct Row<P> {
    gpa_start: u64,
    gpa_end: u64,
    slot: Arc<Slot<P>>,
    hva: HvaEntry,
    id: IdEntry,
}

impl<P> Clone for Row<P> {
    fn clone(&self) -> Self {
        Row {
            gpa_start: self.gpa_start,
            gpa_end: self.gpa_end,
            slot: Arc::clone(&self.slot),
            hva: self.hva,
            id: self.id,
        }
    }
}

impl<P> Row<P> {
    pub(super) fn slot(&self) -> &Arc<Slot<P>> {
        &self.slot
    }

    /// The only row of a map of one slot: every column names row 0.
    fn single(slot: Arc<Slot<P>>) -> Self {
        let gpa = slot.gpa_range();
        let hva = slot.hva_range();
        Row {
            gpa_start: gpa.start,
            gpa_end: gpa.end,
            hva: HvaEntry {
                start: hva.start,
                end: hva.end,
                max_end: hva.end,
                slot: 0,
            },
            id: IdEntry {
                id: slot.id(),
                slot: 0,
            },
            slot,
        }
    }
}

/// All slots of a small map.
pub(super) struct Flat<P> {
    store: Store<P>,
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
        Flat { store }
    }
}

impl<P> Default for Flat<P> {
    fn default() -> Self {
        Flat {
            store: Store::Many(Vec::new()),
        }
    }
}

/// A new slot's host-range and id entries, naming it as `slot` (its running maximum is set
/// when the entry is in place).
pub(super) fn new_entries(key: &HvaKey, slot: u32) -> (HvaEntry, IdEntry) {
    (
        HvaEntry {
            start: key.start,
            end: key.end,
            max_end: 0,
            slot,
        },
        IdEntry { id: key.id, slot },
    )
}

/// Sorts `slots` (each id once, guest ranges disjoint) into guest-address order and returns,
/// for each position `i`, the `i`-th entry of the host-range order (with the running maximum
/// of host ends) and the `i`-th entry of the id order, each naming its slot by position: the
/// rows of a flat map and the keys of a slab alike.
pub(super) fn sorted_entries<P>(slots: &mut [Arc<Slot<P>>]) -> Vec<(HvaEntry, IdEntry)> {
    slots.sort_unstable_by_key(|s| s.gpa().0);
    let mut by_hva: Vec<u32> = (0..position(slots.len())).collect();
    by_hva.sort_unstable_by_key(|&i| hva_key(&slots[i as usize]));
    let mut by_id: Vec<u32> = (0..position(slots.len())).collect();
    by_id.sort_unstable_by_key(|&i| slots[i as usize].id());
    let mut max_end = 0;
    by_hva
        .into_iter()
        .zip(by_id)
        .map(|(hva_slot, id_slot)| {
            let range = slots[hva_slot as usize].hva_range();
            max_end = max_end.max(range.end);
            (
                HvaEntry {
                    start: range.start,
                    end: range.end,
                    max_end,
                    slot: hva_slot,
                },
                IdEntry {
                    id: slots[id_slot as usize].id(),
                    slot: id_slot,
                },
            )
        })
        .collect()
}

/// A row position as the index columns store it. Flat maps hold at most a few hundred slots.
pub(super) fn position(i: usize) -> u32 {
    u32::try_from(i).expect("a flat map holds few slots")
}

/// Moves the column entry of row `from` to row `to`, shifting the entries in between by one
/// towards `from`.
pub(super) fn move_entry<R, T: Copy>(
    rows: &mut [R],
    from: usize,
    to: usize,
    col: impl Fn(&mut R) -> &mut T,
) {
    let moved = *col(&mut rows[from]);
    put_entry(rows, from, to, moved, col);
}

/// Writes `entry` into the column at row `to`, shifting the entries from `to` up to (and over)
/// row `from` by one towards `from`.
pub(super) fn put_entry<R, T: Copy>(
    rows: &mut [R],
    from: usize,
    to: usize,
    moved: T,
    col: impl Fn(&mut R) -> &mut T,
) {
    if from < to {
        for i in from..to {
            let next = *col(&mut rows[i + 1]);
            *col(&mut rows[i]) = next;
        }
    } else {
        for i in (to..from).rev() {
            let prev = *col(&mut rows[i]);
            *col(&mut rows[i + 1]) = prev;
        }
    }
    *col(&mut rows[to]) = moved;
}

impl<P> Flat<P> {
    #[inline]
    pub(super) fn rows(&self) -> &[Row<P>] {
        match &self.store {
            Store::One(row) => std::slice::from_ref(row),
            Store::Many(rows) => rows,
        }
    }

    fn rows_mut(&mut self) -> &mut [Row<P>] {
        match &mut self.store {
            Store::One(row) => std::slice::from_mut(row),
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

    /// Keeps a single row inline.
    fn settle(&mut self) {
        if let Store::Many(rows) = &mut self.store {
            if rows.len() == 1 {
                let row = rows.pop().expect("one row");
                self.store = Store::One(row);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.rows().len()
    }

    /// The slot with the largest guest base at most `addr`.
    #[inline]
    pub(super) fn floor_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        let i = self.rows().partition_point(|r| r.gpa_start <= addr);
        Some(&self.rows()[i.checked_sub(1)?].slot)
    }

    /// The slot that holds guest address `addr`.
    #[inline]
    pub(super) fn find_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        let i = self.rows().partition_point(|r| r.gpa_start <= addr);
        let row = &self.rows()[i.checked_sub(1)?];
        (addr < row.gpa_end).then_some(&row.slot)
    }

    /// The row whose id entry is `id`.
    fn id_row(&self, id: SlotId) -> Option<usize> {
        let k = self.rows().partition_point(|r| r.id.id < id);
        self.rows().get(k).filter(|r| r.id.id == id).map(|_| k)
    }

    pub(super) fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        let k = self.id_row(id)?;
        Some(&self.rows()[self.rows()[k].id.slot as usize].slot)
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
        if let Store::One(row) = &self.store {
            if row.hva.start < hi && row.hva.end > lo {
                f(&row.slot);
            }
            return;
        }
        let rows = self.rows();
        if rows.len() <= LINEAR_SCAN {
            for row in rows {
                if row.hva.start >= hi {
                    break;
                }
                if row.hva.end > lo {
                    f(&rows[row.hva.slot as usize].slot);
                }
            }
            return;
        }
        // Entries from `end` on start at or after `hi`; entries before `start` all end at or
        // before `lo` (their running maximum does).
        let end = rows.partition_point(|r| r.hva.start < hi);
        let start = rows[..end].partition_point(|r| r.hva.max_end <= lo);
        for row in &rows[start..end] {
            if row.hva.end > lo {
                f(&rows[row.hva.slot as usize].slot);
            }
        }
    }

    /// The slots whose guest base is at least `from`, in guest-address order.
    pub(super) fn iter_from(&self, from: u64) -> std::slice::Iter<'_, Row<P>> {
        self.rows()[self.rows().partition_point(|r| r.gpa_start < from)..].iter()
    }

    /// The position in the host-range order of `key`: the number of entries below it.
    fn hva_position(&self, key: &HvaKey) -> usize {
        let rows = self.rows();
        rows.partition_point(|r| {
            r.hva.start < key.start
                || (r.hva.start == key.start
                    && (r.hva.end < key.end
                        || (r.hva.end == key.end && rows[r.hva.slot as usize].slot.id() < key.id)))
        })
    }

    /// Renumbers the slot rows that the host-range and id entries name after a row was added
    /// or removed at `at` (`renumber`), except those of the entries at `skip_hva` and `skip_id`,
    /// and recomputes the running maximum of host range ends.
    fn renumber(
        &mut self,
        renumber: impl Fn(u32) -> u32,
        skip_hva: Option<usize>,
        skip_id: Option<usize>,
    ) {
        let mut max_end = 0;
        for (i, row) in self.rows_mut().iter_mut().enumerate() {
            if Some(i) != skip_hva {
                row.hva.slot = renumber(row.hva.slot);
            }
            if Some(i) != skip_id {
                row.id.slot = renumber(row.id.slot);
            }
            max_end = max_end.max(row.hva.end);
            row.hva.max_end = max_end;
        }
    }

    /// Adds `slot`; its id must be new and its guest base unused.
    pub(super) fn insert(&mut self, slot: Arc<Slot<P>>) {
        let key = hva_key(&slot);
        let range = slot.gpa_range();
        let g = self.rows().partition_point(|r| r.gpa_start < range.start);
        let h = self.hva_position(&key);
        let k = self.rows().partition_point(|r| r.id.id < key.id);
        let at = position(g);
        let (hva, id) = new_entries(&key, at);
        let row = Row {
            gpa_start: range.start,
            gpa_end: range.end,
            slot,
            hva: HvaEntry {
                max_end: key.end,
                ..hva
            },
            id,
        };
        if self.len() == 0 {
            self.store = Store::One(row);
            return;
        }
        // The new row goes in at `g` whole, which puts its guest-address entry in place and
        // shifts every column's entries from `g` on; then its host-range and id entries go to
        // theirs, the entries in between moving back by one.
        let rows = self.vec();
        rows.insert(g, row);
        put_entry(rows, g, h, hva, |r| &mut r.hva);
        put_entry(rows, g, k, id, |r| &mut r.id);
        self.renumber(|s| s + u32::from(s >= at), Some(h), Some(k));
    }

    /// Removes the slot with id `id` and returns it.
    pub(super) fn remove(&mut self, id: SlotId) -> Option<Arc<Slot<P>>> {
        let k = self.id_row(id)?;
        let g = self.rows()[k].id.slot as usize;
        match &mut self.store {
            Store::One(_) => {
                let Store::One(row) = std::mem::take(self).store else {
                    unreachable!("matched above")
                };
                return Some(row.slot);
            }
            // The other row becomes the only one, rebuilt rather than moved about.
            Store::Many(rows) if rows.len() == 2 => {
                let removed = rows.swap_remove(g);
                let kept = rows.pop().expect("two rows");
                self.store = Store::One(Row::single(kept.slot));
                return Some(removed.slot);
            }
            Store::Many(_) => {}
        }
        let h = self.hva_position(&hva_key(&self.rows()[g].slot));
        // Gather the slot's three entries in its row, then take the row out.
        let rows = self.rows_mut();
        move_entry(rows, h, g, |r| &mut r.hva);
        move_entry(rows, k, g, |r| &mut r.id);
        let row = self.vec().remove(g);
        let at = position(g);
        self.renumber(|s| s - u32::from(s > at), None, None);
        self.settle();
        Some(row.slot)
    }

    /// Puts `slot` in place of the slot with its id, whose guest base and host range it keeps.
    pub(super) fn replace_in_place(&mut self, slot: Arc<Slot<P>>) {
        let g = self.rows().partition_point(|r| r.gpa_start < slot.gpa().0);
        self.rows_mut()[g].slot = slot;
    }

    /// The array of `slots` (any order, each id once, guest ranges disjoint).
    pub(super) fn from_slots(mut slots: Vec<Arc<Slot<P>>>) -> Self {
        let entries = sorted_entries(&mut slots);
        let rows = slots
            .iter()
            .zip(entries)
            .map(|(slot, (hva, id))| Row {
                gpa_start: slot.gpa().0,
                gpa_end: slot.gpa_range().end,
                slot: Arc::clone(slot),
                hva,
                id,
            })
            .collect();
        let mut flat = Flat {
            store: Store::Many(rows),
        };
        flat.settle();
        flat
    }

    /// Bytes of the array.
    pub(super) fn heap_bytes(&self) -> usize {
        match &self.store {
            Store::One(_) => 0,
            Store::Many(rows) => rows.capacity() * size_of::<Row<P>>(),
        }
    }

    /// Checks that the three columns are each sorted, name every row once and agree with the
    /// slots, and the running maxima. For tests.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let rows = self.rows();
        let mut hva_seen = vec![false; rows.len()];
        let mut id_seen = vec![false; rows.len()];
        let mut max_end = 0;
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(row.gpa_start, row.slot.gpa().0);
            assert_eq!(row.gpa_end, row.slot.gpa_range().end);
            let hva_slot = &rows[row.hva.slot as usize].slot;
            let range = hva_slot.hva_range();
            assert_eq!((row.hva.start, row.hva.end), (range.start, range.end));
            assert_eq!(row.id.id, rows[row.id.slot as usize].slot.id());
            max_end = max_end.max(row.hva.end);
            assert_eq!(row.hva.max_end, max_end);
            assert!(!std::mem::replace(
                &mut hva_seen[row.hva.slot as usize],
                true
            ));
            assert!(!std::mem::replace(&mut id_seen[row.id.slot as usize], true));
            if i > 0 {
                let prev = &rows[i - 1];
                assert!(prev.gpa_end <= row.gpa_start, "guest order or overlap");
                let prev_key = hva_key(&rows[prev.hva.slot as usize].slot);
                assert!(prev_key < hva_key(hva_slot), "host-range order");
                assert!(prev.id.id < row.id.id, "id order");
            }
        }
    }
}
