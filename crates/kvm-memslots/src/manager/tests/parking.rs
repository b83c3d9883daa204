//! Bitmap mode: a logging slot is parked out of the guest's way before its log is read and
//! it is deleted, so a write between the read and the delete cannot land in a log KVM frees.

// A slot layout of one slot is a one-element list of ranges: what the lint warns about is
// what is meant here.
#![allow(clippy::single_range_in_vec_init)]

use std::sync::Arc;

use super::*;

/// A hook that, right after each `KVM_GET_DIRTY_LOG`, has the guest write the first page of
/// every unit of the region at `MIB` (as a vCPU running meanwhile would), and records the
/// writes that landed in a slot.
struct WritesAfterReads {
    fake: Arc<FakeKvm>,
    units: u64,
    armed: AtomicBool,
    landed: Mutex<BTreeSet<u64>>,
    missed: Mutex<BTreeSet<u64>>,
}

impl Hook for WritesAfterReads {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        let is_read =
            matches!(request, KvmRequest::GetDirtyLog { .. }) && self.armed.load(Ordering::Relaxed);
        let answer = proceed();
        if is_read {
            for unit in 0..self.units {
                let gpa = MIB + unit * SLOT;
                let into = if self.fake.guest_write(gpa) {
                    &self.landed
                } else {
                    &self.missed
                };
                into.lock().unwrap().insert(gpa);
            }
        }
        answer
    }
}

type Writing = MemoryManager<Hooked<Arc<FakeKvm>, Arc<WritesAfterReads>>>;

fn writing(units: u64) -> (Writing, Arc<WritesAfterReads>, RegionId) {
    let fake = Arc::new(FakeKvm::without_initially_set(64));
    let hook = Arc::new(WritesAfterReads {
        fake: Arc::clone(&fake),
        units,
        armed: AtomicBool::new(false),
        landed: Mutex::default(),
        missed: Mutex::default(),
    });
    let m = MemoryManager::new(Hooked::with_hook(fake, Arc::clone(&hook)));
    let r = m.add_region(logging(region(MIB, units))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    hook.armed.store(true, Ordering::Relaxed);
    (m, hook, r)
}

impl Hook for Arc<WritesAfterReads> {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        self.as_ref().around(request, proceed)
    }
}

type WritingOp = fn(&Writing, RegionId) -> Result<(), Error>;

/// Guest writes right after a change reads a slot's log: the slot being read is parked (the
/// write at its address finds no memory, as a vCPU's exits), and every write that landed is
/// reported, exactly: none went into a log KVM then freed, and no slot's pages were marked
/// wholesale.
#[test]
fn a_write_after_a_log_is_read_is_never_lost() {
    let changes: [(&str, WritingOp); 3] = [
        ("merge", |m, r| m.reslot(reslot(r, 0..8, &[0..8]))),
        ("split", |m, r| {
            m.reslot(reslot(r, 0..8, &[0..2, 2..3, 5..8]))
        }),
        ("read-only", |m, r| m.set_read_only(r, true)),
    ];
    for (name, change) in changes {
        let (m, hook, r) = writing(8);
        change(&m, r).unwrap();
        hook.armed.store(false, Ordering::Relaxed);
        let landed = hook.landed.lock().unwrap().clone();
        assert!(
            !hook.missed.lock().unwrap().is_empty(),
            "{name}: a parked slot is away"
        );
        let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
        let reported: BTreeSet<u64> = dirty[0].addresses().map(|a| a.0).collect();
        assert_eq!(reported, landed, "{name}");
    }
}

/// Where KVM refuses every parking place (slots of the VMM's own are there), the slot is
/// deleted in place and all its pages are reported: over-reporting, never losing.
#[test]
fn a_taken_parking_place_marks_the_deleted_slots_pages() {
    let m = MemoryManager::with_reserved_slots(
        Faulty::new(FakeKvm::without_initially_set(64)),
        MemoryLimits::default(),
        2,
    )
    .unwrap();
    let r = m.add_region(logging(region(MIB, 8))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let places = crate::manager::parking::parking_places(&m.state(), 2 * SLOT);
    assert!(places.contains(&(4 * GIB)), "{places:x?}");
    let theirs: Vec<KvmSlot> = places
        .iter()
        .zip(62..)
        .map(|(&gpa, slot)| KvmSlot {
            slot,
            gpa,
            size: PAGE_SIZE,
            hva: 0x7000_0000,
            flags: SlotFlags::default(),
        })
        .collect();
    for slot in &theirs {
        // SAFETY: the fake KVM never touches the memory a slot names (none is mapped here).
        unsafe { m.kvm().inner().set_user_memory_region(slot) }.unwrap();
    }
    assert!(m.kvm().inner().guest_write(MIB + 3 * SLOT));
    m.reslot(reslot(r, 2..6, &[2..4, 4..6])).unwrap();
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    let expected: Vec<u64> = (2 * SLOT / PAGE_SIZE..6 * SLOT / PAGE_SIZE)
        .map(|p| MIB + p * PAGE_SIZE)
        .collect();
    assert_eq!(
        dirty[0].addresses().map(|a| a.0).collect::<Vec<_>>(),
        expected
    );
    for slot in &theirs {
        assert!(m.kvm().inner().slots().contains(slot));
    }
}

/// A read that fails after the slot was parked moves it back: the change is undone whole. If
/// KVM refuses the move back too, the manager says so and refuses further changes.
#[test]
fn a_parked_slot_goes_back_if_its_read_fails() {
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(64)));
    let r = m.add_region(logging(region(MIB, 4))).unwrap();
    m.add_region(region(16 * MIB, 2)).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    let before = everything(&m);
    m.kvm().fail(KvmCall::GetDirtyLog, 1, libc::EIO);
    let err = m.reslot(reslot(r, 0..4, &[0..4])).unwrap_err();
    assert!(matches!(err, Error::GetDirtyLog { .. }), "{err}");
    assert_eq!(everything(&m), before);
    // Park (call 0), read (fails), move back (call 1, refused).
    m.kvm().fail(KvmCall::GetDirtyLog, 0, libc::EIO);
    m.kvm().fail_from(KvmCall::SetRegion, 1, libc::EIO);
    let err = m.reslot(reslot(r, 0..4, &[0..4])).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UndoFailed {
                undo_op: "move back",
                ..
            }
        ),
        "{err}"
    );
    m.kvm().heal();
    assert!(matches!(
        m.reslot(reslot(r, 0..4, &[0..4])).unwrap_err(),
        Error::Broken { .. }
    ));
}

/// Refuses, as KVM does (`EINVAL`), a slot that reaches past the host's physical address
/// width; every other call goes through.
struct AddressWidth(u64);

impl Hook for AddressWidth {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        if let KvmRequest::SetRegion(slot) = request {
            if slot.size > 0 && slot.gpa + slot.size > self.0 {
                return Err(Errno::new(libc::EINVAL));
            }
        }
        proceed()
    }
}

/// The host's physical address width, as the end of guest address space.
fn width() -> u64 {
    1 << crate::manager::parking::host_address_bits().expect("an x86-64 host reports it")
}

/// Wherever regions lie, up to the very top of the host's address width, there are parking
/// places: inside the width, clear of every region (holes included), the highest first.
#[test]
fn parking_places_are_free_and_inside_the_width_wherever_regions_lie() {
    let top = width();
    // Regions as (guest address, size).
    let layouts: [&[(u64, u64)]; 5] = [
        &[(MIB, 8 * SLOT)],
        // Ending at the top of the width.
        &[(MIB, 8 * SLOT), (top - 8 * SLOT, 8 * SLOT)],
        // Across the top GiB boundary, and just under the top.
        &[(top - GIB - 4 * SLOT, 8 * SLOT), (top - 2 * SLOT, 2 * SLOT)],
        // The GiB below the top full, and the one below that in part.
        &[(top - 2 * GIB + 4 * SLOT, 4 * SLOT), (top - GIB, GIB)],
        // At 4 GiB too.
        &[(4 * GIB, 8 * SLOT), (top - 8 * SLOT, 8 * SLOT)],
    ];
    for layout in layouts {
        let m = MemoryManager::new(FakeKvm::without_initially_set(64));
        let mut spans = Vec::new();
        for &(gpa, size) in layout {
            m.add_region(RegionSpec::new(GuestAddress(gpa), size).with_slot_size(size))
                .unwrap();
            spans.push(gpa..gpa + size);
        }
        for size in [SLOT, 8 * SLOT, GIB] {
            let places = crate::manager::parking::parking_places(&m.state(), size);
            assert!(!places.is_empty(), "{layout:x?}, {size:#x}");
            for &place in &places {
                assert!(place.is_multiple_of(PAGE_SIZE), "{place:#x}");
                assert!(place >= 4 * GIB, "{layout:x?}: {place:#x} below 4 GiB");
                assert!(
                    place + size <= top,
                    "{layout:x?}: {place:#x} past the width"
                );
                assert!(
                    spans
                        .iter()
                        .all(|s| place + size <= s.start || s.end <= place),
                    "{layout:x?}: {place:#x}+{size:#x} on a region"
                );
            }
            // The first is the highest free place on a GiB boundary (or only page-aligned
            // where no GiB boundary has room): no GiB boundary above it has room.
            let first = places[0];
            let mut above = (first / GIB + 1) * GIB;
            while above + size <= top {
                assert!(
                    spans
                        .iter()
                        .any(|s| above < s.end && s.start < above + size),
                    "{layout:x?}: {above:#x} is free above {first:#x}"
                );
                above += GIB;
            }
        }
    }
}

/// A logging region that ends at the top of the host's address width (where KVM refuses to
/// park above it) still has its slots parked, not deleted in place: a merge of its slots
/// reports exactly the page the guest wrote, not every page.
#[test]
fn a_region_at_the_top_of_the_width_is_parked_too() {
    let top = width();
    let m = MemoryManager::new(Hooked::with_hook(
        FakeKvm::without_initially_set(64),
        AddressWidth(top),
    ));
    let gpa = top - 8 * SLOT;
    let r = m.add_region(logging(region(gpa, 8))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    assert!(m.kvm().inner().guest_write(gpa + 3 * SLOT + PAGE_SIZE));
    m.reslot(reslot(r, 0..8, &[0..8])).unwrap();
    let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
    assert_eq!(
        dirty[0].addresses().map(|a| a.0).collect::<Vec<_>>(),
        vec![gpa + 3 * SLOT + PAGE_SIZE]
    );
}
