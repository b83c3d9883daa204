//! A test-guest VM's snapshot state file: what snapshot it is (kind, id, parent, place in its
//! chain, the VM, and a check of the memory file it goes with), the memory layout
//! (kvm-memslots-persist's `MemoryLayout`), every vCPU's state and the hotplug area, framed as
//! a magic, the format version, the JSON and its CRC-32. A file is opened without blocking and
//! its header checked before it is read ([`read_state_file`]), and its contents are checked
//! against themselves ([`SnapshotState::validate`]) before anything is built. The guest's
//! memory (its command blocks included) is in the memory file beside it.

use std::ops::RangeInclusive;
use std::path::Path;

use kvm_memslots_persist::{frame, unframe_versions, MemoryLayout};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::control::hotplug::HotplugConfig;
use crate::migration::StateRecord;
use crate::snapshot::file::{check_register_blocks, TEST_GUEST_MAGIC};
pub use crate::snapshot::file::{open_input, StateFileError, MAX_STATE_FILE};
pub use crate::snapshot::info::{
    MemoryCheck, MemoryMismatch, SnapshotId, SnapshotInfo, SnapshotKind, MEMORY_HEAD,
};
use crate::snapshot::saved::{self, SavedState};
use crate::test_guest::controller::HOTPLUG_GPA;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::{IDENTITY_MAPPED, MAX_VCPUS};
use crate::vm::state::{VcpuState, SAVED_MSRS};

/// The state file's format version (2: each file knows what snapshot it is; 3: a hotplug
/// piece's slot covers only its plugged blocks). Written by this build.
pub const STATE_VERSION: u32 = 3;

/// The oldest state file version this build reads: a version 2 file's partly plugged hotplug
/// piece may be slotted whole, and the restore cuts its slot to its plugged blocks. (Version 3
/// keeps an older build, which would take such a slot for the whole piece, from reading it.)
pub const OLDEST_STATE_VERSION: u32 = 2;

const MAGIC: &[u8; 8] = TEST_GUEST_MAGIC;

/// The magic of a test guest's migration State record.
pub const MIGRATION_MAGIC: &[u8; 8] = b"TVMMIGR\0";
/// The migration state record's format version (3 with [`STATE_VERSION`] 3).
pub const MIGRATION_STATE_VERSION: u32 = 3;

/// The oldest migration state record version this build reads (from an older source).
pub const OLDEST_MIGRATION_STATE_VERSION: u32 = 2;

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
    /// one `mapped` entry per piece (slot size) of the area, no more plugged blocks than the
    /// area has, exactly the pieces those blocks need mapped, and each mapped piece (and
    /// nothing else) a region of the layout there with one slot over the whole piece, or (a
    /// version 3 state, written when pieces had holes) slots over its plugged blocks only: the
    /// restore gives it its one slot back and makes its unplugged blocks unreachable.
    fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
        let area = HotplugArea::new(self.config, HOTPLUG_GPA, IDENTITY_MAPPED, usize::MAX)
            .map_err(|e| format!("the hotplug area: {e}"))?;
        let slots = area.pieces.len();
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
        let end = area.range().end;
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
            let (slots, wanted, runs) = (
                region.slots(),
                area.piece_slots(slot as usize, self.plugged_blocks),
                area.piece_runs(slot as usize, self.plugged_blocks),
            );
            if slots != wanted && slots != runs {
                return Err(format!(
                    "the layout's region at {:#x} has slots {slots:x?}; the hotplug area's \
                     plugged blocks there need {wanted:x?}",
                    region.gpa
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

/// Reads and checks the state file at `path` (see [`SnapshotState::from_bytes`]), its header
/// first (`snapshot::file::read_framed`). The error does not name the path: the caller does.
pub fn read_state_file(path: &Path) -> Result<SnapshotState, StateFileError> {
    saved::read_file(path)
}

impl SavedState for SnapshotState {
    const MAGIC: &'static [u8; 8] = MAGIC;
    const VERSIONS: RangeInclusive<u32> = OLDEST_STATE_VERSION..=STATE_VERSION;

    fn version(&self) -> u32 {
        self.version
    }

    fn snapshot(&self) -> Option<&SnapshotInfo> {
        self.snapshot.as_ref()
    }

    fn validate(&self) -> Result<(), StateFileError> {
        SnapshotState::validate(self)
    }
}

impl SnapshotState {
    /// The file's bytes (kvm-memslots-persist's `frame`: magic, version, length, JSON, CRC-32).
    pub fn to_bytes(&self) -> Vec<u8> {
        saved::to_bytes(self)
    }

    /// Reads a state file's bytes, naming what is wrong with a bad one: the frame's checks,
    /// register blocks of their exact sizes, [`validate`](Self::validate), and it must say
    /// what snapshot it is ([`saved::from_bytes`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateFileError> {
        saved::from_bytes(bytes).and_then(saved::of_a_snapshot)
    }

    /// The checks [`from_bytes`](Self::from_bytes) makes after parsing, against the state
    /// itself before anything is built: a version this build reads, 1 to [`MAX_VCPUS`] vCPUs
    /// each with the
    /// [`SAVED_MSRS`], a layout that passes [`MemoryLayout::validate`], a hotplug area that
    /// agrees with itself and the layout, and a snapshot identity that does.
    pub fn validate(&self) -> Result<(), StateFileError> {
        let bad = |why: String| StateFileError(why);
        if !(OLDEST_STATE_VERSION..=STATE_VERSION).contains(&self.version) {
            return Err(bad(format!(
                "state version {}; this build reads versions {OLDEST_STATE_VERSION} to \
                 {STATE_VERSION}",
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
        frame(MIGRATION_MAGIC, MIGRATION_STATE_VERSION, &json)
    }

    /// Reads a State record, naming what is wrong with a bad one.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let (_, json) = unframe_versions(
            MIGRATION_MAGIC,
            OLDEST_MIGRATION_STATE_VERSION..=MIGRATION_STATE_VERSION,
            bytes,
        )?;
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
    fn to_bytes(&self, layout: &MemoryLayout, states: Vec<VcpuState>) -> Result<Vec<u8>, String> {
        Ok(MigrationState {
            snapshot: SnapshotState {
                version: STATE_VERSION,
                snapshot: None,
                layout: layout.clone(),
                vcpus: states,
                hotplug: self.hotplug.clone(),
            },
            paused: self.paused,
        }
        .to_bytes())
    }
}

#[cfg(test)]
// Slot layouts are lists of ranges, one range long as often as not.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::vm::state::{VcpuState, SAVED_MSRS};
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use std::fs::File;
    use std::os::unix::fs::FileExt;
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
                page_size: Default::default(),
            },
            plugged_blocks: 5,
            mapped: [[true; 2].as_slice(), &[false; 6]].concat(),
        }
    }

    #[test]
    fn a_hotplug_area_is_checked_against_itself_and_the_layout() {
        let (_memory, two) = layout(&[0, 1]);
        // Slots of the whole piece (the layout helper's): a piece's one slot.
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
        // A partly plugged piece's slot covers it whole (or, written when pieces had holes,
        // its plugged block); any other slotting is refused, naming both.
        let with_slots = |piece_1: Vec<std::ops::Range<u64>>| {
            let (memory, _) = layout(&[0]);
            let gpa = GuestAddress(HOTPLUG_GPA + 8 * MIB);
            memory
                .add_region(RegionSpec::new(gpa, 8 * MIB).with_slot_ranges(piece_1))
                .expect("a piece with a hole");
            MemoryLayout::of(&memory)
        };
        let cut = with_slots(vec![0..2 * MIB]);
        assert_eq!(hotplug().validate(&cut), Ok(()));
        let wrong = hotplug()
            .validate(&with_slots(vec![0..4 * MIB]))
            .expect_err("refused");
        assert!(
            wrong.contains("has slots [0..400000]") && wrong.contains("need [0..800000]"),
            "{wrong}"
        );
        let odd = hotplug()
            .validate(&with_slots(vec![0..2 * MIB, 6 * MIB..8 * MIB]))
            .expect_err("neither the piece nor its plugged blocks");
        assert!(odd.contains("need [0..800000]"), "{odd}");
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
            debugregs: None,
            mp_state: None,
            cpuid: Vec::new(),
        };
        let mut vcpus = serde_json::to_value([&vcpu]).expect("JSON");
        assert_eq!(check_register_blocks(&vcpus), Ok(()));
        let sregs = vcpus[0]["sregs"].as_array_mut().expect("bytes");
        sregs.truncate(sregs.len() - 8);
        let err = check_register_blocks(&vcpus).expect_err("refused");
        assert!(err.starts_with("vCPU 0's sregs has"), "{err}");
    }
}
