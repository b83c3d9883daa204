//! Re-slots: a region's slots replaced without its memory moving, holes, and dirty pages
//! across them. (The failure table in `operations` covers their undo at every step.)

// A slot layout of one slot is a one-element list of ranges: what the lint warns about is
// what is meant here.
#![allow(clippy::single_range_in_vec_init)]

use std::ops::Range;

use super::*;
use crate::testing::Stopwatch;

/// The guest address of unit `unit` (of `SLOT` bytes) of the region at `MIB`.
fn at(unit: u64) -> u64 {
    MIB + unit * SLOT
}

fn units(ranges: Option<Vec<Range<u64>>>) -> Vec<Range<u64>> {
    ranges
        .unwrap()
        .into_iter()
        .map(|r| r.start / SLOT..r.end / SLOT)
        .collect()
}

#[test]
fn a_reslot_merges_and_splits_slots_and_leaves_the_memory_where_it_is() {
    let (m, r) = setup();
    let hva = m.regions()[0].hva;
    for unit in 0..8 {
        m.current()
            .write_obj(unit + 100, GuestAddress(at(unit) + 8))
            .unwrap();
    }
    let read = |m: &Manager, unit: u64| m.current().read_obj::<u64>(GuestAddress(at(unit) + 8));
    m.reslot(reslot(r, 0..8, &[0..8])).unwrap();
    assert_eq!(units(m.slot_ranges(r)), vec![0..8]);
    assert_mirrored(&m);
    // The new slot takes a number no slot had (8 and 9 are region 1's): within a change no
    // number names two slots. The old numbers are free after it.
    assert_eq!(m.region_slots(r), Some(vec![SlotId(10)]));
    assert_eq!(m.slot_usage().used, 3);
    // Split with a hole at units 2..5: what is left is the same memory.
    m.reslot(reslot(r, 0..8, &[0..2, 5..6, 6..8])).unwrap();
    assert_eq!(units(m.slot_ranges(r)), vec![0..2, 5..6, 6..8]);
    assert_mirrored(&m);
    for unit in [0, 1, 5, 6, 7] {
        assert_eq!(read(&m, unit).unwrap(), unit + 100);
    }
    for unit in 2..5 {
        assert!(read(&m, unit).is_err(), "unit {unit} is a hole");
        assert!(
            !m.kvm().inner().guest_write(at(unit)),
            "KVM has no slot there"
        );
    }
    let info = m.regions()[0].clone();
    assert_eq!((info.slots, info.size, info.hva), (3, 8 * SLOT, hva));
    // Filling the hole gives back what was there: the memory was never unmapped.
    let calls = m.kvm().inner().set_calls();
    m.reslot(reslot(r, 2..5, &[2..5])).unwrap();
    assert_eq!(
        m.kvm().inner().set_calls() - calls,
        1,
        "one create, nothing else"
    );
    for unit in 0..8 {
        assert_eq!(read(&m, unit).unwrap(), unit + 100);
    }
    // A slot asked for as it is keeps its number and gets no request.
    let kept = m.region_slots(r).unwrap()[1];
    let calls = m.kvm().inner().set_calls();
    m.reslot(reslot(r, 2..8, &[2..5, 5..8])).unwrap();
    assert_eq!(m.region_slots(r).unwrap()[1], kept);
    assert_eq!(
        m.kvm().inner().set_calls() - calls,
        3,
        "two deleted, one made"
    );
    assert_mirrored(&m);
    assert_eq!(m.find_by_hva(HostAddress(hva.0 + 6 * SLOT))[0].gpa.0, at(6));
    // Nothing to change: no call.
    let calls = m.kvm().inner().set_calls();
    m.reslot(reslot(r, 0..8, &[0..2, 2..5, 5..8])).unwrap();
    assert_eq!(m.kvm().inner().set_calls(), calls);
}

#[test]
fn a_region_may_be_added_with_holes() {
    let m = manager(16);
    let spec = region(MIB, 8).with_slot_ranges(vec![SLOT..3 * SLOT, 6 * SLOT..7 * SLOT]);
    let r = m.add_region(spec).unwrap();
    assert_eq!(units(m.slot_ranges(r)), vec![1..3, 6..7]);
    assert_mirrored(&m);
    assert_eq!(m.slot_usage().used, 2);
    assert!(m.current().read_obj::<u8>(GuestAddress(at(0))).is_err());
    m.current().write_obj(5u8, GuestAddress(at(2))).unwrap();
    // The whole region, holes included, is the region's: nothing else goes there.
    let err = m.add_region(region(at(3), 2)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "guest range [0x10c000, 0x114000) overlaps region 0 at [0x100000, 0x120000)"
    );
    let other = m.add_region(region(4 * MIB, 1)).unwrap();
    let err = m.move_region(other, GuestAddress(at(4))).unwrap_err();
    assert!(
        matches!(err, Error::Overlap { other, .. } if other == r),
        "{err}"
    );
    let err = m.move_region(r, GuestAddress(4 * MIB - SLOT)).unwrap_err();
    assert!(matches!(err, Error::Overlap { .. }), "{err}");
    assert!(matches!(
        m.discard(GuestAddress(at(0)), SLOT).unwrap_err(),
        Error::DiscardHole { .. }
    ));
    // Moved, holes and all; the old place is free again.
    m.move_region(r, GuestAddress(8 * MIB)).unwrap();
    assert_eq!(
        m.current()
            .read_obj::<u8>(GuestAddress(8 * MIB + 2 * SLOT))
            .unwrap(),
        5
    );
    m.add_region(region(at(3), 2)).unwrap();
    assert_mirrored(&m);
    // A region with no slot at all holds its range too, and costs no slot number.
    let empty = m
        .add_region(RegionSpec::new(GuestAddress(16 * MIB), MIB).with_slot_ranges(vec![]))
        .unwrap();
    assert_eq!(m.region_slots(empty), Some(vec![]));
    assert!(m.add_region(region(16 * MIB + SLOT, 1)).is_err());
    m.remove_region(empty).unwrap();
    m.remove_region(r).unwrap();
    assert_mirrored(&m);
}

#[test]
fn bad_reslots_are_refused_with_the_fault_named_and_change_nothing() {
    let m = manager(11);
    let r = m.add_region(region(MIB, 8)).unwrap();
    m.reslot(reslot(r, 4..8, &[4..8])).unwrap();
    let before = everything(&m);
    let cases: Vec<(Vec<RegionChange>, &str)> = vec![
        (
            vec![RegionChange::Reslot(reslot(RegionId(9), 0..1, &[]))],
            "region 9 does not exist",
        ),
        (
            vec![RegionChange::Reslot(reslot(r, 0..9, &[]))],
            "slot layout: the slot at offsets [0x0, 0x24000) is not a range inside the region",
        ),
        (
            vec![RegionChange::Reslot(Reslot {
                region: r,
                range: 0..0x800,
                slots: vec![],
            })],
            "slot layout: the slot at offsets [0x0, 0x800) is not page-aligned",
        ),
        (
            vec![RegionChange::Reslot(reslot(r, 0..4, &[0..2, 1..3]))],
            "slot layout: the slot at offsets [0x4000, 0xc000) overlaps or comes before the slot listed before it",
        ),
        (
            vec![RegionChange::Reslot(reslot(r, 0..4, &[2..2]))],
            "slot layout: the slot at offsets [0x8000, 0x8000) is empty",
        ),
        (
            vec![RegionChange::Reslot(reslot(r, 0..4, &[3..5]))],
            "slot layout: the slot at offsets [0xc000, 0x14000) lies outside the range being slotted",
        ),
        (
            vec![RegionChange::Reslot(reslot(r, 0..6, &[0..6]))],
            "slot layout: the slot at offsets [0x10000, 0x20000) is a slot of the region that crosses the range's edge",
        ),
        (
            vec![
                RegionChange::Reslot(reslot(r, 0..4, &[0..4])),
                RegionChange::Reslot(reslot(r, 4..8, &[4..8])),
            ],
            "region 0 is named by two changes of one batch",
        ),
        (
            vec![
                RegionChange::Remove(r),
                RegionChange::Reslot(reslot(r, 4..8, &[4..8])),
            ],
            "region 0 is named by two changes of one batch",
        ),
        (
            // 5 numbers in use, 6 free: 7 new slots do not fit, even with one freed after.
            vec![RegionChange::Reslot(Reslot {
                region: r,
                range: 4 * SLOT..8 * SLOT,
                slots: (0..7)
                    .map(|p| 4 * SLOT + p * PAGE_SIZE..4 * SLOT + (p + 1) * PAGE_SIZE)
                    .collect(),
            })],
            "out of KVM memory slots: 7 needed, 6 of 11 free",
        ),
        (
            vec![RegionChange::Add(region(4 * MIB, 2).with_slot_ranges(vec![
                0..SLOT,
                SLOT..3 * SLOT,
            ]))],
            "slot layout: the slot at offsets [0x4000, 0xc000) lies outside the range being slotted",
        ),
    ];
    for (batch, message) in cases {
        let err = m.apply(batch).expect_err(message);
        assert_eq!(err.to_string(), message);
        assert!(err.is_caller_error(), "{err}");
        assert_eq!(everything(&m), before, "{message}");
    }
}

/// Pages reported for region `r` by a harvest, as guest addresses.
fn harvested<K: KvmMemory>(m: &MemoryManager<K>, r: RegionId) -> Vec<u64> {
    let harvested = m.harvest_dirty(Target::Region(r)).unwrap();
    harvested[0].addresses().map(|a| a.0).collect()
}

/// Writes the pages `units` (the first page of each unit) through the fake.
fn write_units(kvm: &FakeKvm, units: &[u64]) -> Vec<u64> {
    for &unit in units {
        assert!(kvm.guest_write(at(unit)), "unit {unit} has a slot");
    }
    units.iter().map(|&u| at(u)).collect()
}

/// Guest writes before and after merges and splits are reported exactly once, in bitmap mode
/// as `KvmVm` sets KVM up (new logs start clear) and in ring mode.
#[test]
fn dirty_pages_stay_exact_across_reslots() {
    let kvms = [
        ("bitmap", FakeKvm::without_initially_set(16)),
        ("ring", FakeKvm::with_dirty_ring(16, 256)),
    ];
    for (mode, kvm) in kvms {
        let m = MemoryManager::new(Faulty::new(kvm));
        let r = m.add_region(logging(region(MIB, 8))).unwrap();
        assert_eq!(harvested(&m, r).len() as u64, 8 * SLOT / PAGE_SIZE);
        let fake = m.kvm().inner();
        let mut written = write_units(fake, &[0, 3, 5]);
        m.reslot(reslot(r, 0..8, &[0..6, 6..8])).unwrap();
        written.extend(write_units(fake, &[1, 7]));
        m.reslot(reslot(r, 0..6, &[0..2, 4..6])).unwrap();
        written.extend(write_units(fake, &[4]));
        written.sort_unstable();
        written.dedup();
        assert_eq!(harvested(&m, r), written, "{mode}");
        assert!(harvested(&m, r).is_empty(), "{mode}: reported once");
        // Written, then re-slotted before a harvest: still there.
        let written = write_units(fake, &[0, 5]);
        m.reslot(reslot(r, 0..8, &[0..1, 1..2, 4..8])).unwrap();
        assert_eq!(harvested(&m, r), written, "{mode}");
        assert_eq!(m.stray_ring_entries.load(Ordering::Relaxed), 0, "{mode}");
    }
}

/// With all-set new logs (`KVM_DIRTY_LOG_INITIALLY_SET`), a created slot reports all its pages
/// once, as a read-only toggle's re-created slot does: over-reporting, never losing.
#[test]
fn with_initially_set_logs_new_slots_report_every_page_once() {
    let (m, r) = setup();
    m.start_dirty_log(Target::Region(r)).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let written = write_units(m.kvm().inner(), &[6]);
    m.reslot(reslot(r, 0..4, &[0..4])).unwrap();
    let pages = harvested(&m, r);
    assert!(pages.contains(&written[0]));
    assert_eq!(pages.len() as u64, 4 * SLOT / PAGE_SIZE + 1);
    assert!(harvested(&m, r).is_empty());
}

#[test]
fn a_log_read_failing_during_a_reslot_undoes_it_and_loses_no_page() {
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(16)));
    let r = m.add_region(logging(region(MIB, 8))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let written = write_units(m.kvm().inner(), &[0, 2, 6]);
    let before = everything(&m);
    for k in 0..4 {
        m.kvm().fail(KvmCall::GetDirtyLog, k, libc::EIO);
        let err = m.reslot(reslot(r, 0..8, &[0..8])).unwrap_err();
        assert!(matches!(err, Error::GetDirtyLog { .. }), "{err}");
        assert_eq!(everything(&m), before, "step {k}");
    }
    // Logs read before a failure are pending; the others are still in KVM.
    assert_eq!(harvested(&m, r), written);
    m.reslot(reslot(r, 0..8, &[0..8])).unwrap();
    assert_mirrored(&m);
}

/// Ring mode: a collection while a re-slot is being applied (a vCPU's ring-full exit, or a
/// harvest) attributes the entries of a slot created but not yet published to its region.
#[test]
fn ring_entries_of_a_slot_being_created_keep_their_region() {
    /// What runs after each slot KVM creates.
    type Action = Box<dyn FnMut(&KvmSlot) + Send>;
    #[derive(Default)]
    struct AfterCreate(Mutex<Option<Action>>);
    impl Hook for AfterCreate {
        fn around<T>(
            &self,
            request: KvmRequest<'_>,
            proceed: impl FnOnce() -> Result<T, Errno>,
        ) -> Result<T, Errno> {
            let result = proceed();
            if let (Ok(_), KvmRequest::SetRegion(slot)) = (&result, request) {
                if slot.size > 0 {
                    let mut action = self.0.lock().unwrap();
                    if let Some(action) = action.as_mut() {
                        action(slot);
                    }
                }
            }
            result
        }
    }
    let fake = Arc::new(FakeKvm::with_dirty_ring(16, 256));
    let m = Arc::new(MemoryManager::new(Hooked::with_hook(
        Arc::clone(&fake),
        AfterCreate::default(),
    )));
    let r = m.add_region(logging(region(MIB, 8))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let weak = Arc::downgrade(&m);
    let writer = Arc::clone(&fake);
    *m.kvm().hook().0.lock().unwrap() = Some(Box::new(move |slot: &KvmSlot| {
        // The guest writes the new slot at once, and a collection runs before the change is
        // published.
        assert!(writer.guest_write(slot.gpa + PAGE_SIZE));
        weak.upgrade().unwrap().collect_dirty_rings().unwrap();
    }));
    m.reslot(Reslot {
        region: r,
        range: 0..8 * SLOT,
        slots: vec![0..4 * SLOT, 4 * SLOT..8 * SLOT],
    })
    .unwrap();
    *m.kvm().hook().0.lock().unwrap() = None;
    assert_eq!(m.stray_ring_entries.load(Ordering::Relaxed), 0);
    let pages = m.harvest_dirty(Target::Region(r)).unwrap()[0]
        .addresses()
        .map(|a| a.0)
        .collect::<Vec<_>>();
    assert_eq!(pages, vec![at(0) + PAGE_SIZE, at(4) + PAGE_SIZE]);
}

#[test]
fn memory_in_a_hole_can_be_given_back() {
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(16)));
    let r = m.add_region(logging(region(MIB, 8))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    for unit in [2, 3] {
        m.current().write_obj(9u64, GuestAddress(at(unit))).unwrap();
    }
    m.harvest_dirty(Target::All).unwrap();
    m.reslot(reslot(r, 0..8, &[0..2, 4..8])).unwrap();
    m.discard_region(r, 2 * SLOT..3 * SLOT).unwrap();
    // The discarded pages changed: reported dirty.
    let pages = harvested(&m, r);
    assert_eq!(pages.len() as u64, SLOT / PAGE_SIZE);
    assert_eq!(pages[0], at(2));
    m.reslot(reslot(r, 0..8, &[0..8])).unwrap();
    let read = |unit| m.current().read_obj::<u64>(GuestAddress(at(unit))).unwrap();
    assert_eq!(
        (read(2), read(3)),
        (0, 9),
        "only the range discarded is zero"
    );
    let err = m.discard_region(r, 7 * SLOT..9 * SLOT).unwrap_err();
    assert_eq!(
        err.to_string(),
        "offsets [0x1c000, 0x24000) are not a range inside region 0"
    );
    assert!(matches!(
        m.discard_region(RegionId(7), 0..SLOT),
        Err(Error::UnknownRegion(_))
    ));
}

#[test]
fn a_change_over_the_slot_budget_is_refused_and_changes_nothing() {
    let limits = MemoryLimits {
        max_slots: 10,
        ..MemoryLimits::unlimited()
    };
    let m = MemoryManager::with_limits(Faulty::new(FakeKvm::new(64, true)), limits);
    let r = m.add_region(region(MIB, 8)).unwrap();
    let before = everything(&m);
    let calls = m.kvm().inner().set_calls();
    let refusals: Vec<(Vec<RegionChange>, &str)> = vec![
        (
            vec![RegionChange::Add(region(4 * MIB, 3))],
            "the change creates 3 KVM slots and would bring the slots in use to 11, over the limit max_slots = 10",
        ),
        (
            vec![RegionChange::Reslot(Reslot {
                region: r,
                range: 0..2 * SLOT,
                slots: (0..8).map(|p| p * PAGE_SIZE..(p + 1) * PAGE_SIZE).collect(),
            })],
            "the change creates 8 KVM slots and would bring the slots in use to 14, over the limit max_slots = 10",
        ),
        (
            vec![
                RegionChange::Reslot(reslot(r, 0..8, &[0..1, 1..2, 2..4, 4..8])),
                RegionChange::Add(region(4 * MIB, 8)),
            ],
            "the change creates 10 KVM slots and would bring the slots in use to 12, over the limit max_slots = 10",
        ),
    ];
    for (batch, message) in refusals {
        let err = m.apply(batch).expect_err(message);
        assert_eq!(err.to_string(), message);
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert_eq!(everything(&m), before, "{message}");
        assert_eq!(m.kvm().inner().set_calls(), calls, "no KVM call");
    }
    // Within the budget: merging frees room for a new region.
    m.apply(vec![
        RegionChange::Reslot(reslot(r, 0..8, &[0..8])),
        RegionChange::Add(region(4 * MIB, 9)),
    ])
    .unwrap();
    assert_eq!(m.slot_usage().used, 10);
    // Under a budget lowered below the use, changes that do not add slots still go through.
    m.set_limits(MemoryLimits {
        max_slots: 4,
        ..MemoryLimits::unlimited()
    });
    m.reslot(reslot(r, 0..8, &[0..4, 4..8])).unwrap_err();
    m.reslot(reslot(r, 0..8, &[0..4])).unwrap();
    assert_mirrored(&m);
}

/// A re-slot that asks for the slots the range has already, and a batch of nothing (or of
/// such re-slots), change nothing: no KVM call, no new map version, no change counted.
#[test]
fn a_reslot_or_batch_that_changes_nothing_is_no_change() {
    for ring in [false, true] {
        let kvm = if ring {
            FakeKvm::with_dirty_ring(64, 4096)
        } else {
            FakeKvm::new(64, true)
        };
        let m = MemoryManager::new(Hooked::<_, Stopwatch>::new(kvm));
        let r = m.add_region(logging(region(MIB, 8))).unwrap();
        m.reslot(reslot(r, 0..8, &[0..2, 2..3, 5..8])).unwrap();
        let calls = |m: &MemoryManager<Hooked<FakeKvm, Stopwatch>>| {
            [
                KvmCall::SetRegion,
                KvmCall::GetDirtyLog,
                KvmCall::CollectDirtyRings,
                KvmCall::ResetDirtyRings,
            ]
            .map(|kind| m.kvm().hook().calls(kind))
        };
        let (before, version, sequence) = (calls(&m), m.published(), m.change_sequence());
        m.reslot(reslot(r, 0..8, &[0..2, 2..3, 5..8])).unwrap();
        m.reslot(reslot(r, 2..5, &[2..3])).unwrap();
        assert_eq!(m.apply(Vec::new()).unwrap(), Vec::new());
        m.apply(vec![RegionChange::Reslot(reslot(r, 5..8, &[5..8]))])
            .unwrap();
        assert_eq!(calls(&m), before, "ring mode: {ring}");
        assert!(Arc::ptr_eq(&m.published(), &version), "no new version");
        assert_eq!(m.change_sequence(), sequence, "no change counted");
        assert_eq!(units(m.slot_ranges(r)), vec![0..2, 2..3, 5..8]);
    }
}
