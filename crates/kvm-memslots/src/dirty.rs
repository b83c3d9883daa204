//! Dirty-page bitmaps: one bit per 4 KiB page, bit `i` of word `i / 64` for page `i`.

use std::ops::Range;

use vm_memory::GuestAddress;

use crate::region_memory::RegionId;
use crate::PAGE_SIZE;

/// A reader of the dirty log ([`MemoryManager::add_dirty_consumer`]): each consumer's harvests
/// report every page dirtied since its own last harvest, whatever the others harvest.
///
/// [`MemoryManager::add_dirty_consumer`]: crate::MemoryManager::add_dirty_consumer
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DirtyConsumer(pub(crate) u32);

impl DirtyConsumer {
    /// The consumer every manager has, which [`harvest_dirty`] and [`start_dirty_log`] read
    /// and log for.
    ///
    /// [`harvest_dirty`]: crate::MemoryManager::harvest_dirty
    /// [`start_dirty_log`]: crate::MemoryManager::start_dirty_log
    pub const DEFAULT: DirtyConsumer = DirtyConsumer(0);

    /// Its number (the default consumer's is 0).
    pub fn number(self) -> u32 {
        self.0
    }
}

impl std::fmt::Display for DirtyConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "dirty-log consumer {}", self.0)
    }
}

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

    /// Whether page `page` of the region (counted from its base, from 0) is dirty; false for a
    /// page past the region's `pages`.
    pub fn is_dirty(&self, page: u64) -> bool {
        page < self.pages
            && usize::try_from(page / 64)
                .ok()
                .and_then(|word| self.bitmap.get(word))
                .is_some_and(|word| word & (1 << (page % 64)) != 0)
    }

    /// Whether the page holding guest address `gpa` is dirty; false for an address outside the
    /// region.
    pub fn is_dirty_at(&self, gpa: GuestAddress) -> bool {
        gpa.0
            .checked_sub(self.gpa.0)
            .is_some_and(|offset| self.is_dirty(offset / PAGE_SIZE))
    }

    /// The guest-address ranges of runs of consecutive dirty pages, in order: `[a, b)` for
    /// each run, with no two runs touching.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let start = next_bit(&self.bitmap, at, self.pages, true);
            if start == self.pages {
                return None;
            }
            let end = next_bit(&self.bitmap, start, self.pages, false);
            at = end;
            Some(self.gpa.0 + start * PAGE_SIZE..self.gpa.0 + end * PAGE_SIZE)
        })
    }
}

/// The first bit from `from` on that is `set` (or clear), or `limit` if none is before it.
/// Words past the end of `bitmap` count as clear.
fn next_bit(bitmap: &[u64], from: u64, limit: u64, set: bool) -> u64 {
    let mut at = from;
    while at < limit {
        let index = at / 64;
        let word = usize::try_from(index)
            .ok()
            .and_then(|i| bitmap.get(i))
            .copied()
            .unwrap_or(0);
        let bits = if set { word } else { !word };
        let wanted = bits & (u64::MAX << (at % 64));
        if wanted != 0 {
            return (index * 64 + u64::from(wanted.trailing_zeros())).min(limit);
        }
        at = (index + 1) * 64;
    }
    limit
}

/// Sets bits `first .. first + count` of `bitmap`.
#[cfg(test)]
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
#[cfg(test)]
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

    fn pages(pages: u64, dirty: &[u64]) -> DirtyPages {
        let mut bitmap = vec![0; pages.div_ceil(64) as usize];
        for page in dirty {
            mark_range(&mut bitmap, *page, 1);
        }
        DirtyPages {
            region: RegionId(0),
            gpa: GuestAddress(0x10_0000),
            pages,
            bitmap,
        }
    }

    fn page_range(first: u64, end: u64) -> Range<u64> {
        0x10_0000 + first * PAGE_SIZE..0x10_0000 + end * PAGE_SIZE
    }

    #[test]
    fn single_pages_are_dirty_up_to_the_last_one() {
        let d = pages(130, &[0, 63, 64, 129]);
        let dirty: Vec<u64> = (0..140).filter(|p| d.is_dirty(*p)).collect();
        assert_eq!(dirty, vec![0, 63, 64, 129]);
        assert!(!d.is_dirty(u64::MAX));
        assert!(d.is_dirty_at(GuestAddress(0x10_0000)));
        assert!(d.is_dirty_at(GuestAddress(0x10_0000 + 129 * PAGE_SIZE + 0xfff)));
        assert!(!d.is_dirty_at(GuestAddress(0x10_0000 + 0x1000)));
        assert!(!d.is_dirty_at(GuestAddress(0x10_0000 + 130 * PAGE_SIZE)));
        assert!(!d.is_dirty_at(GuestAddress(0x10_0000 - 1)));
        assert!(!d.is_dirty_at(GuestAddress(0)));
        assert!(!d.is_dirty_at(GuestAddress(u64::MAX)));
    }

    #[test]
    fn bits_past_the_region_are_not_dirty() {
        let mut d = pages(66, &[65]);
        d.bitmap[1] |= 1 << 5; // page 69: past the region, in its last word
        assert!(d.is_dirty(65));
        assert!(!d.is_dirty(69));
        assert!(!d.is_dirty_at(GuestAddress(0x10_0000 + 69 * PAGE_SIZE)));
        assert_eq!(d.ranges().collect::<Vec<_>>(), vec![page_range(65, 66)]);
    }

    #[test]
    fn ranges_join_runs_across_words_and_end_at_the_last_page() {
        let mut dirty = vec![1, 2];
        dirty.extend(60..70); // across the first word boundary
        dirty.extend(127..131); // across the second one, to the last page
        let d = pages(131, &dirty);
        assert_eq!(
            d.ranges().collect::<Vec<_>>(),
            vec![page_range(1, 3), page_range(60, 70), page_range(127, 131)]
        );
        // A whole word and more, and a region with no dirty page.
        let d = pages(200, &(0..128).collect::<Vec<_>>());
        assert_eq!(d.ranges().collect::<Vec<_>>(), vec![page_range(0, 128)]);
        assert_eq!(pages(200, &[]).ranges().count(), 0);
        // Every page: one run, up to exactly the last page.
        let d = pages(64, &(0..64).collect::<Vec<_>>());
        assert_eq!(d.ranges().collect::<Vec<_>>(), vec![page_range(0, 64)]);
    }

    #[test]
    fn ranges_cover_exactly_the_dirty_pages() {
        // Pseudo-random bitmaps: the ranges hold exactly the pages `is_dirty` reports, in order,
        // and no two ranges touch.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for pages_in_region in [1, 63, 64, 65, 200, 257] {
            let mut bitmap = vec![0u64; (pages_in_region as usize).div_ceil(64)];
            for w in &mut bitmap {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *w = x & (x >> 3);
            }
            let d = DirtyPages {
                region: RegionId(0),
                gpa: GuestAddress(0),
                pages: pages_in_region,
                bitmap,
            };
            let ranges: Vec<Range<u64>> = d.ranges().collect();
            let from_ranges: Vec<u64> = ranges
                .iter()
                .flat_map(|r| (r.start / PAGE_SIZE)..(r.end / PAGE_SIZE))
                .collect();
            let expected: Vec<u64> = (0..pages_in_region).filter(|p| d.is_dirty(*p)).collect();
            assert_eq!(from_ranges, expected, "{pages_in_region} pages");
            assert!(ranges.windows(2).all(|w| w[0].end < w[1].start));
        }
    }
}
