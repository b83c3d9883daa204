//! Discard: giving the host back the memory behind a guest range.

use std::ops::Range;
use std::sync::Arc;

use memslot_map::AddressRange;
use vm_memory::GuestAddress;

use super::{check_aligned_to, check_range, MemoryManager};
use crate::error::Error;
use crate::kvm::KvmMemory;
use crate::pending::PendingBits;
use crate::region_memory::{split_by, PageSize, RegionId, RegionMemory};
use crate::PAGE_SIZE;

/// A part of a discard that is one run of one region's mapping.
struct Piece {
    pending: Arc<PendingBits>,
    memory: Arc<RegionMemory>,
    /// Offset of the run in the region.
    offset: u64,
    /// Its guest range.
    start: u64,
    end: u64,
}

impl<K: KvmMemory> MemoryManager<K> {
    /// Gives the host back the memory behind guest range `[gpa, gpa + len)`, which must be
    /// all memory: private pages read back as zeros, shared ones are freed from their file
    /// (`MADV_DONTNEED` / `MADV_REMOVE`). The slots stay as they are; the pages count as dirty
    /// in the next harvest, since their contents changed.
    ///
    /// # KVM calls
    ///
    /// No KVM ioctl (KVM's MMU notifier sees the change); a range with a hole is refused
    /// before any call. For each run of one region's mapping in the range, lowest guest
    /// address first (neighbouring slots of a region make one run), one call:
    ///
    /// - [`Backing::PrivateFile`](crate::Backing::PrivateFile): `mmap` with `MAP_FIXED` of
    ///   private anonymous read-write memory over the run (`MAP_NORESERVE`; of hugetlb pages,
    ///   reserved, in a region of 2 MiB pages);
    /// - a shared mapping (memfd or [`Backing::File`](crate::Backing::File)):
    ///   `madvise(MADV_REMOVE)`;
    /// - private anonymous memory: `madvise(MADV_DONTNEED)`.
    ///
    /// In a region of 2 MiB hugetlb pages ([`PageSize::Huge2M`]) only whole pages can be
    /// given back: a range that starts or ends inside one is refused
    /// ([`Error::Unaligned`], naming the page size) before any call.
    ///
    /// Nothing to undo: on a failure the discard stops and returns the error; runs before it
    /// stay discarded (and count as dirty), the rest is untouched.
    pub fn discard(&self, gpa: GuestAddress, len: u64) -> Result<(), Error> {
        check_range(gpa.0, len)?;
        let range = AddressRange {
            start: gpa.0,
            end: gpa.0 + len,
        };
        // Take the writer lock before reading the map, and hold it until the pages are
        // discarded and marked: a change (a move, say) cannot then come between the look-up
        // and the madvise and make the discard hit memory that is no longer at `gpa`.
        let state = self.state();
        let current = Arc::clone(state.current());
        // Check the whole range first so that a hole refuses the discard before any of it.
        if let Some(hole) = current.first_hole(range.start, range.end) {
            return Err(Error::DiscardHole { range, hole });
        }
        // Pieces of one mapping that follow each other are merged into one madvise call.
        let mut pieces: Vec<Piece> = Vec::new();
        let mut at = range.start;
        for slot in current.iter_from_gpa(gpa) {
            if at == range.end {
                break;
            }
            let end = slot.gpa_range().end.min(range.end);
            let offset = slot.payload().offset() + (at - slot.gpa().0);
            match pieces.last_mut() {
                Some(last)
                    if Arc::ptr_eq(&last.memory, slot.payload().memory())
                        && last.offset + (last.end - last.start) == offset =>
                {
                    last.end = end;
                }
                _ => pieces.push(Piece {
                    pending: Arc::clone(slot.payload().pending()),
                    memory: Arc::clone(slot.payload().memory()),
                    offset,
                    start: at,
                    end,
                }),
            }
            at = end;
        }
        // A region of hugetlb pages gives back whole pages only: the range's edges inside one
        // must be on its 2 MiB boundaries, checked for every run before any is discarded.
        for piece in &pieces {
            let page = piece.memory.page_size().alignment();
            check_aligned_to("discard start", piece.offset, page)?;
            check_aligned_to("discard length", piece.end - piece.start, page)?;
        }
        for piece in pieces {
            let len = piece.end - piece.start;
            discard_guarded(&piece.memory, piece.offset, len).map_err(|source| Error::Discard {
                range: AddressRange {
                    start: piece.start,
                    end: piece.end,
                },
                source,
            })?;
            // The guest's memory changed: the next harvest must report these pages.
            piece
                .pending
                .mark(piece.offset / PAGE_SIZE, len / PAGE_SIZE);
        }
        drop(state);
        Ok(())
    }
}

impl<K: KvmMemory> MemoryManager<K> {
    /// Gives the host back the memory behind byte range `range` of region `id`, slots or not:
    /// for memory in a hole (an unplugged block, say), which [`discard`](Self::discard),
    /// going by guest address, refuses. Otherwise as `discard`: the pages read back as zeros
    /// (private memory) or are freed from their file (shared), and count as dirty in the next
    /// harvest. The region's slots stay as they are.
    ///
    /// Refused, with nothing discarded, if the region does not exist or the range is not a
    /// page-aligned range inside it.
    ///
    /// # KVM calls
    ///
    /// No KVM ioctl. One call for the range, as [`discard`](Self::discard) makes for a run.
    pub fn discard_region(&self, id: RegionId, range: Range<u64>) -> Result<(), Error> {
        // The writer lock, as `discard` takes it: no change comes between the look-up and the
        // call.
        let state = self.state();
        let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
        if range.start >= range.end || range.end > region.size {
            return Err(Error::OutsideRegion {
                region: id,
                start: range.start,
                end: range.end,
            });
        }
        let page = region.memory.page_size().alignment();
        check_aligned_to("offset", range.start, page)?;
        check_aligned_to("length", range.end - range.start, page)?;
        let len = range.end - range.start;
        discard_guarded(&region.memory, range.start, len).map_err(|source| Error::Discard {
            range: AddressRange {
                start: region.gpa.0 + range.start,
                end: region.gpa.0 + range.end,
            },
            source,
        })?;
        region
            .pending()
            .mark(range.start / PAGE_SIZE, len / PAGE_SIZE);
        Ok(())
    }
}

impl<K: KvmMemory> MemoryManager<K> {
    /// Makes byte ranges `ranges` of region `id` unreachable (`accessible` false): the guest's
    /// accesses fault in KVM (its `KVM_RUN` fails with `EFAULT`, or a `KVM_EXIT_MEMORY_FAULT`
    /// naming the guest address), the host's readers of the region
    /// ([`RegionMemory::read_volatile`], [`RegionMemory::access`]) see zeros, and vm-memory
    /// refuses them (a device's access gets an error). Or reachable again (`accessible` true),
    /// with what they held. The slots stay as they are: this is how a slot can stay over memory
    /// the guest must not use (an unplugged block inside a plugged piece), with no KVM call.
    /// The pages count as dirty in the next harvest either way (what readers see of them
    /// changed). To give the memory back too, [`discard_region`](Self::discard_region) the
    /// ranges once they are unreachable (nothing can fault them in again then).
    ///
    /// Refused, nothing changed, if the region does not exist or a range is empty, outside it
    /// or not aligned to its page size.
    ///
    /// A device that copies to or from a range through vm-memory while it turns unreachable
    /// can fault: the check `get_slice` makes is not held across the copy. Devices that DMA
    /// into memory a guest may unplug must hold [`RegionMemory::access`] across the copy.
    ///
    /// # KVM calls
    ///
    /// None. One `mprotect` per range. If one fails, the ranges done before it get their
    /// protection back and the error is returned.
    pub fn set_accessible(
        &self,
        id: RegionId,
        ranges: &[Range<u64>],
        accessible: bool,
    ) -> Result<(), Error> {
        let state = self.state();
        let region = state.regions.get(&id).ok_or(Error::UnknownRegion(id))?;
        let page = region.memory.page_size().alignment();
        for range in ranges {
            if range.start >= range.end || range.end > region.size {
                return Err(Error::OutsideRegion {
                    region: id,
                    start: range.start,
                    end: range.end,
                });
            }
            check_aligned_to("offset", range.start, page)?;
            check_aligned_to("length", range.end - range.start, page)?;
        }
        let guest = |range: &Range<u64>| AddressRange {
            start: region.gpa.0 + range.start,
            end: region.gpa.0 + range.end,
        };
        // What to put back if a range after the first fails (one range needs no undo).
        let before = match ranges.len() {
            0 | 1 => Vec::new(),
            _ => region.memory.inaccessible(),
        };
        for (done, range) in ranges.iter().enumerate() {
            if let Err(source) = region.memory.set_accessible(range.clone(), accessible) {
                // Put back what the ranges before had, range by range (each was all one way:
                // either as asked already, or the other way).
                for undo in &ranges[..done] {
                    for (part, was_accessible) in split_by(undo.clone(), &before) {
                        let _ = region.memory.set_accessible(part, was_accessible);
                    }
                }
                return Err(Error::Protect {
                    range: guest(range),
                    source,
                });
            }
        }
        for range in ranges {
            region.pending().mark(
                range.start / PAGE_SIZE,
                (range.end - range.start) / PAGE_SIZE,
            );
        }
        drop(state);
        Ok(())
    }
}

/// The `mmap` flags of the zero pages a discard puts over a private file mapping: private
/// anonymous memory of the region's page size (hugetlb pages reserved, as the region's were).
fn zero_pages_flags(page_size: PageSize) -> libc::c_int {
    let base = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
    match page_size {
        PageSize::Huge2M => base | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
        PageSize::Base | PageSize::Transparent => base | libc::MAP_NORESERVE,
    }
}

/// [`discard_run`] of `len` bytes of `memory` from `offset`, holding its protection steady:
/// the zero pages a private file mapping gets keep each part's protection (inaccessible
/// parts stay `PROT_NONE`).
fn discard_guarded(memory: &RegionMemory, offset: u64, len: u64) -> std::io::Result<()> {
    if !memory.is_private_file() {
        return discard_run(memory, offset, len, libc::PROT_READ | libc::PROT_WRITE);
    }
    let access = memory.access();
    for (part, accessible) in split_by(offset..offset + len, access.inaccessible()) {
        let prot = if accessible {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_NONE
        };
        discard_run(memory, part.start, part.end - part.start, prot)?;
    }
    Ok(())
}

/// Gives the host back `len` bytes of `memory` from `offset` (see [`MemoryManager::discard`]
/// for the call each kind of memory gets); a private file mapping gets zero pages of
/// protection `prot`, the protection the range has (the caller holds it steady).
pub(crate) fn discard_run(
    memory: &RegionMemory,
    offset: u64,
    len: u64,
    prot: libc::c_int,
) -> std::io::Result<()> {
    if offset
        .checked_add(len)
        .is_none_or(|end| end > memory.size())
    {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let hva = memory.host_address() + offset;
    let ret = if memory.is_private_file() {
        // Dropping a copy-on-write page would bring the file's page back: put fresh
        // zero pages there instead, in one step (MAP_FIXED replaces the range
        // atomically, so it is never unmapped; KVM's MMU notifier sees the change).
        // SAFETY: `[hva, hva + len)` lies inside the region's mapping (checked above), which
        // `memory` keeps alive; it is replaced by a private anonymous mapping of
        // the same range and protection (`prot`, which the caller holds steady), so the
        // region's memory stays mapped as it was. Guest memory is only accessed through volatile accesses and raw
        // pointers, never Rust references, so replacing its contents breaks no
        // aliasing rule.
        let mapped = unsafe {
            libc::mmap(
                hva as *mut libc::c_void,
                len as usize,
                prot,
                zero_pages_flags(memory.page_size()),
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            -1
        } else {
            0
        }
    } else {
        let advice = if memory.is_shared() {
            libc::MADV_REMOVE
        } else {
            libc::MADV_DONTNEED
        };
        // SAFETY: `[hva, hva + len)` lies inside the region's mapping (checked above), which
        // `memory` keeps mapped during the call. Guest memory is only accessed
        // through volatile accesses and raw pointers, never Rust references, so
        // replacing its contents with zeros (or freeing its file pages) breaks no
        // aliasing rule.
        unsafe { libc::madvise(hva as *mut libc::c_void, len as usize, advice) }
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
