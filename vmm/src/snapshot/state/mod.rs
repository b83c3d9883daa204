//! The one saved state of a VM, whatever its guest kind, as a snapshot's state file and a
//! migration's State record hold it ([`SavedState`]): the format version, the guest kind, what
//! snapshot it is (a State record is none), the memory layout, every vCPU, the VM's irqchip,
//! PIT and clock (a Linux guest's; the test guest has none), whether a client had paused it,
//! and the kind's own part ([`GuestPart`]: the test guest's hotplug area, or a Linux guest's
//! machine and devices, each device with its own state type). It is framed, versioned and
//! checked here once (a magic, the format version, the JSON and its CRC-32:
//! kvm-memslots-persist's `frame`); the kind adds only the checks of its own part.
//!
//! The formats older builds wrote, one per kind and use, keep being read: they are turned into
//! this one as they are read (`older.rs`). A file is opened without blocking and its header
//! checked before it is read (`file`), and read once (`StateFile`): its guest
//! kind is told from the bytes read, which are then read as that kind's state.

pub(crate) mod file;
mod older;

use std::path::Path;

use kvm_memslots_persist::{frame, unframe_versions, MemoryLayout};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use self::file::{check_register_blocks, read_framed, StateFileError};
use self::older::Older;
use super::info::SnapshotInfo;
use crate::vm::state::{VcpuState, VmState};

/// The magic of a saved state, of either guest kind.
pub const STATE_MAGIC: &[u8; 8] = b"TVMSTATE";

/// The format version this build writes: 4, the first with one envelope for both guest kinds
/// (the test guest's state files were versions 2 and 3 under `TVMSNAP`, its State records 2
/// and 3 under `TVMMIGR`, a Linux guest's both version 1 under `TVMLINUX`; all still read).
pub const STATE_VERSION: u32 = 4;

/// Which guest a saved state is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestKind {
    /// The built-in test guest (`tinyvmm serve`).
    TestGuest,
    /// A Linux guest (`tinyvmm boot`).
    Linux,
}

impl std::fmt::Display for GuestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GuestKind::TestGuest => "a test guest's",
            GuestKind::Linux => "a Linux guest's",
        })
    }
}

impl GuestKind {
    /// The kind of a saved state's framed bytes (a State record's, say): an older format's
    /// magic says it, this format's JSON does.
    pub(crate) fn of_bytes(bytes: &[u8]) -> Result<GuestKind, StateFileError> {
        if let Some(older) = Older::of(bytes) {
            return Ok(older.kind);
        }
        /// The one field read to tell the kind.
        #[derive(Deserialize)]
        struct Kind {
            kind: GuestKind,
        }
        let (_, json) = unframe_versions(STATE_MAGIC, STATE_VERSION..=STATE_VERSION, bytes)
            .map_err(StateFileError)?;
        serde_json::from_slice::<Kind>(json)
            .map(|k| k.kind)
            .map_err(|e| StateFileError(format!("its guest kind: {e}")))
    }
}

/// A state file read whole, once, its header checked first ([`read_framed`]): its guest kind
/// is told from these bytes ([`kind`](Self::kind)) and its state read from them as that
/// kind's ([`state`](Self::state)), so that a restore reads the file once whatever its kind.
#[derive(Debug, Clone)]
pub(crate) struct StateFile {
    bytes: Vec<u8>,
}

impl StateFile {
    /// Reads the state file at `path` ([`read_framed`], in this format or an older one). The
    /// error does not name the path: the caller does.
    pub(crate) fn read(path: &Path) -> Result<StateFile, StateFileError> {
        read_framed(path, format_of).map(|bytes| StateFile { bytes })
    }

    /// Its guest kind ([`GuestKind::of_bytes`]); an error says what the file is instead.
    pub(crate) fn kind(&self) -> Result<GuestKind, StateFileError> {
        GuestKind::of_bytes(&self.bytes)
    }

    /// Its state, read and checked as [`SavedState::from_bytes`] does, and it must say what
    /// snapshot it is. The error does not name the path: the caller does.
    pub(crate) fn state<G: GuestPart>(&self) -> Result<SavedState<G>, StateFileError> {
        let state = SavedState::<G>::from_bytes(&self.bytes)?;
        match state.snapshot {
            Some(_) => Ok(state),
            None => Err(StateFileError("it does not say what snapshot it is".into())),
        }
    }
}

/// A guest kind's own part of its saved state.
pub trait GuestPart: Serialize + DeserializeOwned {
    /// The kind whose part it is.
    const KIND: GuestKind;

    /// The kind's checks of its part, and of the vCPUs and VM state, against the rest of
    /// `state` (its layout is valid by then).
    fn validate(state: &SavedState<Self>) -> Result<(), String>;
}

/// What a VM saves besides memory: the one envelope both guest kinds' state files and State
/// records are.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedState<G> {
    /// [`STATE_VERSION`] (a state read from an older format is turned into this one).
    pub(crate) version: u32,
    /// The guest kind, whose part [`guest`](Self::guest) is.
    pub(crate) kind: GuestKind,
    /// What snapshot this is: every state file says; a migration's State record, which is not
    /// a snapshot, has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotInfo>,
    /// The memory layout.
    pub layout: MemoryLayout,
    /// Every vCPU's state, by index.
    pub vcpus: Vec<VcpuState>,
    /// The irqchip, PIT and clock, where the VM has them (a Linux guest's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) vm: Option<VmState>,
    /// Whether a client had paused the VM (a migration's destination keeps it paused; a
    /// restore is paused anyway).
    #[serde(default)]
    pub(crate) paused: bool,
    /// The guest kind's own part.
    pub(crate) guest: G,
}

impl<G: GuestPart> SavedState<G> {
    /// A state of this build's format that is no snapshot (yet): a State record's, or a
    /// state file's before it says what snapshot it is.
    pub fn new(
        layout: MemoryLayout,
        vcpus: Vec<VcpuState>,
        vm: Option<VmState>,
        paused: bool,
        guest: G,
    ) -> Self {
        SavedState {
            version: STATE_VERSION,
            kind: G::KIND,
            snapshot: None,
            layout,
            vcpus,
            vm,
            paused,
            guest,
        }
    }

    /// The framed bytes (kvm-memslots-persist's `frame`: magic, version, length, JSON,
    /// CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a saved state serialises");
        frame(STATE_MAGIC, self.version, &json)
    }

    /// Reads a saved state's framed bytes (a state file's or a State record's, of this format
    /// or an older one this build reads), naming what is wrong with bad ones: the frame's
    /// checks, another guest kind's state, register blocks of other than their exact sizes,
    /// the JSON, the header's version against the state's, and
    /// `validate`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateFileError> {
        let bad = |why: String| StateFileError(why);
        let json = match Older::of(bytes) {
            Some(older) => older.read(bytes).map_err(bad)?,
            None => {
                let (version, json) =
                    unframe_versions(STATE_MAGIC, versions(), bytes).map_err(bad)?;
                let json: Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
                match json.get("version").and_then(Value::as_u64) {
                    Some(body) if body != u64::from(version) => {
                        return Err(bad(format!(
                            "the header's version is {version}, the state's {body}"
                        )))
                    }
                    _ => json,
                }
            }
        };
        let kind = json
            .get("kind")
            .and_then(|kind| serde_json::from_value::<GuestKind>(kind.clone()).ok());
        if let Some(kind) = kind.filter(|kind| *kind != G::KIND) {
            return Err(bad(format!(
                "it is {kind} state, not {} (restore it as such)",
                G::KIND
            )));
        }
        check_register_blocks(&json["vcpus"]).map_err(bad)?;
        let state: Self = serde_json::from_value(json).map_err(|e| bad(e.to_string()))?;
        state.validate()?;
        Ok(state)
    }

    /// Reads and checks the state file at `path`, its header first (`read_framed`), as
    /// [`from_bytes`](Self::from_bytes) does, and it must say what snapshot it is
    /// (`StateFile::state`). The error does not name the path: the caller does.
    pub fn read_file(path: &Path) -> Result<Self, StateFileError> {
        StateFile::read(path)?.state()
    }

    /// The checks [`from_bytes`](Self::from_bytes) makes after parsing, against the state
    /// itself before anything is built: this format's version, this kind's state, a layout
    /// that passes [`MemoryLayout::validate`], a snapshot identity that agrees with it, and
    /// the kind's own checks ([`GuestPart::validate`]).
    fn validate(&self) -> Result<(), StateFileError> {
        let bad = |why: String| StateFileError(why);
        if self.version != STATE_VERSION {
            return Err(bad(format!(
                "state version {}; this build reads version {STATE_VERSION} (and older \
                 formats it turns into it)",
                self.version
            )));
        }
        if self.kind != G::KIND {
            return Err(bad(format!("it is {} state, not {}", self.kind, G::KIND)));
        }
        // The layout's own checks (version, alignment, order, overlaps, file offsets).
        self.layout.validate().map_err(|e| bad(e.to_string()))?;
        G::validate(self).map_err(bad)?;
        if let Some(info) = &self.snapshot {
            info.validate(&self.layout).map_err(bad)?;
        }
        Ok(())
    }
}

/// The versions of this format this build reads.
fn versions() -> std::ops::RangeInclusive<u32> {
    STATE_VERSION..=STATE_VERSION
}

/// The format a frame's `header` is in, by its magic: an older one this build reads, or this
/// one (whose magic the frame's check then looks for, naming it).
fn format_of(header: &[u8]) -> (&'static [u8; 8], std::ops::RangeInclusive<u32>) {
    match Older::of(header) {
        Some(older) => (older.magic, older.versions.clone()),
        None => (STATE_MAGIC, versions()),
    }
}

/// The bytes of `name` in `vmm/tests/data`: saved states of older formats, which each guest
/// kind's tests read.
#[cfg(test)]
pub(crate) fn test_data(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
