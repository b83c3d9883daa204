//! The pages a snapshot chain owes its next Diff: what its reader of the dirty log handed over
//! and no snapshot has saved yet (a failed or cancelled Diff's, a live Diff's under way). One
//! bitmap per region, each harvest merged into it: however many rounds or failed Diffs, the
//! set is never larger than one harvest of every region.

use std::collections::HashMap;

use kvm_memslots::{DirtyPages, RegionId};

/// Pages by region, one bitmap each ([`DirtyPages`], as a harvest reports them).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct PageSet {
    /// One per region, in the order they first came.
    regions: Vec<DirtyPages>,
    /// Where each region's bitmap is in `regions`.
    index: HashMap<RegionId, usize>,
}

impl PageSet {
    /// No page.
    pub(super) fn new() -> Self {
        Self::default()
    }

    /// Adds the pages of `harvest` (each region's bits OR-ed into its bitmap; a region seen
    /// for the first time is copied in).
    pub(super) fn merge(&mut self, harvest: &[DirtyPages]) {
        for pages in harvest {
            match self.index.get(&pages.region) {
                Some(&at) => or_into(&mut self.regions[at], pages),
                None => self.insert(pages.clone()),
            }
        }
    }

    /// [`merge`](Self::merge), moving in the bitmaps of regions seen for the first time.
    pub(super) fn merge_owned(&mut self, harvest: Vec<DirtyPages>) {
        for pages in harvest {
            match self.index.get(&pages.region) {
                Some(&at) => or_into(&mut self.regions[at], &pages),
                None => self.insert(pages),
            }
        }
    }

    fn insert(&mut self, pages: DirtyPages) {
        self.index.insert(pages.region, self.regions.len());
        self.regions.push(pages);
    }

    /// Every region's pages, as a harvest would report them (what `write_dirty_pages` takes).
    pub(super) fn pages(&self) -> &[DirtyPages] {
        &self.regions
    }

    /// How many bitmaps it holds: one per region it has pages of.
    #[cfg(test)]
    pub(super) fn bitmaps(&self) -> usize {
        self.regions.len()
    }

    /// Whether it holds no bitmap.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

impl From<Vec<DirtyPages>> for PageSet {
    fn from(harvest: Vec<DirtyPages>) -> Self {
        let mut set = PageSet::new();
        set.merge_owned(harvest);
        set
    }
}

/// ORs `from`'s bits into `into` (the same region: a region's size never changes, but a
/// longer bitmap is taken whole), and takes `from`'s base (the newer one: bits count from
/// the region's start whatever its base).
fn or_into(into: &mut DirtyPages, from: &DirtyPages) {
    if into.bitmap.len() < from.bitmap.len() {
        into.bitmap.resize(from.bitmap.len(), 0);
    }
    for (word, bits) in into.bitmap.iter_mut().zip(&from.bitmap) {
        *word |= bits;
    }
    into.pages = into.pages.max(from.pages);
    into.gpa = from.gpa;
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestAddress;

    use super::*;

    fn pages(region: u64, gpa: u64, dirty: &[u64]) -> DirtyPages {
        let mut bitmap = vec![0u64; 3];
        for page in dirty {
            bitmap[(page / 64) as usize] |= 1 << (page % 64);
        }
        DirtyPages {
            region: RegionId(region),
            gpa: GuestAddress(gpa),
            pages: 150,
            bitmap,
        }
    }

    fn addresses(set: &PageSet) -> Vec<u64> {
        let mut all: Vec<u64> = set
            .pages()
            .iter()
            .flat_map(|d| d.addresses().map(|a| a.0))
            .collect();
        all.sort_unstable();
        all
    }

    #[test]
    fn rounds_merge_into_one_bitmap_per_region() {
        let mut set = PageSet::new();
        for round in 0..100u64 {
            set.merge(&[pages(1, 0, &[round % 150]), pages(2, 1 << 30, &[149])]);
        }
        assert_eq!(set.bitmaps(), 2);
        let mut expected: Vec<u64> = (0..100).map(|p| p * 4096).collect();
        expected.push((1 << 30) + 149 * 4096);
        assert_eq!(addresses(&set), expected);
    }

    #[test]
    fn a_moved_region_keeps_its_bits_at_its_new_base() {
        let mut set = PageSet::from(vec![pages(1, 0, &[3])]);
        set.merge_owned(vec![pages(1, 1 << 20, &[5]), pages(4, 8 << 20, &[0])]);
        assert_eq!(set.bitmaps(), 2);
        assert_eq!(
            addresses(&set),
            vec![(1 << 20) + 3 * 4096, (1 << 20) + 5 * 4096, 8 << 20]
        );
        assert!(!set.is_empty() && PageSet::new().is_empty());
    }
}
