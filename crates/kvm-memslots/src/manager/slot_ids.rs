//! The KVM slot-number allocator.

use std::collections::BTreeSet;

use memslot_map::SlotId;

/// KVM slot numbers: the lowest free number first, never two live slots with one number.
pub(super) struct SlotIds {
    /// KVM's number of slots.
    pub(super) limit: u32,
    next: u32,
    pub(super) free: BTreeSet<u32>,
}

impl SlotIds {
    /// KVM's `limit` slot numbers, none in use.
    pub(super) fn new(limit: u32) -> Self {
        SlotIds {
            limit,
            next: 0,
            free: BTreeSet::new(),
        }
    }

    pub(super) fn available(&self) -> usize {
        self.free.len() + (self.limit - self.next) as usize
    }

    pub(super) fn used(&self) -> usize {
        self.next as usize - self.free.len()
    }

    pub(super) fn alloc(&mut self, n: usize) -> Option<Vec<SlotId>> {
        if n > self.available() {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        while ids.len() < n {
            let id = match self.free.pop_first() {
                Some(id) => id,
                None => {
                    self.next += 1;
                    self.next - 1
                }
            };
            ids.push(SlotId(id));
        }
        Some(ids)
    }

    pub(super) fn release(&mut self, ids: &[SlotId]) {
        self.free.extend(ids.iter().map(|id| id.0));
        // Keep the free set small: give back the top of the range.
        while self.next > 0 && self.free.remove(&(self.next - 1)) {
            self.next -= 1;
        }
    }
}
