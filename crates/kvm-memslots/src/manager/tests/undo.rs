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
