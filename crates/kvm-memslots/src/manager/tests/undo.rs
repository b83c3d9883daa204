//! Undoing a refused change loses no dirty page and leaves KVM as the map says, whether the
//! change was refused or a KVM call panicked.

// A slot layout of one slot is a one-element list of ranges: what the lint warns about is
// what is meant here.
#![allow(clippy::single_range_in_vec_init)]

use std::sync::Arc;

use super::*;

/// A hook that, once armed, lets `at` calls of `KVM_SET_USER_MEMORY_REGION` through, then has
/// the guest write `gpa` (as a vCPU running meanwhile would) and refuses the next one with `EIO`.
struct WriteThenRefuse {
    fake: Arc<FakeKvm>,
    armed: AtomicBool,
    at: u64,
    gpa: u64,
    calls: AtomicU64,
    /// Whether the write landed in a slot.
    landed: AtomicBool,
}

impl Hook for Arc<WriteThenRefuse> {
    fn around<T>(
        &self,
        request: KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, Errno>,
    ) -> Result<T, Errno> {
        if matches!(request, KvmRequest::SetRegion(_))
            && self.armed.load(Ordering::SeqCst)
            && self.calls.fetch_add(1, Ordering::SeqCst) == self.at
        {
            self.armed.store(false, Ordering::SeqCst);
            let landed = self.fake.guest_write(self.gpa);
            self.landed.store(landed, Ordering::SeqCst);
            return Err(Errno::new(libc::EIO));
        }
        proceed()
    }
}

type Refusing = MemoryManager<Hooked<Arc<FakeKvm>, Arc<WriteThenRefuse>>>;

/// A manager over the fake KVM (bitmap mode, logs starting clear as `KvmVm` has them) with a
/// logging region at `MIB` of two slots of two units each (read-only if asked), its first
/// harvest taken, and the hook armed to write `gpa` and refuse the call after `at` more.
fn refusing(read_only: bool, at: u64, gpa: u64) -> (Refusing, Arc<WriteThenRefuse>, RegionId) {
    let fake = Arc::new(FakeKvm::without_initially_set(64));
    let hook = Arc::new(WriteThenRefuse {
        fake: Arc::clone(&fake),
        armed: AtomicBool::new(false),
        at,
        gpa,
        calls: AtomicU64::new(0),
        landed: AtomicBool::new(false),
    });
    let m = MemoryManager::new(Hooked::with_hook(fake, Arc::clone(&hook)));
    let spec = region(MIB, 4)
        .with_slot_ranges(vec![0..2 * SLOT, 2 * SLOT..4 * SLOT])
        .with_flags(SlotFlags {
            log_dirty: true,
            read_only,
        });
    let r = m.add_region(spec).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    hook.armed.store(true, Ordering::SeqCst);
    (m, hook, r)
}

type RefusedOp = fn(&Refusing, RegionId) -> Result<(), Error>;

/// A guest write into a slot a change created (a read-only toggle's re-created slot, a
/// re-slot's new one) lands in that slot's log; a later step of the same change is refused,
/// and the undo deletes the slot again: it reads the slot's log first (parked, as the forward
/// path does), so the next harvest reports the write.
#[test]
fn a_write_into_a_slot_an_undo_deletes_is_harvested() {
    // Each change, the `KVM_SET_USER_MEMORY_REGION` calls it makes before the refused one,
    // and the page the guest writes just before it (in a slot the change created by then).
    let changes: [(&str, bool, RefusedOp, u64, u64); 3] = [
        // Slot 0..2: park, delete, create writable; slot 2..4: park (refused).
        (
            "read-only toggle",
            true,
            |m, r| m.set_read_only(r, false),
            3,
            MIB + PAGE_SIZE,
        ),
        // Slot 0..2: park, delete; create 0..1; create 1..2 (refused).
        (
            "re-slot",
            false,
            |m, r| m.reslot(reslot(r, 0..2, &[0..1, 1..2])),
            3,
            MIB + PAGE_SIZE,
        ),
        // The same re-slot made whole, then the batch's new region's slot (refused).
        (
            "batch",
            false,
            |m, r| {
                m.apply(vec![
                    RegionChange::Reslot(reslot(r, 0..2, &[0..1, 1..2])),
                    RegionChange::Add(region(16 * MIB, 1)),
                ])
                .map(drop)
            },
            4,
            MIB + SLOT + PAGE_SIZE,
        ),
    ];
    for (name, read_only, change, at, gpa) in changes {
        let (m, hook, r) = refusing(read_only, at, gpa);
        let before = m.regions();
        let kvm_before = m.kvm().inner().slots();
        let err = change(&m, r).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EIO), "{name}: {err}");
        assert!(
            hook.landed.load(Ordering::SeqCst),
            "{name}: the write landed"
        );
        assert_eq!(m.regions(), before, "{name}");
        assert_eq!(m.kvm().inner().slots(), kvm_before, "{name}: undone");
        let dirty = m.harvest_dirty(Target::Region(r)).unwrap();
        let reported: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
        assert_eq!(reported, vec![gpa], "{name}: the write is harvested, alone");
    }
}

/// A KVM call that panics in the middle of a stop of logging (the second slot's update):
/// the slots updated before it get logging back before the panic goes on, so KVM logs every
/// slot the map says logs, and harvests go on working (before, every one failed with
/// `ENOENT` for the first slot, for good). A write in the window where a slot did not log is
/// not lost: its pages count as dirty. Changes stay refused.
#[test]
fn a_panic_in_a_stop_of_logging_leaves_harvests_working() {
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(64)));
    let r = m.add_region(logging(region(MIB, 4))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    m.kvm().panic_at(KvmCall::SetRegion, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.stop_dirty_log(Target::Region(r))
    }));
    assert!(panicked.is_err());
    assert!(!m.kvm().failure_pending(), "the planned panic came");
    let logging: Vec<bool> = m
        .kvm()
        .inner()
        .slots()
        .iter()
        .map(|s| s.flags.log_dirty)
        .collect();
    assert_eq!(logging, vec![true; 4], "KVM logs as the map says");
    // The first slot did not log for a moment, and what the second's call did is unknown:
    // all their pages count as dirty.
    let first = m.harvest_dirty(Target::All).unwrap();
    let pages: Vec<u64> = first[0].addresses().map(|a| a.0).collect();
    assert_eq!(
        pages,
        (0..8).map(|p| MIB + p * PAGE_SIZE).collect::<Vec<_>>()
    );
    // KVM logs the guest's writes again, and harvests report them.
    assert!(m.kvm().inner().guest_write(MIB + PAGE_SIZE));
    assert!(m.kvm().inner().guest_write(MIB + 3 * SLOT));
    let next = m.harvest_dirty(Target::All).unwrap();
    let pages: Vec<u64> = next[0].addresses().map(|a| a.0).collect();
    assert_eq!(pages, vec![MIB + PAGE_SIZE, MIB + 3 * SLOT]);
    let refused = m.stop_dirty_log(Target::All).unwrap_err();
    assert!(matches!(refused, Error::BrokenByPanic { .. }), "{refused}");
}

/// A read of a parked slot's log that panics (mid re-slot, bitmap mode): the slot is moved
/// back from its parking place before the panic goes on, KVM's slots are the map's, and
/// harvests report what the guest writes there.
#[test]
fn a_panic_while_a_slot_is_parked_moves_it_back() {
    let m = MemoryManager::new(Faulty::new(FakeKvm::without_initially_set(64)));
    let r = m.add_region(logging(region(MIB, 4))).unwrap();
    m.harvest_dirty(Target::All).unwrap();
    m.kvm().panic_at(KvmCall::GetDirtyLog, 0);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.reslot(reslot(r, 0..4, &[0..4]))
    }));
    assert!(panicked.is_err());
    assert!(!m.kvm().failure_pending(), "the planned panic came");
    assert_mirrored(&m);
    assert!(m.kvm().inner().guest_write(MIB + 2 * SLOT));
    let dirty = m.harvest_dirty(Target::All).unwrap();
    let pages: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(pages, vec![MIB + 2 * SLOT]);
}
