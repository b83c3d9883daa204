//! The test guest's part of its saved state ([`TestGuestPart`]: the hotplug area's
//! bookkeeping) and its checks, in the one envelope every guest kind's state file and State
//! record are (`snapshot::state`, which frames, versions and checks the rest: what snapshot it
//! is, the memory layout, every vCPU's state); and the State record a migration sends
//! ([`MigrationRecord`]). The guest's memory (its command blocks included) is in the memory
//! file beside the state file.

use std::path::Path;

use kvm_memslots_persist::MemoryLayout;
use serde::{Deserialize, Serialize};

use crate::control::hotplug::HotplugConfig;
use crate::migration::StateRecord;
pub use crate::snapshot::info::{
    MemoryCheck, MemoryMismatch, SnapshotId, SnapshotInfo, SnapshotKind, MEMORY_HEAD,
};
pub use crate::snapshot::state::file::{open_input, StateFileError, MAX_STATE_FILE};
pub use crate::snapshot::state::STATE_VERSION;
use crate::snapshot::state::{GuestKind, GuestPart, SavedState};
use crate::test_guest::controller::HOTPLUG_GPA;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::{IDENTITY_MAPPED, MAX_VCPUS};
use crate::vm::state::{VcpuState, SAVED_MSRS};

/// A test guest's saved state: the one envelope with the test guest's part.
pub type SnapshotState = SavedState<TestGuestPart>;

/// What a test guest saves besides what every kind does: its hotplug area.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestGuestPart {
    /// The hotplug area, if one was configured.
    #[serde(default)]
    pub hotplug: Option<HotplugState>,
}

impl GuestPart for TestGuestPart {
    const KIND: GuestKind = GuestKind::TestGuest;

    /// 1 to [`MAX_VCPUS`] vCPUs each with the [`SAVED_MSRS`], no VM state (the test guest's
    /// VM has no irqchip, PIT or clock to restore), and a hotplug area that agrees with itself
    /// and the layout.
    fn validate(state: &SnapshotState) -> Result<(), String> {
        if state.vcpus.is_empty() || state.vcpus.len() > MAX_VCPUS {
            return Err(format!(
                "{} vCPUs; the test guest has 1 to {MAX_VCPUS}",
                state.vcpus.len()
            ));
        }
        for (i, vcpu) in state.vcpus.iter().enumerate() {
            let indices: Vec<u32> = vcpu.msrs.iter().map(|(index, _)| *index).collect();
            if indices != SAVED_MSRS {
                return Err(format!(
                    "vCPU {i} has the MSRs {indices:x?}; a saved vCPU has exactly {SAVED_MSRS:x?}"
                ));
            }
        }
        if state.vm.is_some() {
            return Err(
                "it has a `vm` (irqchip, PIT and clock), which a test guest's VM has not".into(),
            );
        }
        match &state.guest.hotplug {
            Some(hotplug) => hotplug.validate(&state.layout),
            None => Ok(()),
        }
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
    /// one `mapped` entry per piece (slot size) of the area, no more plugged blocks than the
    /// area has, exactly the pieces those blocks need mapped, and each mapped piece (and
    /// nothing else) a region of the layout there with one slot over the whole piece, or (a
    /// version 3 state, written when pieces had holes) slots over its plugged blocks only: the
    /// restore gives it its one slot back and makes its unplugged blocks unreachable.
    pub fn validate(&self, layout: &MemoryLayout) -> Result<(), String> {
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

/// Reads and checks the test guest's state file at `path` ([`SavedState::read_file`]: of this
/// build's format or an older one, its header first). The error does not name the path: the
/// caller does.
pub fn read_state_file(path: &Path) -> Result<SnapshotState, StateFileError> {
    SnapshotState::read_file(path)
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
        let part = TestGuestPart {
            hotplug: self.hotplug.clone(),
        };
        Ok(SnapshotState::new(layout.clone(), states, None, self.paused, part).to_bytes())
    }
}

#[cfg(test)]
// Slot layouts are lists of ranges, one range long as often as not.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::snapshot::state::file::check_register_blocks;
    use crate::snapshot::state::test_data;
    use crate::vm::state::{VcpuState, SAVED_MSRS};
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use kvm_memslots_persist::frame;
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

    /// State files and State records as the builds before the one envelope wrote them (the
    /// test guest's own formats, `TVMSNAP` and `TVMMIGR` versions 2 and 3, made by those
    /// builds' code: one vCPU, a hotplug area with 5 blocks plugged, a Diff's identity) read
    /// as this format's, every field where it was; written again, they are this format.
    #[test]
    fn test_guest_states_of_the_formats_before_read_into_the_envelope() {
        for (name, magic, snapshot, paused) in [
            ("test-guest-v2.state", b"TVMSNAP\0", true, false),
            ("test-guest-v3.state", b"TVMSNAP\0", true, false),
            ("test-guest-v2.record", b"TVMMIGR\0", false, true),
            ("test-guest-v3.record", b"TVMMIGR\0", false, true),
        ] {
            let bytes = test_data(name);
            assert!(bytes.starts_with(magic), "{name}");
            assert_eq!(
                GuestKind::of_bytes(&bytes).expect("a kind"),
                GuestKind::TestGuest
            );
            let state = SnapshotState::from_bytes(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                (state.version, state.kind, state.paused),
                (STATE_VERSION, GuestKind::TestGuest, paused),
                "{name}"
            );
            assert_eq!(state.guest.hotplug, Some(hotplug()), "{name}");
            assert!(state.vm.is_none(), "{name}");
            assert_eq!(state.vcpus.len(), 1);
            assert_eq!(state.vcpus[0].regs.rip, 0x10000);
            assert_eq!(state.vcpus[0].msrs[0], (SAVED_MSRS[0], 7));
            assert_eq!(state.layout.regions.len(), 3, "{name}");
            match (&state.snapshot, snapshot) {
                (Some(info), true) => {
                    assert_eq!((info.kind, info.position), (SnapshotKind::Diff, 1));
                }
                (None, false) => {}
                (info, _) => panic!("{name}: snapshot {info:?}"),
            }
            let again = state.to_bytes();
            assert!(again.starts_with(crate::snapshot::state::STATE_MAGIC));
            let back = SnapshotState::from_bytes(&again).expect("this format");
            assert_eq!(
                (back.snapshot, back.guest, back.paused),
                (state.snapshot, state.guest, state.paused)
            );
        }
        // An older file whose header and body disagree, a version before the oldest read, a
        // record's state of a version never written, and an older record with a field it
        // never had: each refused, naming it.
        let older = |magic: &[u8; 8], version: u32, change: &dyn Fn(&mut serde_json::Value)| {
            let bytes = test_data(if magic == b"TVMSNAP\0" {
                "test-guest-v3.state"
            } else {
                "test-guest-v3.record"
            });
            let json = kvm_memslots_persist::unframe(magic, 3, &bytes).expect("a frame");
            let mut json: serde_json::Value = serde_json::from_slice(json).expect("JSON");
            change(&mut json);
            let bytes = frame(magic, version, &serde_json::to_vec(&json).expect("bytes"));
            SnapshotState::from_bytes(&bytes)
                .expect_err("refused")
                .to_string()
        };
        let why = older(b"TVMSNAP\0", 3, &|json| json["version"] = 2.into());
        assert!(
            why.contains("the header's version is 3, the state's 2"),
            "{why}"
        );
        let why = older(b"TVMSNAP\0", 1, &|json| json["version"] = 1.into());
        assert!(
            why.contains("format version 1; this build reads versions 2 to 3"),
            "{why}"
        );
        let why = older(b"TVMMIGR\0", 3, &|json| {
            json["snapshot"]["version"] = 9.into()
        });
        assert!(
            why.contains("state version 9; this build reads versions 2 to 3"),
            "{why}"
        );
        let why = older(b"TVMMIGR\0", 3, &|json| json["extra"] = 1.into());
        assert!(why.contains("unknown field `extra`"), "{why}");
        let why = older(b"TVMSNAP\0", 3, &|json| json["extra"] = 1.into());
        assert!(why.contains("unknown field `extra`"), "{why}");
        // A Linux guest's older state is not the test guest's.
        let why = SnapshotState::from_bytes(&test_data("linux-v1.state"))
            .expect_err("refused")
            .to_string();
        assert!(
            why.contains("it is a Linux guest's state, not a test guest's"),
            "{why}"
        );
    }

    /// This format's state: checked as the test guest's, and refused naming what is wrong.
    #[test]
    fn a_test_guest_state_is_checked_as_the_test_guest_s() {
        let state = SnapshotState::from_bytes(&test_data("test-guest-v3.state")).expect("valid");
        let json = serde_json::to_value(&state).expect("JSON");
        assert_eq!(json["kind"], "test_guest");
        assert_eq!(json["guest"]["hotplug"]["plugged_blocks"], 5);
        let refused = |change: &dyn Fn(&mut serde_json::Value)| {
            let mut json = json.clone();
            change(&mut json);
            let bytes = frame(
                crate::snapshot::state::STATE_MAGIC,
                STATE_VERSION,
                &serde_json::to_vec(&json).expect("bytes"),
            );
            SnapshotState::from_bytes(&bytes)
                .expect_err("refused")
                .to_string()
        };
        let why = refused(&|json| json["kind"] = "linux".into());
        assert!(
            why.contains("it is a Linux guest's state, not a test guest's"),
            "{why}"
        );
        let why = refused(&|json| json["guest"]["hotplug"]["plugged_blocks"] = 0.into());
        assert!(why.contains("slot 0 is mapped"), "{why}");
        let why = refused(&|json| json["vcpus"][0]["msrs"] = serde_json::json!([]));
        assert!(why.contains("vCPU 0 has the MSRs []"), "{why}");
        let why = refused(&|json| json["vcpus"] = serde_json::json!([]));
        assert!(why.contains("0 vCPUs; the test guest has 1 to"), "{why}");
        let why = refused(&|json| json["guest"]["devices"] = serde_json::json!([]));
        assert!(why.contains("unknown field `devices`"), "{why}");
        let why = refused(&|json| json["version"] = 5.into());
        assert!(
            why.contains("the header's version is 4, the state's 5"),
            "{why}"
        );
        let why = refused(&|json| {
            json.as_object_mut().expect("an object").remove("kind");
        });
        assert!(why.contains("missing field `kind`"), "{why}");
    }
}
