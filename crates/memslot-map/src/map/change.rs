//! [`Change`] and the single changes to a map (insert, remove, move, set flags), each checked
//! before it touches the indexes.

use std::sync::Arc;

use vm_memory::GuestAddress;

use super::{next_generation, Index, MemslotMap};
use crate::error::{AddressKind, MapError};
use crate::slot::{HostAddress, Slot, SlotFlags, SlotId};

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

impl<P: Clone> MemslotMap<P> {
    /// Adds `slot`. Refused, leaving the map as it was, when the id is taken, the map is full,
    /// the slot is empty, unaligned or wraps around, or its guest range overlaps another slot
    /// (checked in that order).
    #[inline]
    pub fn insert(&mut self, slot: Slot<P>) -> Result<(), MapError> {
        self.check_insert(&slot)?;
        self.put_checked(Arc::new(slot));
        Ok(())
    }

    /// Adds the slot `slot` points to, as [`insert`](Self::insert) does, but without allocating
    /// a new `Arc` for it: the map holds (and its lookups return) `slot` itself. For a caller
    /// that already keeps its slots in `Arc`s, as vm-memory's callers keep their regions, or
    /// that puts back a slot it took out with [`remove`](Self::remove). Refused, leaving the
    /// map as it was, for the same reasons and in the same order as `insert`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use memslot_map::{GuestAddress, HostAddress, MapConfig, MemslotMap, Slot, SlotFlags, SlotId};
    ///
    /// let slot = Arc::new(Slot::new(
    ///     SlotId(0), GuestAddress(0x1000), 0x1000, HostAddress(0x7f00_0000_0000), SlotFlags::default(), "ram",
    /// ));
    /// let mut map = MemslotMap::new(MapConfig::default());
    /// map.insert_arc(Arc::clone(&slot)).unwrap();
    /// assert!(Arc::ptr_eq(map.get(SlotId(0)).unwrap(), &slot));
    /// // Taken out and put back: still the same slot, nothing allocated.
    /// let taken = map.remove(SlotId(0)).unwrap();
    /// map.insert_arc(taken).unwrap();
    /// assert!(Arc::ptr_eq(map.find_by_gpa(GuestAddress(0x1800)).unwrap(), &slot));
    /// ```
    #[inline]
    pub fn insert_arc(&mut self, slot: Arc<Slot<P>>) -> Result<(), MapError> {
        self.check_insert(&slot)?;
        self.put_checked(slot);
        Ok(())
    }

    /// The checks of [`insert`](Self::insert), in its order.
    #[inline]
    fn check_insert(&self, slot: &Slot<P>) -> Result<(), MapError> {
        let id = slot.id();
        if self.get(id).is_some() {
            return Err(MapError::DuplicateId { id });
        }
        if self.len() >= self.config.max_slots {
            return Err(MapError::SlotLimit {
                id,
                limit: self.config.max_slots,
            });
        }
        self.check_shape(id, slot.gpa(), slot.size(), slot.hva())?;
        self.check_no_overlap(id, slot.gpa(), slot.size())
    }

    /// Adds `slot`, which [`check_insert`](Self::check_insert) accepted.
    #[inline]
    fn put_checked(&mut self, slot: Arc<Slot<P>>) {
        match &mut self.index {
            Index::Flat(flat) => flat.insert(slot),
            Index::Slab(slab) => slab.insert(slot),
            Index::Trees(trees) => trees.put(slot),
        }
        self.settle();
        self.generation = next_generation();
    }

    /// Removes the slot with id `id` and returns it.
    #[inline]
    pub fn remove(&mut self, id: SlotId) -> Result<Arc<Slot<P>>, MapError> {
        let slot = match &mut self.index {
            Index::Flat(flat) => flat.remove(id).ok_or(MapError::UnknownId { id })?,
            Index::Slab(slab) => slab.remove(id).ok_or(MapError::UnknownId { id })?,
            Index::Trees(trees) => trees.remove(id).ok_or(MapError::UnknownId { id })?,
        };
        self.settle();
        self.generation = next_generation();
        Ok(slot)
    }

    /// Gives slot `id` the guest-physical base `gpa`. Refused when the id is unknown, the new
    /// base is unaligned or the range would wrap, or it would overlap another slot.
    pub fn move_slot(&mut self, id: SlotId, gpa: GuestAddress) -> Result<(), MapError> {
        let old = Arc::clone(self.get(id).ok_or(MapError::UnknownId { id })?);
        self.check_shape(id, gpa, old.size(), old.hva())?;
        self.check_no_overlap(id, gpa, old.size())?;
        let new = Arc::new(old.with_gpa(gpa));
        match &mut self.index {
            Index::Flat(flat) => {
                flat.remove(id).expect("the slot was found by its id");
                flat.insert(new);
            }
            Index::Slab(slab) => {
                slab.remove(id).expect("the slot was found by its id");
                slab.insert(new);
            }
            Index::Trees(trees) => trees.replace(old.gpa().0, new),
        }
        self.generation = next_generation();
        Ok(())
    }

    /// Replaces the flags of slot `id`.
    pub fn set_flags(&mut self, id: SlotId, flags: SlotFlags) -> Result<(), MapError> {
        let old = self.get(id).ok_or(MapError::UnknownId { id })?;
        let new = Arc::new(old.with_flags(flags));
        match &mut self.index {
            Index::Flat(flat) => flat.replace_in_place(new),
            Index::Slab(slab) => slab.replace_in_place(new),
            Index::Trees(trees) => trees.put(new),
        }
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

    #[inline]
    pub(super) fn check_shape(
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
            // The page size is a power of two (`MapConfig::new` checks it).
            if value & (page_size - 1) != 0 {
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
    #[inline]
    fn check_no_overlap(&self, id: SlotId, gpa: GuestAddress, size: u64) -> Result<(), MapError> {
        let start = gpa.0;
        let end = start + size;
        // Guest ranges are disjoint, so only the last slot starting below `end` (or, if that is
        // the slot being moved, the one just below it) can reach into the range.
        let Some(mut candidate) = self.floor_gpa(end - 1) else {
            return Ok(());
        };
        if candidate.id() == id {
            let Some(below) = candidate.gpa().0.checked_sub(1) else {
                return Ok(());
            };
            match self.floor_gpa(below) {
                Some(slot) => candidate = slot,
                None => return Ok(()),
            }
        }
        overlap(id, start, end, candidate)
    }
}

/// Refuses the guest range `[start, end)` for slot `id` if `candidate`, the last other slot
/// starting below `end`, reaches into it.
pub(super) fn overlap<P>(
    id: SlotId,
    start: u64,
    end: u64,
    candidate: &Slot<P>,
) -> Result<(), MapError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::tests::{check_indexes, slot};
    use crate::map::MapConfig;

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
    fn insert_arc_keeps_the_callers_arc_and_checks_as_insert_does() {
        let mut map = MemslotMap::new(MapConfig::new(0x1000, 1200).unwrap());
        // Through all three forms: flat up to 32 slots, a slab up to 1024, trees beyond.
        let slots: Vec<Arc<Slot<u32>>> = (0..1100u32)
            .map(|i| {
                let gpa = u64::from(i) * 0x2000;
                Arc::new(slot(i, gpa, 0x1000, 0x100_0000 - gpa))
            })
            .collect();
        for (n, s) in slots.iter().enumerate() {
            map.insert_arc(Arc::clone(s)).unwrap();
            assert_eq!(map.len(), n + 1);
            check_indexes(&map);
            for s in &slots[..=n] {
                assert!(Arc::ptr_eq(map.get(s.id()).unwrap(), s));
                assert!(Arc::ptr_eq(map.find_by_gpa(s.gpa()).unwrap(), s));
                let by_hva = map.slots_overlapping_hva(s.hva(), 1);
                assert!(by_hva.len() == 1 && Arc::ptr_eq(by_hva[0], s));
            }
        }
        // Refused for the reasons `insert` refuses, with the same errors, changing nothing.
        let before = map.generation();
        for bad in [
            slot(3, 0x1000, 0x1000, 0x0),
            slot(1150, 0x1001, 0x1000, 0x0),
            slot(1150, 0x2000 * 5, 0x1000, 0x0),
            slot(1150, 0x1000, 0, 0x0),
        ] {
            let mut twin = map.clone();
            let expected = twin.insert(bad.clone()).unwrap_err();
            assert_eq!(map.insert_arc(Arc::new(bad)).unwrap_err(), expected);
            assert_eq!(map.generation(), before);
            assert_eq!(map.len(), 1100);
        }
        // A slot taken out goes back in as itself; down to one slot and back up.
        for s in slots.iter().rev() {
            let taken = map.remove(s.id()).unwrap();
            assert!(Arc::ptr_eq(&taken, s));
            map.insert_arc(taken).unwrap();
            map.remove(s.id()).unwrap();
            check_indexes(&map);
        }
        assert!(map.is_empty());
        let mut full = MemslotMap::new(MapConfig::new(0x1000, 1).unwrap());
        full.insert_arc(Arc::clone(&slots[0])).unwrap();
        assert_eq!(
            full.insert_arc(Arc::clone(&slots[1])),
            Err(MapError::SlotLimit {
                id: SlotId(1),
                limit: 1
            })
        );
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
}
