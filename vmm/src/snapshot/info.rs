//! What a snapshot is, whatever the guest kind: its kind, id, parent, place in its chain, the
//! VM it belongs to, and a cheap check of the memory file of its point ([`MemoryCheck`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvm_memslots_persist::MemoryLayout;
use serde::{Deserialize, Serialize};

use crate::host;

/// How much of the start of the memory file a state file checks ([`MemoryCheck`]): for the test
/// guest its system region (page tables, code, command blocks), for Linux its low memory.
pub(crate) const MEMORY_HEAD: u64 = 2 << 20;

/// A snapshot's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum SnapshotKind {
    /// Its memory file has every page that holds data.
    Full,
    /// Its memory file has the pages changed since its parent: it restores merged onto its
    /// chain (`tinyvmm snapshot-merge`).
    Diff,
}

/// A snapshot's id: 128 random bits, written as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct SnapshotId(pub u128);

impl SnapshotId {
    /// A new random id (from the kernel's `getrandom`).
    pub(crate) fn random() -> std::io::Result<Self> {
        let mut bytes = [0u8; 16];
        host::fill_random(&mut bytes)?;
        Ok(SnapshotId(u128::from_le_bytes(bytes)))
    }
}

impl std::fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl From<SnapshotId> for String {
    fn from(id: SnapshotId) -> String {
        id.to_string()
    }
}

impl TryFrom<String> for SnapshotId {
    type Error = String;

    fn try_from(hex: String) -> Result<Self, String> {
        if hex.len() != 32 {
            return Err(format!("snapshot id {hex:?} is not 32 hex digits"));
        }
        u128::from_str_radix(&hex, 16)
            .map(SnapshotId)
            .map_err(|e| format!("snapshot id {hex:?}: {e}"))
    }
}

/// What snapshot a state file is, and what its memory file must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotInfo {
    /// Full or Diff.
    pub(crate) kind: SnapshotKind,
    /// This snapshot's id.
    pub id: SnapshotId,
    /// The snapshot before it in its chain (none for a Full).
    pub(crate) parent: Option<SnapshotId>,
    /// Its place in its chain: 0 for the Full, then 1, 2... for each Diff.
    pub(crate) position: u32,
    /// The VM's identity: its chain's Full snapshot's id.
    pub(crate) vm: SnapshotId,
    /// The memory at this snapshot's point (a Diff's: its chain merged up to it).
    pub(crate) memory: MemoryCheck,
}

impl SnapshotInfo {
    /// A Full snapshot of memory that `memory` describes: the first of a new chain.
    pub fn full(memory: MemoryCheck) -> std::io::Result<Self> {
        let id = SnapshotId::random()?;
        Ok(SnapshotInfo {
            kind: SnapshotKind::Full,
            id,
            parent: None,
            position: 0,
            vm: id,
            memory,
        })
    }

    /// The Diff snapshot that follows this one.
    pub fn next_diff(&self, memory: MemoryCheck) -> std::io::Result<Self> {
        Ok(SnapshotInfo {
            kind: SnapshotKind::Diff,
            id: SnapshotId::random()?,
            parent: Some(self.id),
            position: self.position.saturating_add(1),
            vm: self.vm,
            memory,
        })
    }

    /// Checks that the fields agree: a Full is its own chain's first, without a parent; a
    /// Diff comes later, after another snapshot of its VM; the memory is the layout's.
    pub(crate) fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
        let consistent = match self.kind {
            SnapshotKind::Full => self.parent.is_none() && self.position == 0 && self.vm == self.id,
            SnapshotKind::Diff => {
                self.position > 0 && self.parent.is_some_and(|p| p != self.id) && self.vm != self.id
            }
        };
        if !consistent {
            return Err(format!(
                "a {:?} snapshot at position {} with parent {} in the chain of {} contradicts itself",
                self.kind,
                self.position,
                self.parent.map_or("none".into(), |p| p.to_string()),
                self.vm
            ));
        }
        let expected = MemoryCheck::expected_head(layout);
        if self.memory.size != layout.memory_file_size() || self.memory.head != expected {
            return Err(format!(
                "its memory check ({} bytes, the first {} checked) does not fit its layout ({} \
                 bytes, the first {expected} checked)",
                self.memory.size,
                self.memory.head,
                layout.memory_file_size()
            ));
        }
        Ok(())
    }

    /// Why `self` (from `path`) cannot follow `before` (from `before_path`) in a chain, if it
    /// cannot: it is of another VM, or it is not `before`'s child (a link missing between them,
    /// or out of order).
    pub(crate) fn check_follows(
        &self,
        path: &Path,
        before: &SnapshotInfo,
        before_path: &Path,
    ) -> Result<(), String> {
        let (this, that) = (path.display(), before_path.display());
        if self.vm != before.vm {
            return Err(format!(
                "{this} is of another VM (the chain of Full {}) than {that} (the chain of Full {})",
                self.vm, before.vm
            ));
        }
        if self.parent != Some(before.id) || self.position != before.position.saturating_add(1) {
            return Err(format!(
                "{this} does not follow {that}: it is snapshot {} of its chain, after {}, but \
                 {that} is snapshot {} ({}): a link is missing or out of order",
                self.position,
                self.parent.map_or("none".into(), |p| p.to_string()),
                before.position,
                before.id
            ));
        }
        Ok(())
    }
}

/// What the memory file of a snapshot's point must be, checked cheaply before a restore and
/// after a merge: its size and the CRC-32 of its first bytes (the test guest's system region).
/// A Diff's own memory file fails it (it has holes where the guest's code is), and so does the
/// memory of another VM or another point, where their first bytes differ (the command blocks
/// count every command).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryCheck {
    /// The memory file's size (the layout's).
    pub(crate) size: u64,
    /// How many of its first bytes are checked: [`MEMORY_HEAD`], or all of a smaller file.
    pub(crate) head: u64,
    /// Their CRC-32.
    pub(crate) head_crc32: u32,
}

/// Why a memory file is not the one a state file wants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MemoryMismatch {
    /// Another size.
    #[error("it has {found} bytes; the snapshot's memory has {expected}")]
    Size {
        /// The file's.
        found: u64,
        /// The snapshot's.
        expected: u64,
    },
    /// Other first bytes.
    #[error(
        "its first {head} bytes differ from the snapshot's memory (CRC-32 {found:#010x}, not \
         {expected:#010x})"
    )]
    Head {
        /// How many bytes were compared.
        head: u64,
        /// The file's CRC-32.
        found: u32,
        /// The snapshot's.
        expected: u32,
    },
    /// The file could not be read.
    #[error("reading it failed: {0}")]
    Io(String),
}

impl MemoryCheck {
    /// How many bytes of a memory file of `layout` are checked.
    fn expected_head(layout: &MemoryLayout) -> u64 {
        layout.memory_file_size().min(MEMORY_HEAD)
    }

    /// The check of the memory file `layout` gives `memory` (paused): the bytes at the start
    /// of the file are those of the layout's first regions, read from guest memory.
    pub fn of_memory(
        memory: &impl vm_memory::GuestMemory,
        layout: &MemoryLayout,
    ) -> Result<Self, vm_memory::GuestMemoryError> {
        Ok(Self::of_head(&Self::read_head(memory, layout)?, layout))
    }

    /// The bytes a check of `layout`'s memory file covers, read from guest memory (paused):
    /// the start of the file, which is the layout's first regions. For a caller that copies
    /// them in a pause and hashes them later ([`of_head`](Self::of_head)).
    pub(super) fn read_head(
        memory: &impl vm_memory::GuestMemory,
        layout: &MemoryLayout,
    ) -> Result<Vec<u8>, vm_memory::GuestMemoryError> {
        use vm_memory::{Bytes, GuestAddress};
        let mut bytes = vec![0u8; Self::expected_head(layout) as usize];
        let mut at = 0usize;
        for region in &layout.regions {
            if at == bytes.len() {
                break;
            }
            let n = (region.size as usize).min(bytes.len() - at);
            memory.read_slice(&mut bytes[at..at + n], GuestAddress(region.gpa))?;
            at += n;
        }
        Ok(bytes)
    }

    /// The check of `layout`'s memory file whose first bytes are `head`, as
    /// [`read_head`](Self::read_head) read them from guest memory.
    pub(super) fn of_head(head: &[u8], layout: &MemoryLayout) -> Self {
        MemoryCheck {
            size: layout.memory_file_size(),
            head: head.len() as u64,
            head_crc32: crc32fast::hash(head),
        }
    }

    /// Whether `file` has this memory file's size (a Diff's own file has it too).
    pub(crate) fn check_size(&self, file: &File) -> Result<(), MemoryMismatch> {
        let found = file
            .metadata()
            .map_err(|e| MemoryMismatch::Io(e.to_string()))?
            .len();
        if found != self.size {
            return Err(MemoryMismatch::Size {
                found,
                expected: self.size,
            });
        }
        Ok(())
    }

    /// Whether `file` is this memory file: its size, and its first bytes' CRC-32.
    pub(crate) fn check(&self, file: &File) -> Result<(), MemoryMismatch> {
        let io = |e: std::io::Error| MemoryMismatch::Io(e.to_string());
        self.check_size(file)?;
        let mut bytes = vec![0u8; self.head.min(MEMORY_HEAD) as usize];
        file.read_exact_at(&mut bytes, 0).map_err(io)?;
        let crc = crc32fast::hash(&bytes);
        if crc != self.head_crc32 {
            return Err(MemoryMismatch::Head {
                head: self.head,
                found: crc,
                expected: self.head_crc32,
            });
        }
        Ok(())
    }
}
