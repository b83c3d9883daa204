//! A restored VM's working set: the pages it touched first, in the order it first touched
//! them, recorded by the lazy loader ([`crate::uffd`]) and given back to a later lazy restore
//! of the same snapshot, which fetches those pages ahead of the guest.
//!
//! Pages are named by their place in the snapshot's memory file (byte offset / 4 KiB), the
//! addressing every layout shares, and kept as runs of neighbouring pages, whatever the regions'
//! page size: a first touch in a 2 MiB hugetlb page is recorded as its 512 pages, and a list
//! naming any page of one prefetches the whole page. The list file is a
//! [`frame`] (magic, version, length, payload, CRC-32); its payload names the snapshot the list
//! belongs to twice: by an id the VMM gives (tinyvmm: the state file's snapshot id) and by the
//! checksum of the snapshot's layout file. [`WorkingSet::check`] refuses, with the reason, a list
//! of another snapshot, of another layout, or naming pages the layout does not have.

use std::ops::Range;

use kvm_memslots::PAGE_SIZE;

use crate::error::SnapshotError;
use crate::frame::{frame, le_u32, le_u64, unframe};
use crate::layout::MemoryLayout;

/// The working-set file format's version; a file of another version is refused.
pub const WORKING_SET_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"KVMSWST\0";

/// The payload's fixed part: snapshot id (16), layout CRC-32 (4), run count (8).
const HEAD: usize = 28;

/// The pages a restored VM touched, in first-touch order, and the snapshot they belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkingSet {
    /// The snapshot's id, as the VMM names its snapshots (0 where it does not).
    pub snapshot: u128,
    /// The checksum the snapshot's layout file stores ([`MemoryLayout::to_bytes`]: the CRC-32
    /// of the layout's JSON).
    pub layout_crc32: u32,
    /// Runs of pages of the memory file (page numbers: byte offset / page size), in the order
    /// the VM first touched them; none is empty.
    pub runs: Vec<Range<u64>>,
}

/// The CRC-32 a working set of `layout` records: the checksum its layout file stores (of the
/// layout's JSON; the CRC-32 of the whole file would be the same for every layout).
fn layout_crc32(layout: &MemoryLayout) -> u32 {
    let file = layout.to_bytes();
    le_u32(&file, file.len() - 4)
}

impl WorkingSet {
    /// An empty working set of snapshot `snapshot`, whose layout is `layout`.
    pub fn new(snapshot: u128, layout: &MemoryLayout) -> Self {
        WorkingSet {
            snapshot,
            layout_crc32: layout_crc32(layout),
            runs: Vec::new(),
        }
    }

    /// Appends page `page` (of the memory file): it extends the last run if it follows it.
    pub fn push(&mut self, page: u64) {
        match self.runs.last_mut() {
            Some(last) if last.end == page => last.end += 1,
            _ => self.runs.push(page..page + 1),
        }
    }

    /// How many pages it names (a page named twice counts twice).
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.end - r.start).sum()
    }

    /// The list file: magic, version, length, the payload (snapshot id, layout CRC-32, the
    /// runs as first page and length, little-endian), its CRC-32 ([`frame`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut payload = Vec::with_capacity(HEAD + 16 * self.runs.len());
        payload.extend_from_slice(&self.snapshot.to_le_bytes());
        payload.extend_from_slice(&self.layout_crc32.to_le_bytes());
        payload.extend_from_slice(&(self.runs.len() as u64).to_le_bytes());
        for run in &self.runs {
            payload.extend_from_slice(&run.start.to_le_bytes());
            payload.extend_from_slice(&(run.end - run.start).to_le_bytes());
        }
        frame(MAGIC, WORKING_SET_VERSION, &payload)
    }

    /// Reads a list file, refusing (with the reason) a wrong magic or version, a truncated or
    /// corrupted file, and runs that are empty or wrap around.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let bad = |why: String| SnapshotError::WorkingSet(why);
        let payload = unframe(MAGIC, WORKING_SET_VERSION, bytes).map_err(bad)?;
        if payload.len() < HEAD {
            return Err(bad(format!(
                "its content is {} bytes, shorter than its {HEAD}-byte head",
                payload.len()
            )));
        }
        let mut snapshot = [0u8; 16];
        snapshot.copy_from_slice(&payload[..16]);
        let count = le_u64(payload, 20);
        let body = &payload[HEAD..];
        if count.checked_mul(16) != Some(body.len() as u64) {
            return Err(bad(format!(
                "it announces {count} runs but holds {} bytes of runs",
                body.len()
            )));
        }
        let runs = body
            .chunks_exact(16)
            .map(|run| {
                let (start, len) = (le_u64(run, 0), le_u64(run, 8));
                match start.checked_add(len) {
                    Some(end) if len > 0 => Ok(start..end),
                    _ => Err(bad(format!("a run of {len} pages from page {start}"))),
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(WorkingSet {
            snapshot: u128::from_le_bytes(snapshot),
            layout_crc32: le_u32(payload, 16),
            runs,
        })
    }

    /// Checks that the list fits `layout`: recorded on a snapshot of this layout, naming only
    /// pages it has. (A lazy restore checks this before it prefetches anything.)
    pub fn check_layout(&self, layout: &MemoryLayout) -> Result<(), SnapshotError> {
        let bad = |why: String| Err(SnapshotError::WorkingSet(why));
        let expected = layout_crc32(layout);
        if self.layout_crc32 != expected {
            return bad(format!(
                "it was recorded on another memory layout (layout CRC-32 {:#010x}, not this \
                 snapshot's {expected:#010x})",
                self.layout_crc32
            ));
        }
        let pages = layout.memory_file_size() / PAGE_SIZE;
        if let Some(run) = self.runs.iter().find(|r| r.is_empty() || r.end > pages) {
            return bad(format!(
                "it names pages {}..{} of the memory file, which has {pages} pages",
                run.start, run.end
            ));
        }
        Ok(())
    }

    /// Checks that the list belongs to snapshot `snapshot`, whose layout is `layout`: its id,
    /// then [`check_layout`](Self::check_layout).
    pub fn check(&self, snapshot: u128, layout: &MemoryLayout) -> Result<(), SnapshotError> {
        if self.snapshot != snapshot {
            return Err(SnapshotError::WorkingSet(format!(
                "it was recorded on snapshot {:032x}, not on {snapshot:032x}",
                self.snapshot
            )));
        }
        self.check_layout(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutBacking, RegionLayout, LAYOUT_VERSION};

    fn layout(size: u64) -> MemoryLayout {
        MemoryLayout {
            version: LAYOUT_VERSION,
            regions: vec![RegionLayout {
                id: 0,
                gpa: 0,
                size,
                slot_size: size,
                read_only: false,
                log_dirty: false,
                backing: LayoutBacking::Anonymous,
                file_offset: 0,
                slot_ranges: None,
                page_size: Default::default(),
            }],
        }
    }

    #[test]
    fn a_working_set_round_trips_in_first_touch_order() {
        let layout = layout(1 << 20);
        let mut set = WorkingSet::new(7, &layout);
        for page in [5, 6, 7, 2, 3, 200, 8] {
            set.push(page);
        }
        assert_eq!(set.runs, [5..8, 2..4, 200..201, 8..9]);
        assert_eq!(set.pages(), 7);
        let bytes = set.to_bytes();
        assert_eq!(WorkingSet::from_bytes(&bytes).expect("reads back"), set);
        set.check(7, &layout).expect("its own snapshot");
        // An empty list is a list too.
        let empty = WorkingSet::new(7, &layout);
        assert_eq!(
            WorkingSet::from_bytes(&empty.to_bytes()).expect("empty"),
            empty
        );
    }

    #[test]
    fn a_working_set_of_another_snapshot_or_past_the_layout_is_refused() {
        let layout = layout(1 << 20);
        let mut set = WorkingSet::new(7, &layout);
        set.push(3);
        let refuse = |r: Result<(), SnapshotError>| r.expect_err("refused").to_string();
        assert!(refuse(set.check(8, &layout)).contains("recorded on snapshot"));
        assert!(refuse(set.check(7, &self::layout(2 << 20))).contains("another memory layout"));
        set.push(256);
        let past = refuse(set.check(7, &layout));
        assert!(
            past.contains("pages 256..257") && past.contains("256 pages"),
            "{past}"
        );
        // A damaged file names what is wrong.
        let mut bytes = set.to_bytes();
        bytes[25] ^= 1;
        let corrupted = WorkingSet::from_bytes(&bytes)
            .expect_err("corrupted")
            .to_string();
        assert!(corrupted.contains("checksum"), "{corrupted}");
        let mut bad_run = set.clone();
        bad_run.runs.truncate(1);
        bad_run.runs[0] = u64::MAX..u64::MAX;
        let mut bytes = bad_run.to_bytes();
        let empty = WorkingSet::from_bytes(&bytes)
            .expect_err("empty run")
            .to_string();
        assert!(empty.contains("a run of 0 pages"), "{empty}");
        bytes.truncate(bytes.len() - 1);
        assert!(WorkingSet::from_bytes(&bytes).is_err());
        let short = frame(MAGIC, WORKING_SET_VERSION, &[0; 10]);
        let short = WorkingSet::from_bytes(&short)
            .expect_err("short")
            .to_string();
        assert!(short.contains("shorter than"), "{short}");
    }
}
