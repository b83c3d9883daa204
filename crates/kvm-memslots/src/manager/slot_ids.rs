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

    /// Free numbers other than `avoid`.
    pub(super) fn available_besides(&self, avoid: u32) -> usize {
        let free = self.free.contains(&avoid) || (self.next..self.limit).contains(&avoid);
        self.available() - usize::from(free)
    }

    pub(super) fn used(&self) -> usize {
        self.next as usize - self.free.len()
    }

    /// `n` numbers, lowest first, never `avoid` (a number a harvest is reading the log of:
    /// it may have been freed since, but must not name another region's slot before that
    /// harvest is done with it).
    pub(super) fn alloc(&mut self, n: usize, avoid: u32) -> Option<Vec<SlotId>> {
        if n > self.available_besides(avoid) {
            return None;
        }
        let mut skipped = self.free.remove(&avoid);
        let mut ids = Vec::with_capacity(n);
        while ids.len() < n {
            let id = match self.free.pop_first() {
                Some(id) => id,
                None => {
                    self.next += 1;
                    self.next - 1
                }
            };
            if id == avoid {
                skipped = true;
                continue;
            }
            ids.push(SlotId(id));
        }
        if skipped {
            self.free.insert(avoid);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leased_number_is_never_handed_out() {
        let mut ids = SlotIds::new(8);
        let all = ids.alloc(4, u32::MAX).unwrap();
        ids.release(&all[1..]);
        // 1, 2 and 3 went back to the top of the range; none of the new numbers may be 2.
        assert_eq!(ids.available_besides(2), 6);
        let got = ids.alloc(3, 2).unwrap();
        assert_eq!(got, vec![SlotId(1), SlotId(3), SlotId(4)]);
        assert!(ids.free.contains(&2));
        assert_eq!(ids.available(), 4);
        // With every other number taken, the leased one is refused rather than handed out.
        assert!(ids.alloc(4, 2).is_none());
        assert_eq!(ids.alloc(4, u32::MAX).unwrap()[0], SlotId(2));
    }
}
