//! The end-to-end check of a stream: what the sender sent against what the receiver's memory
//! holds once the last page landed ([`MemoryDigest`]).
//!
//! Each page contributes [`page_hash`] of its guest address and its bytes (XXH3-64 seeded
//! with the address; 0 for a page of zeros, which is what a page never sent reads on the
//! receiver's fresh memory); a region's digest is the sum (mod 2^64) of its pages'
//! contributions, and the count of pages that contribute. The sum does not depend on the order
//! pages went in, and the sender keeps each page's last contribution ([`SentPages`]), so a page
//! sent again in a later round replaces what it contributed before: the sender's digest is
//! that of the memory the receiver should hold, computed from the very bytes it sent, while it
//! sent them. The receiver computes its own from its guest memory, never from the stream.

use std::sync::atomic::{AtomicUsize, Ordering};

use kvm_memslots::{KvmMemory, MemoryManager, RegionMemory, PAGE_SIZE};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::StreamError;
use crate::layout::MemoryLayout;
use crate::memory_file::data_runs;

/// Bytes hashed per read of guest memory.
const CHUNK: u64 = 1 << 20;
/// The most bytes of guest memory one piece of the receiver's check holds.
const PIECE: u64 = 64 << 20;
/// The most threads the receiver's check runs on.
const MAX_THREADS: usize = 8;

static ZERO_PAGE: [u8; PAGE_SIZE as usize] = [0; PAGE_SIZE as usize];

/// What one page at guest `gpa` holding `page` (`PAGE_SIZE` bytes) contributes to its region's
/// digest: 0 for a page of zeros, otherwise XXH3-64 of its bytes seeded with its address (never
/// 0: a hash of 0 counts as 1).
pub fn page_hash(gpa: u64, page: &[u8]) -> u64 {
    if page == &ZERO_PAGE[..] {
        return 0;
    }
    xxh3_64_with_seed(page, gpa).max(1)
}

/// One region's digest: how many pages hold data and the sum of their [`page_hash`]es.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionDigest {
    /// Pages that are not all zeros.
    pub pages: u64,
    /// The sum (mod 2^64) of every page's [`page_hash`].
    pub sum: u64,
}

impl RegionDigest {
    fn add(&mut self, hash: u64) {
        if hash != 0 {
            self.pages += 1;
            self.sum = self.sum.wrapping_add(hash);
        }
    }

    fn remove(&mut self, hash: u64) {
        if hash != 0 {
            self.pages -= 1;
            self.sum = self.sum.wrapping_sub(hash);
        }
    }
}

/// The digest of a layout's memory, by layout index. A region handed over (its file shared,
/// no page sent) has an empty digest and is not compared: the receiver maps the very memory
/// the sender had.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryDigest {
    /// Each layout region's, in layout order.
    pub regions: Vec<RegionDigest>,
}

impl MemoryDigest {
    /// The bytes of a Digest record: each region's page count and sum, little-endian.
    pub(super) fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.regions.len() * 16);
        for r in &self.regions {
            bytes.extend_from_slice(&r.pages.to_le_bytes());
            bytes.extend_from_slice(&r.sum.to_le_bytes());
        }
        bytes
    }

    pub(super) fn from_bytes(bytes: &[u8]) -> Self {
        MemoryDigest {
            regions: bytes
                .chunks_exact(16)
                .map(|r| RegionDigest {
                    pages: crate::frame::le_u64(r, 0),
                    sum: crate::frame::le_u64(r, 8),
                })
                .collect(),
        }
    }

    /// The digest of `memory` (laid out as `layout`) as it is now, read from guest memory:
    /// every page that holds data ([`data_runs`]: the rest reads zeros and contributes
    /// nothing), except the regions `skip` marks (by layout index: handed over). Guest memory
    /// must not change meanwhile (no vCPU runs). The work is cut into pieces of at most 64 MiB
    /// that as many threads as the host has CPUs (at most 8) take in turn: the sums add up in
    /// any order.
    pub fn of_memory<K: KvmMemory>(
        memory: &MemoryManager<K>,
        layout: &MemoryLayout,
        skip: &[bool],
    ) -> Result<Self, StreamError> {
        let regions = layout.mappings(memory)?;
        let mut pieces = Vec::new();
        for (index, region) in regions.iter().enumerate() {
            if skip.get(index).copied().unwrap_or(false) {
                continue;
            }
            for run in data_runs(region)? {
                let mut at = run.start;
                while at < run.end {
                    let end = run.end.min(at + PIECE);
                    pieces.push((index, at..end));
                    at = end;
                }
            }
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_THREADS)
            .min(pieces.len().max(1));
        let next = AtomicUsize::new(0);
        let work = || -> Result<Vec<RegionDigest>, StreamError> {
            let mut digests = vec![RegionDigest::default(); layout.regions.len()];
            let mut buf = vec![0u8; CHUNK as usize];
            while let Some((index, run)) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) {
                let gpa = layout.regions[*index].gpa;
                hash_run(
                    &regions[*index],
                    gpa,
                    run.clone(),
                    &mut buf,
                    &mut digests[*index],
                )?;
            }
            Ok(digests)
        };
        let parts: Vec<Result<Vec<RegionDigest>, StreamError>> = std::thread::scope(|scope| {
            let helpers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
            let mut parts = vec![work()];
            parts.extend(helpers.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(StreamError::Format(
                        "a thread hashing guest memory panicked".into(),
                    ))
                })
            }));
            parts
        });
        let mut digest = MemoryDigest {
            regions: vec![RegionDigest::default(); layout.regions.len()],
        };
        for part in parts {
            for (total, d) in digest.regions.iter_mut().zip(part?) {
                total.pages += d.pages;
                total.sum = total.sum.wrapping_add(d.sum);
            }
        }
        Ok(digest)
    }

    /// Compares this digest (the receiver's, [`of_memory`](Self::of_memory)) with `sent` (the
    /// sender's) region by region; the first region that differs is the error, with its place
    /// and both counts of pages holding data, and how many regions differ.
    pub fn check(&self, sent: &MemoryDigest, layout: &MemoryLayout) -> Result<(), StreamError> {
        if self.regions.len() != sent.regions.len() {
            return Err(StreamError::Format(format!(
                "the sender's digest covers {} regions, the layout has {}",
                sent.regions.len(),
                self.regions.len()
            )));
        }
        let differ: Vec<usize> = (0..self.regions.len())
            .filter(|&i| self.regions[i] != sent.regions[i])
            .collect();
        let Some(&first) = differ.first() else {
            return Ok(());
        };
        let (here, there, r) = (
            self.regions[first],
            sent.regions[first],
            &layout.regions[first],
        );
        Err(StreamError::Mismatch(format!(
            "the region at guest {:#x} ({:#x} bytes) holds {} pages of data here (digest \
             {:#018x}), the sender sent {} (digest {:#018x}); {} of {} regions differ",
            r.gpa,
            r.size,
            here.pages,
            here.sum,
            there.pages,
            there.sum,
            differ.len(),
            self.regions.len()
        )))
    }
}

/// Adds the pages of `run` (byte offsets in `region`, whose guest base is `gpa`) to `digest`.
fn hash_run(
    region: &RegionMemory,
    gpa: u64,
    run: std::ops::Range<u64>,
    buf: &mut [u8],
    digest: &mut RegionDigest,
) -> Result<(), StreamError> {
    let mut at = run.start;
    while at < run.end {
        let n = (run.end - at).min(CHUNK) as usize;
        region
            .read_volatile(at, &mut buf[..n])
            .map_err(|e| StreamError::Format(format!("reading guest memory: {e}")))?;
        for (i, page) in buf[..n].chunks_exact(PAGE_SIZE as usize).enumerate() {
            digest.add(page_hash(gpa + at + i as u64 * PAGE_SIZE, page));
        }
        at += n as u64;
    }
    Ok(())
}

/// What a sender contributed to each region's digest, page by page: so that a page sent
/// again replaces its earlier contribution. One `u64` per page of each region whose pages
/// travel (1/512 of guest memory, allocated zeroed: only the parts of pages sent are touched).
#[derive(Debug, Default)]
pub(super) struct SentPages {
    regions: Vec<(Vec<u64>, RegionDigest)>,
}

impl SentPages {
    /// A table for `layout`'s regions, none sent yet.
    pub(super) fn new(layout: &MemoryLayout) -> Self {
        SentPages {
            regions: vec![(Vec::new(), RegionDigest::default()); layout.regions.len()],
        }
    }

    /// Records that the pages of `data` went out from offset `offset` of layout region
    /// `index` (at guest `gpa` + `offset`, `size` bytes in all).
    pub(super) fn sent(&mut self, index: usize, gpa: u64, size: u64, offset: u64, data: &[u8]) {
        let (hashes, digest) = &mut self.regions[index];
        if hashes.is_empty() {
            *hashes = vec![0; (size / PAGE_SIZE) as usize];
        }
        for (i, page) in data.chunks_exact(PAGE_SIZE as usize).enumerate() {
            let at = offset + i as u64 * PAGE_SIZE;
            let hash = page_hash(gpa + at, page);
            let slot = &mut hashes[(at / PAGE_SIZE) as usize];
            digest.remove(*slot);
            digest.add(hash);
            *slot = hash;
        }
    }

    /// The digest of what was sent (the last copy of each page).
    pub(super) fn digest(&self) -> MemoryDigest {
        MemoryDigest {
            regions: self.regions.iter().map(|(_, d)| *d).collect(),
        }
    }
}
