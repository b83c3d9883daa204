//! The frame every guest kind's saved state is in, written, versioned and checked once: a
//! magic, the format version, the JSON and its CRC-32 (kvm-memslots-persist's `frame`). Each
//! kind keeps its own state type ([`SavedState`]: the test guest's `SnapshotState`, a Linux
//! guest's `LinuxState`) and its own checks; reading one here unframes it, refuses register
//! blocks of the wrong size, parses it, holds the header's version to the state's and runs the
//! kind's checks, and a state file must say what snapshot it is.

use std::ops::RangeInclusive;
use std::path::Path;

use kvm_memslots_persist::{frame, unframe_versions};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::file::{check_register_blocks, read_framed, StateFileError};
use super::info::SnapshotInfo;

/// A guest kind's saved state, as its state file (and a Linux guest's migration State record)
/// frames it.
pub trait SavedState: Serialize + DeserializeOwned {
    /// The frame's magic.
    const MAGIC: &'static [u8; 8];
    /// The format versions this build reads; it writes the newest.
    const VERSIONS: RangeInclusive<u32>;

    /// The state's own version (as its JSON says).
    fn version(&self) -> u32;

    /// What snapshot it is (none in a migration's State record).
    fn snapshot(&self) -> Option<&SnapshotInfo>;

    /// The kind's checks of the state against itself, before anything is built from it.
    fn validate(&self) -> Result<(), StateFileError>;
}

/// `state`'s framed bytes, with its own version in the header.
pub fn to_bytes<S: SavedState>(state: &S) -> Vec<u8> {
    let json = serde_json::to_vec(state).expect("a saved state serialises");
    frame(S::MAGIC, state.version(), &json)
}

/// Reads framed bytes, naming what is wrong with bad ones: the frame's checks, register blocks
/// of their exact sizes, the JSON, the header's version against the state's, and the kind's
/// [`validate`](SavedState::validate).
pub fn from_bytes<S: SavedState>(bytes: &[u8]) -> Result<S, StateFileError> {
    let bad = |why: String| StateFileError(why);
    let (version, json) = unframe_versions(S::MAGIC, S::VERSIONS, bytes).map_err(bad)?;
    let json: Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    check_register_blocks(&json["vcpus"]).map_err(bad)?;
    let state: S = serde_json::from_value(json).map_err(|e| bad(e.to_string()))?;
    if state.version() != version {
        return Err(bad(format!(
            "the header's version is {version}, the state's {}",
            state.version()
        )));
    }
    state.validate()?;
    Ok(state)
}

/// `state` if it says what snapshot it is, as every state file does.
pub fn of_a_snapshot<S: SavedState>(state: S) -> Result<S, StateFileError> {
    match state.snapshot() {
        Some(_) => Ok(state),
        None => Err(StateFileError("it does not say what snapshot it is".into())),
    }
}

/// Reads and checks the state file at `path`, its header first ([`read_framed`]), as
/// [`from_bytes`] does, and it must say what snapshot it is. The error does not name the
/// path: the caller does.
pub fn read_file<S: SavedState>(path: &Path) -> Result<S, StateFileError> {
    of_a_snapshot(from_bytes(&read_framed(path, S::MAGIC, S::VERSIONS)?)?)
}
