//! The manager against the rule-enforcing fake KVM, with failures injected at every step.

use crate::dirty::DirtyPages;
use std::sync::{mpsc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use vm_memory::{Bytes, GuestMemoryBackend};

use super::*;
use crate::error::ErrorKind;
use crate::testing::{FakeKvm, Faulty, Hook, Hooked, KvmCall, KvmRequest};

type Manager = MemoryManager<Faulty<FakeKvm>>;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const SLOT: u64 = 0x4000;

fn manager(max_slots: u32) -> Manager {
    MemoryManager::new(Faulty::new(FakeKvm::new(max_slots, true)))
}

fn region(gpa: u64, slots: u64) -> RegionSpec {
    RegionSpec::new(GuestAddress(gpa), slots * SLOT).with_slot_size(SLOT)
}

/// KVM's slots as the published map says they are.
fn expected_kvm(m: &Manager) -> Vec<KvmSlot> {
    let mut slots: Vec<KvmSlot> = m
        .published()
        .iter()
        .map(|s| KvmSlot::from(s.as_ref()))
        .collect();
    slots.sort_by_key(|s| s.slot);
    slots
}

fn assert_mirrored(m: &Manager) {
    assert_eq!(
        m.kvm().inner().slots(),
        expected_kvm(m),
        "KVM and the map disagree"
    );
}

/// Everything an operation may change, to compare before and after a failure.
#[derive(Debug, PartialEq)]
struct Everything {
    kvm: Vec<KvmSlot>,
    map: Vec<KvmSlot>,
    regions: Vec<RegionInfo>,
    usage: SlotUsage,
    memory: MemoryUse,
}

fn everything(m: &Manager) -> Everything {
    Everything {
        kvm: m.kvm().inner().slots(),
        map: expected_kvm(m),
        regions: m.regions(),
        usage: m.slot_usage(),
        memory: m.memory_use(),
    }
}

#[test]
fn regions_are_split_into_slots_and_mirrored() {
    let m = manager(64);
    let a = m.add_region(region(MIB, 8)).unwrap();
    let b = m
        .add_region(RegionSpec::new(GuestAddress(4 * MIB), 3 * SLOT + 0x1000).with_slot_size(SLOT))
        .unwrap();
    assert_mirrored(&m);
    let regions = m.regions();
    assert_eq!(regions.len(), 2);
    assert_eq!((regions[0].id, regions[0].slots), (a, 8));
    assert_eq!((regions[1].id, regions[1].slots), (b, 4));
    // One region alone reads as the list has it.
    assert_eq!(m.region(a).as_ref(), Some(&regions[0]));
    assert_eq!(m.region(b).as_ref(), Some(&regions[1]));
    let last = m
        .current()
        .find_region(GuestAddress(4 * MIB + 3 * SLOT))
        .unwrap()
        .slot()
        .size();
    assert_eq!(last, 0x1000, "the last slot holds the remainder");
    assert_eq!(
        m.slot_usage(),
        SlotUsage {
            used: 12,
            free: 52,
            reserved: 0,
            max: 64
        }
    );
    m.remove_region(a).unwrap();
    assert_eq!(m.region(a), None, "a removed region is no region");
    assert_mirrored(&m);
    // Freed slot numbers are reused, lowest first.
    m.add_region(region(8 * MIB, 2)).unwrap();
    let numbers: Vec<u32> = m.kvm().inner().slots().iter().map(|s| s.slot).collect();
    assert_eq!(numbers, vec![0, 1, 8, 9, 10, 11]);
    assert_mirrored(&m);
}

#[test]
fn bad_requests_are_refused_with_the_fault_named() {
    let m = manager(10);
    let a = m.add_region(region(MIB, 8)).unwrap();
    let before = everything(&m);
    let cases: Vec<(RegionSpec, &str)> = vec![
        (
            region(MIB + 7 * SLOT, 2),
            "guest range [0x11c000, 0x124000) overlaps region 0 at [0x11c000, 0x120000)",
        ),
        (
            region(0, 3),
            "out of KVM memory slots: 3 needed, 2 of 10 free",
        ),
        (
            RegionSpec::new(GuestAddress(0x800), SLOT),
            "guest address 0x800 is not a multiple of the page size (0x1000)",
        ),
        (RegionSpec::new(GuestAddress(0), 0), "region size is zero"),
        (
            RegionSpec::new(GuestAddress(u64::MAX - 0xfff), 0x2000),
            "guest range at 0xfffffffffffff000 of size 0x2000 wraps around the address space",
        ),
        (
            RegionSpec::new(GuestAddress(0), SLOT).with_slot_size(0),
            "slot size 0x0 is zero or above the per-slot limit 0x7fffffff000",
        ),
    ];
    for (spec, message) in cases {
        assert_eq!(m.add_region(spec).unwrap_err().to_string(), message);
        assert_eq!(everything(&m), before);
    }
    assert_eq!(
        m.remove_region(RegionId(7)).unwrap_err().to_string(),
        "region 7 does not exist"
    );
    let err = m.move_region(a, GuestAddress(MIB - SLOT)).map(|_| ());
    assert!(err.is_ok());
    m.add_region(region(0, 1)).unwrap();
    assert_eq!(
        m.move_region(a, GuestAddress(0)).unwrap_err().to_string(),
        "guest range [0x0, 0x4000) overlaps region 1 at [0x0, 0x4000)"
    );
    assert_mirrored(&m);
}

/// An operation on a manager prepared by `setup`.
type Operation = fn(&Manager, RegionId) -> Result<(), Error>;

fn setup() -> (Manager, RegionId) {
    let m = manager(64);
    let r = m.add_region(region(MIB, 8)).unwrap();
    m.add_region(region(16 * MIB, 2)).unwrap();
    (m, r)
}

/// Each operation under test: its name, what to do first (not failed), and the operation.
// A slot layout of one slot is a one-element list of ranges, as the lint warns; it is meant.
#[allow(clippy::single_range_in_vec_init)]
fn operations() -> Vec<(&'static str, Operation, Operation)> {
    let nothing: Operation = |_, _| Ok(());
    vec![
        ("add", nothing, |m, _| {
            m.add_region(region(32 * MIB, 8)).map(drop)
        }),
        ("remove", nothing, |m, r| m.remove_region(r)),
        ("add a batch", nothing, |m, _| {
            m.add_regions([region(32 * MIB, 3), region(48 * MIB, 1), region(8 * MIB, 2)])
                .map(drop)
        }),
        ("remove a batch", nothing, |m, r| {
            m.remove_regions([RegionId(1), r])
        }),
        (
            "replace logging regions in one batch",
            |m, _| m.start_dirty_log(Target::All),
            |m, r| {
                m.apply(vec![
                    RegionChange::Add(region(MIB + 4 * SLOT, 6)),
                    RegionChange::Remove(r),
                    RegionChange::Add(region(MIB, 4)),
                    RegionChange::Remove(RegionId(1)),
                ])
                .map(drop)
            },
        ),
        ("move up into itself", nothing, |m, r| {
            m.move_region(r, GuestAddress(MIB + 3 * SLOT))
        }),
        ("move down into itself", nothing, |m, r| {
            m.move_region(r, GuestAddress(MIB - 5 * SLOT))
        }),
        ("set read-only", nothing, |m, r| m.set_read_only(r, true)),
        (
            "set a logging region read-only",
            |m, r| m.start_dirty_log(Target::Region(r)),
            |m, r| m.set_read_only(r, true),
        ),
        ("start logging all", nothing, |m, _| {
            m.start_dirty_log(Target::All)
        }),
        (
            "stop logging one",
            |m, r| m.start_dirty_log(Target::Region(r)),
            |m, r| m.stop_dirty_log(Target::Region(r)),
        ),
        ("merge slots", nothing, |m, r| {
            m.reslot(reslot(r, 0..8, &[0..4, 4..8]))
        }),
        (
            "split a slot and make a hole",
            |m, r| m.reslot(reslot(r, 0..8, &[0..8])),
            |m, r| m.reslot(reslot(r, 0..8, &[0..2, 2..3, 5..8])),
        ),
        (
            "merge logging slots, keeping one",
            |m, r| m.start_dirty_log(Target::Region(r)),
            |m, r| m.reslot(reslot(r, 2..8, &[2..3, 3..6, 6..8])),
        ),
        (
            "re-slot, remove and add in one batch",
            |m, r| m.reslot(reslot(r, 0..8, &[0..1, 4..8])),
            |m, r| {
                m.apply(vec![
                    RegionChange::Add(region(32 * MIB, 2)),
                    RegionChange::Reslot(reslot(r, 0..8, &[0..2, 3..8])),
                    RegionChange::Remove(RegionId(1)),
                ])
                .map(drop)
            },
        ),
    ]
}

/// A re-slot of region `r` (of `SLOT`-sized slots, as `region` makes) in units of `SLOT`.
fn reslot(r: RegionId, range: std::ops::Range<u64>, slots: &[std::ops::Range<u64>]) -> Reslot {
    Reslot {
        region: r,
        range: range.start * SLOT..range.end * SLOT,
        slots: slots.iter().map(|s| s.start * SLOT..s.end * SLOT).collect(),
    }
}

#[test]
fn a_failure_at_any_step_leaves_kvm_and_the_map_as_they_were() {
    let fresh = |prepare: Operation| {
        let (m, r) = setup();
        prepare(&m, r).unwrap();
        (m, r)
    };
    for (name, prepare, op) in operations() {
        // Count the KVM requests the operation makes.
        let (m, r) = fresh(prepare);
        let calls = m.kvm().inner().set_calls();
        op(&m, r).unwrap_or_else(|e| panic!("{name}: {e}"));
        let steps = m.kvm().inner().set_calls() - calls;
        assert!(steps >= 2, "{name}: {steps} steps");
        assert_mirrored(&m);
        for k in 0..steps {
            let (m, r) = fresh(prepare);
            let before = everything(&m);
            m.kvm().fail(KvmCall::SetRegion, k, libc::EIO);
            let err = op(&m, r).expect_err(name);
            assert!(matches!(err, Error::Kvm { .. }), "{name} step {k}: {err}");
            assert!(err.to_string().contains("Input/output error"), "{err}");
            assert_eq!(
                everything(&m),
                before,
                "{name}: failure at step {k} changed something"
            );
            assert_mirrored(&m);
            // The same operation goes through once KVM accepts it.
            op(&m, r).unwrap_or_else(|e| panic!("{name} after a failure: {e}"));
            assert_mirrored(&m);
        }
    }
}

#[test]
fn a_failed_undo_is_reported_and_refuses_further_changes() {
    let (m, r) = setup();
    // The third request fails, and so does every later one: the undo of the first two too.
    m.kvm().fail_from(KvmCall::SetRegion, 2, libc::EIO);
    let err = m.move_region(r, GuestAddress(64 * MIB)).unwrap_err();
    assert!(matches!(err, Error::UndoFailed { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("KVM's slots no longer match the map"),
        "{err}"
    );
    m.kvm().heal();
    let refused = m.add_region(region(128 * MIB, 1)).unwrap_err();
    assert!(matches!(refused, Error::Broken { .. }), "{refused}");
    // Reads still work.
    assert_eq!(m.regions().len(), 2);
    m.harvest_dirty(Target::All).unwrap();
}

#[test]
fn dirty_pages_come_from_kvm_and_from_the_vmm() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    // Initially set: the first harvest reports every page of the logging region.
    let first = m.harvest_dirty(Target::All).unwrap();
    assert_eq!(first[0].count(), 8 * SLOT / PAGE_SIZE);
    assert_eq!(first[1].count(), 0);
    assert!(m
        .harvest_dirty(Target::All)
        .unwrap()
        .iter()
        .all(|d| d.count() == 0));
    // The guest writes two pages in different slots; the VMM writes one through vm-memory.
    let fake = m.kvm().inner();
    assert!(fake.guest_write(MIB + 0x1000));
    assert!(fake.guest_write(MIB + 5 * SLOT + 0x2010));
    m.current()
        .write_obj(0xabcd_u32, GuestAddress(MIB + 7 * SLOT + 0x3000))
        .unwrap();
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(
        got,
        vec![
            MIB + 0x1000,
            MIB + 5 * SLOT + 0x2000,
            MIB + 7 * SLOT + 0x3000
        ]
    );
    assert_eq!(m.harvest_dirty(Target::Region(r)).unwrap()[0].count(), 0);
}

#[test]
fn a_failed_harvest_loses_no_dirty_page() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let fake = m.kvm().inner();
    fake.guest_write(MIB);
    fake.guest_write(MIB + 6 * SLOT);
    // Reading the second slot's log fails: the first slot's page was read already.
    m.kvm().fail(KvmCall::GetDirtyLog, 1, libc::EFAULT);
    let err = m.harvest_dirty(Target::All).unwrap_err();
    assert_eq!(
        err.to_string(),
        "region 0: reading the dirty log of slot 1 failed: Bad address (os error 14)"
    );
    // Clearing fails once: the bits stay pending (and set in KVM).
    m.kvm().fail(KvmCall::ClearDirtyLog, 0, libc::EINVAL);
    assert!(m.harvest_dirty(Target::All).is_err());
    let dirty = m.harvest_dirty(Target::All).unwrap();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(got, vec![MIB, MIB + 6 * SLOT]);
    assert_eq!(m.harvest_dirty(Target::All).unwrap()[0].count(), 0);
}

#[test]
fn a_failed_add_uses_up_the_region_id_its_error_names() {
    let m = manager(64);
    m.kvm().fail(KvmCall::SetRegion, 1, libc::EIO);
    let err = m.add_region(region(MIB, 3)).unwrap_err();
    assert!(err.to_string().starts_with("region 0: "), "{err}");
    assert_eq!(m.add_region(region(MIB, 3)).unwrap(), RegionId(1));
    // Refused before any id is taken: the next one is still free.
    assert!(m.add_region(region(MIB, 1)).is_err());
    assert_eq!(m.add_region(region(64 * MIB, 1)).unwrap(), RegionId(2));
}

#[test]
fn reserved_slot_numbers_are_never_used() {
    let kvm = Faulty::new(FakeKvm::new(16, true));
    let m = MemoryManager::with_reserved_slots(kvm, MemoryLimits::unlimited(), 6).unwrap();
    assert_eq!(m.reserved_slots(), 10..16);
    // Ten slots fill the numbers left to the manager; an eleventh is refused.
    let r = m.add_region(region(MIB, 10)).unwrap();
    let err = m.add_region(region(64 * MIB, 1)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "out of KVM memory slots: 1 needed, 0 of 10 free"
    );
    let numbers: Vec<u32> = m.kvm().inner().slots().iter().map(|s| s.slot).collect();
    assert_eq!(numbers, (0..10).collect::<Vec<_>>());
    assert_eq!(
        m.slot_usage(),
        SlotUsage {
            used: 10,
            free: 0,
            reserved: 6,
            max: 16
        }
    );
    // Moves and re-creates stay within them too.
    m.set_read_only(r, true).unwrap();
    m.move_region(r, GuestAddress(128 * MIB)).unwrap();
    assert!(m.kvm().inner().slots().iter().all(|s| s.slot < 10));
    assert_mirrored(&m);
}

#[test]
fn failures_planned_for_two_kinds_of_call_both_come() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.kvm().fail(KvmCall::GetDirtyLog, 0, libc::EFAULT);
    m.kvm().fail(KvmCall::SetRegion, 0, libc::EIO);
    // A second plan for a kind replaces the first: this one skips a call.
    m.kvm().fail(KvmCall::GetDirtyLog, 1, libc::EIO);
    let err = m.harvest_dirty(Target::All).unwrap_err();
    assert!(err.to_string().contains("Input/output error"), "{err}");
    assert!(
        m.kvm().failure_pending(),
        "the SetRegion plan is still to come"
    );
    let err = m.set_read_only(r, true).unwrap_err();
    assert!(err.to_string().contains("KVM refused"), "{err}");
    assert!(!m.kvm().failure_pending());
    m.set_read_only(r, true).unwrap();
}

#[test]
fn stopping_logging_or_toggling_read_only_keeps_logged_pages() {
    let (m, r) = setup();
    m.start_dirty_log(Target::All).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    m.kvm().inner().guest_write(MIB + 2 * SLOT);
    m.set_read_only(r, true).unwrap();
    assert!(m.regions()[0].flags.read_only);
    assert_mirrored(&m);
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    // Re-created slots start all dirty again (initially set), and the page written before is
    // among them.
    assert!(dirty[0].addresses().any(|a| a.0 == MIB + 2 * SLOT));
    m.harvest_dirty(Target::All).unwrap();
    m.kvm().inner().guest_write(MIB + 3 * SLOT);
    m.stop_dirty_log(Target::All).unwrap();
    assert_mirrored(&m);
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    assert_eq!(
        dirty[0].addresses().map(|a| a.0).collect::<Vec<_>>(),
        vec![MIB + 3 * SLOT]
    );
}

#[test]
fn a_moved_region_keeps_its_data_and_slot_numbers() {
    let (m, r) = setup();
    let pattern: Vec<u8> = (0..8 * SLOT).map(|i| (i % 251) as u8).collect();
    m.current()
        .write_slice(&pattern, GuestAddress(MIB))
        .unwrap();
    let numbers_before: Vec<u32> = m.kvm().inner().slots().iter().map(|s| s.slot).collect();
    m.move_region(r, GuestAddress(MIB + 3 * SLOT)).unwrap();
    m.move_region(r, GuestAddress(40 * MIB)).unwrap();
    assert_mirrored(&m);
    let numbers_after: Vec<u32> = m.kvm().inner().slots().iter().map(|s| s.slot).collect();
    assert_eq!(
        numbers_before, numbers_after,
        "a move keeps KVM's slot numbers"
    );
    let mut back = vec![0u8; pattern.len()];
    m.current()
        .read_slice(&mut back, GuestAddress(40 * MIB))
        .unwrap();
    assert_eq!(back, pattern);
    assert!(m.current().find_region(GuestAddress(MIB)).is_none());
}

#[test]
fn discard_zeroes_private_and_frees_shared_memory() {
    let m = manager(16);
    let private = m.add_region(region(MIB, 4)).unwrap();
    let shared = m
        .add_region(region(2 * MIB, 4).with_backing(Backing::Memfd))
        .unwrap();
    let mem = m.current();
    for gpa in [MIB, 2 * MIB] {
        mem.write_slice(&[0xaa; 4 * SLOT as usize], GuestAddress(gpa))
            .unwrap();
    }
    // Across a slot boundary, in both regions.
    for gpa in [MIB + SLOT, 2 * MIB + SLOT] {
        m.discard(GuestAddress(gpa + 0x3000), 0x2000).unwrap();
        let mut buf = [0u8; 0x4000];
        mem.read_slice(&mut buf, GuestAddress(gpa)).unwrap();
        assert!(buf[..0x3000].iter().all(|b| *b == 0xaa));
        assert!(buf[0x3000..].iter().all(|b| *b == 0));
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(gpa + 0x5000)).unwrap(),
            0xaa
        );
    }
    let err = m
        .discard(GuestAddress(MIB + 3 * SLOT), 2 * SLOT)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot discard [0x10c000, 0x114000): no memory at 0x110000"
    );
    // The refused discard did not touch the part that is memory.
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(MIB + 3 * SLOT)).unwrap(),
        0xaa
    );
    assert!(m.regions().iter().any(|r| r.id == shared && r.shared));
    assert!(m.regions().iter().any(|r| r.id == private && !r.shared));
}

#[test]
fn host_addresses_lead_back_to_their_guest_addresses() {
    let (m, r) = setup();
    let info = m.regions().into_iter().find(|i| i.id == r).unwrap();
    let found = m.find_by_hva(HostAddress(info.hva.0 + 5 * SLOT + 0x10));
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].region, r);
    assert_eq!(found[0].gpa, GuestAddress(MIB + 5 * SLOT + 0x10));
    assert!(m.find_by_hva(HostAddress(8)).is_empty());
}

#[test]
fn dropping_the_manager_deletes_every_kvm_slot() {
    let fake = Arc::new(FakeKvm::new(16, false));
    let m = MemoryManager::new(Arc::clone(&fake));
    m.add_region(region(MIB, 5)).unwrap();
    assert_eq!(fake.slots().len(), 5);
    drop(m);
    assert!(fake.slots().is_empty());
}

#[test]
fn the_first_harvest_reports_every_page_without_manual_protection_too() {
    let m = MemoryManager::new(FakeKvm::new(16, false));
    let r = m.add_region(region(MIB, 2)).unwrap();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.kvm().guest_write(MIB);
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    assert_eq!(dirty[0].count(), 2 * SLOT / PAGE_SIZE);
    m.kvm().guest_write(MIB + SLOT);
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(got, vec![MIB + SLOT]);
}

#[test]
fn a_refused_stop_of_logging_reports_every_page_of_its_regions() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    m.kvm().inner().guest_write(MIB);
    // The third slot's update is refused: the first two were unlogged for a while.
    m.kvm().fail(KvmCall::SetRegion, 2, libc::EIO);
    m.stop_dirty_log(Target::Region(r)).unwrap_err();
    assert!(m.regions()[0].flags.log_dirty, "the stop was undone");
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    assert_eq!(dirty[0].count(), m.regions()[0].size / PAGE_SIZE);
}

#[test]
fn discarded_pages_are_reported_dirty() {
    let (m, r) = setup();
    m.harvest_dirty(Target::All).unwrap();
    // Three pages across a slot boundary, with no guest or VMM write.
    m.discard(GuestAddress(MIB + SLOT - 0x1000), 0x3000)
        .unwrap();
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(
        got,
        vec![MIB + SLOT - 0x1000, MIB + SLOT, MIB + SLOT + 0x1000]
    );
    assert_eq!(m.harvest_dirty(Target::Region(r)).unwrap()[0].count(), 0);
}

#[test]
fn a_log_read_failing_during_a_stop_undoes_it_and_loses_no_page() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let fake = m.kvm().inner();
    fake.guest_write(MIB + 0x10);
    fake.guest_write(MIB + 4 * SLOT);
    let before = everything(&m);
    // The third slot's log cannot be read: the first two slots had stopped logging already.
    m.kvm().fail(KvmCall::GetDirtyLog, 2, libc::EIO);
    let err = m.stop_dirty_log(Target::Region(r)).unwrap_err();
    assert!(matches!(err, Error::GetDirtyLog { slot: 2, .. }), "{err}");
    assert_eq!(everything(&m), before, "the stop was undone");
    assert!(
        m.regions()
            .iter()
            .find(|i| i.id == r)
            .unwrap()
            .flags
            .log_dirty
    );
    // Slot 0's page was read before the failure and slot 4's is still in KVM's log; slots
    // 0 and 1 logged again from all-set bitmaps (initially set), so they report every page.
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert!(
        got.contains(&MIB) && got.contains(&(MIB + 4 * SLOT)),
        "{got:x?}"
    );
    m.stop_dirty_log(Target::Region(r)).unwrap();
    assert_mirrored(&m);
}

/// How long a test waits for another thread before it gives up.
const PATIENCE: Duration = Duration::from_secs(30);

#[derive(Default)]
struct GateState {
    /// The next call of this kind (on this slot number, if given) stops at the gate.
    armed: Option<(KvmCall, Option<u32>)>,
    /// A call is waiting at the gate.
    entered: bool,
    /// The waiting call may go on.
    released: bool,
}

/// A hook with a gate: once armed, the next call of the armed kind says that it arrived and
/// waits until the test releases it. A change stopped in `set_user_memory_region` holds the
/// manager's writer lock and has published nothing; a harvest stopped in `get_dirty_log` or
/// `reset_dirty_rings` is half-way through.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    /// Called before every dirty-log or ring call reaches the fake (the concurrency test's
    /// rendezvous).
    rendezvous: std::sync::OnceLock<Box<dyn Fn(KvmCall) + Send + Sync>>,
}

/// The fake KVM behind a [`Gate`].
type Gated = Hooked<FakeKvm, Gate>;

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn arm(&self) {
        self.arm_at(KvmCall::SetRegion, None);
    }

    /// Arms the gate for the next call of kind `call` (on slot number `slot`, if given).
    fn arm_at(&self, call: KvmCall, slot: Option<u32>) {
        self.lock().armed = Some((call, slot));
    }

    /// Whether a call is waiting at the gate now.
    fn holding(&self) -> bool {
        let state = self.lock();
        state.entered && !state.released
    }

    /// Stops the calling KVM call at the gate if it is armed for it.
    fn pass(&self, call: KvmCall, slot: Option<u32>) {
        let mut state = self.lock();
        let hit = state
            .armed
            .is_some_and(|(c, s)| c == call && (s.is_none() || s == slot));
        if hit {
            state.armed = None;
            state.entered = true;
            self.changed.notify_all();
            let (_state, waited) = self
                .changed
                .wait_timeout_while(state, PATIENCE, |s| !s.released)
                .unwrap_or_else(|p| p.into_inner());
            assert!(!waited.timed_out(), "the gate was never released");
        }
    }

    /// Waits until a call is stopped at the gate.
    fn wait_entered(&self) {
        let state = self.lock();
        let (_state, waited) = self
            .changed
            .wait_timeout_while(state, PATIENCE, |s| !s.entered)
            .unwrap_or_else(|p| p.into_inner());
        assert!(!waited.timed_out(), "no KVM call reached the gate");
    }

    fn release(&self) {
        self.lock().released = true;
        self.changed.notify_all();
    }
}

impl Hook for Gate {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        let call = request.kind();
        if matches!(
            call,
            KvmCall::GetDirtyLog | KvmCall::ClearDirtyLog | KvmCall::ResetDirtyRings
        ) {
            if let Some(rendezvous) = self.rendezvous.get() {
                rendezvous(call);
            }
        }
        self.pass(call, request.slot());
        proceed()
    }
}

/// The scheduling state of thread `tid` of this process ('R', 'S', 'D', ...).
fn thread_state(tid: libc::pid_t) -> char {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
        .unwrap_or_else(|e| panic!("cannot read the state of thread {tid}: {e}"));
    // "tid (name) S ...": the name may hold spaces and parentheses, the state follows the last
    // ')'.
    let after_name = &stat[stat.rfind(')').expect("a stat line names its thread") + 1..];
    after_name
        .trim_start()
        .chars()
        .next()
        .expect("a stat line has a state")
}

/// Waits until thread `tid` sleeps (on a lock, in these tests).
fn wait_until_asleep(tid: libc::pid_t) {
    let step = Duration::from_millis(1);
    for _ in 0..PATIENCE.as_millis() {
        if thread_state(tid) == 'S' {
            return;
        }
        thread::sleep(step);
    }
    panic!("thread {tid} never went to sleep");
}

/// A discard that starts while a move of the region it names is half-way through KVM waits for
/// the move and then sees the region gone from the old range. Reading the map before taking the
/// writer lock would let it wipe the region at its new address and mark its pages dirty.
#[test]
fn a_discard_racing_a_move_waits_for_it_and_spares_the_moved_data() {
    let m = MemoryManager::new(Gated::new(FakeKvm::new(16, true)));
    let r = m.add_region(region(MIB, 4)).unwrap();
    let pattern: Vec<u8> = (0..4 * SLOT).map(|i| (i % 251) as u8 | 1).collect();
    m.current()
        .write_slice(&pattern, GuestAddress(MIB))
        .unwrap();
    assert_eq!(
        m.harvest_dirty(Target::All).unwrap()[0].count(),
        4 * SLOT / PAGE_SIZE
    );
    let m = &m;
    m.kvm().hook().arm();
    let discarded = thread::scope(|scope| {
        // The move stops in KVM, holding the writer lock, before it publishes anything.
        let mover = scope.spawn(|| m.move_region(r, GuestAddress(8 * MIB)));
        m.kvm().hook().wait_entered();
        let (tid_tx, tid_rx) = mpsc::channel();
        let discarder = scope.spawn(move || {
            // SAFETY: gettid has no preconditions and cannot fail.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            m.discard(GuestAddress(MIB), 4 * SLOT)
        });
        let tid = tid_rx.recv_timeout(PATIENCE).unwrap();
        // The discard is blocked on the writer lock that the move holds.
        wait_until_asleep(tid);
        m.kvm().hook().release();
        mover.join().unwrap().unwrap();
        discarder.join().unwrap()
    });
    // The discard ran after the move: the old range is a hole.
    match discarded {
        Err(Error::DiscardHole { range, hole }) => {
            assert_eq!(range.start, MIB);
            assert_eq!(hole, MIB);
        }
        other => panic!("the discard did not see the move: {other:?}"),
    }
    let mut back = vec![0u8; pattern.len()];
    m.current()
        .read_slice(&mut back, GuestAddress(8 * MIB))
        .unwrap();
    assert!(back == pattern, "the moved region lost its data");
    let dirty = m.harvest_dirty(Target::All).unwrap();
    assert_eq!(dirty[0].count(), 0, "pages were marked dirty: {dirty:?}");
}

#[test]
fn refusals_are_the_callers_errors_and_kvm_failures_are_not() {
    let (m, r) = setup();
    let caller_errors = [
        (
            m.add_region(RegionSpec::new(GuestAddress(0x800), SLOT)),
            ErrorKind::Invalid,
        ),
        (m.add_region(region(MIB, 1)), ErrorKind::Conflict),
        (m.add_region(region(64 * MIB, 100)), ErrorKind::Conflict),
        (
            m.remove_region(RegionId(99)).map(|()| RegionId(99)),
            ErrorKind::NotFound,
        ),
        (
            m.discard(GuestAddress(MIB), 9 * SLOT).map(|()| r),
            ErrorKind::Invalid,
        ),
    ];
    for (result, kind) in caller_errors {
        let err = result.unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
        assert!(err.is_caller_error(), "{err}");
    }
    m.kvm().fail(KvmCall::SetRegion, 0, libc::EIO);
    let err = m.move_region(r, GuestAddress(64 * MIB)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Host, "{err}");
    assert!(!err.is_caller_error());
    m.kvm().fail_from(KvmCall::SetRegion, 1, libc::EIO);
    let err = m.move_region(r, GuestAddress(64 * MIB)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Broken, "{err}");
    m.kvm().heal();
    let err = m.remove_region(r).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Broken, "{err}");
    assert!(!err.is_caller_error());
}

#[test]
fn debug_output_summarises_the_manager() {
    let (m, r) = setup();
    m.move_region(r, GuestAddress(64 * MIB)).unwrap();
    assert_eq!(
        format!("{m:?}"),
        "MemoryManager { slots: 10, max_slots: 64, regions: 2, change_sequence: 6, .. }"
    );
    assert!(
        format!("{:?}", m.handle()).contains("slots: 10"),
        "{:?}",
        m.handle()
    );
}

#[test]
fn regions_over_a_limit_are_refused_before_anything_is_allocated() {
    let limits = MemoryLimits {
        max_guest_memory: 8 * MIB,
        max_region_size: 4 * MIB,
        max_metadata: u64::MAX,
        max_slots: u64::MAX,
    };
    let m = MemoryManager::with_limits(Faulty::new(FakeKvm::new(64, true)), limits);
    assert_eq!(m.limits(), limits);
    let first = m
        .add_region(RegionSpec::new(GuestAddress(0), 4 * MIB))
        .unwrap();
    m.add_region(RegionSpec::new(GuestAddress(4 * MIB), 3 * MIB))
        .unwrap();
    assert_eq!(m.memory_use().guest_memory, 7 * MIB);
    let before = everything(&m);
    let calls = m.kvm().inner().set_calls();
    let refuse = |size: u64| {
        m.add_region(RegionSpec::new(GuestAddress(GIB), size))
            .unwrap_err()
    };
    let e = refuse(4 * MIB + PAGE_SIZE);
    assert_eq!(e.kind(), ErrorKind::Invalid);
    assert!(
        e.to_string()
            .contains("over the limit max_region_size = 0x400000"),
        "{e}"
    );
    let e = refuse(2 * MIB);
    assert_eq!(e.kind(), ErrorKind::Conflict);
    assert!(
        e.to_string()
            .contains("would bring guest memory to 0x900000 bytes (0.0 GiB), over the limit max_guest_memory = 0x800000"),
        "{e}"
    );
    // Sizes no host can give are limits' business too, never an allocation that aborts.
    for shift in [40, 44, 52, 56, 63] {
        assert!(
            matches!(refuse(1 << shift), Error::OverLimit { .. }),
            "2^{shift}"
        );
    }
    assert!(matches!(refuse(u64::MAX - 4095), Error::WrapAround { .. }));
    assert_eq!(everything(&m), before, "a refusal changes nothing");
    assert_eq!(m.kvm().inner().set_calls(), calls, "nor asks KVM anything");
    assert!(m.admit(MIB, MIB).is_ok() && m.admit(2 * MIB, MIB).is_err());
    // An area of many regions: each under the per-region limit, the total under the others.
    assert!(matches!(
        m.admit(MIB, 5 * MIB),
        Err(Error::OverLimit {
            limit: Limit::RegionSize,
            ..
        })
    ));
    // Removing a region gives its share back.
    m.remove_region(first).unwrap();
    assert_eq!(m.memory_use().guest_memory, 3 * MIB);
    m.add_region(RegionSpec::new(GuestAddress(GIB), 4 * MIB))
        .unwrap();
    // Metadata is limited as well: the estimate of the next region is over.
    let tight = MemoryLimits {
        max_metadata: m.memory_use().metadata + crate::metadata_bytes(MIB) - 1,
        ..MemoryLimits::unlimited()
    };
    m.set_limits(tight);
    let e = m
        .add_region(RegionSpec::new(GuestAddress(2 * GIB), MIB))
        .unwrap_err();
    assert!(e.to_string().contains("max_metadata"), "{e}");
}

type RingManager = MemoryManager<Faulty<FakeKvm>>;

fn ring_manager(entries: u32) -> RingManager {
    MemoryManager::new(Faulty::new(FakeKvm::with_dirty_ring(64, entries)))
}

/// Harvests region `id` and returns the guest addresses of its dirty pages.
fn dirty_addresses(m: &RingManager, id: RegionId) -> Vec<u64> {
    let harvested = m.harvest_dirty(Target::Region(id)).unwrap();
    harvested[0].addresses().map(|a| a.0).collect()
}

#[test]
fn ring_mode_harvests_exactly_the_pages_written() {
    let m = ring_manager(256);
    let id = m.add_region(region(MIB, 4)).unwrap();
    m.start_dirty_log(Target::Region(id)).unwrap();
    // As an initially-set log: the first harvest has every page.
    assert_eq!(dirty_addresses(&m, id).len() as u64, 4 * SLOT / PAGE_SIZE);
    assert!(dirty_addresses(&m, id).is_empty(), "nothing written since");
    let written = [MIB, MIB + SLOT + PAGE_SIZE, MIB + 4 * SLOT - PAGE_SIZE];
    for gpa in written {
        assert!(m.kvm().inner().guest_write(gpa + 8));
        // Written twice before a harvest: one entry, one page.
        assert!(m.kvm().inner().guest_write(gpa));
    }
    assert_eq!(dirty_addresses(&m, id), written.to_vec());
    assert!(dirty_addresses(&m, id).is_empty());
    // Reset re-protected the pages: written again, reported again.
    m.kvm().inner().guest_write(MIB);
    assert_eq!(dirty_addresses(&m, id), vec![MIB]);
}

#[test]
fn rings_are_reset_only_when_entries_were_collected_or_a_reset_is_owed() {
    let m = ring_manager(256);
    let id = m.add_region(logging(region(MIB, 2))).unwrap();
    dirty_addresses(&m, id);
    m.kvm().fail(KvmCall::ResetDirtyRings, 0, libc::EIO);
    // Nothing written: nothing collected, no reset asked for.
    assert!(dirty_addresses(&m, id).is_empty());
    assert!(m.kvm().failure_pending(), "no reset was asked for");
    m.kvm().inner().guest_write(MIB);
    assert!(m.harvest_dirty(Target::All).is_err(), "the reset fails");
    // Nothing new collected, but the failed reset is owed: this harvest asks for it (the page
    // was collected into pending by the failed harvest, and is reported now).
    m.kvm().fail(KvmCall::ResetDirtyRings, 0, libc::EIO);
    assert!(
        m.harvest_dirty(Target::All).is_err(),
        "the owed reset is asked for"
    );
    assert_eq!(dirty_addresses(&m, id), vec![MIB]);
    // Reset now: the page is protected again and a new write to it is reported.
    m.kvm().inner().guest_write(MIB);
    assert_eq!(dirty_addresses(&m, id), vec![MIB]);
}

#[test]
fn ring_entries_keep_their_region_across_changes_and_id_reuse() {
    let m = ring_manager(256);
    let a = m
        .add_region(region(MIB, 2).with_flags(SlotFlags {
            log_dirty: true,
            read_only: false,
        }))
        .unwrap();
    let b = m
        .add_region(region(2 * MIB, 2).with_flags(SlotFlags {
            log_dirty: true,
            read_only: false,
        }))
        .unwrap();
    let c = m
        .add_region(region(3 * MIB, 2).with_flags(SlotFlags {
            log_dirty: true,
            read_only: false,
        }))
        .unwrap();
    for id in [a, b, c] {
        assert_eq!(
            dirty_addresses(&m, id).len() as u64,
            2 * SLOT / PAGE_SIZE,
            "initially set"
        );
    }
    let write = |gpa: u64| assert!(m.kvm().inner().guest_write(gpa));
    // A read-only toggle deletes and re-creates the slots: the entry is kept, and nothing
    // else is added (the re-created slots start protected, not all dirty).
    write(MIB + SLOT);
    m.set_read_only(a, true).unwrap();
    assert_eq!(dirty_addresses(&m, a), vec![MIB + SLOT]);
    m.set_read_only(a, false).unwrap();
    assert!(dirty_addresses(&m, a).is_empty());
    // Stopping logging keeps what was written while it was on.
    write(2 * MIB + PAGE_SIZE);
    m.stop_dirty_log(Target::Region(b)).unwrap();
    assert_eq!(dirty_addresses(&m, b), vec![2 * MIB + PAGE_SIZE]);
    // A moved slot keeps its id and its offset: the entry follows the region.
    write(3 * MIB + 2 * PAGE_SIZE);
    m.move_region(c, GuestAddress(5 * MIB)).unwrap();
    assert_eq!(dirty_addresses(&m, c), vec![5 * MIB + 2 * PAGE_SIZE]);
    // An entry of a removed region never lands in the region that reuses its slot ids.
    write(5 * MIB + SLOT);
    let c_slots: Vec<SlotId> = m
        .published()
        .iter()
        .filter(|s| s.payload().region() == c)
        .map(|s| s.id())
        .collect();
    m.remove_region(c).unwrap();
    let d = m.add_region(region(6 * MIB, 2)).unwrap();
    let d_slots: Vec<SlotId> = m
        .published()
        .iter()
        .filter(|s| s.payload().region() == d)
        .map(|s| s.id())
        .collect();
    assert_eq!(d_slots, c_slots, "the ids are reused");
    assert!(dirty_addresses(&m, d).is_empty(), "nothing of c's is d's");
    m.start_dirty_log(Target::Region(d)).unwrap();
    assert_eq!(dirty_addresses(&m, d).len() as u64, 2 * SLOT / PAGE_SIZE);
    write(6 * MIB + SLOT + PAGE_SIZE);
    assert_eq!(dirty_addresses(&m, d), vec![6 * MIB + SLOT + PAGE_SIZE]);
}

#[test]
fn a_failed_ring_reset_loses_no_page_and_a_full_ring_is_emptied() {
    let m = ring_manager(256);
    let id = m
        .add_region(
            region(MIB, 80)
                .with_slot_size(4 * SLOT)
                .with_flags(SlotFlags {
                    log_dirty: true,
                    read_only: false,
                }),
        )
        .unwrap();
    dirty_addresses(&m, id);
    m.kvm().inner().guest_write(MIB);
    m.kvm().fail(KvmCall::ResetDirtyRings, 0, libc::EIO);
    let e = m.harvest_dirty(Target::All).unwrap_err();
    assert!(
        e.to_string().contains("resetting the dirty rings failed"),
        "{e}"
    );
    assert_eq!(
        dirty_addresses(&m, id),
        vec![MIB],
        "kept for the next harvest"
    );
    // Fill the ring, as a running vCPU would before exiting with KVM_EXIT_DIRTY_RING_FULL.
    let pages: Vec<u64> = (0..300).map(|p| MIB + p * PAGE_SIZE).collect();
    for &gpa in &pages[..256] {
        m.kvm().inner().guest_write(gpa);
    }
    assert!(m.kvm().inner().ring_full());
    m.collect_dirty_rings().unwrap();
    assert!(!m.kvm().inner().ring_full());
    for &gpa in &pages[256..] {
        m.kvm().inner().guest_write(gpa);
    }
    assert_eq!(dirty_addresses(&m, id), pages);
}

type GatedManager = MemoryManager<Gated>;

fn logging(spec: RegionSpec) -> RegionSpec {
    spec.with_flags(SlotFlags {
        log_dirty: true,
        read_only: false,
    })
}

/// The slot numbers of region `id` in the published map, in offset order.
fn slot_numbers<K: KvmMemory>(m: &MemoryManager<K>, id: RegionId) -> Vec<u32> {
    let mut slots: Vec<(u64, u32)> = m
        .published()
        .iter()
        .filter(|s| s.payload().region() == id)
        .map(|s| (s.payload().offset(), s.id().0))
        .collect();
    slots.sort_unstable();
    slots.into_iter().map(|(_, n)| n).collect()
}

/// Pages reported, by region (page numbers counted from the region's base).
type Reported = BTreeMap<RegionId, BTreeSet<u64>>;

fn record(into: &mut Reported, harvested: &[DirtyPages]) {
    for d in harvested {
        let pages = into.entry(d.region).or_default();
        pages.extend((0..d.pages).filter(|p| d.is_dirty(*p)));
    }
}

/// How long a change may take while a harvest is stopped at the gate: it waits for nothing,
/// so this is plenty; a change that waited for the harvest would never end.
const CHANGE_PATIENCE: Duration = Duration::from_secs(5);

/// Runs `changes` on another thread while the gate holds a harvest, and returns what they
/// return. Fails (after releasing the gate) if they do not finish while the harvest is held.
fn change_while_held<T: Send>(m: &GatedManager, changes: impl FnOnce() -> T + Send) -> T {
    thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel();
        let changer = scope.spawn(move || {
            let result = changes();
            let _ = done_tx.send(());
            result
        });
        if done_rx.recv_timeout(CHANGE_PATIENCE).is_err() {
            m.kvm().hook().release();
            panic!("a change waited for a harvest held inside KVM (the writer lock?)");
        }
        assert!(m.kvm().hook().holding(), "the harvest was held throughout");
        changer.join().unwrap()
    })
}

/// A bitmap-mode harvest held inside `KVM_GET_DIRTY_LOG`: a stop of logging, a remove and an
/// add that reuses the removed slot numbers, and a read-only toggle of the harvested region
/// all complete meanwhile, and the harvests report every page the guest wrote while logging.
/// The region added logging reports every page (its first harvest, in every mode); with
/// all-set logs, so does the region whose slots were re-created (the documented over-report);
/// the others report exactly what was written.
fn bitmap_harvest_held_in_kvm(manual: bool) {
    let m: GatedManager = MemoryManager::new(Gated::new(FakeKvm::new(16, manual)));
    let a = m.add_region(logging(region(MIB, 4))).unwrap();
    let b = m.add_region(logging(region(2 * MIB, 2))).unwrap();
    let c = m.add_region(logging(region(3 * MIB, 2))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let fake = m.kvm().inner();
    let write = |base: u64, page: u64| assert!(fake.guest_write(base + page * PAGE_SIZE));
    let mut written = Reported::new();
    let mut wrote = |r: RegionId, base: u64, page: u64| {
        write(base, page);
        written.entry(r).or_default().insert(page);
    };
    for page in [1, 5, 13] {
        wrote(a, MIB, page);
    }
    wrote(b, 2 * MIB, 2);
    write(3 * MIB, 0);
    write(3 * MIB, 6);
    let c_slots = slot_numbers(&m, c);
    let a_slots = slot_numbers(&m, a);
    // The harvest stops reading a's second slot (its first one is read already).
    m.kvm()
        .hook()
        .arm_at(KvmCall::GetDirtyLog, Some(a_slots[1]));
    let mut reported = Reported::new();
    let (d, more) = thread::scope(|scope| {
        let harvester = scope.spawn(|| m.harvest_dirty(Target::All));
        m.kvm().hook().wait_entered();
        let changed = change_while_held(&m, || {
            let mut more = Vec::new();
            write(MIB, 6);
            more.push((a, 6));
            m.stop_dirty_log(Target::Region(b)).unwrap();
            write(2 * MIB, 3); // not logged: not the harvests' to report
            m.remove_region(c).unwrap();
            let d = m.add_region(logging(region(4 * MIB, 2))).unwrap();
            assert_eq!(slot_numbers(&m, d), c_slots, "c's slot numbers are reused");
            write(4 * MIB, 1);
            more.push((d, 1));
            m.set_read_only(a, true).unwrap();
            m.set_read_only(a, false).unwrap();
            write(MIB, 9);
            more.push((a, 9));
            (d, more)
        });
        assert!(!harvester.is_finished());
        m.kvm().hook().release();
        record(&mut reported, &harvester.join().unwrap().unwrap());
        changed
    });
    for (r, page) in more {
        written.entry(r).or_default().insert(page);
    }
    record(&mut reported, &m.harvest_dirty(Target::All).unwrap());
    assert!(
        m.harvest_dirty(Target::All)
            .unwrap()
            .iter()
            .all(|h| h.count() == 0),
        "everything was reported once"
    );
    reported.remove(&c);
    written.insert(d, (0..8).collect());
    if manual {
        written.insert(a, (0..16).collect());
    }
    assert_eq!(reported, written);
    assert_mirrored_gated(&m);
}

fn assert_mirrored_gated(m: &GatedManager) {
    let mut expected: Vec<KvmSlot> = m
        .published()
        .iter()
        .map(|s| KvmSlot::from(s.as_ref()))
        .collect();
    expected.sort_by_key(|s| s.slot);
    assert_eq!(
        m.kvm().inner().slots(),
        expected,
        "KVM and the map disagree"
    );
}

#[test]
fn a_harvest_held_in_kvm_lets_changes_through_and_loses_no_page() {
    bitmap_harvest_held_in_kvm(false);
    bitmap_harvest_held_in_kvm(true);
}

/// A harvest reading a slot's log keeps its number from being given to a new region (KVM
/// would write that region's log, maybe longer, into the harvest's buffer); a read that finds
/// the slot deleted meanwhile is skipped, not an error.
#[test]
fn a_slot_number_being_read_is_not_given_to_a_new_region() {
    let m: GatedManager = MemoryManager::new(Gated::new(FakeKvm::new(16, true)));
    let _a = m.add_region(logging(region(MIB, 2))).unwrap();
    let d = m.add_region(logging(region(2 * MIB, 2))).unwrap();
    let d_slots = slot_numbers(&m, d);
    m.harvest_dirty(Target::All).unwrap();
    m.kvm()
        .hook()
        .arm_at(KvmCall::GetDirtyLog, Some(d_slots[0]));
    thread::scope(|scope| {
        let harvester = scope.spawn(|| m.harvest_dirty(Target::Region(d)));
        m.kvm().hook().wait_entered();
        let e = change_while_held(&m, || {
            m.remove_region(d).unwrap();
            m.add_region(logging(region(3 * MIB, 2))).unwrap()
        });
        let e_slots = slot_numbers(&m, e);
        assert!(
            !e_slots.contains(&d_slots[0]),
            "{e_slots:?} reuse the number being read"
        );
        assert!(e_slots.contains(&d_slots[1]), "the others are reused");
        m.kvm().hook().release();
        let harvested = harvester.join().unwrap();
        assert!(harvested.is_ok(), "{harvested:?}");
    });
    // Once the harvest is done, the number is free for the next region.
    let f = m.add_region(region(4 * MIB, 1)).unwrap();
    assert_eq!(slot_numbers(&m, f), vec![d_slots[0]]);
    assert_mirrored_gated(&m);
}

/// The same race in ring mode, with the harvest held in `KVM_RESET_DIRTY_RINGS` after it
/// took and attributed the entries: the changes (whose drains collect the rings too) complete
/// meanwhile, and the harvests report exactly the pages written while logging; an entry of a
/// removed region never lands in the region that reuses its slot numbers.
#[test]
fn a_ring_harvest_held_in_kvm_lets_changes_through_and_loses_no_page() {
    let m: GatedManager = MemoryManager::new(Gated::new(FakeKvm::with_dirty_ring(16, 256)));
    let a = m.add_region(logging(region(MIB, 4))).unwrap();
    let b = m.add_region(logging(region(2 * MIB, 2))).unwrap();
    let c = m.add_region(logging(region(3 * MIB, 2))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let fake = m.kvm().inner();
    let write = |base: u64, page: u64| assert!(fake.guest_write(base + page * PAGE_SIZE));
    let mut written = Reported::new();
    for page in [1, 5, 13] {
        write(MIB, page);
        written.entry(a).or_default().insert(page);
    }
    write(2 * MIB, 2);
    written.entry(b).or_default().insert(2);
    write(3 * MIB, 0);
    let c_slots = slot_numbers(&m, c);
    m.kvm().hook().arm_at(KvmCall::ResetDirtyRings, None);
    let mut reported = Reported::new();
    let d = thread::scope(|scope| {
        let harvester = scope.spawn(|| m.harvest_dirty(Target::All));
        m.kvm().hook().wait_entered();
        let d = change_while_held(&m, || {
            write(MIB, 6);
            write(3 * MIB, 6); // c's, in the ring when c is removed
            m.stop_dirty_log(Target::Region(b)).unwrap();
            write(2 * MIB, 3); // not logged
            write(3 * MIB, 7);
            m.remove_region(c).unwrap();
            // Not logging: any page it reports would be one of c's entries.
            let d = m.add_region(region(4 * MIB, 2)).unwrap();
            assert_eq!(slot_numbers(&m, d), c_slots, "c's slot numbers are reused");
            write(MIB, 8);
            m.set_read_only(a, true).unwrap();
            m.set_read_only(a, false).unwrap();
            write(MIB, 9);
            d
        });
        assert!(!harvester.is_finished());
        m.kvm().hook().release();
        record(&mut reported, &harvester.join().unwrap().unwrap());
        d
    });
    written.entry(a).or_default().extend([6, 8, 9]);
    record(&mut reported, &m.harvest_dirty(Target::All).unwrap());
    assert!(m
        .harvest_dirty(Target::All)
        .unwrap()
        .iter()
        .all(|h| h.count() == 0));
    reported.remove(&c);
    reported.retain(|_, pages| !pages.is_empty());
    assert!(
        !reported.contains_key(&d),
        "c's entries landed in d: {reported:?}"
    );
    assert_eq!(reported, written);
    assert_mirrored_gated(&m);
}

/// What the concurrency test's threads share.
#[derive(Default)]
struct Race {
    /// Changes attempted so far by the writer thread.
    changes: AtomicU64,
    writer_done: AtomicBool,
    /// A harvest waited in vain for a change to complete while it was inside KVM.
    stalled: AtomicBool,
    harvester: std::sync::OnceLock<thread::ThreadId>,
    calls: AtomicU64,
    /// Logical time: each completed guest write and each returned harvest takes a tick.
    clock: AtomicU64,
}

impl Race {
    /// Every third dirty-log or ring call of the harvester waits inside KVM until the writer
    /// completes a change: it proves that changes go on while a harvest is half-way.
    fn rendezvous(&self) {
        if self.harvester.get() != Some(&thread::current().id())
            || !self.calls.fetch_add(1, Ordering::Relaxed).is_multiple_of(3)
            || self.stalled.load(Ordering::Relaxed)
        {
            return;
        }
        let before = self.changes.load(Ordering::SeqCst);
        let start = std::time::Instant::now();
        while self.changes.load(Ordering::SeqCst) == before
            && !self.writer_done.load(Ordering::SeqCst)
        {
            if start.elapsed() > CHANGE_PATIENCE {
                self.stalled.store(true, Ordering::SeqCst);
                return;
            }
            thread::sleep(Duration::from_micros(50));
        }
    }
}

/// A tiny deterministic generator (xorshift64).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A writer thread making random changes, a guest writing random pages through the fake, and
/// a harvester, all at once. Checked at the end, for every page of a region that still exists:
/// if the guest's last write to it hit a logging slot (known exactly: no change was applied to
/// KVM between the guest's look at the map and its write), some harvest that *returned* after
/// that write reported the page. (A harvest in flight during the write may be the one: a write
/// between its read and its clear of the log is covered by its report only.) And changes
/// complete while a harvest is inside KVM (`Race::rendezvous`).
fn random_changes_writes_and_harvests(kvm: FakeKvm, seed: u64) {
    let ring = kvm.dirty_ring();
    let race = Arc::new(Race::default());
    let gate = Gated::new(kvm);
    let hook_race = Arc::clone(&race);
    let _ = gate
        .hook()
        .rendezvous
        .set(Box::new(move |_call: KvmCall| hook_race.rendezvous()));
    let m: GatedManager = MemoryManager::new(gate);
    for i in 0..3 {
        m.add_region(logging(region((1 + 2 * i) * MIB, 2))).unwrap();
    }
    // A second reader of the log (a snapshot chain, a migration), which logs what it likes:
    // each must get every logged page, whatever the other harvests or stops.
    let second = m.add_dirty_consumer().unwrap();
    m.start_dirty_log_for(second, Target::All).unwrap();
    let consumers = [DirtyConsumer::DEFAULT, second];
    type Pages = BTreeMap<(RegionId, u64), u64>;
    let harvester = |consumer: DirtyConsumer| {
        let mut rng = Rng(seed ^ 0xaaaa ^ u64::from(consumer.number()));
        let mut reports = Pages::new();
        while !race.writer_done.load(Ordering::SeqCst) {
            let target = match m.regions() {
                r if r.is_empty() || rng.below(3) == 0 => Target::All,
                r => Target::Region(r[rng.below(r.len() as u64) as usize].id),
            };
            let harvested = match m.harvest_dirty_for(consumer, target) {
                Err(Error::UnknownRegion(_)) => continue,
                other => other.unwrap(),
            };
            let at = race.clock.fetch_add(1, Ordering::SeqCst) + 1;
            for d in &harvested {
                for page in (0..d.pages).filter(|p| d.is_dirty(*p)) {
                    reports.insert((d.region, page), at);
                }
            }
        }
        reports
    };
    let (writes, reports) = thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut rng = Rng(seed);
            for _ in 0..150 {
                let regions = m.regions();
                let pick = |rng: &mut Rng| regions[rng.below(regions.len() as u64) as usize].id;
                let gpa = GuestAddress((1 + rng.below(12)) * MIB);
                let result = match rng.below(8) {
                    _ if regions.is_empty() => m.add_region(region(gpa.0, 2)).map(drop),
                    0 | 1 => {
                        let spec = region(gpa.0, 1 + rng.below(3));
                        let spec = if rng.below(2) == 0 {
                            logging(spec)
                        } else {
                            spec
                        };
                        m.add_region(spec).map(drop)
                    }
                    2 => m.remove_region(pick(&mut rng)),
                    3 => m.move_region(pick(&mut rng), gpa),
                    4 => {
                        let r = pick(&mut rng);
                        let ro = m.regions().iter().any(|i| i.id == r && i.flags.read_only);
                        m.set_read_only(r, !ro)
                    }
                    5 => {
                        let consumer = consumers[rng.below(2) as usize];
                        m.start_dirty_log_for(consumer, Target::Region(pick(&mut rng)))
                    }
                    6 => {
                        // New slots for the whole region: each page a hole, the start of a
                        // slot, or more of the slot before.
                        let info = &regions[rng.below(regions.len() as u64) as usize];
                        let mut slots: Vec<std::ops::Range<u64>> = Vec::new();
                        let mut open = false;
                        for page in 0..info.size / PAGE_SIZE {
                            let (start, end) = (page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
                            match rng.below(4) {
                                0 => open = false,
                                1 if open => slots.last_mut().expect("open").end = end,
                                _ => {
                                    slots.push(start..end);
                                    open = true;
                                }
                            }
                        }
                        m.reslot(Reslot {
                            region: info.id,
                            range: 0..info.size,
                            slots,
                        })
                    }
                    _ => {
                        let consumer = consumers[rng.below(2) as usize];
                        m.stop_dirty_log_for(consumer, Target::Region(pick(&mut rng)))
                    }
                };
                if let Err(e) = result {
                    assert!(e.is_caller_error(), "{e}");
                }
                race.changes.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_micros(200));
            }
            // Somewhere for the guest's last writes to land, whatever the changes left.
            let writable_logging = |r: &RegionInfo| r.flags.log_dirty && !r.flags.read_only;
            if !m.regions().iter().any(writable_logging) {
                m.add_region(logging(region(20 * MIB, 2))).unwrap();
            }
            race.writer_done.store(true, Ordering::SeqCst);
        });
        let guest = scope.spawn(|| {
            let mut rng = Rng(seed ^ 0x5555);
            let mut writes = Pages::new();
            // After the last change, writes land in regions that stay: a few of those make
            // sure the final check has pages to check, however the race went.
            let mut settled = 0;
            loop {
                let done = race.writer_done.load(Ordering::SeqCst);
                if done && settled >= 20 {
                    break;
                }
                let before = m.change_sequence();
                let map = m.current();
                let slots: Vec<_> = map.map().iter().cloned().collect();
                if before % 2 == 1 || slots.is_empty() {
                    continue;
                }
                let slot = &slots[rng.below(slots.len() as u64) as usize];
                if slot.flags().read_only {
                    continue;
                }
                if ring && m.kvm().inner().ring_full() {
                    // As a vCPU exiting with KVM_EXIT_DIRTY_RING_FULL.
                    m.collect_dirty_rings().unwrap();
                }
                let page = rng.below(slot.size() / PAGE_SIZE);
                // Misses when a change moved or removed the slot since the look at the map.
                let hit = m.kvm().inner().guest_write(slot.gpa().0 + page * PAGE_SIZE);
                let at = race.clock.fetch_add(1, Ordering::SeqCst) + 1;
                if m.change_sequence() == before && slot.flags().log_dirty {
                    assert!(hit, "no change, yet the slot was not there");
                    let page = slot.payload().offset() / PAGE_SIZE + page;
                    writes.insert((slot.payload().region(), page), at);
                    if done {
                        settled += 1;
                    }
                }
            }
            writes
        });
        let first = scope.spawn(|| {
            race.harvester.set(thread::current().id()).unwrap();
            harvester(consumers[0])
        });
        let other = scope.spawn(|| harvester(consumers[1]));
        writer.join().unwrap();
        let reports = [first.join().unwrap(), other.join().unwrap()];
        (guest.join().unwrap(), reports)
    });
    assert!(
        !race.stalled.load(Ordering::SeqCst),
        "a change waited for a harvest that was inside KVM (the writer lock?)"
    );
    let live: Vec<RegionId> = m.regions().iter().map(|r| r.id).collect();
    for (consumer, mut reports) in consumers.into_iter().zip(reports) {
        // A last harvest, after everything.
        let at = race.clock.fetch_add(1, Ordering::SeqCst) + 1;
        for d in m.harvest_dirty_for(consumer, Target::All).unwrap() {
            for page in (0..d.pages).filter(|p| d.is_dirty(*p)) {
                reports.insert((d.region, page), at);
            }
        }
        let mut checked = 0;
        for ((region, page), written) in &writes {
            if !live.contains(region) {
                continue;
            }
            checked += 1;
            let reported = reports.get(&(*region, *page)).copied().unwrap_or(0);
            assert!(
                reported > *written,
                "{consumer}: region {region} page {page}: last written at {written}, last reported at {reported}"
            );
        }
        assert!(checked > 0, "the guest wrote nothing checkable");
    }
    assert!(race.changes.load(Ordering::SeqCst) == 150);
    assert_mirrored_gated(&m);
}

#[test]
fn random_changes_lose_no_page_written_while_logging() {
    random_changes_writes_and_harvests(FakeKvm::new(32, true), 0x1234_5678_9abc_def1);
    random_changes_writes_and_harvests(FakeKvm::new(32, false), 0x0fed_cba9_8765_4321);
    // As KvmVm sets real KVM up: manual protection, logs that start clear.
    random_changes_writes_and_harvests(FakeKvm::without_initially_set(32), 0x2468_ace0_1357_9bdf);
    random_changes_writes_and_harvests(FakeKvm::with_dirty_ring(32, 4096), 0x1357_9bdf_2468_ace0);
}

#[test]
fn without_initially_set_logs_a_toggle_or_a_rollback_reports_only_what_was_written() {
    // What KvmVm asks of real KVM: manual protection, logs that start clear and tracked.
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(64)));
    let id = m.add_region(region(MIB, 4)).unwrap();
    m.start_dirty_log(Target::Region(id)).unwrap();
    let pages = |m: &Manager| -> Vec<u64> {
        let d = m.harvest_dirty(Target::Region(id)).unwrap();
        d[0].addresses().map(|a| a.0).collect()
    };
    // The first harvest still reports every page (the manager marks them).
    assert_eq!(pages(&m).len() as u64, 4 * SLOT / PAGE_SIZE);
    assert!(pages(&m).is_empty());
    // A read-only toggle deletes and re-creates the slots: only the page written is reported,
    // not the whole region.
    m.kvm().inner().guest_write(MIB + PAGE_SIZE);
    m.set_read_only(id, true).unwrap();
    m.set_read_only(id, false).unwrap();
    m.kvm().inner().guest_write(MIB + 2 * SLOT);
    assert_eq!(pages(&m), vec![MIB + PAGE_SIZE, MIB + 2 * SLOT]);
    // A remove that KVM refuses half-way is rolled back (its slots created again): still exact.
    m.kvm().inner().guest_write(MIB + SLOT);
    m.kvm().fail(KvmCall::SetRegion, 2, libc::EIO);
    assert!(m.remove_region(id).is_err());
    assert_eq!(pages(&m), vec![MIB + SLOT]);
    // A region added logging reports all its pages first, then what is written.
    let logged = m
        .add_region(region(8 * MIB, 2).with_flags(SlotFlags {
            log_dirty: true,
            read_only: false,
        }))
        .unwrap();
    let first = m.harvest_dirty(Target::Region(logged)).unwrap();
    assert_eq!(first[0].count(), 2 * SLOT / PAGE_SIZE);
    m.kvm().inner().guest_write(8 * MIB);
    let next = m.harvest_dirty(Target::Region(logged)).unwrap();
    assert_eq!(
        next[0].addresses().collect::<Vec<_>>(),
        [GuestAddress(8 * MIB)]
    );
}

#[test]
fn switching_logging_to_what_it_is_makes_no_call_and_no_version() {
    let m = manager(64);
    let id = m.add_region(region(0, 4)).unwrap();
    m.start_dirty_log(Target::Region(id)).unwrap();
    let (calls, generation) = (m.kvm().inner().set_calls(), m.published().generation());
    let sequence = m.change_sequence();
    m.start_dirty_log(Target::Region(id)).unwrap();
    m.start_dirty_log(Target::All).unwrap();
    assert_eq!(m.kvm().inner().set_calls(), calls);
    assert_eq!(m.published().generation(), generation, "no new version");
    assert_eq!(m.change_sequence(), sequence);
    m.stop_dirty_log(Target::Region(id)).unwrap();
    m.stop_dirty_log(Target::Region(id)).unwrap();
    assert_eq!(m.kvm().inner().set_calls(), calls + 4);
}

#[test]
fn a_panicking_kvm_call_leaves_the_change_sequence_even() {
    let m = manager(64);
    m.add_region(region(0, 2)).unwrap();
    assert_eq!(m.change_sequence() % 2, 0);
    // The second slot's KVM_SET_USER_MEMORY_REGION panics, mid-change.
    m.kvm().panic_at(KvmCall::SetRegion, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.add_region(region(GIB, 2))
    }));
    assert!(panicked.is_err());
    assert!(!m.kvm().failure_pending(), "the planned panic came");
    // A vCPU waiting for the change to end (an even sequence) goes on.
    assert_eq!(m.change_sequence() % 2, 0, "{}", m.change_sequence());
    // The first slot was deleted again (KVM is as the map says), but what the panicking call
    // did is unknown: the new region's memory stays mapped for good, and the manager refuses
    // changes rather than trust a map that may disagree with KVM.
    assert_mirrored(&m);
    let kept: Vec<u64> = m
        .state()
        .orphans
        .iter()
        .map(|memory| memory.host_address())
        .collect();
    assert_eq!(kept.len(), 1);
    assert!(is_mapped(kept[0]), "the new region's memory was unmapped");
    assert!(
        !m.published().iter().any(|s| s.gpa().0 == GIB),
        "nothing was published"
    );
    let refused = m.add_region(region(2 * GIB, 1)).unwrap_err();
    assert!(matches!(refused, Error::BrokenByPanic { .. }), "{refused}");
    assert_eq!(refused.kind(), ErrorKind::Broken);
    // Reads go on.
    assert_eq!(m.regions().len(), 1);
}

#[test]
fn a_batch_is_one_change_and_one_published_version() {
    let (m, r) = setup();
    let sequence = m.change_sequence();
    let before = m.load();
    let added = m
        .apply(vec![
            RegionChange::Add(region(32 * MIB, 3)),
            RegionChange::Remove(r),
            // Where the removed region was: removals come first.
            RegionChange::Add(region(MIB, 8)),
        ])
        .unwrap();
    assert_eq!(added, vec![RegionId(2), RegionId(3)]);
    assert_eq!(m.change_sequence(), sequence + 2, "one change");
    // The version before the batch is whole: no reader saw part of it.
    assert_eq!(before.len(), 10);
    assert_eq!(m.load().len(), 2 + 3 + 8);
    assert_mirrored(&m);
    let ids: Vec<RegionId> = m.regions().iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![RegionId(1), RegionId(2), RegionId(3)]);
    assert_eq!(m.memory_use().guest_memory, (2 + 3 + 8) * SLOT);
    // The removed region's slot numbers were freed only after the batch: the new regions
    // took numbers the removed one did not hold.
    let numbers = |id| m.region_slots(id).unwrap();
    assert!(numbers(RegionId(2))
        .iter()
        .chain(&numbers(RegionId(3)))
        .all(|n| !(0..8).contains(&n.0)));
}

#[test]
fn a_refused_batch_makes_no_call_and_takes_no_id() {
    let (m, r) = setup();
    let before = everything(&m);
    let calls = m.kvm().inner().set_calls();
    type Refusal = (&'static str, Vec<RegionChange>, fn(&Error) -> bool);
    let refusals: Vec<Refusal> = vec![
        (
            "unknown region",
            vec![
                RegionChange::Add(region(32 * MIB, 1)),
                RegionChange::Remove(RegionId(9)),
            ],
            |e| matches!(e, Error::UnknownRegion(RegionId(9))),
        ),
        (
            "region removed twice",
            vec![RegionChange::Remove(r), RegionChange::Remove(r)],
            |e| matches!(e, Error::UnknownRegion(_)),
        ),
        (
            "additions overlap each other",
            vec![
                RegionChange::Add(region(32 * MIB, 4)),
                RegionChange::Add(region(48 * MIB, 1)),
                RegionChange::Add(region(32 * MIB + 3 * SLOT, 1)),
            ],
            |e| matches!(e, Error::BatchOverlap { other: 0, .. }),
        ),
        (
            "an addition overlaps a region that stays",
            vec![
                RegionChange::Remove(r),
                RegionChange::Add(region(16 * MIB, 1)),
            ],
            |e| {
                matches!(
                    e,
                    Error::Overlap {
                        other: RegionId(1),
                        ..
                    }
                )
            },
        ),
        (
            "a bad addition after good ones",
            vec![
                RegionChange::Add(region(32 * MIB, 1)),
                RegionChange::Add(RegionSpec::new(GuestAddress(48 * MIB), 0x800)),
            ],
            |e| matches!(e, Error::Unaligned { .. }),
        ),
        (
            "more slots than KVM has, counted over the batch",
            vec![
                RegionChange::Add(region(32 * MIB, 30)),
                RegionChange::Add(region(64 * MIB, 30)),
            ],
            |e| {
                matches!(
                    e,
                    Error::OutOfSlots {
                        needed: 60,
                        free: 54,
                        ..
                    }
                )
            },
        ),
    ];
    for (name, batch, expected) in refusals {
        let err = m.apply(batch).expect_err(name);
        assert!(expected(&err), "{name}: {err}");
        assert_eq!(everything(&m), before, "{name}");
        assert_eq!(m.kvm().inner().set_calls(), calls, "{name}: a KVM call");
    }
    // No region id was used up by the refusals.
    assert_eq!(m.add_region(region(32 * MIB, 1)).unwrap(), RegionId(2));
}

#[test]
fn a_batch_over_a_limit_is_refused_as_a_whole() {
    let limits = MemoryLimits {
        max_guest_memory: 10 * SLOT,
        ..MemoryLimits::for_this_host()
    };
    let m = MemoryManager::with_limits(Faulty::new(FakeKvm::new(64, true)), limits);
    let r = m.add_region(region(0, 6)).unwrap();
    let before = everything(&m);
    // Each addition fits alone; together they do not.
    let err = m
        .add_regions([region(MIB, 3), region(2 * MIB, 3)])
        .unwrap_err();
    assert!(matches!(err, Error::OverLimit { .. }), "{err}");
    assert_eq!(everything(&m), before);
    // A removal in the same batch makes room.
    m.apply(vec![
        RegionChange::Add(region(MIB, 3)),
        RegionChange::Add(region(2 * MIB, 3)),
        RegionChange::Remove(r),
    ])
    .unwrap();
    assert_eq!(m.memory_use().guest_memory, 6 * SLOT);
}

#[test]
fn a_log_read_failing_during_a_batch_removal_undoes_it_and_loses_no_page() {
    // Two logging regions, 10 slots: fail the k-th log read of the batch that removes both.
    for k in 0..10 {
        let (m, r) = setup();
        m.start_dirty_log(Target::All).unwrap();
        m.harvest_dirty(Target::All).unwrap();
        let fake = m.kvm().inner();
        fake.guest_write(MIB + 7 * SLOT);
        fake.guest_write(16 * MIB + SLOT);
        let before = everything(&m);
        m.kvm().fail(KvmCall::GetDirtyLog, k, libc::EIO);
        let err = m
            .apply(vec![
                RegionChange::Remove(r),
                RegionChange::Remove(RegionId(1)),
                RegionChange::Add(region(32 * MIB, 2)),
            ])
            .unwrap_err();
        assert!(matches!(err, Error::GetDirtyLog { .. }), "{k}: {err}");
        assert_eq!(everything(&m), before, "step {k}: the batch was undone");
        let dirty = m.harvest_dirty(Target::All).unwrap();
        let got: Vec<u64> = dirty
            .iter()
            .flat_map(|d| d.addresses().map(|a| a.0))
            .collect();
        assert!(
            got.contains(&(MIB + 7 * SLOT)) && got.contains(&(16 * MIB + SLOT)),
            "step {k}: {got:x?}"
        );
    }
}

#[test]
fn a_failed_undo_of_a_batch_keeps_the_new_memory_mapped() {
    let (m, r) = setup();
    // The batch removes region r (8 deletes), then adds 2 slots: the second create fails,
    // and so does every later request, the undo's first among them.
    m.kvm().fail_from(KvmCall::SetRegion, 9, libc::EIO);
    let err = m
        .apply(vec![
            RegionChange::Remove(r),
            RegionChange::Add(region(32 * MIB, 2)),
        ])
        .unwrap_err();
    assert!(matches!(err, Error::UndoFailed { .. }), "{err}");
    m.kvm().heal();
    // KVM still has the new region's first slot: its memory must still be mapped.
    let stuck = m
        .kvm()
        .inner()
        .slots()
        .into_iter()
        .find(|s| s.gpa == 32 * MIB)
        .expect("the created slot stays in KVM");
    assert!(
        is_mapped(stuck.hva),
        "the memory under a KVM slot was unmapped"
    );
    assert!(matches!(
        m.add_region(region(64 * MIB, 1)).unwrap_err(),
        Error::Broken { .. }
    ));
}

#[test]
fn a_ring_mode_batch_drains_the_rings_around_its_removals() {
    let m = ring_manager(256);
    let a = m.add_region(logging(region(0, 2))).unwrap();
    let b = m.add_region(logging(region(MIB, 2))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let write = |gpa: u64| assert!(m.kvm().inner().guest_write(gpa));
    write(SLOT);
    write(MIB);
    let old: Vec<u32> = [a, b].iter().flat_map(|&id| slot_numbers(&m, id)).collect();
    // Both regions go and, in the same batch, a new one comes that takes none of their
    // numbers; the next region takes them all: no entry written before is its.
    let c = m
        .apply(vec![
            RegionChange::Remove(a),
            RegionChange::Add(region(4 * MIB, 1)),
            RegionChange::Remove(b),
        ])
        .unwrap()[0];
    assert!(slot_numbers(&m, c).iter().all(|n| !old.contains(n)));
    let d = m.add_region(region(8 * MIB, 4)).unwrap();
    let mut reused = slot_numbers(&m, d);
    reused.sort_unstable();
    assert_eq!(reused, old, "the numbers are reused");
    assert!(
        dirty_addresses(&m, d).is_empty(),
        "nothing of a's or b's is d's"
    );
    m.start_dirty_log(Target::Region(d)).unwrap();
    assert_eq!(dirty_addresses(&m, d).len() as u64, 4 * SLOT / PAGE_SIZE);
    write(8 * MIB + SLOT);
    assert_eq!(dirty_addresses(&m, d), vec![8 * MIB + SLOT]);
}

/// Whether the page at host address `hva` is mapped in this process.
fn is_mapped(hva: u64) -> bool {
    // SAFETY: `msync` with MS_ASYNC only inspects the mapping at the page; it neither reads
    // nor writes memory, and fails with ENOMEM where nothing is mapped.
    unsafe { libc::msync(hva as *mut libc::c_void, PAGE_SIZE as usize, libc::MS_ASYNC) == 0 }
}

#[test]
fn a_waiter_for_a_settled_map_wakes_when_the_change_ends_or_gives_up() {
    let m: Arc<GatedManager> = Arc::new(MemoryManager::new(Gated::new(FakeKvm::new(16, true))));
    m.add_region(region(0, 2)).unwrap();
    // A change held inside KVM: the sequence is odd until it is let go.
    m.kvm().hook().arm();
    let changer = {
        let m = Arc::clone(&m);
        thread::spawn(move || m.add_region(region(MIB, 1)).unwrap())
    };
    m.kvm().hook().wait_entered();
    let odd = m.change_sequence();
    assert_eq!(odd % 2, 1);
    // Giving up returns at once with nothing.
    assert_eq!(m.wait_settled(|| true), None);
    let (sequence, map) = m.load_consistent();
    assert_eq!(
        (sequence, map.len()),
        (odd, 2),
        "the old version, mid-change"
    );
    drop(map);
    let waiter = {
        let m = Arc::clone(&m);
        thread::spawn(move || m.wait_settled(|| false))
    };
    thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "it waits while the change lasts");
    m.kvm().hook().release();
    changer.join().unwrap();
    assert_eq!(waiter.join().unwrap(), Some(odd + 1));
    let (sequence, map) = m.load_consistent();
    assert_eq!((sequence, map.len()), (odd + 1, 3));
}

/// The pages of `harvested` as guest addresses.
fn addresses_of(harvested: &[DirtyPages]) -> Vec<u64> {
    harvested
        .iter()
        .flat_map(|d| d.addresses().map(|a| a.0))
        .collect()
}

#[test]
fn a_harvest_or_a_stop_by_one_consumer_hides_no_page_from_another() {
    let kvms: [fn() -> FakeKvm; 3] = [
        || FakeKvm::new(16, true),
        || FakeKvm::without_initially_set(16),
        || FakeKvm::with_dirty_ring(16, 256),
    ];
    for kvm in kvms {
        for stop in [false, true] {
            let m = MemoryManager::new(Faulty::new(kvm()));
            let ram = m.add_region(region(MIB, 4)).unwrap();
            // A snapshot chain logs from its Full on, and reads at each Diff.
            let chain = m.add_dirty_consumer().unwrap();
            m.start_dirty_log_for(chain, Target::All).unwrap();
            m.harvest_dirty_for(chain, Target::All).unwrap();
            // A client starts logging too, to watch the dirty rate.
            m.start_dirty_log(Target::All).unwrap();
            assert_eq!(
                addresses_of(&m.harvest_dirty(Target::All).unwrap()).len() as u64,
                4 * SLOT / PAGE_SIZE,
                "the client's first harvest has every page"
            );
            m.kvm().inner().guest_write(MIB + SLOT);
            if stop {
                m.stop_dirty_log(Target::All).unwrap();
                assert_eq!(m.dirty_log_holders(ram), Some(vec![chain]));
                assert!(
                    m.regions()[0].flags.log_dirty,
                    "still logging for the chain"
                );
            } else {
                assert_eq!(
                    addresses_of(&m.harvest_dirty(Target::All).unwrap()),
                    vec![MIB + SLOT]
                );
            }
            m.kvm().inner().guest_write(MIB + 3 * SLOT);
            assert_eq!(
                addresses_of(&m.harvest_dirty_for(chain, Target::All).unwrap()),
                vec![MIB + SLOT, MIB + 3 * SLOT],
                "stop {stop}"
            );
            // KVM logs while a consumer does: the chain's stop ends it only after the client's.
            m.stop_dirty_log_for(chain, Target::All).unwrap();
            assert_eq!(m.regions()[0].flags.log_dirty, !stop);
            assert_mirrored(&m);
        }
    }
}

#[test]
fn a_consumer_removed_leaves_the_others_their_pages() {
    let m = manager(16);
    let a = m.add_region(logging(region(0, 2))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let other = m.add_dirty_consumer().unwrap();
    m.kvm().inner().guest_write(SLOT);
    // The other consumer's harvest moves the page to the default consumer's stash...
    assert_eq!(
        addresses_of(&m.harvest_dirty_for(other, Target::All).unwrap()),
        vec![SLOT]
    );
    // ... and a region added meanwhile has stashes for both.
    let b = m.add_region(logging(region(MIB, 1))).unwrap();
    m.kvm().inner().guest_write(MIB);
    m.remove_dirty_consumer(other).unwrap();
    assert_eq!(m.dirty_consumers(), vec![DirtyConsumer::DEFAULT]);
    // ... from which it goes back to pending when the default is alone again.
    let dirty = m.harvest_dirty(Target::All).unwrap();
    let first: Vec<u64> = (0..SLOT / PAGE_SIZE).map(|p| MIB + p * PAGE_SIZE).collect();
    assert_eq!(dirty[0].region, a);
    assert_eq!(
        dirty[0].addresses().map(|a| a.0).collect::<Vec<_>>(),
        vec![SLOT]
    );
    assert_eq!(dirty[1].region, b);
    assert_eq!(dirty[1].addresses().map(|a| a.0).collect::<Vec<_>>(), first);
    // Gone for good.
    for err in [
        m.harvest_dirty_for(other, Target::All).unwrap_err(),
        m.start_dirty_log_for(other, Target::All).unwrap_err(),
        m.remove_dirty_consumer(other).unwrap_err(),
        m.remove_dirty_consumer(DirtyConsumer::DEFAULT).unwrap_err(),
    ] {
        assert!(matches!(err, Error::UnknownConsumer(_)), "{err}");
        assert_eq!(err.kind(), ErrorKind::NotFound);
    }
}

#[test]
fn removing_a_consumer_stops_logging_only_where_it_was_the_last() {
    let m = manager(16);
    let a = m.add_region(region(0, 2)).unwrap();
    let b = m.add_region(region(MIB, 2)).unwrap();
    let migration = m.add_dirty_consumer().unwrap();
    m.start_dirty_log_for(migration, Target::All).unwrap();
    m.start_dirty_log(Target::Region(b)).unwrap();
    let calls = m.kvm().inner().set_calls();
    // A refused stop removes nothing.
    m.kvm().fail(KvmCall::SetRegion, 1, libc::EIO);
    m.remove_dirty_consumer(migration).unwrap_err();
    assert_eq!(m.dirty_consumers().len(), 2);
    assert_mirrored(&m);
    m.remove_dirty_consumer(migration).unwrap();
    let logging: Vec<bool> = m.regions().iter().map(|r| r.flags.log_dirty).collect();
    assert_eq!(logging, vec![false, true]);
    assert_eq!(m.dirty_log_holders(a), Some(vec![]));
    assert_eq!(m.dirty_log_holders(b), Some(vec![DirtyConsumer::DEFAULT]));
    // Two updates (a's slots) for the refusal's undo-and-retry, each way.
    assert!(m.kvm().inner().set_calls() > calls);
    assert_mirrored(&m);
}

#[test]
fn a_consumer_that_logs_new_regions_sees_every_page_of_them() {
    let m = manager(16);
    let chain = m.add_dirty_consumer().unwrap();
    m.log_new_regions_for(chain, true).unwrap();
    let a = m.add_region(region(0, 2)).unwrap();
    assert_eq!(m.dirty_log_holders(a), Some(vec![chain]));
    assert!(m.regions()[0].flags.log_dirty);
    // Its first harvest has every page of the new region; the client's stop changes nothing.
    let first = m.harvest_dirty_for(chain, Target::Region(a)).unwrap();
    assert_eq!(first[0].count(), 2 * SLOT / PAGE_SIZE);
    m.stop_dirty_log(Target::All).unwrap();
    m.kvm().inner().guest_write(SLOT + PAGE_SIZE);
    assert_eq!(
        addresses_of(&m.harvest_dirty_for(chain, Target::All).unwrap()),
        vec![SLOT + PAGE_SIZE]
    );
    // A region added with logging on logs for the default consumer too.
    let b = m.add_region(logging(region(MIB, 1))).unwrap();
    assert_eq!(
        m.dirty_log_holders(b),
        Some(vec![DirtyConsumer::DEFAULT, chain])
    );
    // Ended, the consumer no longer logs new regions, and its regions stop logging.
    m.remove_dirty_consumer(chain).unwrap();
    let c = m.add_region(region(2 * MIB, 1)).unwrap();
    assert_eq!(m.dirty_log_holders(c), Some(vec![]));
    assert_eq!(m.dirty_log_holders(a), Some(vec![]));
    assert!(matches!(
        m.log_new_regions_for(chain, true).unwrap_err(),
        Error::UnknownConsumer(_)
    ));
    assert_mirrored(&m);
}

#[test]
fn regions_may_be_given_their_ids() {
    let m = manager(16);
    let ids = m
        .add_regions([
            region(0, 1).with_id(RegionId(7)),
            region(MIB, 1),
            region(2 * MIB, 1).with_id(RegionId(3)),
        ])
        .unwrap();
    // An id asked for is never handed out after: the region without one gets one above it.
    assert_eq!(ids, vec![RegionId(7), RegionId(8), RegionId(3)]);
    assert_eq!(m.add_region(region(3 * MIB, 1)).unwrap(), RegionId(9));
    let before = everything(&m);
    for batch in [
        vec![region(4 * MIB, 1).with_id(RegionId(3))],
        vec![
            region(4 * MIB, 1).with_id(RegionId(20)),
            region(5 * MIB, 1).with_id(RegionId(20)),
        ],
    ] {
        let err = m.add_regions(batch).unwrap_err();
        assert!(matches!(err, Error::RegionIdInUse(_)), "{err}");
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert_eq!(everything(&m), before);
    }
    // The id of a region removed in the same batch is not free yet; after it, it is.
    let err = m
        .apply(vec![
            RegionChange::Remove(RegionId(3)),
            RegionChange::Add(region(2 * MIB, 1).with_id(RegionId(3))),
        ])
        .unwrap_err();
    assert!(matches!(err, Error::RegionIdInUse(RegionId(3))), "{err}");
    m.remove_region(RegionId(3)).unwrap();
    assert_eq!(
        m.add_region(region(2 * MIB, 1).with_id(RegionId(3)))
            .unwrap(),
        RegionId(3)
    );
    assert_mirrored(&m);
}

#[test]
fn an_overflowed_ring_reports_every_logging_page_for_every_consumer() {
    let m = ring_manager(256);
    let a = m.add_region(logging(region(0, 2))).unwrap();
    let quiet = m.add_region(region(MIB, 2)).unwrap();
    let chain = m.add_dirty_consumer().unwrap();
    m.harvest_dirty(Target::All).unwrap();
    m.harvest_dirty_for(chain, Target::All).unwrap();
    m.kvm().inner().guest_write(PAGE_SIZE);
    assert_eq!(m.dirty_ring_overflows(), 0);
    // The emulator pushed past the ring's room: entries were written over.
    m.kvm().inner().overflow_ring();
    let all = 2 * SLOT / PAGE_SIZE;
    for consumer in [DirtyConsumer::DEFAULT, chain] {
        let dirty = m.harvest_dirty_for(consumer, Target::All).unwrap();
        let count = |id| dirty.iter().find(|d| d.region == id).unwrap().count();
        assert_eq!((count(a), count(quiet)), (all, 0), "{consumer}");
    }
    assert_eq!(m.dirty_ring_overflows(), 1);
    // Pages whose entries were lost stay unprotected in KVM: every later harvest reports
    // every logging page too.
    let again = m.harvest_dirty(Target::Region(a)).unwrap();
    assert_eq!(again[0].count(), all);
}

mod parking;
mod reslot;
mod undo;

/// Whether the host's page tables let the process read `len` bytes at `hva`: a `write` from
/// them into a pipe fails with `EFAULT` where they do not (a load would fault the test).
fn host_readable(hva: u64, len: usize) -> bool {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two descriptors for pipe to fill.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the kernel only reads `[hva, hva + len)` and reports EFAULT where it cannot;
    // `fds[1]` is the pipe's write end just made (the pipe holds 64 KiB, more than `len`).
    let n = unsafe { libc::write(fds[1], hva as *const libc::c_void, len) };
    let err = std::io::Error::last_os_error();
    for fd in fds {
        // SAFETY: closing the descriptors made above, owned by nothing else.
        unsafe { libc::close(fd) };
    }
    match n {
        n if n == len as isize => true,
        _ => {
            assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
            false
        }
    }
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn an_inaccessible_range_keeps_its_slot_reads_as_zeros_and_is_refused_to_devices() {
    for backing in [Backing::Anonymous, Backing::Memfd] {
        let m = manager(16);
        let r = m
            .add_region(region(MIB, 4).with_backing(backing.clone()))
            .unwrap();
        let mem = m.current();
        mem.write_slice(&[0xaa; 4 * SLOT as usize], GuestAddress(MIB))
            .unwrap();
        let slots = m.slot_ranges(r);
        let kvm = m.kvm().inner().slots();
        m.harvest_dirty(Target::All).unwrap();
        // Two pages across the slot boundary; no KVM call, the slots unchanged.
        let hole = SLOT - 0x1000..SLOT + 0x1000;
        m.set_accessible(r, std::slice::from_ref(&hole), false)
            .unwrap();
        // Given back too (a discard under PROT_NONE keeps it PROT_NONE).
        m.discard_region(r, hole.clone()).unwrap();
        assert_eq!(m.slot_ranges(r), slots);
        assert_eq!(m.kvm().inner().slots(), kvm);
        assert_mirrored(&m);
        let memory = m.region_memory(r).unwrap();
        assert_eq!(memory.inaccessible(), vec![hole.clone()]);
        let hva = memory.host_address();
        assert!(!host_readable(hva + hole.start, 0x1000));
        assert!(host_readable(hva + hole.start - 0x1000, 0x1000));
        // The host's readers see zeros there and the data around it.
        let mut buf = vec![0u8; 4 * SLOT as usize];
        memory.read_volatile(0, &mut buf).unwrap();
        assert!(buf[..hole.start as usize].iter().all(|b| *b == 0xaa));
        assert!(buf[hole.start as usize..hole.end as usize]
            .iter()
            .all(|b| *b == 0));
        assert!(buf[hole.end as usize..].iter().all(|b| *b == 0xaa));
        // A device (vm-memory) is refused it, and reaches the rest.
        assert!(mem
            .read_obj::<u8>(GuestAddress(MIB + hole.start + 8))
            .is_err());
        assert!(mem
            .write_obj(1u8, GuestAddress(MIB + hole.end - 1))
            .is_err());
        assert!(mem
            .get_host_address(GuestAddress(MIB + hole.start))
            .is_err());
        assert!(mem.get_host_address(GuestAddress(MIB + hole.end)).is_ok());
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(MIB + hole.end)).unwrap(),
            0xaa
        );
        // Its pages changed (to zeros): the next harvest reports them.
        let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
        let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
        assert_eq!(got, vec![MIB + hole.start, MIB + hole.start + 0x1000]);
        // Accessible again: zeros (the old contents were given back), writable.
        m.set_accessible(r, std::slice::from_ref(&hole), true)
            .unwrap();
        assert!(memory.inaccessible().is_empty());
        assert!(host_readable(hva + hole.start, 0x2000));
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(MIB + hole.start)).unwrap(),
            0
        );
        mem.write_obj(7u8, GuestAddress(MIB + hole.start)).unwrap();
        assert_eq!(m.slot_ranges(r), slots);
    }
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn a_bad_protection_change_is_refused_and_changes_nothing() {
    let m = manager(16);
    let r = m.add_region(region(MIB, 4)).unwrap();
    let memory = m.region_memory(r).unwrap();
    let size = 4 * SLOT;
    assert!(matches!(
        m.set_accessible(r, &[0..0x1000, size - 0x1000..size + 0x1000], false),
        Err(Error::OutsideRegion { .. })
    ));
    assert!(matches!(
        m.set_accessible(r, &[0x800..0x1000], false),
        Err(Error::Unaligned { .. })
    ));
    assert!(matches!(
        m.set_accessible(RegionId(99), &[0..0x1000], false),
        Err(Error::UnknownRegion(RegionId(99)))
    ));
    // The first range was not protected either.
    assert!(memory.inaccessible().is_empty());
    assert!(host_readable(memory.host_address(), 0x1000));
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn inaccessible_ranges_merge_and_split() {
    let m = manager(16);
    let r = m.add_region(region(MIB, 4)).unwrap();
    let memory = m.region_memory(r).unwrap();
    m.set_accessible(r, &[0x1000..0x3000, 0x5000..0x6000], false)
        .unwrap();
    m.set_accessible(r, &[0x3000..0x5000], false).unwrap();
    assert_eq!(memory.inaccessible(), vec![0x1000..0x6000]);
    m.set_accessible(r, &[0x2000..0x3000], true).unwrap();
    assert_eq!(memory.inaccessible(), vec![0x1000..0x2000, 0x3000..0x6000]);
    assert!(host_readable(memory.host_address() + 0x2000, 0x1000));
    assert!(!host_readable(memory.host_address() + 0x3000, 0x1000));
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn a_region_can_start_with_unreachable_ranges_and_they_keep_their_contents() {
    let m = manager(16);
    let r = m
        .add_region(region(MIB, 4).with_inaccessible(vec![SLOT..2 * SLOT]))
        .unwrap();
    let memory = m.region_memory(r).unwrap();
    assert_eq!(memory.inaccessible(), vec![SLOT..2 * SLOT]);
    assert!(!host_readable(memory.host_address() + SLOT, 0x1000));
    assert!(host_readable(memory.host_address(), 0x1000));
    // Made unreachable and back without a discard: the contents come back.
    m.current().write_obj(9u8, GuestAddress(MIB)).unwrap();
    m.set_accessible(r, &[0..SLOT], false).unwrap();
    assert!(m.current().read_obj::<u8>(GuestAddress(MIB)).is_err());
    m.set_accessible(r, &[0..2 * SLOT], true).unwrap();
    assert_eq!(m.current().read_obj::<u8>(GuestAddress(MIB)).unwrap(), 9);
    // A layout of unreachable ranges that overlap is refused; nothing was mapped.
    assert!(matches!(
        m.add_region(region(2 * MIB, 4).with_inaccessible(vec![0..SLOT, 0..SLOT])),
        Err(Error::SlotLayout { .. })
    ));
    assert_eq!(m.regions().len(), 1);
}
