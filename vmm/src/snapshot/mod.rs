//! Snapshots of any guest kind: what a snapshot is (`info`), the one saved state a state
//! file (and a migration's State record) holds, read, framed, versioned and checked once
//! ([`state`], older builds' formats included), the chain of Full and Diff snapshots a
//! controller takes on a paused VM (`chain`), live ones included (`live`), and the pages
//! the chain owes its next Diff (`pages`). The guest kind supplies only its own part of the
//! saved state.

mod chain;
pub(crate) mod info;
pub(crate) mod live;
mod pages;
pub mod state;

pub(crate) use chain::SnapshotChain;
pub(crate) use info::SnapshotInfo;
pub(crate) use state::file::StateFileError;
pub(crate) use state::{GuestKind, StateFile};
