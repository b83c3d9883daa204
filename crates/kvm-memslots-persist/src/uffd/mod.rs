//! Lazy restore with userfaultfd: a snapshot's regions are fresh anonymous memory registered
//! for missing-page faults, and a handler thread fills each page the first time anything
//! touches it (a vCPU through KVM, or the VMM), from the memory file (`UFFDIO_COPY`) or, for a
//! hole, with zeros (`UFFDIO_ZEROPAGE`). Nothing is read up front, not even where the holes
//! are: a first fill asks the file with one `SEEK_DATA` (a scan of a memory file with 65536
//! runs of data took about 95 ms, all of it before the guest's first instruction). A file cut
//! under the loader fails it (the page is past the file's end), it is not taken for a hole.
//!
//! A discarded page reads zeros afterwards, as a discard promises, whether the handler had
//! filled it or not: the loader asks for `UFFD_FEATURE_EVENT_REMOVE`, so a discard of
//! registered memory (`MADV_DONTNEED`, `MADV_REMOVE`) first tells the handler its range, which
//! the handler then treats as filled (and a page filled once that faults again is one that was
//! discarded since). The discard waits until the handler has read the event, and the handler
//! serves events in order, so no fault after the discard is served before it. libc has only
//! the system call's number, so the ioctl structures are declared in `sys` from the kernel's
//! `include/uapi/linux/userfaultfd.h` (`docs/decisions/uffd-interface.md` says why not the
//! `userfaultfd` crate).
//!
//! The parts: `sys` (the kernel's interface: the userfaultfd, its ioctls and messages),
//! `region` (one registered region and the units it filled), `loader` ([`LazyLoader`]: the
//! regions registered, the handler started, and both ended when dropped), `handler` (the
//! thread that serves faults and discards and prefetches), `owed` (what the live loaders of
//! this process still owe, for snapshots), `recording` ([`Recording`]) and `stats`
//! ([`LoaderStats`]).
//!
//! **Snapshots of a lazy restore.** A page the handler has not filled yet has no page table
//! entry, so `/proc/self/pagemap` says nothing of it, yet the VM reads the file's data there.
//! While a loader lives, its regions and what it has filled are listed for this process's
//! snapshots and migrations: [`data_runs`](crate::data_runs) (and so a full memory file and a
//! stream's first round) adds the pages the loader still owes that are data in the file, and
//! reading them through the mapping fills them; a memfd handed over
//! ([`shared_files`](crate::stream::shared_files)) is filled first. A page is marked filled
//! only once its fill is done, so one being filled counts as owed.
//!
//! **Page sizes.** A fault fills a *block* around the faulting address, and the loader marks
//! what it filled in *units*:
//! - 4 KiB pages: one page, one `UFFDIO_COPY` (or `UFFDIO_ZEROPAGE` for a hole) a fault.
//! - 2 MiB hugetlb pages: the whole huge page. The kernel fills and discards a hugetlb mapping
//!   only in whole pages (`UFFDIO_COPY` of a huge-page-aligned, huge-page-sized range; no
//!   `UFFDIO_ZEROPAGE`), so the block and the unit are the 2 MiB page: one `pread` of its 2 MiB
//!   of the memory file (holes read as zeros; the region's place in the file need not be on
//!   the 2 MiB grid), one copy. A page that is all hole, or discarded since its fill, is a
//!   copy from a buffer of zeros. A 512 MiB guest touched whole costs 256 copies instead of
//!   131,072.
//! - Transparent huge pages: the 2 MiB block of host addresses around the fault (clipped to
//!   the region), in runs of its 4 KiB pages not filled yet, marked at 4 KiB. Filled at 2 MiB
//!   rather than 4 KiB because a guest that touches one page of a block will touch others (a
//!   THP region is asked for to be backed 2 MiB at a time), so 512 faults become one; and
//!   because khugepaged does not collapse a range of a userfaultfd-registered mapping that has
//!   a page missing or mapping the zero page, so filled 4 KiB at a time the region would stay
//!   in 4 KiB pages. A block with any data is read whole and copied (its holes as real zero
//!   pages); a block all hole maps the zero page. Marks stay at 4 KiB because a THP region
//!   may discard single 4 KiB pages.
//!
//! Whatever the page size, the working set and the stats ([`LoaderStats`]) count 4 KiB pages
//! of the memory file: a recorded first touch in a 2 MiB hugetlb page (or a THP block) is the
//! block's pages not filled before, and a prefetch of a list that names any 4 KiB page of a
//! hugetlb page fills the whole page.
//!
//! **Regions removed** from the manager while the loader lives are unmapped as without it: the
//! loader does not hold their mappings, the kernel ends a registration with its mapping, and
//! the loader forgets a region whose mapping is gone (its pages are owed no more, and are not
//! prefetched).
//!
//! **Working sets** ([`LazyOptions`]): the handler sees every first touch, so it can record the
//! pages in that order ([`Recording`]) until told to stop, for a set time, or until the loader
//! ends, and hand the list ([`WorkingSet`](crate::WorkingSet)) over. Given such a list, it fills
//! those pages ahead of the guest, in the list's order, a window of up to 256 pages at a time (one
//! block where that is larger: a 2 MiB page) (one `pread` of the window, one `UFFDIO_COPY` per run
//! of units in it, 64 copies at most), and looks for faults between windows: a fault is served
//! first, so a page the guest needs before the prefetch reaches it waits for one window at most (64
//! copies, or one 2 MiB copy). Prefetching in the handler's own thread keeps a discard exact: the
//! handler marks a discarded range as soon as it reads the event, before it fills anything else,
//! and skips marked pages; a copy the kernel refuses while a discard is under way (`EAGAIN`) is
//! tried again after the handler has read it. A page filled twice (a fault on a page the prefetch
//! filled meanwhile, `EEXIST`) keeps its first fill, and the faulting thread is woken.
//!
//! # Example
//!
//! A snapshot restored lazily: nothing is read until the first touch (here the VMM's own read;
//! a vCPU's access through KVM faults the same way). Needs userfaultfd (Linux 4.3+, and root or
//! `vm.unprivileged_userfaultfd`).
//!
//! ```
//! use kvm_memslots::testing::FakeKvm;
//! use kvm_memslots::{MemoryManager, RegionSpec};
//! use kvm_memslots_persist::{write_memory_file, LazyLoader, MemoryLayout};
//! use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
//!
//! let vm = MemoryManager::new(FakeKvm::new(64, true));
//! vm.add_region(RegionSpec::new(GuestAddress(0), 2 << 20))?;
//! vm.handle().memory().write_obj(7u64, GuestAddress(0x1000))?;
//! let layout = MemoryLayout::of(&vm);
//! # let path = std::env::temp_dir().join(format!("kvm-memslots-persist-uffd-doc-{}", std::process::id()));
//! # let memory_file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
//! # std::fs::remove_file(&path)?;
//! write_memory_file(&vm, &layout, &memory_file)?;
//!
//! let restored = MemoryManager::new(FakeKvm::new(64, true));
//! layout.build(&restored)?;
//! let loader = LazyLoader::start(&restored, &layout, &memory_file)?;
//! assert_eq!(restored.handle().memory().read_obj::<u64>(GuestAddress(0x1000))?, 7);
//! drop(loader);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod handler;
mod loader;
mod owed;
mod recording;
mod region;
mod stats;
mod sys;

pub use loader::{LazyLoader, LazyOptions};
pub(crate) use owed::{fill_owed, owed_runs};
pub use recording::Recording;
pub use stats::LoaderStats;
