//! Dirty-page bitmaps: one bit per 4 KiB page, bit `i` of word `i / 64` for page `i`.

use vm_memory::GuestAddress;

use crate::memory::RegionId;
use crate::PAGE_SIZE;

/// The pages of one region written since the previous harvest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyPages {
    /// The region.
    pub region: RegionId,
    /// The region's guest base when harvested: bit `i` stands for page `gpa + i * 4096`.
    pub gpa: GuestAddress,
    /// Pages in the region (bits that count in `bitmap`).
    pub pages: u64,
    /// One bit per page of the region.
    pub bitmap: Vec<u64>,
}

impl DirtyPages {
    /// Number of dirty pages.
    pub fn count(&self) -> u64 {
        self.bitmap.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Guest addresses of the dirty pages, in order.
    pub fn addresses(&self) -> impl Iterator<Item = GuestAddress> + '_ {
        set_bits(&self.bitmap).map(|page| GuestAddress(self.gpa.0 + page * PAGE_SIZE))
    }
}

/// Sets bits `first .. first + count` of `bitmap`.
pub(crate) fn mark_range(bitmap: &mut [u64], first: u64, count: u64) {
    for bit in first..first + count {
        bitmap[(bit / 64) as usize] |= 1 << (bit % 64);
    }
}

/// Indexes of the set bits, in order.
pub(crate) fn set_bits(bitmap: &[u64]) -> impl Iterator<Item = u64> + '_ {
    bitmap.iter().enumerate().flat_map(|(i, word)| {
        let mut w = *word;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let bit = w.trailing_zeros();
            w &= w - 1;
            Some(i as u64 * 64 + u64::from(bit))
        })
    })
}

/// Sets in `dst` the bits `at + i` for every bit `i < bits` set in `src`.
pub(crate) fn or_bits(dst: &mut [u64], at: u64, src: &[u64], bits: u64) {
    for i in set_bits(src).take_while(|i| *i < bits) {
        let bit = at + i;
        dst[(bit / 64) as usize] |= 1 << (bit % 64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn or_bits_shifts_and_stops_at_the_count() {
        let mut dst = vec![0u64; 3];
        or_bits(&mut dst, 60, &[0b1011, u64::MAX], 66);
        let set: Vec<u64> = set_bits(&dst).collect();
        let mut expected = vec![60, 61, 63];
        expected.extend(124..126);
        assert_eq!(set, expected);
    }

    #[test]
    fn addresses_follow_the_region_base() {
        let pages = DirtyPages {
            region: RegionId(1),
            gpa: GuestAddress(0x10_0000),
            pages: 130,
            bitmap: vec![1 << 3, 0, 1 << 1],
        };
        assert_eq!(pages.count(), 2);
        let got: Vec<_> = pages.addresses().collect();
        assert_eq!(
            got,
            vec![
                GuestAddress(0x10_3000),
                GuestAddress(0x10_0000 + 129 * 0x1000)
            ]
        );
    }
}
