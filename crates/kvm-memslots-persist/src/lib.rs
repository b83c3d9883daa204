//! Persistence for [`kvm_memslots`] guest memory: what a VMM saves, restores and migrates.
//!
//! - [`layout`]: a manager's [`MemoryLayout`] (every region with its slot size, flags, backing
//!   and place in the memory file), checked with [`MemoryLayout::validate`], written and read as
//!   a checksummed layout file, and built into a fresh manager.
//! - [`frame`]/[`unframe`]: the checksummed frame (magic, version, length, payload, CRC-32) of
//!   the layout file, for a VMM's own state files too; [`framed_len`] checks a header before
//!   a reader reads a file whole.
//! - [`memory_file`]: sparse memory files, full or of a harvest's pages; merging diffs;
//!   loading; full and merged files on hugetlbfs too, as templates that file-backed restores
//!   map in 2 MiB pages.
//! - [`stream`]: guest memory between two VMM processes as checksummed records, the reusable
//!   part of a live migration.
//! - [`uffd`]: a lazy restore whose pages a userfaultfd handler fills on first touch, which
//!   can record the pages first touched and fetch a recorded list ahead of the guest.
//! - [`working_set`]: that list ([`WorkingSet`]), as a checksummed file that names its snapshot.
//!
//! The crate uses only `kvm-memslots`' public API; the manager crate does not depend on it.

#![doc = include_str!("../README.md")]

mod error;
mod frame;
mod hugetlbfs;
pub mod layout;
pub mod memory_file;
mod sparse;
pub mod stream;
pub mod uffd;
pub mod working_set;

pub use error::SnapshotError;
pub use frame::{frame, framed_len, framed_len_versions, unframe, unframe_versions, FRAME_HEADER};
pub use layout::{LayoutBacking, LayoutPageSize, MemoryLayout, RegionLayout, LAYOUT_VERSION};
pub use memory_file::{
    check_diff_file, data_runs, load_memory_file, merge_memory_files, merge_snapshots,
    write_dirty_pages, write_dirty_pages_sliced, write_memory_file, write_memory_file_sliced,
    Slices, WriteStats,
};
pub use uffd::{LazyLoader, LazyOptions, LoaderStats, Recording};
pub use working_set::{WorkingSet, WORKING_SET_VERSION};
