//! A test-guest VM's snapshot state file: what snapshot it is (kind, id, parent, place in its
//! chain, the VM, and a check of the memory file it goes with), the memory layout
//! (kvm-memslots-persist's `MemoryLayout`), every vCPU's state and the hotplug area, framed as
//! a magic, the format version, the JSON and its CRC-32. A file is opened without blocking and
//! its header checked before it is read ([`read_state_file`]), and its contents are checked
//! against themselves ([`SnapshotState::validate`]) before anything is built. The guest's
//! memory (its command blocks included) is in the memory file beside it.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use kvm_bindings::{kvm_lapic_state, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave};
use kvm_memslots_persist::{frame, framed_len, unframe, MemoryLayout, FRAME_HEADER};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::control::hotplug::HotplugConfig;
use crate::migration::StateRecord;
use crate::test_guest::controller::HOTPLUG_GPA;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::{IDENTITY_MAPPED, MAX_VCPUS};
use crate::vm::state::{VcpuState, SAVED_MSRS};

/// The state file's format version (2: each file knows what snapshot it is).
pub const STATE_VERSION: u32 = 2;

/// The largest state file read: a layout of every KVM slot as its own region and the most
/// vCPUs take a few MiB.
pub const MAX_STATE_FILE: u64 = 64 << 20;

/// How much of the start of the memory file a state file checks ([`MemoryCheck`]): the test
/// guest's system region (page tables, code, command blocks).
pub const MEMORY_HEAD: u64 = 2 << 20;

const MAGIC: &[u8; 8] = b"TVMSNAP\0";

const STATE_MAGIC: &[u8; 8] = b"TVMMIGR\0";
/// The migration state record's format version.
pub const MIGRATION_STATE_VERSION: u32 = 2;

/// What a snapshot saves besides memory.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotState {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// What snapshot this is: every state file says; a migration's State record, which is not
    /// a snapshot, has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotInfo>,
    /// The memory layout.
    pub layout: MemoryLayout,
    /// Every vCPU's state, by index.
    pub vcpus: Vec<VcpuState>,
    /// The hotplug area, if one was configured.
    #[serde(default)]
    pub hotplug: Option<HotplugState>,
}

/// A snapshot's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotKind {
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
    pub fn random() -> std::io::Result<Self> {
        let mut bytes = [0u8; 16];
        let mut filled = 0;
        while filled < bytes.len() {
            let rest = &mut bytes[filled..];
            // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`, which is valid
            // and exclusively borrowed for the call.
            let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            } else {
                filled += n as usize;
            }
        }
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
    pub kind: SnapshotKind,
    /// This snapshot's id.
    pub id: SnapshotId,
    /// The snapshot before it in its chain (none for a Full).
    pub parent: Option<SnapshotId>,
    /// Its place in its chain: 0 for the Full, then 1, 2... for each Diff.
    pub position: u32,
    /// The VM's identity: its chain's Full snapshot's id.
    pub vm: SnapshotId,
    /// The memory at this snapshot's point (a Diff's: its chain merged up to it).
    pub memory: MemoryCheck,
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
    fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
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
    pub fn check_follows(
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
    pub size: u64,
    /// How many of its first bytes are checked: [`MEMORY_HEAD`], or all of a smaller file.
    pub head: u64,
    /// Their CRC-32.
    pub head_crc32: u32,
}

/// Why a memory file is not the one a state file wants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryMismatch {
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
        use vm_memory::{Bytes, GuestAddress};
        let head = Self::expected_head(layout);
        let mut bytes = vec![0u8; head as usize];
        let mut at = 0usize;
        for region in &layout.regions {
            if at == bytes.len() {
                break;
            }
            let n = (region.size as usize).min(bytes.len() - at);
            memory.read_slice(&mut bytes[at..at + n], GuestAddress(region.gpa))?;
            at += n;
        }
        Ok(MemoryCheck {
            size: layout.memory_file_size(),
            head,
            head_crc32: crc32fast::hash(&bytes),
        })
    }

    /// Whether `file` has this memory file's size (a Diff's own file has it too).
    pub fn check_size(&self, file: &File) -> Result<(), MemoryMismatch> {
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
    pub fn check(&self, file: &File) -> Result<(), MemoryMismatch> {
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

/// The hotplug area's bookkeeping: its configuration, the blocks plugged, and which of its
/// slots are mapped (their regions are in the layout).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugState {
    /// As configured.
    pub config: HotplugConfig,
    /// Plugged blocks, from the area's start.
    pub plugged_blocks: u64,
    /// Whether each slot of the area is mapped.
    pub mapped: Vec<bool>,
}

impl HotplugState {
    /// Checks the area against itself and `layout`: a configuration the API would accept,
    /// one `mapped` entry per slot, no more plugged blocks than the area has, exactly the
    /// slots those blocks need mapped, and each mapped slot (and nothing else) a region of
    /// the layout there.
    fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
        let area = HotplugArea::new(self.config, HOTPLUG_GPA, IDENTITY_MAPPED, usize::MAX)
            .map_err(|e| format!("the hotplug area: {e}"))?;
        let slots = area.slots.len();
        if self.mapped.len() != slots {
            return Err(format!(
                "the hotplug area has {slots} slots, but `mapped` lists {}",
                self.mapped.len()
            ));
        }
        let per_slot = area.blocks_per_slot();
        let blocks = slots as u64 * per_slot;
        if self.plugged_blocks > blocks {
            return Err(format!(
                "the hotplug area's plugged_blocks {} is more than its {blocks} blocks",
                self.plugged_blocks
            ));
        }
        let wanted = self.plugged_blocks.div_ceil(per_slot) as usize;
        if let Some(i) = (0..slots).find(|&i| self.mapped[i] != (i < wanted)) {
            return Err(format!(
                "the hotplug area's slot {i} is {}mapped in `mapped`, but plugged_blocks {} maps \
                 slots 0..{wanted}",
                if self.mapped[i] { "" } else { "not " },
                self.plugged_blocks
            ));
        }
        let end = area.gpa + slots as u64 * area.slot_size;
        for region in layout
            .regions
            .iter()
            .filter(|r| r.gpa < end && area.gpa < r.gpa.saturating_add(r.size))
        {
            let slot = (region.gpa - area.gpa.min(region.gpa)) / area.slot_size;
            let is_slot = region.gpa >= area.gpa
                && region.gpa == area.slot_gpa(slot as usize).0
                && region.size == area.slot_size;
            if !is_slot || !self.mapped[slot as usize] {
                return Err(format!(
                    "the layout's region at {:#x} ({} bytes) is inside the hotplug area but not \
                     one of its mapped slots",
                    region.gpa, region.size
                ));
            }
        }
        if let Some(i) = (0..wanted).find(|&i| {
            let gpa = area.slot_gpa(i).0;
            !layout
                .regions
                .iter()
                .any(|r| r.gpa == gpa && r.size == area.slot_size)
        }) {
            return Err(format!(
                "the hotplug area's mapped slot {i} at {:#x} is not a region of the layout",
                area.slot_gpa(i).0
            ));
        }
        Ok(())
    }
}

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
#[error("invalid snapshot state file: {0}")]
pub struct StateFileError(pub String);

/// Opens `path` to read without blocking (a FIFO with no writer, or a device, cannot hang the
/// caller) and refuses anything but a regular file, saying what it is (the caller names the
/// path).
pub fn open_input(path: &Path) -> Result<File, String> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let kind = file
        .metadata()
        .map_err(|e| format!("reading its type: {e}"))?
        .file_type();
    let what = if kind.is_file() {
        return Ok(file);
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Err(format!("{what}, not a regular file"))
}

/// Reads and checks the state file at `path` (see [`SnapshotState::from_bytes`]), its header
/// first: a file that is not a regular file, is empty, has another magic or version, is over
/// [`MAX_STATE_FILE`] or another size than its header says is refused before it is read
/// whole. The error does not name the path: the caller does.
pub fn read_state_file(path: &Path) -> Result<SnapshotState, StateFileError> {
    let bad = StateFileError;
    let mut file = open_input(path).map_err(bad)?;
    let size = file
        .metadata()
        .map_err(|e| bad(format!("reading its size: {e}")))?
        .len();
    if size == 0 {
        return Err(bad("the file is empty".into()));
    }
    let mut header = [0u8; FRAME_HEADER];
    let got = size.min(FRAME_HEADER as u64) as usize;
    file.read_exact(&mut header[..got])
        .map_err(|e| bad(format!("reading its header: {e}")))?;
    let total = framed_len(MAGIC, STATE_VERSION, &header[..got]).map_err(bad)?;
    if total > MAX_STATE_FILE {
        return Err(bad(format!(
            "its header announces {total} bytes, over the {} MiB a state file may have",
            MAX_STATE_FILE >> 20
        )));
    }
    if total != size {
        return Err(bad(format!(
            "{size} bytes, but its header announces {total} (truncated or padded)"
        )));
    }
    let mut bytes = header[..got].to_vec();
    bytes.resize(total as usize, 0);
    file.read_exact(&mut bytes[got..])
        .map_err(|e| bad(format!("reading it: {e}")))?;
    SnapshotState::from_bytes(&bytes)
}

/// Checks that every vCPU's register blocks in `vcpus` (the JSON of [`VcpuState`]s) have
/// exactly their structure's size: kvm-bindings' deserialiser fills a short one with zeros.
fn check_register_blocks(vcpus: &Value) -> Result<(), String> {
    use std::mem::size_of;
    let Some(vcpus) = vcpus.as_array() else {
        return Ok(()); // Not a list: the typed parse names it.
    };
    let blocks = [
        ("regs", size_of::<kvm_regs>()),
        ("sregs", size_of::<kvm_sregs>()),
        ("xsave", size_of::<kvm_xsave>()),
        ("xcrs", size_of::<kvm_xcrs>()),
        ("events", size_of::<kvm_vcpu_events>()),
        ("lapic", size_of::<kvm_lapic_state>()),
    ];
    for (i, vcpu) in vcpus.iter().enumerate() {
        for (name, size) in blocks {
            match vcpu.get(name) {
                Some(Value::Array(bytes)) if bytes.len() != size => {
                    return Err(format!(
                        "vCPU {i}'s {name} has {} bytes; a {name} block has {size}",
                        bytes.len()
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

impl SnapshotState {
    /// The file's bytes (kvm-memslots-persist's [`frame`]: magic, version, length, JSON, CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a snapshot state serialises");
        frame(MAGIC, self.version, &json)
    }

    /// Reads a state file's bytes, naming what is wrong with a bad one: the frame's checks,
    /// register blocks of their exact sizes, [`validate`](Self::validate), and it must say
    /// what snapshot it is.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateFileError> {
        let bad = |why: String| StateFileError(why);
        let json = unframe(MAGIC, STATE_VERSION, bytes).map_err(bad)?;
        let json: Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
        check_register_blocks(&json["vcpus"]).map_err(bad)?;
        let state: SnapshotState = serde_json::from_value(json).map_err(|e| bad(e.to_string()))?;
        state.validate()?;
        if state.snapshot.is_none() {
            return Err(bad("it does not say what snapshot it is".into()));
        }
        Ok(state)
    }

    /// The checks [`from_bytes`](Self::from_bytes) makes after parsing, against the state
    /// itself before anything is built: this version, 1 to [`MAX_VCPUS`] vCPUs each with the
    /// [`SAVED_MSRS`], a layout that passes [`MemoryLayout::validate`], a hotplug area that
    /// agrees with itself and the layout, and a snapshot identity that does.
    pub fn validate(&self) -> Result<(), StateFileError> {
        let bad = |why: String| StateFileError(why);
        if self.version != STATE_VERSION {
            return Err(bad(format!(
                "the header's version is {STATE_VERSION}, the state's {}",
                self.version
            )));
        }
        if self.vcpus.is_empty() || self.vcpus.len() > MAX_VCPUS {
            return Err(bad(format!(
                "{} vCPUs; the test guest has 1 to {MAX_VCPUS}",
                self.vcpus.len()
            )));
        }
        for (i, vcpu) in self.vcpus.iter().enumerate() {
            let indices: Vec<u32> = vcpu.msrs.iter().map(|(index, _)| *index).collect();
            if indices != SAVED_MSRS {
                return Err(bad(format!(
                    "vCPU {i} has the MSRs {indices:x?}; a saved vCPU has exactly {SAVED_MSRS:x?}"
                )));
            }
        }
        // The layout's own checks (version, alignment, order, overlaps, file offsets).
        self.layout.validate().map_err(|e| bad(e.to_string()))?;
        if let Some(hotplug) = &self.hotplug {
            hotplug.validate(&self.layout).map_err(bad)?;
        }
        if let Some(info) = &self.snapshot {
            info.validate(&self.layout).map_err(bad)?;
        }
        Ok(())
    }
}

/// What the State record of a migration carries: the snapshot state (layout, vCPUs, hotplug
/// area) and whether the VM was paused by a client.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationState {
    /// What a snapshot would save.
    pub snapshot: SnapshotState,
    /// The VM was paused (`PATCH /vm`): it stays paused on the destination.
    pub paused: bool,
}

impl MigrationState {
    /// The record's bytes (framed: magic, version, length, JSON, CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a migration state serialises");
        frame(STATE_MAGIC, MIGRATION_STATE_VERSION, &json)
    }

    /// Reads a State record, naming what is wrong with a bad one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let json = unframe(STATE_MAGIC, MIGRATION_STATE_VERSION, bytes)?;
        let record: Value =
            serde_json::from_slice(json).map_err(|e| format!("the migration state: {e}"))?;
        check_register_blocks(&record["snapshot"]["vcpus"])
            .map_err(|e| format!("the migration state: {e}"))?;
        let state: MigrationState =
            serde_json::from_value(record).map_err(|e| format!("the migration state: {e}"))?;
        // The snapshot state's own checks.
        state.snapshot.validate().map_err(|e| e.to_string())?;
        Ok(state)
    }
}

/// The test guest's [`StateRecord`]: what its migration sends besides the layout and the
/// vCPUs' states, taken when the migration starts.
#[derive(Debug)]
pub struct MigrationRecord {
    /// The hotplug area's bookkeeping.
    pub hotplug: Option<HotplugState>,
    /// Paused by a client.
    pub paused: bool,
}

impl StateRecord for MigrationRecord {
    fn to_bytes(&self, layout: &MemoryLayout, states: Vec<VcpuState>) -> Vec<u8> {
        MigrationState {
            snapshot: SnapshotState {
                version: STATE_VERSION,
                snapshot: None,
                layout: layout.clone(),
                vcpus: states,
                hotplug: self.hotplug.clone(),
            },
            paused: self.paused,
        }
        .to_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

    /// A 2 MiB system region at 0, and at the hotplug area the regions of `slots` 8 MiB slots.
    fn layout(slots: &[u64]) -> (MemoryManager<FakeKvm>, MemoryLayout) {
        let memory = MemoryManager::new(FakeKvm::new(64, false));
        memory
            .add_region(RegionSpec::new(GuestAddress(0), 2 * MIB))
            .expect("the system region");
        for slot in slots {
            let gpa = GuestAddress(HOTPLUG_GPA + slot * 8 * MIB);
            memory
                .add_region(RegionSpec::new(gpa, 8 * MIB))
                .expect("a slot");
        }
        let layout = MemoryLayout::of(&memory);
        (memory, layout)
    }

    /// 64 MiB in 2 MiB blocks and 8 MiB slots, 5 blocks plugged: slots 0 and 1 mapped.
    fn hotplug() -> HotplugState {
        HotplugState {
            config: HotplugConfig {
                total_size_mib: 64,
                block_size_mib: 2,
                slot_size_mib: Some(8),
            },
            plugged_blocks: 5,
            mapped: [[true; 2].as_slice(), &[false; 6]].concat(),
        }
    }

    #[test]
    fn a_hotplug_area_is_checked_against_itself_and_the_layout() {
        let (_memory, two) = layout(&[0, 1]);
        assert_eq!(hotplug().validate(&two), Ok(()));
        let refused = |change: fn(&mut HotplugState), layout: &MemoryLayout| {
            let mut state = hotplug();
            change(&mut state);
            state.validate(layout).expect_err("refused")
        };
        let short = refused(|s| s.mapped.truncate(2), &two);
        assert!(short.contains("8 slots, but `mapped` lists 2"), "{short}");
        let absurd = refused(|s| s.plugged_blocks = 1 << 62, &two);
        assert!(absurd.contains("more than its 32 blocks"), "{absurd}");
        let none = refused(|s| s.plugged_blocks = 0, &two);
        assert!(none.contains("slot 0 is mapped"), "{none}");
        let more = refused(|s| s.plugged_blocks = 9, &two);
        assert!(more.contains("slot 2 is not mapped"), "{more}");
        let block = refused(|s| s.config.block_size_mib = 3, &two);
        assert!(block.contains("block_size_mib 3"), "{block}");
        // The layout lacks a mapped slot's region, or has one the map does not list.
        let (_memory, one) = layout(&[0]);
        let missing = hotplug().validate(&one).expect_err("refused");
        assert!(missing.contains("mapped slot 1"), "{missing}");
        let (_memory, three) = layout(&[0, 1, 3]);
        let extra = hotplug().validate(&three).expect_err("refused");
        assert!(extra.contains("inside the hotplug area"), "{extra}");
    }

    #[test]
    fn a_memory_check_tells_the_memory_of_its_point_from_other_files() {
        let (memory, layout) = layout(&[0]);
        memory
            .current()
            .write_obj(0xabu8, GuestAddress(0x10000))
            .expect("write");
        let check = MemoryCheck::of_memory(&*memory.current(), &layout).expect("read");
        assert_eq!((check.size, check.head), (10 * MIB, MEMORY_HEAD));
        let path = std::env::temp_dir().join(format!("tinyvmm-unit-{}-check", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("a file");
        let _ = std::fs::remove_file(&path);
        file.set_len(10 * MIB).expect("size");
        assert!(matches!(
            check.check(&file),
            Err(MemoryMismatch::Head { .. })
        ));
        file.write_all_at(&[0xab], 0x10000).expect("write");
        assert_eq!(check.check(&file), Ok(()));
        file.set_len(9 * MIB).expect("size");
        assert_eq!(
            check.check(&file),
            Err(MemoryMismatch::Size {
                found: 9 * MIB,
                expected: 10 * MIB
            })
        );
    }

    #[test]
    fn snapshot_infos_follow_each_other_in_one_chain() {
        let (_memory, layout) = layout(&[]);
        let memory = MemoryCheck {
            size: layout.memory_file_size(),
            head: MEMORY_HEAD,
            head_crc32: 1,
        };
        let full = SnapshotInfo::full(memory).expect("an id");
        let diff = full.next_diff(memory).expect("an id");
        let next = diff.next_diff(memory).expect("an id");
        for info in [full, diff, next] {
            assert_eq!(info.validate(&layout), Ok(()));
        }
        assert_eq!(
            (diff.parent, diff.position, diff.vm),
            (Some(full.id), 1, full.id)
        );
        let (a, b, c) = (Path::new("a"), Path::new("b"), Path::new("c"));
        assert_eq!(diff.check_follows(b, &full, a), Ok(()));
        let skipped = next.check_follows(c, &full, a).expect_err("refused");
        assert!(skipped.starts_with("c does not follow a"), "{skipped}");
        let other = SnapshotInfo::full(memory).expect("an id");
        let mixed = diff.check_follows(b, &other, a).expect_err("refused");
        assert!(mixed.contains("another VM"), "{mixed}");
        // Fields that contradict each other, or another layout's memory.
        let orphan = SnapshotInfo {
            parent: None,
            ..diff
        };
        assert!(orphan.validate(&layout).is_err());
        let late_full = SnapshotInfo {
            position: 2,
            ..full
        };
        assert!(late_full.validate(&layout).is_err());
        let resized = SnapshotInfo {
            memory: MemoryCheck {
                size: 4096,
                ..memory
            },
            ..full
        };
        let err = resized.validate(&layout).expect_err("refused");
        assert!(err.contains("does not fit its layout"), "{err}");
    }

    #[test]
    fn a_snapshot_id_is_32_hex_digits_and_random() {
        let id = SnapshotId::random().expect("random");
        assert_ne!(id, SnapshotId::random().expect("random"));
        let json = serde_json::to_string(&id).expect("JSON");
        assert_eq!(json.len(), 34, "{json}");
        assert_eq!(
            serde_json::from_str::<SnapshotId>(&json).expect("parsed"),
            id
        );
        assert!(serde_json::from_str::<SnapshotId>("\"12\"").is_err());
        assert!(serde_json::from_str::<SnapshotId>(&format!("\"{}\"", "g".repeat(32))).is_err());
    }

    #[test]
    fn register_blocks_must_have_their_exact_size() {
        let vcpu = VcpuState {
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            events: Default::default(),
            msrs: SAVED_MSRS.iter().map(|&i| (i, 0)).collect(),
            lapic: None,
        };
        let mut vcpus = serde_json::to_value([&vcpu]).expect("JSON");
        assert_eq!(check_register_blocks(&vcpus), Ok(()));
        let sregs = vcpus[0]["sregs"].as_array_mut().expect("bytes");
        sregs.truncate(sregs.len() - 8);
        let err = check_register_blocks(&vcpus).expect_err("refused");
        assert!(err.starts_with("vCPU 0's sregs has"), "{err}");
    }
}
