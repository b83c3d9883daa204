//! The indexes of a middle-sized map: the keys of all three orders in one array of plain data,
//! and the slots themselves in a slab of shared chunks.
//!
//! A small map's array ([`super::flat`]) holds the slot `Arc`s in its rows, so a new version
//! costs a reference-count increment per slot when it is cloned and a decrement per slot when
//! the old one is dropped, as vm-memory's `Vec` of `Arc`s does. Past a few dozen slots those
//! atomic operations are most of the time of a change. Here the rows hold only keys and slab
//! positions (plain data: cloning them is one block copy), and the slots sit in a slab of
//! chunks of [`CHUNK`] slots, each chunk behind an `Arc`: cloning the map costs one increment
//! per chunk, and a change copies only the chunk it writes (`Arc::make_mut`). Slab positions
//! never move while a slot is in the map (a removal moves the last slot into the hole and
//! repoints its three entries), so an insert or removal shifts rows but renumbers nothing.

use std::mem::size_of;
use std::sync::Arc;

use arrayvec::ArrayVec;

use super::{hva_key, HvaKey};
use crate::search::count_prefix;
use crate::slot::{Slot, SlotId};

/// Slots per chunk of the slab.
const CHUNK: usize = 16;

/// The most slots a map keeps in the slab form: one more, and it turns into the trees.
pub(super) const SLAB_MAX: usize = 1024;
/// A map in tree form with fewer slots than this turns back into the slab form (hysteresis, as
/// for the flat form).
pub(super) const SLAB_MIN: usize = 512;

/// An entry of the host-range order: a host range, the largest end in this and every earlier
/// entry (it only grows, so an overlap search finds the first entry that can reach a range by
/// halving), and the slab position of its slot.
#[derive(Debug, Clone, Copy)]
struct HvaEntry {
    start: u64,
    end: u64,
    max_end: u64,
    slot: u32,
}

/// An entry of the id order: an id and the slab position of its slot.
#[derive(Debug, Clone, Copy)]
struct IdEntry {
    id: SlotId,
    slot: u32,
}

/// A new slot's host-range and id entries, naming it as `slot` (its running maximum is set
/// when the entry is in place).
fn new_entries(key: &HvaKey, slot: u32) -> (HvaEntry, IdEntry) {
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
/// of host ends) and the `i`-th entry of the id order, each naming its slot by position.
fn sorted_entries<P>(slots: &mut [Arc<Slot<P>>]) -> Vec<(HvaEntry, IdEntry)> {
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

/// A slab position as the key columns store it. A slab holds at most [`SLAB_MAX`] slots.
fn position(i: usize) -> u32 {
    u32::try_from(i).expect("a slab holds few slots")
}

/// Moves the column entry of row `from` to row `to`, shifting the entries in between by one
/// towards `from`.
fn move_entry<R, T: Copy>(rows: &mut [R], from: usize, to: usize, col: impl Fn(&mut R) -> &mut T) {
    let moved = *col(&mut rows[from]);
    put_entry(rows, from, to, moved, col);
}

/// Writes `entry` into the column at row `to`, shifting the entries from `to` up to (and over)
/// row `from` by one towards `from`.
fn put_entry<R, T: Copy>(
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

/// Row `i` of the key array: the `i`-th slot in guest-address order (its guest range and slab
/// position), the `i`-th entry of the host-range order and the `i`-th entry of the id order,
/// each naming its slot by slab position.
#[derive(Debug, Clone, Copy)]
struct Key {
    gpa_start: u64,
    gpa_end: u64,
    gpa_slot: u32,
    hva: HvaEntry,
    id: IdEntry,
}

/// Up to [`CHUNK`] slots; every chunk of a slab but the last is full.
struct Chunk<P> {
    slots: ArrayVec<Arc<Slot<P>>, CHUNK>,
}

impl<P> Clone for Chunk<P> {
    /// Shares the slots (an increment each).
    fn clone(&self) -> Self {
        Chunk {
            slots: self.slots.clone(),
        }
    }
}

/// All slots of a middle-sized map.
pub(super) struct Slab<P> {
    keys: Vec<Key>,
    chunks: Vec<Arc<Chunk<P>>>,
}

impl<P> Clone for Slab<P> {
    /// Copies the keys (with room for one more row: a clone is most often made to be changed)
    /// and shares the chunks.
    fn clone(&self) -> Self {
        let mut keys = Vec::with_capacity(self.keys.len() + 1);
        keys.extend_from_slice(&self.keys);
        Slab {
            keys,
            chunks: self.chunks.clone(),
        }
    }
}

/// The slots of a slab in guest-address order.
pub(super) struct SlabIter<'a, P> {
    slab: &'a Slab<P>,
    keys: std::slice::Iter<'a, Key>,
}

impl<'a, P> Iterator for SlabIter<'a, P> {
    type Item = &'a Arc<Slot<P>>;

    fn next(&mut self) -> Option<Self::Item> {
        let key = self.keys.next()?;
        Some(self.slab.slot(key.gpa_slot))
    }
}

impl<P> Slab<P> {
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The slot at slab position `s`.
    #[inline]
    fn slot(&self, s: u32) -> &Arc<Slot<P>> {
        let s = s as usize;
        &self.chunks[s / CHUNK].slots[s % CHUNK]
    }

    /// The slot with the largest guest base at most `addr`.
    #[inline]
    pub(super) fn floor_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        let i = count_prefix(&self.keys, |k| k.gpa_start <= addr);
        Some(self.slot(self.keys[i.checked_sub(1)?].gpa_slot))
    }

    /// The slot that holds guest address `addr`.
    #[inline]
    pub(super) fn find_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        let i = count_prefix(&self.keys, |k| k.gpa_start <= addr);
        let key = &self.keys[i.checked_sub(1)?];
        (addr < key.gpa_end).then(|| self.slot(key.gpa_slot))
    }

    /// The row whose id entry is `id`.
    fn id_row(&self, id: SlotId) -> Option<usize> {
        let k = self.keys.partition_point(|r| r.id.id < id);
        self.keys.get(k).filter(|r| r.id.id == id).map(|_| k)
    }

    pub(super) fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        Some(self.slot(self.keys[self.id_row(id)?].id.slot))
    }

    /// Calls `f` on every slot whose host range overlaps `[lo, hi)` (not empty), in host-range
    /// order. Kept out of line (as the trees' search is), so that the flat form's search
    /// inlines into its callers.
    #[inline(never)]
    pub(super) fn for_each_hva_overlap<'a>(
        &'a self,
        lo: u64,
        hi: u64,
        mut f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        // Entries from `end` on start at or after `hi`; entries before `start` all end at or
        // before `lo` (their running maximum does).
        let end = self.keys.partition_point(|k| k.hva.start < hi);
        let start = self.keys[..end].partition_point(|k| k.hva.max_end <= lo);
        for key in &self.keys[start..end] {
            if key.hva.end > lo {
                f(self.slot(key.hva.slot));
            }
        }
    }

    /// The slots in guest-address order.
    pub(super) fn iter(&self) -> SlabIter<'_, P> {
        SlabIter {
            slab: self,
            keys: self.keys.iter(),
        }
    }

    /// The slots whose guest base is at least `from`, in guest-address order.
    pub(super) fn iter_from(&self, from: u64) -> SlabIter<'_, P> {
        let i = self.keys.partition_point(|k| k.gpa_start < from);
        SlabIter {
            slab: self,
            keys: self.keys[i..].iter(),
        }
    }

    /// The slots in host-range order.
    pub(super) fn by_hva(&self) -> impl Iterator<Item = &Arc<Slot<P>>> {
        self.keys.iter().map(|k| self.slot(k.hva.slot))
    }

    /// The slots in id order.
    pub(super) fn by_id(&self) -> impl Iterator<Item = &Arc<Slot<P>>> {
        self.keys.iter().map(|k| self.slot(k.id.slot))
    }

    /// The row of the host-range order where `key` is or would go.
    fn hva_position(&self, key: &HvaKey) -> usize {
        self.keys.partition_point(|r| {
            r.hva.start < key.start
                || (r.hva.start == key.start
                    && (r.hva.end < key.end
                        || (r.hva.end == key.end && self.slot(r.hva.slot).id() < key.id)))
        })
    }

    /// The row of the guest-address order where a slot based at `gpa` is or would go.
    fn gpa_position(&self, gpa: u64) -> usize {
        self.keys.partition_point(|k| k.gpa_start < gpa)
    }

    /// Recomputes the running maximum of host range ends from row `from` on.
    fn rerun_max_end(&mut self, from: usize) {
        let mut max_end = from
            .checked_sub(1)
            .map_or(0, |prev| self.keys[prev].hva.max_end);
        for key in &mut self.keys[from..] {
            max_end = max_end.max(key.hva.end);
            key.hva.max_end = max_end;
        }
    }

    /// Adds `slot`; its id must be new and its guest base unused.
    pub(super) fn insert(&mut self, slot: Arc<Slot<P>>) {
        let key = hva_key(&slot);
        let range = slot.gpa_range();
        let g = self.gpa_position(range.start);
        let h = self.hva_position(&key);
        let k = self.keys.partition_point(|r| r.id.id < key.id);
        // The slot goes at the end of the slab.
        let s = position(self.keys.len());
        match self.chunks.last_mut() {
            Some(chunk) if chunk.slots.len() < CHUNK => Arc::make_mut(chunk).slots.push(slot),
            _ => {
                let mut slots = ArrayVec::new();
                slots.push(slot);
                self.chunks.push(Arc::new(Chunk { slots }));
            }
        }
        let (hva, id) = new_entries(&key, s);
        // The new row goes in at `g` whole, which puts its guest-address entry in place and
        // shifts every column's entries from `g` on; then its host-range and id entries go to
        // theirs, the entries in between moving back by one.
        self.keys.insert(
            g,
            Key {
                gpa_start: range.start,
                gpa_end: range.end,
                gpa_slot: s,
                hva,
                id,
            },
        );
        put_entry(&mut self.keys, g, h, hva, |r| &mut r.hva);
        put_entry(&mut self.keys, g, k, id, |r| &mut r.id);
        self.rerun_max_end(g.min(h));
    }

    /// Removes the slot with id `id` and returns it.
    pub(super) fn remove(&mut self, id: SlotId) -> Option<Arc<Slot<P>>> {
        let k = self.id_row(id)?;
        let s = self.keys[k].id.slot;
        let removed = Arc::clone(self.slot(s));
        let g = self.gpa_position(removed.gpa().0);
        let h = self.hva_position(&hva_key(&removed));
        // Gather the slot's three entries in its row, then take the row out.
        move_entry(&mut self.keys, h, g, |r| &mut r.hva);
        move_entry(&mut self.keys, k, g, |r| &mut r.id);
        self.keys.remove(g);
        self.rerun_max_end(g.min(h));
        // The last slot of the slab fills the hole; its three entries are pointed at it.
        let last = position(self.keys.len());
        if s != last {
            let moved = Arc::clone(self.slot(last));
            let rows = [
                self.gpa_position(moved.gpa().0),
                self.hva_position(&hva_key(&moved)),
                self.id_row(moved.id())
                    .expect("the moved slot is in the map"),
            ];
            self.keys[rows[0]].gpa_slot = s;
            self.keys[rows[1]].hva.slot = s;
            self.keys[rows[2]].id.slot = s;
            let chunk = Arc::make_mut(&mut self.chunks[s as usize / CHUNK]);
            chunk.slots[s as usize % CHUNK] = moved;
        }
        let chunk = self.chunks.last_mut().expect("the slab holds the slot");
        if chunk.slots.len() == 1 {
            self.chunks.pop();
        } else {
            Arc::make_mut(chunk).slots.pop();
        }
        Some(removed)
    }

    /// Puts `slot` in place of the slot with its id, whose guest base and host range it keeps.
    pub(super) fn replace_in_place(&mut self, slot: Arc<Slot<P>>) {
        let k = self.id_row(slot.id()).expect("the slot is in the map");
        let s = self.keys[k].id.slot as usize;
        Arc::make_mut(&mut self.chunks[s / CHUNK]).slots[s % CHUNK] = slot;
    }

    /// The slab of `slots` (any order, each id once, guest ranges disjoint).
    pub(super) fn from_slots(mut slots: Vec<Arc<Slot<P>>>) -> Self {
        // Slab position = guest-address order.
        let entries = sorted_entries(&mut slots);
        let keys = slots
            .iter()
            .enumerate()
            .zip(entries)
            .map(|((g, slot), (hva, id))| Key {
                gpa_start: slot.gpa().0,
                gpa_end: slot.gpa_range().end,
                gpa_slot: position(g),
                hva,
                id,
            })
            .collect();
        let chunks = slots
            .chunks(CHUNK)
            .map(|chunk| {
                Arc::new(Chunk {
                    slots: chunk.iter().cloned().collect(),
                })
            })
            .collect();
        Slab { keys, chunks }
    }

    /// Bytes of the key array and of the chunks.
    pub(super) fn heap_bytes(&self) -> usize {
        self.keys.capacity() * size_of::<Key>()
            + self.chunks.capacity() * size_of::<Arc<Chunk<P>>>()
            + self.chunks.len() * (size_of::<Chunk<P>>() + 2 * size_of::<usize>())
    }

    /// Checks that the three columns are each sorted, name every slab position once and agree
    /// with the slots, the running maxima, and the slab's shape. For tests.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let n = self.keys.len();
        assert_eq!(self.chunks.len(), n.div_ceil(CHUNK));
        for (i, chunk) in self.chunks.iter().enumerate() {
            let full = if i + 1 < self.chunks.len() {
                CHUNK
            } else {
                n - i * CHUNK
            };
            assert_eq!(chunk.slots.len(), full, "chunk {i}");
        }
        let mut seen = [vec![false; n], vec![false; n], vec![false; n]];
        let mut max_end = 0;
        for (i, key) in self.keys.iter().enumerate() {
            for (column, s) in [key.gpa_slot, key.hva.slot, key.id.slot].iter().enumerate() {
                assert!(!std::mem::replace(&mut seen[column][*s as usize], true));
            }
            let slot = self.slot(key.gpa_slot);
            assert_eq!(key.gpa_start, slot.gpa().0);
            assert_eq!(key.gpa_end, slot.gpa_range().end);
            let hva_slot = self.slot(key.hva.slot);
            let range = hva_slot.hva_range();
            assert_eq!((key.hva.start, key.hva.end), (range.start, range.end));
            assert_eq!(key.id.id, self.slot(key.id.slot).id());
            max_end = max_end.max(key.hva.end);
            assert_eq!(key.hva.max_end, max_end);
            if i > 0 {
                let prev = &self.keys[i - 1];
                assert!(prev.gpa_end <= key.gpa_start, "guest order or overlap");
                let prev_key = hva_key(self.slot(prev.hva.slot));
                assert!(prev_key < hva_key(hva_slot), "host-range order");
                assert!(prev.id.id < key.id.id, "id order");
            }
        }
    }
}
