//! The saved-state formats of older builds, one per guest kind and use, read and turned into
//! this build's envelope as they are read: the test guest's state file (`TVMSNAP`, versions 2
//! and 3: what snapshot, layout, vCPUs, hotplug area), its migration State record (`TVMMIGR`,
//! versions 2 and 3: that state without a snapshot, and whether a client had paused the VM)
//! and a Linux guest's state file and State record (`TVMLINUX`, version 1: what snapshot,
//! layout, vCPUs, VM state, devices, machine, paused). Their shared fields are the envelope's;
//! what is left is the kind's own part, which its type then parses (refusing a field it does
//! not know, as the older reader did).
//!
//! A version 2 test guest file may slot a partly plugged hotplug piece whole; the restore
//! cuts its slot to its plugged blocks whatever the version, so nothing else of it is kept.

use std::ops::RangeInclusive;

use serde_json::{Map, Value};

use super::{GuestKind, STATE_VERSION};
use kvm_memslots_persist::unframe_versions;

/// An older build's format.
#[derive(Debug)]
pub(super) struct Older {
    /// Its frame's magic.
    pub(crate) magic: &'static [u8; 8],
    /// The versions of it this build reads.
    pub(crate) versions: RangeInclusive<u32>,
    /// The guest kind it is of.
    pub(crate) kind: GuestKind,
    /// A test guest's State record: the state under `snapshot`, beside `paused`.
    nested: bool,
}

/// Every older format this build reads.
const OLDER: [Older; 3] = [
    Older {
        magic: b"TVMSNAP\0",
        versions: 2..=3,
        kind: GuestKind::TestGuest,
        nested: false,
    },
    Older {
        magic: b"TVMMIGR\0",
        versions: 2..=3,
        kind: GuestKind::TestGuest,
        nested: true,
    },
    Older {
        magic: b"TVMLINUX",
        versions: 1..=1,
        kind: GuestKind::Linux,
        nested: false,
    },
];

/// The envelope's fields besides its version, kind and the kind's part, as older formats
/// name them.
const SHARED: [&str; 5] = ["snapshot", "layout", "vcpus", "vm", "paused"];

impl Older {
    /// The older format whose magic `bytes` start with, if any.
    pub(super) fn of(bytes: &[u8]) -> Option<&'static Older> {
        OLDER
            .iter()
            .find(|older| bytes.get(..8) == Some(older.magic.as_slice()))
    }

    /// `bytes` (framed in this format) unframed and their JSON turned into this build's
    /// envelope, its version [`STATE_VERSION`]; or why not.
    pub(super) fn read(&self, bytes: &[u8]) -> Result<Value, String> {
        let (version, json) = unframe_versions(self.magic, self.versions.clone(), bytes)?;
        let json: Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
        self.convert(version, json)
    }

    fn convert(&self, version: u32, json: Value) -> Result<Value, String> {
        let Value::Object(mut fields) = json else {
            return Err("its JSON is not an object".into());
        };
        if self.nested {
            let paused = fields.remove("paused").unwrap_or(Value::Bool(false));
            let Some(Value::Object(state)) = fields.remove("snapshot") else {
                return Err("the State record has no `snapshot` (the state) object".into());
            };
            if let Some(unknown) = fields.keys().next() {
                return Err(format!("unknown field `{unknown}` in the State record"));
            }
            fields = state;
            fields.insert("paused".into(), paused);
        }
        let body = fields.remove("version").and_then(|v| v.as_u64());
        match body {
            // A State record's state may be of any version read: its header is the record's.
            Some(body) if self.nested && !self.versions.contains(&(body as u32)) => {
                return Err(format!(
                    "state version {body}; this build reads versions {} to {}",
                    self.versions.start(),
                    self.versions.end()
                ))
            }
            Some(body) if !self.nested && body != u64::from(version) => {
                return Err(format!(
                    "the header's version is {version}, the state's {body}"
                ))
            }
            Some(_) => {}
            None => return Err("missing field `version`".into()),
        }
        let mut envelope = Map::new();
        envelope.insert("version".into(), STATE_VERSION.into());
        envelope.insert(
            "kind".into(),
            serde_json::to_value(self.kind).expect("a kind serialises"),
        );
        for name in SHARED {
            if let Some(value) = fields.remove(name) {
                envelope.insert(name.into(), value);
            }
        }
        envelope.insert("guest".into(), Value::Object(fields));
        Ok(Value::Object(envelope))
    }
}
