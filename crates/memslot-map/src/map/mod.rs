//! One version of the slot map: three persistent indexes over the same slots.
//!
//! This file holds the map's types, its configuration and its queries; `change` holds
//! [`Change`] and the single changes with their checks, and `batch`
//! [`MemslotMap::with_changes`], which writes runs of changes in one sorted pass.

use std::cell::Cell;
use std::fmt;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::GuestAddress;

use crate::error::ConfigError;
use crate::slot::{HostAddress, Slot, SlotId};

mod batch;
mod change;
mod flat;
mod slab;
mod trees;

use flat::{Flat, Row, FLAT_MAX, FLAT_MIN};
use slab::{Slab, SlabIter, SLAB_MAX, SLAB_MIN};
use trees::{GpaIter, Trees};

pub use change::Change;

/// Rules a map checks every slot against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapConfig {
    page_size: u64,
    max_slots: usize,
}

impl MapConfig {
    /// Slots must be aligned to `page_size` (a power of two) in guest address, host address and
    /// size, and the map holds at most `max_slots` slots.
    pub fn new(page_size: u64, max_slots: usize) -> Result<Self, ConfigError> {
        if !page_size.is_power_of_two() {
            return Err(ConfigError::PageSize(page_size));
        }
        Ok(MapConfig {
            page_size,
            max_slots,
        })
    }

    /// The alignment every slot must have.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The most slots the map holds.
    pub fn max_slots(&self) -> usize {
        self.max_slots
    }
}

impl Default for MapConfig {
    /// 4 KiB pages and no limit on the number of slots.
    fn default() -> Self {
        MapConfig {
            page_size: 4096,
            max_slots: usize::MAX,
        }
    }
}

/// Key of the host-address index. Host ranges may overlap, so the id breaks ties; the end is in
/// the key so that a search never loads a slot to learn where it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct HvaKey {
    start: u64,
    end: u64,
    id: SlotId,
}

/// Every map version gets a generation no other version in the process has, so that a
/// [`LookupHint`] can tell whether it was filled from the version it is used with. Each thread
/// takes a block of [`GENERATION_BLOCK`] generations at a time from here (0 is never handed
/// out: it is the generation of an empty hint).
static NEXT_GENERATION_BLOCK: AtomicU64 = AtomicU64::new(1);

/// How many generations a thread takes at a time, so that most changes get theirs without an
/// atomic operation on a line that all writers share.
const GENERATION_BLOCK: u64 = 1024;

thread_local! {
    /// The next generation this thread hands out and the end of its block.
    static GENERATIONS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

#[inline]
fn next_generation() -> u64 {
    GENERATIONS.with(|block| {
        let (next, end) = block.get();
        if next < end {
            block.set((next + 1, end));
            return next;
        }
        let start = NEXT_GENERATION_BLOCK.fetch_add(GENERATION_BLOCK, Ordering::Relaxed);
        block.set((start + 1, start + GENERATION_BLOCK));
        start
    })
}

/// A reader's own memory of the slot it found last (the kernel's `last_used_slot`, but kept by
/// each reader rather than in the shared map, so that readers never write a shared cache line).
///
/// A hint is valid only for the map version that filled it; used with another version it is
/// ignored and refilled. It holds a reference to its slot, keeping that slot's payload alive
/// until the hint is refilled or dropped.
pub struct LookupHint<P> {
    generation: u64,
    slot: Option<Arc<Slot<P>>>,
}

impl<P> fmt::Debug for LookupHint<P> {
    /// The generation of the version that filled the hint and the id of the slot it holds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupHint")
            .field("generation", &self.generation)
            .field("slot", &self.slot.as_ref().map(|s| s.id()))
            .finish()
    }
}

impl<P> Default for LookupHint<P> {
    fn default() -> Self {
        LookupHint {
            generation: 0,
            slot: None,
        }
    }
}

/// Heap memory a map version holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Number of slots.
    pub slots: usize,
    /// Bytes of the three indexes' nodes.
    pub index_bytes: usize,
    /// Bytes of the slots themselves (their payloads' own heap not included).
    pub slot_bytes: usize,
}

impl MemoryUsage {
    /// Index and slot bytes divided by the number of slots (0 for an empty map).
    pub fn bytes_per_slot(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            (self.index_bytes + self.slot_bytes) as f64 / self.slots as f64
        }
    }
}

/// One version of a map of memory slots, indexed by guest address, host address and id.
///
/// Guest ranges never overlap; host ranges may. A map of more than 1024 slots keeps them in
/// persistent B+trees: cloning it is O(1) and the clone shares every node with the original;
/// changing a clone copies only the O(log n) nodes on the changed paths. A map of up to 32 slots
/// keeps them in one array, as vm-memory does: cloning it copies the array (one reference-count
/// increment per slot) and a change edits the copy in place. In between, a map keeps the keys of
/// its three orders in one array of plain data (cloned as one block copy) and the slots in a
/// slab of shared chunks of 16 (cloning it costs one increment per chunk, a change copies the
/// chunk it writes). Both cost less than copying tree paths at their sizes. The map changes
/// form as it grows past 32 and 1024 slots and as it shrinks below 512 and 16; the forms answer
/// every query alike.
/// Lookups are O(log n) (host-range lookups O(log n + k) for k results), except that a map of
/// up to 32 slots, which keeps only the guest-address order, answers lookups by id and by host
/// address by reading its (at most 32) rows' inline keys.
///
/// ```
/// use memslot_map::{Change, HostAddress, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
/// use vm_memory::GuestAddress;
///
/// let map = MemslotMap::new(MapConfig::default());
/// let slot = |id, gpa, hva| {
///     Slot::new(SlotId(id), GuestAddress(gpa), 0x1000, HostAddress(hva), SlotFlags::default(), ())
/// };
/// let v1 = map
///     .with_changes([Change::Insert(slot(0, 0x0, 0x7000_0000)), Change::Insert(slot(1, 0x1000, 0x7000_0000))])
///     .unwrap();
/// assert_eq!(v1.find_by_gpa(GuestAddress(0x1800)).unwrap().id(), SlotId(1));
/// // Both slots are backed by the same host page.
/// assert_eq!(v1.slots_overlapping_hva(HostAddress(0x7000_0010), 1).len(), 2);
/// // A refused batch changes nothing.
/// assert!(v1.with_changes([Change::Remove(SlotId(0)), Change::Remove(SlotId(9))]).is_err());
/// assert_eq!(v1.len(), 2);
/// ```
#[derive(Clone)]
pub struct MemslotMap<P> {
    index: Index<P>,
    config: MapConfig,
    generation: u64,
}

/// The three indexes, in the form that suits the number of slots: up to [`FLAT_MAX`] slots one
/// array copied whole on a change, up to [`SLAB_MAX`] an array of keys and a slab of shared
/// chunks of slots, beyond that three persistent B+trees; back to the slab below [`SLAB_MIN`]
/// and to the array below [`FLAT_MIN`].
#[derive(Clone)]
enum Index<P> {
    Flat(Flat<P>),
    Slab(Slab<P>),
    Trees(Trees<P>),
}

/// The slots of any form in guest-address order.
enum SlotIter<'a, P> {
    Flat(std::slice::Iter<'a, Row<P>>),
    Slab(SlabIter<'a, P>),
    Trees(GpaIter<'a, P>),
}

impl<'a, P> Iterator for SlotIter<'a, P> {
    type Item = &'a Arc<Slot<P>>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            SlotIter::Flat(rows) => rows.next().map(Row::slot),
            SlotIter::Slab(slots) => slots.next(),
            SlotIter::Trees(entries) => entries.next().map(|(_, slot)| slot),
        }
    }
}

impl<P> fmt::Debug for MemslotMap<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemslotMap")
            .field("slots", &self.index.len())
            .field("config", &self.config)
            .field("generation", &self.generation)
            .finish()
    }
}

impl<P: Clone> MemslotMap<P> {
    /// An empty map whose slots must follow `config`.
    pub fn new(config: MapConfig) -> Self {
        MemslotMap {
            index: Index::Flat(Flat::default()),
            config,
            generation: next_generation(),
        }
    }

    /// The rules this map checks slots against.
    pub fn config(&self) -> MapConfig {
        self.config
    }

    /// A number unique to this version in this process; every change gives a new one.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the map has no slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slot that holds guest-physical address `addr`. O(log n).
    #[inline]
    pub fn find_by_gpa(&self, addr: GuestAddress) -> Option<&Arc<Slot<P>>> {
        match &self.index {
            Index::Flat(flat) => flat.find_gpa(addr.0),
            Index::Slab(slab) => slab.find_gpa(addr.0),
            Index::Trees(trees) => trees.floor_gpa(addr.0).filter(|s| s.contains_gpa(addr)),
        }
    }

    /// The slot with the largest guest base at most `addr`.
    fn floor_gpa(&self, addr: u64) -> Option<&Arc<Slot<P>>> {
        match &self.index {
            Index::Flat(flat) => flat.floor_gpa(addr),
            Index::Slab(slab) => slab.floor_gpa(addr),
            Index::Trees(trees) => trees.floor_gpa(addr),
        }
    }

    /// Like [`find_by_gpa`](Self::find_by_gpa), first trying the slot `hint` remembers; on a
    /// miss the hint is refilled with the slot found.
    ///
    /// ```
    /// use memslot_map::{GuestAddress, HostAddress, LookupHint, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
    ///
    /// let mut map = MemslotMap::new(MapConfig::default());
    /// let hva = HostAddress(0x7f00_0000_0000);
    /// map.insert(Slot::new(SlotId(3), GuestAddress(0x10_0000), 0x10_0000, hva, SlotFlags::default(), "ram"))
    ///     .unwrap();
    /// // One hint per reader (a vCPU thread, say): a run of accesses to one slot skips the tree.
    /// let mut hint = LookupHint::default();
    /// for offset in (0..0x10_0000).step_by(0x1000) {
    ///     let slot = map.find_by_gpa_hinted(GuestAddress(0x10_0000 + offset), &mut hint).unwrap();
    ///     assert_eq!(slot.id(), SlotId(3));
    /// }
    /// assert!(map.find_by_gpa_hinted(GuestAddress(0x20_0000), &mut hint).is_none());
    /// ```
    #[inline]
    pub fn find_by_gpa_hinted<'a>(
        &'a self,
        addr: GuestAddress,
        hint: &'a mut LookupHint<P>,
    ) -> Option<&'a Arc<Slot<P>>> {
        let hit = hint.generation == self.generation
            && hint.slot.as_ref().is_some_and(|s| s.contains_gpa(addr));
        if hit {
            return hint.slot.as_ref();
        }
        self.find_and_fill_hint(addr, hint)
    }

    /// The miss path of [`find_by_gpa_hinted`](Self::find_by_gpa_hinted), kept out of line so
    /// that the hit path inlines into its caller.
    #[inline(never)]
    fn find_and_fill_hint<'a>(
        &'a self,
        addr: GuestAddress,
        hint: &'a mut LookupHint<P>,
    ) -> Option<&'a Arc<Slot<P>>> {
        let found = self.find_by_gpa(addr)?;
        hint.generation = self.generation;
        hint.slot = Some(Arc::clone(found));
        Some(found)
    }

    /// The slot with id `id`. O(log n).
    pub fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        match &self.index {
            Index::Flat(flat) => flat.get(id),
            Index::Slab(slab) => slab.get(id),
            Index::Trees(trees) => trees.get(id),
        }
    }

    /// The slot whose host range holds host address `hva`; where slots alias host memory
    /// (their host ranges overlap), the first of those that hold it in host-address order (by
    /// start, then end, then id). O(log n + k) for k slots holding it (k is 1 without aliasing).
    /// [`for_each_hva_overlap`](Self::for_each_hva_overlap) finds them all.
    ///
    /// ```
    /// use memslot_map::{HostAddress, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
    /// use vm_memory::GuestAddress;
    ///
    /// let mut map = MemslotMap::new(MapConfig::default());
    /// let hva = HostAddress(0x7f00_0000_0000);
    /// // Two guest ranges backed by the same host page.
    /// for (id, gpa) in [(0, 0x10_0000), (1, 0x20_0000)] {
    ///     let slot = Slot::new(SlotId(id), GuestAddress(gpa), 0x1000, hva, SlotFlags::default(), ());
    ///     map.insert(slot)?;
    /// }
    /// let found = map.find_by_hva(HostAddress(hva.0 + 0x10)).expect("both hold it");
    /// assert_eq!(found.id(), SlotId(0));
    /// assert!(map.find_by_hva(HostAddress(hva.0 + 0x1000)).is_none());
    /// # Ok::<(), memslot_map::MapError>(())
    /// ```
    #[inline]
    pub fn find_by_hva(&self, hva: HostAddress) -> Option<&Arc<Slot<P>>> {
        match &self.index {
            Index::Flat(flat) => flat.find_hva(hva.0),
            // Out of line; while no host ranges overlap, there is at most one to find.
            _ => {
                let mut first = None;
                self.for_each_hva_overlap(hva, 1, |slot| {
                    first.get_or_insert(slot);
                });
                first
            }
        }
    }

    /// Calls `f` on every slot whose host range overlaps `[hva, hva + len)`, in host-address
    /// order. O(log n + k) for k slots found; `len` 0 finds nothing.
    #[inline]
    pub fn for_each_hva_overlap<'a>(
        &'a self,
        hva: HostAddress,
        len: u64,
        f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        let (lo, hi) = (hva.0, hva.0.saturating_add(len));
        if lo == hi {
            return;
        }
        match &self.index {
            Index::Flat(flat) => flat.for_each_hva_overlap(lo, hi, f),
            Index::Slab(slab) => slab.for_each_hva_overlap(lo, hi, f),
            Index::Trees(trees) => trees.for_each_hva_overlap(lo, hi, f),
        }
    }

    /// Every slot whose host range overlaps `[hva, hva + len)`, in host-address order.
    pub fn slots_overlapping_hva(&self, hva: HostAddress, len: u64) -> Vec<&Arc<Slot<P>>> {
        let mut out = Vec::new();
        self.for_each_hva_overlap(hva, len, |s| out.push(s));
        out
    }

    /// All slots in guest-address order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Slot<P>>> + '_ {
        match &self.index {
            Index::Flat(flat) => SlotIter::Flat(flat.rows().iter()),
            Index::Slab(slab) => SlotIter::Slab(slab.iter()),
            Index::Trees(trees) => SlotIter::Trees(trees.iter()),
        }
    }

    /// Slots in guest-address order, starting with the one that holds `addr` or else the first
    /// one above it.
    pub fn iter_from_gpa(&self, addr: GuestAddress) -> impl Iterator<Item = &Arc<Slot<P>>> + '_ {
        let from = self.find_by_gpa(addr).map_or(addr.0, |s| s.gpa().0);
        match &self.index {
            Index::Flat(flat) => SlotIter::Flat(flat.iter_from(from)),
            Index::Slab(slab) => SlotIter::Slab(slab.iter_from(from)),
            Index::Trees(trees) => SlotIter::Trees(trees.iter_from(from)),
        }
    }

    /// The first slot, in guest-address order, whose guest range overlaps `[start, end)`.
    /// O(log n).
    pub fn first_overlap(&self, start: u64, end: u64) -> Option<&Arc<Slot<P>>> {
        self.iter_from_gpa(GuestAddress(start))
            .next()
            .filter(|slot| start < end && slot.gpa().0 < end)
    }

    /// The first address of `[start, end)` that no slot holds, or `None` if slots cover all of
    /// it. O(log n + k) for the k slots covering the range before the hole.
    pub fn first_hole(&self, start: u64, end: u64) -> Option<u64> {
        let mut at = start;
        for slot in self.iter_from_gpa(GuestAddress(start)) {
            if at >= end || slot.gpa().0 > at {
                break;
            }
            at = slot.gpa_range().end;
        }
        (at < end).then_some(at)
    }

    /// Heap memory held by this version (shared nodes counted as if they were its own).
    pub fn memory_usage(&self) -> MemoryUsage {
        let slots = self.len();
        MemoryUsage {
            slots,
            index_bytes: match &self.index {
                Index::Flat(flat) => flat.heap_bytes(),
                Index::Slab(slab) => slab.heap_bytes(),
                Index::Trees(trees) => trees.heap_bytes(),
            },
            slot_bytes: slots * (size_of::<Slot<P>>() + 2 * size_of::<usize>()),
        }
    }
}

impl<P: Clone> MemslotMap<P> {
    /// Puts the index into the form that suits the number of slots, if it is not in it: the
    /// slab above [`FLAT_MAX`] slots, the trees above [`SLAB_MAX`], the slab again below
    /// [`SLAB_MIN`] and the array below [`FLAT_MIN`].
    #[inline]
    fn settle(&mut self) {
        let n = self.len();
        let wrong = match &self.index {
            Index::Flat(_) => n > FLAT_MAX,
            Index::Slab(_) => !(FLAT_MIN..=SLAB_MAX).contains(&n),
            Index::Trees(_) => n < SLAB_MIN,
        };
        if wrong {
            self.change_form();
        }
    }

    /// Rebuilds the index in the form for its number of slots (out of line: rare).
    #[cold]
    #[inline(never)]
    fn change_form(&mut self) {
        self.index = Index::of_slots(self.iter().cloned().collect());
    }
}

impl<P> Index<P> {
    fn len(&self) -> usize {
        match self {
            Index::Flat(flat) => flat.len(),
            Index::Slab(slab) => slab.len(),
            Index::Trees(trees) => trees.len(),
        }
    }

    /// The index of `slots` (any order, each id once, guest ranges disjoint) in the form for
    /// their number when a map grows to it.
    fn of_slots(slots: Vec<Arc<Slot<P>>>) -> Self {
        match slots.len() {
            n if n <= FLAT_MAX => Index::Flat(Flat::from_slots(slots)),
            n if n <= SLAB_MAX => Index::Slab(Slab::from_slots(slots)),
            _ => {
                let slab = Slab::from_slots(slots);
                Index::Trees(Trees::from_sorted(slab.iter(), slab.by_hva(), slab.by_id()))
            }
        }
    }
}

fn hva_key<P>(slot: &Slot<P>) -> HvaKey {
    let range = slot.hva_range();
    HvaKey {
        start: range.start,
        end: range.end,
        id: slot.id(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot::SlotFlags;

    pub(super) fn slot(id: u32, gpa: u64, size: u64, hva: u64) -> Slot<u32> {
        Slot::new(
            SlotId(id),
            GuestAddress(gpa),
            size,
            HostAddress(hva),
            SlotFlags::default(),
            id,
        )
    }

    pub(super) fn check_indexes<P: Clone>(map: &MemslotMap<P>) {
        match &map.index {
            Index::Flat(flat) => {
                flat.check();
                assert!(flat.len() <= FLAT_MAX, "a flat map too large");
            }
            Index::Slab(slab) => {
                slab.check();
                assert!(
                    (FLAT_MIN..=SLAB_MAX).contains(&slab.len()),
                    "a slab of {} slots",
                    slab.len()
                );
            }
            Index::Trees(trees) => {
                trees.check();
                assert!(trees.len() >= SLAB_MIN, "trees for a small map");
            }
        }
    }

    #[test]
    fn hinted_lookup_never_returns_a_slot_of_another_version() {
        let mut map = MemslotMap::new(MapConfig::default());
        map.insert(slot(0, 0x0, 0x10_000, 0x0)).unwrap();
        let mut hint = LookupHint::default();
        let v1 = map.clone();
        assert_eq!(
            v1.find_by_gpa_hinted(GuestAddress(0x100), &mut hint)
                .map(|s| s.id()),
            Some(SlotId(0))
        );
        map.move_slot(SlotId(0), GuestAddress(0x100_000)).unwrap();
        // Same address, newer version: the hint (still pointing at the old slot) is not used.
        assert!(map
            .find_by_gpa_hinted(GuestAddress(0x100), &mut hint)
            .is_none());
        assert_eq!(
            map.find_by_gpa_hinted(GuestAddress(0x100_100), &mut hint)
                .map(|s| s.gpa()),
            Some(GuestAddress(0x100_000))
        );
        // And the old version still answers from its own slots.
        assert_eq!(
            v1.find_by_gpa_hinted(GuestAddress(0x100), &mut hint)
                .map(|s| s.gpa()),
            Some(GuestAddress(0))
        );
    }

    #[test]
    fn overlapping_host_ranges_are_all_found() {
        let mut map = MemslotMap::new(MapConfig::default());
        // Two guest ranges aliasing one host range, and a large one covering both.
        map.insert(slot(0, 0x0, 0x4000, 0x10_000)).unwrap();
        map.insert(slot(1, 0x10_000, 0x4000, 0x10_000)).unwrap();
        map.insert(slot(2, 0x100_000, 0x100_000, 0x0)).unwrap();
        map.insert(slot(3, 0x300_000, 0x1000, 0x200_000)).unwrap();
        let ids = |hva, len| {
            let mut v: Vec<_> = map
                .slots_overlapping_hva(HostAddress(hva), len)
                .iter()
                .map(|s| s.id().0)
                .collect();
            v.sort();
            v
        };
        assert_eq!(ids(0x10_000, 1), vec![0, 1, 2]);
        assert_eq!(ids(0x14_000, 0x1000), vec![2]);
        assert_eq!(ids(0xf_f000, 0x1000), vec![2]);
        assert_eq!(ids(0x100_000, 0x100_000), Vec::<u32>::new());
        assert_eq!(ids(0x1f_f000, 0x2000), vec![3]);
        assert_eq!(ids(0x0, u64::MAX), vec![0, 1, 2, 3]);
        assert_eq!(ids(0x10_000, 0), Vec::<u32>::new());
    }

    #[test]
    fn overlaps_and_holes_in_guest_ranges() {
        let mut map = MemslotMap::new(MapConfig::default());
        map.insert(slot(0, 0x1000, 0x2000, 0)).unwrap();
        map.insert(slot(1, 0x3000, 0x1000, 0)).unwrap();
        map.insert(slot(2, 0x8000, 0x1000, 0)).unwrap();
        let overlap = |s, e| map.first_overlap(s, e).map(|s| s.id().0);
        assert_eq!(overlap(0x0, 0x1000), None);
        assert_eq!(overlap(0x0, 0x1001), Some(0));
        assert_eq!(overlap(0x2fff, 0x9000), Some(0));
        assert_eq!(overlap(0x4000, 0x8000), None);
        assert_eq!(overlap(0x4000, 0x8001), Some(2));
        assert_eq!(overlap(0x9000, u64::MAX), None);
        assert_eq!(overlap(0x1000, 0x1000), None);
        assert_eq!(map.first_hole(0x1000, 0x4000), None);
        assert_eq!(map.first_hole(0x1800, 0x3800), None);
        assert_eq!(map.first_hole(0x1000, 0x4001), Some(0x4000));
        assert_eq!(map.first_hole(0x800, 0x2000), Some(0x800));
        assert_eq!(map.first_hole(0x8000, 0x9000), None);
        assert_eq!(map.first_hole(0x5000, 0x5000), None);
    }

    #[test]
    fn the_form_follows_the_size_with_hysteresis() {
        let form = |map: &MemslotMap<u32>| match map.index {
            Index::Flat(_) => "flat",
            Index::Slab(_) => "slab",
            Index::Trees(_) => "trees",
        };
        let page = |i: usize| {
            let i = i as u32;
            slot(
                i,
                u64::from(i) * 0x1000,
                0x1000,
                0x10_000_000 - u64::from(i) * 0x1000,
            )
        };
        // Growing one slot at a time: flat, then the slab past FLAT_MAX, the trees past
        // SLAB_MAX; every step checked.
        let mut map = MemslotMap::new(MapConfig::default());
        let mut versions = Vec::new();
        for i in 0..=SLAB_MAX {
            map.insert(page(i)).unwrap();
            let expected = match map.len() {
                n if n <= FLAT_MAX => "flat",
                n if n <= SLAB_MAX => "slab",
                _ => "trees",
            };
            assert_eq!(form(&map), expected, "{} slots", map.len());
            check_indexes(&map);
            versions.push(map.clone());
        }
        assert_eq!(form(&map), "trees");
        // Every earlier version is untouched (the slab's chunks are shared copy-on-write).
        for (n, version) in versions.iter().enumerate() {
            assert!(version.iter().map(|s| s.id().0 as usize).eq(0..=n));
            check_indexes(version);
        }
        // Shrinking: the trees stay down to SLAB_MIN, the slab down to FLAT_MIN, removing from
        // the middle so that the slab moves its last slot into each hole.
        let mut ids: Vec<usize> = (0..=SLAB_MAX).collect();
        while let Some(id) = (!ids.is_empty()).then(|| ids.remove(ids.len() / 2)) {
            let before = form(&map);
            map.remove(SlotId(id as u32)).unwrap();
            let expected = match (before, map.len()) {
                ("trees", n) if n >= SLAB_MIN => "trees",
                ("trees" | "slab", n) if n >= FLAT_MIN => "slab",
                _ => "flat",
            };
            assert_eq!(form(&map), expected, "{} slots", map.len());
            check_indexes(&map);
            assert!(map
                .iter()
                .map(|s| s.id().0 as usize)
                .eq(ids.iter().copied()));
        }
        assert!(map.is_empty());
        // The removals, which moved slots about in chunks the versions share, left them as
        // they were.
        for (n, version) in versions.iter().enumerate() {
            assert!(version.iter().map(|s| s.id().0 as usize).eq(0..=n));
            for i in 0..=n {
                let found = version
                    .find_by_gpa(GuestAddress(i as u64 * 0x1000))
                    .unwrap();
                assert_eq!(found.id(), SlotId(i as u32));
                assert_eq!(
                    version.get(SlotId(i as u32)).map(|s| s.id()),
                    Some(found.id())
                );
            }
            check_indexes(version);
        }
        // A batch that crosses both bounds lands in the trees; one that empties them in the
        // array; new flags for every slot leave each form as it was.
        let next = map
            .with_changes((0..2 * SLAB_MAX).map(|i| Change::Insert(page(i))))
            .unwrap();
        assert_eq!((form(&map), form(&next)), ("flat", "trees"));
        check_indexes(&next);
        let hvas: Vec<usize> = next
            .slots_overlapping_hva(HostAddress(0), u64::MAX)
            .iter()
            .map(|s| s.id().0 as usize)
            .collect();
        assert!(hvas.iter().copied().eq((0..2 * SLAB_MAX).rev()));
        let flags = SlotFlags {
            log_dirty: true,
            read_only: false,
        };
        for n in [FLAT_MAX, SLAB_MAX] {
            let built = MemslotMap::new(MapConfig::default())
                .with_changes((0..n).map(|i| Change::Insert(page(i))))
                .unwrap();
            let logged = built
                .with_changes((0..n).map(|i| Change::SetFlags {
                    id: SlotId(i as u32),
                    flags,
                }))
                .unwrap();
            assert_eq!(form(&built), form(&logged));
            assert!(logged.iter().all(|s| s.flags() == flags));
            assert!(built.iter().all(|s| s.flags() == SlotFlags::default()));
            check_indexes(&logged);
        }
        let empty = next
            .with_changes((0..2 * SLAB_MAX).map(|i| Change::Remove(SlotId(i as u32))))
            .unwrap();
        assert!(form(&empty) == "flat" && empty.is_empty());
    }

    #[test]
    fn memory_grows_with_slots_in_use() {
        let mut map = MemslotMap::new(MapConfig::default());
        assert_eq!(map.memory_usage().bytes_per_slot(), 0.0);
        for i in 0..10_000u32 {
            let gpa = u64::from(i) * 0x1000;
            map.insert(slot(i, gpa, 0x1000, gpa)).unwrap();
        }
        let full = map.memory_usage();
        for i in 0..9_000u32 {
            map.remove(SlotId(i)).unwrap();
        }
        let few = map.memory_usage();
        check_indexes(&map);
        assert!(full.bytes_per_slot() < 400.0, "{full:?}");
        assert!(
            (few.index_bytes + few.slot_bytes) * 5 < full.index_bytes + full.slot_bytes,
            "{few:?} vs {full:?}"
        );
    }
}
