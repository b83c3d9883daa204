//! KVM's dirty ring (`KVM_CAP_DIRTY_LOG_RING[_ACQ_REL]`): each vCPU has a ring of
//! `(slot, page offset)` entries, one per page the guest dirtied, that KVM fills and the VMM
//! collects; a harvest then costs what was dirtied, not what exists.
//!
//! The protocol (the kernel's `Documentation/virt/kvm/api.rst`, "KVM_CAP_DIRTY_LOG_RING"): KVM
//! publishes an entry by setting its `DIRTY` flag (a release store); the VMM reads the flag
//! with an acquire load, reads the entry, and hands it back by setting `RESET`, in ring order
//! from its own fetch index; `KVM_RESET_DIRTY_RINGS` then re-protects the pages handed back and
//! frees their entries. kvm-ioctls has the capability but not the ring, hence this module.

use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use kvm_bindings::{kvm_dirty_gfn, KVMIO, KVM_DIRTY_LOG_PAGE_OFFSET};
use vmm_sys_util::ioctl_io_nr;

ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);

/// `kvm_dirty_gfn.flags`: KVM published the entry.
const DIRTY: u32 = 1;
/// `kvm_dirty_gfn.flags`: the VMM collected it; KVM frees it at the next reset.
const RESET: u32 = 2;

/// The fewest entries a ring may have: KVM keeps some in reserve (64 on x86), and the ring is
/// at least a page.
pub const MIN_RING_ENTRIES: u32 = 4096 / 16;

/// What a collection of the dirty rings found ([`KvmMemory::collect_dirty_rings`]).
///
/// [`KvmMemory::collect_dirty_rings`]: crate::KvmMemory::collect_dirty_rings
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingCollection {
    /// Entries collected.
    pub entries: u64,
    /// A ring overflowed: it wrapped (as many entries since the last reset as it holds: a ring
    /// found full cannot be told from one KVM pushed past its end, writing over the oldest), or
    /// its entries were found out of step with the collector. Entries may have been written
    /// over before they were collected, so the pages they named are lost to the rings. The
    /// caller must treat every page of every logging slot as dirty. Entries past KVM's soft
    /// limit (`size - 64`, where it asks for a ring-full exit) are not an overflow while the
    /// ring has room for them.
    pub lost: bool,
}

impl std::ops::Add for RingCollection {
    type Output = RingCollection;

    fn add(self, other: RingCollection) -> RingCollection {
        RingCollection {
            entries: self.entries + other.entries,
            lost: self.lost || other.lost,
        }
    }
}

/// One vCPU's ring, mapped from its vCPU file.
#[derive(Debug)]
pub(crate) struct DirtyRing {
    entries: NonNull<kvm_dirty_gfn>,
    count: u32,
    /// The next entry to look at (the VMM's fetch index, modulo `count`).
    next: u32,
    /// Entries collected since the last successful `KVM_RESET_DIRTY_RINGS`.
    since_reset: u32,
    /// An overflow was seen and no collection since found entries at `next` (the ring in step):
    /// each collection that finds nothing at `next` looks for published entries elsewhere. A
    /// collection that finds the ring empty does not end it: KVM's next entries may still come
    /// at another index.
    suspect: bool,
}

// SAFETY: the ring is a shared mapping that KVM and this process access only through the
// atomic flag protocol; the raw pointer is owned by this `DirtyRing` alone (it is unmapped in
// `Drop`), so moving it to another thread is sound.
unsafe impl Send for DirtyRing {}

impl DirtyRing {
    /// Maps the ring of the vCPU whose file is `vcpu`, of `count` entries (the size the VM's
    /// ring was enabled with).
    pub(crate) fn map(vcpu: RawFd, count: u32) -> std::io::Result<Self> {
        let len = count as usize * size_of::<kvm_dirty_gfn>();
        // SAFETY: sysconf has no memory arguments.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as libc::off_t;
        // SAFETY: a new shared mapping of the vCPU file at KVM's documented ring offset; it
        // overlaps no Rust object, and its length is what the ring was enabled with.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu,
                libc::off_t::from(KVM_DIRTY_LOG_PAGE_OFFSET) * page,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(DirtyRing {
            entries: NonNull::new(ptr.cast()).expect("mmap does not return null on success"),
            count,
            next: 0,
            since_reset: 0,
            suspect: false,
        })
    }

    /// The entry's flags, seen atomically.
    fn flags(&self, index: u32) -> &AtomicU32 {
        let index = (index % self.count) as usize;
        // SAFETY: `index < count`, so the entry lies in the mapping, which lives as long as
        // `self`; it is 16-byte aligned (the mapping is page-aligned), and `flags` is its first
        // field (kvm_dirty_gfn is repr(C)).
        let flags_ptr = unsafe { self.entries.as_ptr().add(index) }.cast::<u32>();
        // SAFETY: `flags_ptr` points at a live, aligned u32 in the mapping; KVM and this
        // process access it only atomically, so viewing it as an `AtomicU32` is sound.
        unsafe { AtomicU32::from_ptr(flags_ptr) }
    }

    /// KVM's `KVM_RESET_DIRTY_RINGS` succeeded: the entries collected so far are free again.
    pub(crate) fn reset_done(&mut self) {
        self.since_reset = 0;
    }

    /// Collects the published entries in ring order, handing each to `sink` as (slot, page
    /// offset in the slot) and back to KVM; says how many, and whether entries may have been
    /// lost (see [`RingCollection::lost`]).
    pub(crate) fn collect(&mut self, sink: &mut dyn FnMut(u32, u64)) -> RingCollection {
        let mut found = self.collect_in_order(sink);
        if found.entries == 0 && self.suspect {
            // After an overflow KVM's write index and ours may differ: nothing at ours, but
            // entries elsewhere. KVM publishes in ring order, so if an entry after ours is
            // published while ours (looked at again after it) is not, ours is out of step:
            // start from the first published entry after it.
            let published = (1..self.count).find(|&step| {
                self.flags(self.next.wrapping_add(step))
                    .load(Ordering::Acquire)
                    & DIRTY
                    != 0
            });
            match published {
                Some(step) if self.flags(self.next).load(Ordering::Acquire) & DIRTY == 0 => {
                    // The entries skipped are handed back too: KVM's reset frees entries in
                    // ring order and stops at one that is not, so without them it would never
                    // get past the ones written over, and the vCPU would exit ring-full for
                    // ever. (KVM re-protects the page an entry names: a stale one's, harmless.)
                    for skipped in 0..step {
                        self.flags(self.next.wrapping_add(skipped))
                            .store(RESET, Ordering::Release);
                    }
                    // KVM counts them as used until the next reset, as collected ones.
                    self.since_reset = self.since_reset.saturating_add(step);
                    self.next = self.next.wrapping_add(step);
                    found = self.collect_in_order(sink);
                    found.lost = true;
                }
                Some(_) => found = self.collect_in_order(sink),
                // An empty ring proves nothing: stay suspicious.
                None => {}
            }
        }
        if found.lost {
            self.suspect = true;
        } else if found.entries > 0 {
            // Entries published at `next`, in order: the ring is in step again.
            self.suspect = false;
        }
        found
    }

    /// Collects from the fetch index on while entries are published.
    fn collect_in_order(&mut self, sink: &mut dyn FnMut(u32, u64)) -> RingCollection {
        let mut found = RingCollection::default();
        loop {
            let flags = self.flags(self.next);
            if flags.load(Ordering::Acquire) & DIRTY == 0 {
                return found;
            }
            let index = (self.next % self.count) as usize;
            // SAFETY: `index < count`, so the entry lies in the mapping.
            let entry = unsafe { self.entries.as_ptr().add(index) };
            // SAFETY: the acquire load saw DIRTY, so KVM wrote the entry before it and will
            // not touch it until it is reset: copying it out is race-free.
            let gfn = unsafe { entry.read() };
            sink(gfn.slot, gfn.offset);
            flags.store(RESET, Ordering::Release);
            self.next = self.next.wrapping_add(1);
            found.entries += 1;
            self.since_reset = self.since_reset.saturating_add(1);
            // The ring held as many entries as it has since the last reset: KVM may have
            // pushed past its end (writing over the oldest, which a collection that finds
            // them all published cannot tell from the newest). Entries past KVM's soft limit
            // but short of this are not lost.
            if self.since_reset >= self.count {
                found.lost = true;
            }
        }
    }
}

impl Drop for DirtyRing {
    fn drop(&mut self) {
        let len = self.count as usize * size_of::<kvm_dirty_gfn>();
        // SAFETY: the mapping was made in `map` with this length and is not used after this.
        unsafe { libc::munmap(self.entries.as_ptr().cast(), len) };
    }
}

/// Checks a ring size: a power of two, at least [`MIN_RING_ENTRIES`], at most `max` entries
/// (KVM's, from the capability).
pub(crate) fn check_entries(entries: u32, max: u32) -> Result<(), RingError> {
    if !entries.is_power_of_two() || entries < MIN_RING_ENTRIES || entries > max {
        return Err(RingError::Size {
            entries,
            min: MIN_RING_ENTRIES,
            max,
        });
    }
    Ok(())
}

/// Why a dirty ring could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// KVM has no dirty ring.
    #[error("this KVM has no dirty ring (KVM_CAP_DIRTY_LOG_RING)")]
    Unsupported,
    /// The size is not one KVM takes.
    #[error("a dirty ring of {entries} entries: it must be a power of two from {min} to {max} (KVM's maximum, 16 bytes an entry)")]
    Size {
        /// Entries asked for.
        entries: u32,
        /// The fewest.
        min: u32,
        /// The most.
        max: u32,
    },
    /// KVM refused to enable it: it must be enabled before any vCPU exists.
    #[error("enabling the dirty ring failed ({0}): it must be enabled before any vCPU is created")]
    Enable(vmm_sys_util::errno::Error),
    /// KVM offered to stop zapping every mapping on a slot change
    /// (`KVM_X86_QUIRK_SLOT_ZAP_ALL`) and then refused to.
    #[error("turning KVM_X86_QUIRK_SLOT_ZAP_ALL off failed ({0})")]
    Quirk(vmm_sys_util::errno::Error),
    /// Mapping a vCPU's ring failed. KVM keeps the vCPU it created until the VM goes (KVM
    /// cannot destroy a vCPU): the id is spent, and creating it again fails with `EEXIST`.
    /// The vCPU never ran, so its ring holds nothing to harvest.
    #[error(
        "mapping vCPU {vcpu}'s dirty ring failed: {source} (KVM keeps the vCPU it created: \
         this VM cannot use id {vcpu} again)"
    )]
    Map {
        /// The vCPU.
        vcpu: u64,
        /// The system's error.
        source: std::io::Error,
    },
    /// Creating the vCPU failed.
    #[error("creating vCPU {vcpu} failed: {source}")]
    Vcpu {
        /// The vCPU.
        vcpu: u64,
        /// KVM's error.
        source: vmm_sys_util::errno::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries KVM keeps free below a ring's size (`KVM_DIRTY_RING_RSVD_ENTRIES`): once a ring
    /// holds `size - RSVD_ENTRIES` entries (its soft limit), KVM asks for a ring-full exit
    /// (`KVM_EXIT_DIRTY_RING_FULL`), but the vCPU goes on pushing until that exit (an instruction
    /// emulator pushing a batch of writes, say): a ring past its soft limit is not an overflow.
    /// Only a ring that wraps (fills and is pushed to again before a reset) loses entries.
    const RSVD_ENTRIES: u32 = 64;

    #[test]
    fn ring_sizes_are_powers_of_two_within_kvm_s_bounds() {
        assert!(check_entries(4096, 65536).is_ok());
        assert!(check_entries(256, 65536).is_ok());
        for bad in [0, 3, 128, 4095, 131072] {
            let e = check_entries(bad, 65536).unwrap_err();
            assert!(
                e.to_string().contains("power of two from 256 to 65536"),
                "{e}"
            );
        }
    }

    /// A ring of `count` entries over an anonymous mapping, standing in for a vCPU file's
    /// ring (unmapped when the ring is dropped), its fetch index at `next`.
    fn anonymous_ring(count: u32, next: u32) -> DirtyRing {
        let len = count as usize * 16;
        // SAFETY: a new private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        DirtyRing {
            entries: NonNull::new(ptr.cast()).unwrap(),
            count,
            next,
            since_reset: 0,
            suspect: false,
        }
    }

    #[test]
    fn entries_are_collected_in_order_and_handed_back() {
        let count = 256u32;
        let mut ring = anonymous_ring(count, count - 2);
        let entries = ring.entries;
        let publish = |i: u32, slot: u32, offset: u64| {
            // SAFETY: `i < count`: inside the mapping, which the ring keeps alive.
            let e = unsafe { entries.as_ptr().add(i as usize) };
            let gfn = kvm_dirty_gfn {
                flags: 0,
                slot,
                offset,
            };
            // SAFETY: `e` is a valid, aligned entry nothing else accesses during the test.
            unsafe { e.write(gfn) };
            // SAFETY: as in `collect`: the entry's first field, accessed atomically.
            unsafe { AtomicU32::from_ptr(e.cast::<u32>()) }.store(DIRTY, Ordering::Release);
        };
        // Three entries that wrap around the end of the ring, then a gap.
        publish(count - 2, 1, 10);
        publish(count - 1, 2, 20);
        publish(0, 1, 11);
        publish(2, 9, 99);
        let mut seen = Vec::new();
        assert_eq!(
            ring.collect(&mut |s, o| seen.push((s, o))),
            RingCollection {
                entries: 3,
                lost: false
            }
        );
        assert_eq!(seen, vec![(1, 10), (2, 20), (1, 11)]);
        let flags = |i: usize| {
            // SAFETY: `i < count`: inside the mapping.
            let e = unsafe { entries.as_ptr().add(i) };
            // SAFETY: a valid entry; the ring no longer touches it.
            unsafe { e.read() }.flags
        };
        assert_eq!(
            (flags(254), flags(255), flags(0), flags(2)),
            (RESET, RESET, RESET, DIRTY)
        );
        // Nothing new until entry 1 is published.
        assert_eq!(
            ring.collect(&mut |_, _| panic!("no entry")),
            RingCollection::default()
        );
    }

    /// KVM's side of a ring, as the kernel keeps it: entries pushed at its write index (with
    /// no room check: an emulator pushing past the soft limit), and a reset that frees entries
    /// from its reset index on while they are handed back.
    struct Kernel {
        entries: NonNull<kvm_dirty_gfn>,
        count: u32,
        dirty_index: u32,
        reset_index: u32,
    }

    impl Kernel {
        fn entry(&self, i: u32) -> *mut kvm_dirty_gfn {
            // SAFETY: the index is reduced modulo `count`: inside the mapping.
            unsafe { self.entries.as_ptr().add((i % self.count) as usize) }
        }

        fn flags(&self, i: u32) -> &AtomicU32 {
            // SAFETY: an entry of the mapping, whose first field is only accessed atomically.
            unsafe { AtomicU32::from_ptr(self.entry(i).cast::<u32>()) }
        }

        fn push(&mut self, offset: u64) {
            let e = self.entry(self.dirty_index);
            // SAFETY: inside the mapping; the collector reads it only once DIRTY is stored.
            unsafe {
                e.write(kvm_dirty_gfn {
                    flags: 0,
                    slot: 1,
                    offset,
                })
            };
            self.flags(self.dirty_index).store(DIRTY, Ordering::Release);
            self.dirty_index = self.dirty_index.wrapping_add(1);
        }

        fn reset(&mut self) {
            while self.reset_index != self.dirty_index
                && self.flags(self.reset_index).load(Ordering::Acquire) & RESET != 0
            {
                self.flags(self.reset_index).store(0, Ordering::Release);
                self.reset_index = self.reset_index.wrapping_add(1);
            }
        }

        /// Whether KVM would stop the vCPU with a ring-full exit.
        fn full(&self) -> bool {
            self.dirty_index.wrapping_sub(self.reset_index) >= self.count - RSVD_ENTRIES
        }
    }

    /// A ring and KVM's side of it, both at index 0.
    fn ring_and_kernel(count: u32) -> (DirtyRing, Kernel) {
        let ring = anonymous_ring(count, 0);
        let kernel = Kernel {
            entries: ring.entries,
            count,
            dirty_index: 0,
            reset_index: 0,
        };
        (ring, kernel)
    }

    /// KVM asks for a ring-full exit at its soft limit (`count - 64` entries) but the vCPU
    /// goes on pushing until its next exit: past the soft limit (as seen on this host at 193
    /// to 231 of 256 entries), but short of the ring's size, nothing was written over and
    /// nothing is lost; the ring stays in step and unsuspected.
    #[test]
    fn entries_past_the_soft_limit_but_within_the_ring_are_not_an_overflow() {
        let count = 256u32;
        for pushed in [count - RSVD_ENTRIES + 1, 231, count - 1] {
            let (mut ring, mut kernel) = ring_and_kernel(count);
            for page in 0..u64::from(pushed) {
                kernel.push(page);
            }
            assert!(kernel.full(), "{pushed}: past the soft limit");
            let mut seen = Vec::new();
            let found = ring.collect(&mut |_, o| seen.push(o));
            assert_eq!(
                found,
                RingCollection {
                    entries: u64::from(pushed),
                    lost: false
                },
                "{pushed} entries"
            );
            assert_eq!(seen, (0..u64::from(pushed)).collect::<Vec<_>>());
            kernel.reset();
            ring.reset_done();
            assert!(!kernel.full(), "{pushed}: the reset freed them all");
            // In step: the next entries are collected as usual, and no overflow is reported.
            seen.clear();
            for page in 0..10 {
                kernel.push(1000 + page);
            }
            let found = ring.collect(&mut |_, o| seen.push(o));
            assert_eq!(
                found,
                RingCollection {
                    entries: 10,
                    lost: false
                },
                "{pushed}"
            );
            assert_eq!(seen, (1000..1010).collect::<Vec<_>>());
            assert!(!ring.suspect, "{pushed}");
            drop(ring);
        }
    }

    /// A ring that wrapped (more entries pushed than it holds, since the last reset) is an
    /// overflow, and stays suspect through collections that find it empty: the vCPU's next
    /// entries, pushed out of step with the collector's index, are still found (and the vCPU
    /// does not exit ring-full for ever).
    #[test]
    fn a_wrapped_ring_stays_suspect_until_its_entries_are_found_again() {
        let count = 256u32;
        let (mut ring, mut kernel) = ring_and_kernel(count);
        for page in 0..300 {
            kernel.push(page);
        }
        let found = ring.collect(&mut |_, _| {});
        assert!(found.lost, "{found:?}");
        kernel.reset();
        ring.reset_done();
        // Nothing pushed yet: nothing found, and nothing proves the ring back in step.
        assert_eq!(ring.collect(&mut |_, _| {}), RingCollection::default());
        kernel.reset();
        let mut seen = Vec::new();
        for page in 0..10 {
            kernel.push(5000 + page);
        }
        let found = ring.collect(&mut |_, o| seen.push(o));
        assert_eq!(seen, (5000..5010).collect::<Vec<_>>());
        assert!(found.lost, "found out of step: {found:?}");
        ring.reset_done();
        kernel.reset();
        assert_eq!(
            kernel.dirty_index, kernel.reset_index,
            "the reset freed every entry"
        );
        drop(ring);
    }

    #[test]
    fn an_overflow_is_reported_and_the_collector_follows_kvm_again() {
        let count = 256u32;
        let mut ring = anonymous_ring(count, 0);
        let entries = ring.entries;
        let mut kernel = Kernel {
            entries,
            count,
            dirty_index: 0,
            reset_index: 0,
        };
        // In step, below the soft limit: nothing lost.
        for page in 0..100 {
            kernel.push(page);
        }
        let found = ring.collect(&mut |_, _| {});
        assert_eq!(
            found,
            RingCollection {
                entries: 100,
                lost: false
            }
        );
        ring.reset_done();
        kernel.reset();
        // 300 writes pushed in one emulated batch into a ring of 256: 44 written over.
        for page in 0..300 {
            kernel.push(1000 + page);
        }
        let found = ring.collect(&mut |_, _| {});
        assert!(found.lost, "{found:?}");
        kernel.reset();
        ring.reset_done();
        // KVM's write index and the collector's now differ; the vCPU's next writes must still
        // be collected (or its ring-full exits would never end).
        let mut seen = Vec::new();
        for page in 0..150 {
            kernel.push(5000 + page);
        }
        let found = ring.collect(&mut |_, o| seen.push(o));
        assert!(found.lost, "found out of step: {found:?}");
        assert_eq!(seen, (5000..5150).collect::<Vec<_>>());
        ring.reset_done();
        kernel.reset();
        assert!(!kernel.full(), "the reset freed them all");
        // In step again: later entries are collected as usual.
        seen.clear();
        for page in 0..10 {
            kernel.push(9000 + page);
        }
        assert_eq!(ring.collect(&mut |_, o| seen.push(o)).entries, 10);
        assert_eq!(seen, (9000..9010).collect::<Vec<_>>());
        kernel.reset();
        ring.reset_done();
        // An empty ring clears the suspicion.
        assert_eq!(ring.collect(&mut |_, _| {}), RingCollection::default());
        assert!(!ring.suspect);
        // `ring` unmaps the mapping when dropped, after the last use of `kernel`.
        drop(ring);
    }
}
