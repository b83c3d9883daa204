//! Snapshots of any guest kind: what a snapshot is ([`info`]), how its state file is read
//! ([`file`](mod@file)), and the chain of Full and Diff snapshots a controller takes on a paused VM
//! ([`chain`]), live ones included ([`live`]), and the pages the chain owes its next Diff
//! ([`pages`]). The guest kind supplies only what its state
//! file holds besides.

pub mod chain;
pub mod file;
pub mod info;
pub mod live;
pub mod pages;
pub mod saved;

pub use chain::SnapshotChain;
pub use file::{open_input, GuestKind, StateFileError};
pub use info::{MemoryCheck, MemoryMismatch, SnapshotId, SnapshotInfo, SnapshotKind};
