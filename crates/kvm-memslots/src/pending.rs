//! A region's pending dirty bits ([`PendingBits`]): what KVM, the rings, the VMM's bitmap and
//! discards reported of the region and no harvest has handed over yet.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::dirty::set_bits;
use crate::error::Error;

/// A region's *pending* dirty bits: pages read from KVM (or the VMM's bitmap, or marked by a
/// discard or by logging starting in ring mode) and not yet handed over by a harvest, one bit
/// per page. Shared (`Arc`) by the region's record, each of its slots in the map, and the
/// harvest directory, so that a harvest reaches it lock-free from a map version. Bits are set
/// with `fetch_or` and handed over with `swap(0)`, word by word: a bit set concurrently with a
/// hand-over lands either in it or in the next one, never nowhere.
pub(crate) struct PendingBits {
    words: Box<[AtomicU64]>,
    pages: u64,
}

impl PendingBits {
    /// Room for `pages` bits, all clear, allocated fallibly (an error, never an abort).
    pub(crate) fn new(pages: u64) -> Result<Self, Error> {
        let words = pages.div_ceil(64);
        let fail = || Error::OutOfMemory {
            what: "a region's pending dirty bits",
            bytes: words.saturating_mul(8),
        };
        let count = usize::try_from(words).map_err(|_| fail())?;
        let mut v: Vec<AtomicU64> = Vec::new();
        v.try_reserve_exact(count).map_err(|_| fail())?;
        v.resize_with(count, || AtomicU64::new(0));
        Ok(PendingBits {
            words: v.into_boxed_slice(),
            pages,
        })
    }

    /// Pages covered.
    pub(crate) fn pages(&self) -> u64 {
        self.pages
    }

    /// Sets bits `first .. first + count`.
    pub(crate) fn mark(&self, first: u64, count: u64) {
        let end = first + count;
        let mut bit = first;
        while bit < end {
            let word = bit / 64;
            let low = bit % 64;
            let high = (end - word * 64).min(64);
            let mask = if high - low == 64 {
                u64::MAX
            } else {
                ((1u64 << (high - low)) - 1) << low
            };
            self.words[word as usize].fetch_or(mask, Ordering::AcqRel);
            bit = word * 64 + high;
        }
    }

    /// Sets the bits `at + i` for every bit `i < bits` set in `src`.
    pub(crate) fn or_bits(&self, at: u64, src: &[u64], bits: u64) {
        if at.is_multiple_of(64) {
            // Word-aligned (every slot but the odd one): one `fetch_or` per word.
            let first = (at / 64) as usize;
            for (i, w) in src.iter().enumerate() {
                let valid = bits.saturating_sub(i as u64 * 64);
                if valid == 0 {
                    break;
                }
                let w = if valid < 64 {
                    w & ((1 << valid) - 1)
                } else {
                    *w
                };
                if w != 0 {
                    self.words[first + i].fetch_or(w, Ordering::AcqRel);
                }
            }
            return;
        }
        for i in set_bits(src).take_while(|i| *i < bits) {
            self.mark(at + i, 1);
        }
    }

    /// Hands the bits over into `out` (resized to the region's words) and clears them. The
    /// room is reserved first: if the host has none, nothing is taken.
    pub(crate) fn take_into(&self, out: &mut Vec<u64>) -> Result<(), Error> {
        out.clear();
        out.try_reserve_exact(self.words.len())
            .map_err(|_| Error::OutOfMemory {
                what: "a region's harvested dirty bits",
                bytes: (self.words.len() as u64).saturating_mul(8),
            })?;
        out.extend(self.words.iter().map(|w| w.swap(0, Ordering::AcqRel)));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dirty::{mark_range, or_bits};

    #[test]
    fn pending_bits_mark_or_and_hand_over_like_plain_bitmaps() {
        for (at, pages) in [(0u64, 200u64), (60, 200), (64, 130), (1, 66)] {
            let pending = PendingBits::new(pages).unwrap();
            let mut plain = vec![0u64; pages.div_ceil(64) as usize];
            let src = [0b1011, u64::MAX, 1 << 63];
            let bits = (pages - at).min(150);
            pending.or_bits(at, &src, bits);
            or_bits(&mut plain, at, &src, bits);
            pending.mark(3, 70);
            mark_range(&mut plain, 3, 70);
            pending.mark(pages - 1, 1);
            mark_range(&mut plain, pages - 1, 1);
            let mut out = Vec::new();
            pending.take_into(&mut out).unwrap();
            assert_eq!(out, plain, "at {at}, {pages} pages");
            pending.take_into(&mut out).unwrap();
            assert!(out.iter().all(|w| *w == 0), "handed over once");
        }
    }
}
