//! One version of the slot map: three persistent indexes over the same slots.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::GuestAddress;

use crate::error::{AddressKind, BatchError, ConfigError, MapError};
use crate::ptree::{PTree, Summary, Visit};
use crate::slot::{HostAddress, Slot, SlotFlags, SlotId};

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

/// One change to a map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<P> {
    /// Add a slot.
    Insert(Slot<P>),
    /// Remove the slot with this id.
    Remove(SlotId),
    /// Give a slot a new guest-physical base; its size, host range and payload stay.
    Move {
        /// The slot to move.
        id: SlotId,
        /// Its new guest-physical base.
        gpa: GuestAddress,
    },
    /// Replace a slot's flags.
    SetFlags {
        /// The slot to change.
        id: SlotId,
        /// Its new flags.
        flags: SlotFlags,
    },
}

/// Key of the host-address index. Host ranges may overlap, so the id breaks ties; the end is in
/// the key so that a search never loads a slot to learn where it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct HvaKey {
    start: u64,
    end: u64,
    id: SlotId,
}

/// The largest host range end in a subtree of the host-address index.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct MaxHvaEnd(u64);

impl<V> Summary<HvaKey, V> for MaxHvaEnd {
    fn of_entry(key: &HvaKey, _: &V) -> Self {
        MaxHvaEnd(key.end)
    }
    fn merge(self, other: Self) -> Self {
        MaxHvaEnd(self.0.max(other.0))
    }
}

/// Every map version gets a generation no other version in the process has, so that a
/// [`LookupHint`] can tell whether it was filled from the version it is used with.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
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
/// Guest ranges never overlap; host ranges may. Cloning a map is O(1) and the clone shares every
/// node with the original; changing a clone copies only the O(log n) nodes on the changed paths.
/// Lookups are O(log n) (host-range lookups O(log n + k) for k results).
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
    by_gpa: PTree<u64, Arc<Slot<P>>, ()>,
    by_hva: PTree<HvaKey, Arc<Slot<P>>, MaxHvaEnd>,
    by_id: PTree<SlotId, Arc<Slot<P>>, ()>,
    config: MapConfig,
    generation: u64,
}

impl<P> fmt::Debug for MemslotMap<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemslotMap")
            .field("slots", &self.by_id.len())
            .field("config", &self.config)
            .field("generation", &self.generation)
            .finish()
    }
}

impl<P: Clone> MemslotMap<P> {
    /// An empty map whose slots must follow `config`.
    pub fn new(config: MapConfig) -> Self {
        MemslotMap {
            by_gpa: PTree::default(),
            by_hva: PTree::default(),
            by_id: PTree::default(),
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
        self.by_id.len()
    }

    /// Whether the map has no slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slot that holds guest-physical address `addr`. O(log n).
    pub fn find_by_gpa(&self, addr: GuestAddress) -> Option<&Arc<Slot<P>>> {
        let (_, slot) = self.by_gpa.floor(&addr.0)?;
        slot.contains_gpa(addr).then_some(slot)
    }

    /// Like [`find_by_gpa`](Self::find_by_gpa), first trying the slot `hint` remembers; on a
    /// miss the hint is refilled with the slot found.
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
        let found = self.find_by_gpa(addr)?;
        hint.generation = self.generation;
        hint.slot = Some(Arc::clone(found));
        Some(found)
    }

    /// The slot with id `id`. O(log n).
    pub fn get(&self, id: SlotId) -> Option<&Arc<Slot<P>>> {
        self.by_id.get(&id)
    }

    /// Calls `f` on every slot whose host range overlaps `[hva, hva + len)`, in host-address
    /// order. O(log n + k) for k slots found; `len` 0 finds nothing.
    pub fn for_each_hva_overlap<'a>(
        &'a self,
        hva: HostAddress,
        len: u64,
        mut f: impl FnMut(&'a Arc<Slot<P>>),
    ) {
        let (lo, hi) = (hva.0, hva.0.saturating_add(len));
        if lo == hi {
            return;
        }
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

    /// Every slot whose host range overlaps `[hva, hva + len)`, in host-address order.
    pub fn slots_overlapping_hva(&self, hva: HostAddress, len: u64) -> Vec<&Arc<Slot<P>>> {
        let mut out = Vec::new();
        self.for_each_hva_overlap(hva, len, |s| out.push(s));
        out
    }

    /// All slots in guest-address order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Slot<P>>> + '_ {
        self.by_gpa.iter().map(|(_, slot)| slot)
    }

    /// Slots in guest-address order, starting with the one that holds `addr` or else the first
    /// one above it.
    pub fn iter_from_gpa(&self, addr: GuestAddress) -> impl Iterator<Item = &Arc<Slot<P>>> + '_ {
        let from = self.find_by_gpa(addr).map_or(addr.0, |s| s.gpa().0);
        self.by_gpa.iter_from(&from).map(|(_, slot)| slot)
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
            index_bytes: self.by_gpa.heap_bytes()
                + self.by_hva.heap_bytes()
                + self.by_id.heap_bytes(),
            slot_bytes: slots * (size_of::<Slot<P>>() + 2 * size_of::<usize>()),
        }
    }

    /// Adds `slot`. Refused, leaving the map as it was, when the id is taken, the map is full,
    /// the slot is empty, unaligned or wraps around, or its guest range overlaps another slot
    /// (checked in that order).
    pub fn insert(&mut self, slot: Slot<P>) -> Result<(), MapError> {
        let id = slot.id();
        if self.by_id.get(&id).is_some() {
            return Err(MapError::DuplicateId { id });
        }
        if self.len() >= self.config.max_slots {
            return Err(MapError::SlotLimit {
                id,
                limit: self.config.max_slots,
            });
        }
        self.check_shape(id, slot.gpa(), slot.size(), slot.hva())?;
        self.check_no_overlap(id, slot.gpa(), slot.size())?;
        self.put(Arc::new(slot));
        self.generation = next_generation();
        Ok(())
    }

    /// Removes the slot with id `id` and returns it.
    pub fn remove(&mut self, id: SlotId) -> Result<Arc<Slot<P>>, MapError> {
        let slot = self.by_id.remove(&id).ok_or(MapError::UnknownId { id })?;
        self.by_gpa.remove(&slot.gpa().0);
        self.by_hva.remove(&hva_key(&slot));
        self.generation = next_generation();
        Ok(slot)
    }

    /// Gives slot `id` the guest-physical base `gpa`. Refused when the id is unknown, the new
    /// base is unaligned or the range would wrap, or it would overlap another slot.
    pub fn move_slot(&mut self, id: SlotId, gpa: GuestAddress) -> Result<(), MapError> {
        let old = Arc::clone(self.by_id.get(&id).ok_or(MapError::UnknownId { id })?);
        self.check_shape(id, gpa, old.size(), old.hva())?;
        self.check_no_overlap(id, gpa, old.size())?;
        self.by_gpa.remove(&old.gpa().0);
        self.put(Arc::new(old.with_gpa(gpa)));
        self.generation = next_generation();
        Ok(())
    }

    /// Replaces the flags of slot `id`.
    pub fn set_flags(&mut self, id: SlotId, flags: SlotFlags) -> Result<(), MapError> {
        let old = self.by_id.get(&id).ok_or(MapError::UnknownId { id })?;
        let new = Arc::new(old.with_flags(flags));
        self.put(new);
        self.generation = next_generation();
        Ok(())
    }

    /// Applies one change (see [`insert`](Self::insert), [`remove`](Self::remove),
    /// [`move_slot`](Self::move_slot), [`set_flags`](Self::set_flags)).
    pub fn apply(&mut self, change: Change<P>) -> Result<(), MapError> {
        match change {
            Change::Insert(slot) => self.insert(slot),
            Change::Remove(id) => self.remove(id).map(drop),
            Change::Move { id, gpa } => self.move_slot(id, gpa),
            Change::SetFlags { id, flags } => self.set_flags(id, flags),
        }
    }

    /// A new version with all `changes` applied in order, or, if any is refused, the error of
    /// the first refused one and no new version. `self` is never changed.
    ///
    /// Neighbouring changes of one kind (a region's slots added, removed or given new flags)
    /// are checked one by one, exactly as [`apply`](Self::apply) checks them, and then written
    /// to each index in one sorted pass, which visits every node on the way once rather than
    /// once per slot. Moves are applied one by one.
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
                    if self.by_id.get(&id).is_some() || !ids.insert(id) {
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
                    let in_map = self.by_gpa.floor(&(range.end - 1)).map(|(_, s)| s);
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
                        .by_id
                        .get(&id)
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
                        .by_id
                        .get(&id)
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
        self.generation = next_generation();
    }

    /// Puts `slot` into all three indexes, replacing whatever they hold under its keys.
    fn put(&mut self, slot: Arc<Slot<P>>) {
        self.by_gpa.insert(slot.gpa().0, Arc::clone(&slot));
        self.by_hva.insert(hva_key(&slot), Arc::clone(&slot));
        self.by_id.insert(slot.id(), slot);
    }

    fn check_shape(
        &self,
        id: SlotId,
        gpa: GuestAddress,
        size: u64,
        hva: HostAddress,
    ) -> Result<(), MapError> {
        if size == 0 {
            return Err(MapError::ZeroSize { id });
        }
        let page_size = self.config.page_size;
        for (what, value) in [
            (AddressKind::Guest, gpa.0),
            (AddressKind::Host, hva.0),
            (AddressKind::Size, size),
        ] {
            if value % page_size != 0 {
                return Err(MapError::Unaligned {
                    id,
                    what,
                    value,
                    page_size,
                });
            }
        }
        for (what, base) in [(AddressKind::Guest, gpa.0), (AddressKind::Host, hva.0)] {
            if base.checked_add(size).is_none() {
                return Err(MapError::WrapAround {
                    id,
                    what,
                    base,
                    size,
                });
            }
        }
        Ok(())
    }

    /// Refuses a guest range `[gpa, gpa + size)` (already checked not to wrap) that overlaps a
    /// slot other than `id`.
    fn check_no_overlap(&self, id: SlotId, gpa: GuestAddress, size: u64) -> Result<(), MapError> {
        let start = gpa.0;
        let end = start + size;
        // Guest ranges are disjoint, so only the last slot starting below `end` (or, if that is
        // the slot being moved, the one just below it) can reach into the range.
        let Some((_, mut candidate)) = self.by_gpa.floor(&(end - 1)) else {
            return Ok(());
        };
        if candidate.id() == id {
            let Some(below) = candidate.gpa().0.checked_sub(1) else {
                return Ok(());
            };
            match self.by_gpa.floor(&below) {
                Some((_, slot)) => candidate = slot,
                None => return Ok(()),
            }
        }
        overlap(id, start, end, candidate)
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

/// Refuses the guest range `[start, end)` for slot `id` if `candidate`, the last other slot
/// starting below `end`, reaches into it.
fn overlap<P>(id: SlotId, start: u64, end: u64, candidate: &Slot<P>) -> Result<(), MapError> {
    if candidate.gpa_range().end > start {
        return Err(MapError::Overlap {
            id,
            range: crate::slot::AddressRange { start, end },
            other: candidate.id(),
            other_range: candidate.gpa_range(),
        });
    }
    Ok(())
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

    pub(crate) fn slot(id: u32, gpa: u64, size: u64, hva: u64) -> Slot<u32> {
        Slot::new(
            SlotId(id),
            GuestAddress(gpa),
            size,
            HostAddress(hva),
            SlotFlags::default(),
            id,
        )
    }

    fn check_indexes<P: Clone>(map: &MemslotMap<P>) {
        map.by_gpa.check();
        map.by_hva.check();
        map.by_id.check();
        assert_eq!(map.by_gpa.len(), map.by_id.len());
        assert_eq!(map.by_hva.len(), map.by_id.len());
    }

    #[test]
    fn insert_checks_each_rule_and_names_the_fault() {
        let mut map = MemslotMap::new(MapConfig::new(0x1000, 3).unwrap());
        map.insert(slot(1, 0x10_000, 0x4000, 0x7000_0000)).unwrap();
        let before = map.generation();
        let cases = [
            (
                slot(1, 0x0, 0x1000, 0x0),
                "slot 1 already exists",
                MapError::DuplicateId { id: SlotId(1) },
            ),
            (
                slot(2, 0x0, 0, 0x0),
                "slot 2: size is zero",
                MapError::ZeroSize { id: SlotId(2) },
            ),
            (
                slot(2, 0x800, 0x1000, 0x0),
                "slot 2: guest address 0x800 is not a multiple of the page size 0x1000",
                MapError::Unaligned {
                    id: SlotId(2),
                    what: AddressKind::Guest,
                    value: 0x800,
                    page_size: 0x1000,
                },
            ),
            (
                slot(2, 0x0, 0x1800, 0x0),
                "slot 2: size 0x1800 is not a multiple of the page size 0x1000",
                MapError::Unaligned {
                    id: SlotId(2),
                    what: AddressKind::Size,
                    value: 0x1800,
                    page_size: 0x1000,
                },
            ),
            (
                slot(2, u64::MAX - 0xfff, 0x1000, 0x0),
                "slot 2: guest address 0xfffffffffffff000 + size 0x1000 wraps around the address space",
                MapError::WrapAround {
                    id: SlotId(2),
                    what: AddressKind::Guest,
                    base: u64::MAX - 0xfff,
                    size: 0x1000,
                },
            ),
            (
                slot(2, 0xf000, 0x2000, 0x0),
                "slot 2: guest range [0xf000, 0x11000) overlaps slot 1 at [0x10000, 0x14000)",
                MapError::Overlap {
                    id: SlotId(2),
                    range: crate::slot::AddressRange { start: 0xf000, end: 0x11000 },
                    other: SlotId(1),
                    other_range: crate::slot::AddressRange { start: 0x10000, end: 0x14000 },
                },
            ),
        ];
        for (bad, message, error) in cases {
            let got = map.insert(bad).unwrap_err();
            assert_eq!(got.to_string(), message);
            assert_eq!(got, error);
            assert_eq!(map.generation(), before, "a refused insert changed the map");
            assert_eq!(map.len(), 1);
        }
        // Touching ranges are fine; the limit is enforced.
        map.insert(slot(2, 0xf000, 0x1000, 0x0)).unwrap();
        map.insert(slot(3, 0x14_000, 0x1000, 0x0)).unwrap();
        assert_eq!(
            map.insert(slot(4, 0x20_000, 0x1000, 0x0))
                .unwrap_err()
                .to_string(),
            "slot 4: the map is full (3 slots)"
        );
        check_indexes(&map);
    }

    #[test]
    fn move_skips_itself_but_not_its_neighbours() {
        let mut map = MemslotMap::new(MapConfig::default());
        map.insert(slot(0, 0x0, 0x2000, 0x1000_0000)).unwrap();
        map.insert(slot(1, 0x4000, 0x2000, 0x2000_0000)).unwrap();
        map.insert(slot(2, 0x8000, 0x2000, 0x3000_0000)).unwrap();
        // Sliding into its own old range is fine.
        map.move_slot(SlotId(1), GuestAddress(0x3000)).unwrap();
        map.move_slot(SlotId(1), GuestAddress(0x5000)).unwrap();
        assert_eq!(
            map.move_slot(SlotId(1), GuestAddress(0x7000)),
            Err(MapError::Overlap {
                id: SlotId(1),
                range: crate::slot::AddressRange {
                    start: 0x7000,
                    end: 0x9000
                },
                other: SlotId(2),
                other_range: crate::slot::AddressRange {
                    start: 0x8000,
                    end: 0xa000
                },
            })
        );
        assert_eq!(
            map.move_slot(SlotId(1), GuestAddress(0x1000))
                .unwrap_err()
                .to_string(),
            "slot 1: guest range [0x1000, 0x3000) overlaps slot 0 at [0x0, 0x2000)"
        );
        assert_eq!(
            map.move_slot(SlotId(7), GuestAddress(0x1000)),
            Err(MapError::UnknownId { id: SlotId(7) })
        );
        let moved = map.find_by_gpa(GuestAddress(0x5000)).unwrap();
        assert_eq!(moved.id(), SlotId(1));
        assert_eq!(moved.hva(), HostAddress(0x2000_0000));
        assert_eq!(*moved.payload(), 1);
        assert!(map.find_by_gpa(GuestAddress(0x4fff)).is_none());
        // The host index follows the move.
        let by_hva = map.slots_overlapping_hva(HostAddress(0x2000_1000), 1);
        assert_eq!(by_hva.len(), 1);
        assert_eq!(by_hva[0].gpa(), GuestAddress(0x5000));
        check_indexes(&map);
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
