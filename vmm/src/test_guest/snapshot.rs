//! The test guest's part of its saved state ([`TestGuestPart`]: the hotplug area's
//! bookkeeping) and its checks, in the one envelope every guest kind's state file and State
//! record are (`snapshot::state`, which frames, versions and checks the rest: what snapshot it
//! is, the memory layout, every vCPU's state); and the State record a migration sends
//! (`MigrationRecord`). The guest's memory (its command blocks included) is in the memory
//! file beside the state file.

use kvm_memslots_persist::MemoryLayout;
use serde::{Deserialize, Serialize};

use crate::migration::StateRecord;
pub use crate::snapshot::info::{MemoryCheck, SnapshotInfo};
pub(crate) use crate::snapshot::info::{MemoryMismatch, SnapshotKind};
#[cfg(test)]
use crate::snapshot::info::{SnapshotId, MEMORY_HEAD};
pub(crate) use crate::snapshot::state::file::open_input;
#[cfg(test)]
use crate::snapshot::state::STATE_VERSION;
use crate::snapshot::state::{GuestKind, GuestPart, SavedState};
use crate::test_guest::hotplug::HotplugState;
use crate::test_guest::MAX_VCPUS;
use crate::vm::state::{VcpuState, SAVED_MSRS};

/// A test guest's saved state: the one envelope with the test guest's part.
pub type SnapshotState = SavedState<TestGuestPart>;

/// What a test guest saves besides what every kind does: its hotplug area.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestGuestPart {
    /// The hotplug area, if one was configured.
    #[serde(default)]
    pub(crate) hotplug: Option<HotplugState>,
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

/// The test guest's [`StateRecord`]: what its migration sends besides the layout and the
/// vCPUs' states, taken when the migration starts.
#[derive(Debug)]
pub(super) struct MigrationRecord {
    /// The hotplug area's bookkeeping.
    pub(crate) hotplug: Option<HotplugState>,
    /// Paused by a client.
    pub(crate) paused: bool,
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
    use crate::test_guest::hotplug::tests::{hotplug, layout};
    use crate::vm::state::{VcpuState, SAVED_MSRS};
    use kvm_memslots_persist::frame;
    use std::os::unix::fs::FileExt;
    use std::path::Path;
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

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
        let file = kvm_test_support::files::new_file_at(&path);
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
