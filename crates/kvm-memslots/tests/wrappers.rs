//! Every way of wrapping a `KvmMemory` (`Arc<K>`, `&K`, `testing::Hooked` with any hook) gives
//! the manager the answers of the KVM it wraps: the same harvests, on the fake KVM in each of
//! its set-ups. A wrapper that left a method to a default (`initially_set_logs`, say) would
//! report a different first harvest after logging starts.

use std::sync::Arc;

use kvm_memslots::testing::{FakeKvm, Faulty, Hooked, KvmCall, Stopwatch};
use kvm_memslots::{KvmMemory, MemoryManager, RegionSpec, Target, PAGE_SIZE};
use vm_memory::GuestAddress;

const BASE: u64 = 1 << 20;
const PAGES: u64 = 16;

/// A set-up of the fake KVM: its name, and how to make one.
type SetUp = (&'static str, fn() -> FakeKvm);

/// The fake KVM's set-ups: as `KvmVm::new` sets KVM up (manual protection, logs starting
/// clear), with initially-set logs, without manual protection, and in ring mode.
fn set_ups() -> [SetUp; 4] {
    [
        ("like KvmVm", || FakeKvm::without_initially_set(16)),
        ("initially set", || FakeKvm::new(16, true)),
        ("no manual protection", || FakeKvm::new(16, false)),
        ("dirty ring", || FakeKvm::with_dirty_ring(16, 256)),
    ]
}

/// The pages (numbered from the region's base) that two harvests report, after the guest wrote
/// every page before logging started: the first after logging starts (every page, whatever
/// KVM's logs start as), and the next after the guest writes pages 3 and 9.
fn harvests<K: KvmMemory>(kvm: K, fake: impl Fn(&K) -> &FakeKvm) -> [Vec<u64>; 2] {
    let m = MemoryManager::new(kvm);
    let r = m
        .add_region(RegionSpec::new(GuestAddress(BASE), PAGES * PAGE_SIZE))
        .expect("add a region");
    let write = |pages: &[u64]| {
        for page in pages {
            assert!(fake(m.kvm()).guest_write(BASE + page * PAGE_SIZE));
        }
    };
    let harvest = || -> Vec<u64> {
        let dirty = m.harvest_dirty(Target::Region(r)).expect("harvest");
        dirty[0]
            .addresses()
            .map(|a| (a.0 - BASE) / PAGE_SIZE)
            .collect()
    };
    write(&(0..PAGES).collect::<Vec<_>>());
    m.start_dirty_log(Target::Region(r)).expect("start logging");
    let first = harvest();
    write(&[3, 9]);
    [first, harvest()]
}

#[test]
fn every_wrapper_harvests_what_the_kvm_it_wraps_harvests() {
    for (set_up, new) in set_ups() {
        let unwrapped = harvests(new(), |k| k);
        let all: Vec<u64> = (0..PAGES).collect();
        assert_eq!(unwrapped, [all, vec![3, 9]], "{set_up}: unwrapped");

        let shared = Arc::new(new());
        let wrapped = [
            ("Arc", harvests(Arc::clone(&shared), |k| k)),
            ("&", harvests(&new(), |k| *k)),
            (
                "Hooked with no hook",
                harvests(Hooked::new(new()), |k: &Hooked<_, ()>| k.inner()),
            ),
            ("Faulty", harvests(Faulty::new(new()), |k| k.inner())),
            (
                "Hooked Arc with a Stopwatch",
                harvests(Hooked::<_, Stopwatch>::new(Arc::clone(&shared)), |k| {
                    k.inner()
                }),
            ),
        ];
        for (wrapper, harvested) in wrapped {
            assert_eq!(harvested, unwrapped, "{set_up}: {wrapper}");
        }
    }
}

#[test]
fn a_hook_sees_every_call() {
    let m = MemoryManager::new(Hooked::<_, Stopwatch>::new(FakeKvm::new(16, true)));
    let r = m
        .add_region(RegionSpec::new(GuestAddress(BASE), PAGES * PAGE_SIZE))
        .expect("add a region");
    m.start_dirty_log(Target::Region(r)).expect("start logging");
    m.harvest_dirty(Target::All).expect("harvest");
    let stopwatch = m.kvm().hook();
    assert_eq!(
        stopwatch.calls(KvmCall::SetRegion),
        m.kvm().inner().set_calls()
    );
    assert!(stopwatch.calls(KvmCall::GetDirtyLog) > 0);
    assert!(stopwatch.total_time() >= stopwatch.time(KvmCall::SetRegion));
}

#[test]
fn faulty_fails_a_ring_collection_too() {
    let kvm = Faulty::new(FakeKvm::with_dirty_ring(16, 256));
    kvm.fail(KvmCall::CollectDirtyRings, 1, 5);
    assert_eq!(
        kvm.collect_dirty_rings(&mut |_, _| {}),
        Ok(kvm_memslots::RingCollection::default())
    );
    let err = kvm.collect_dirty_rings(&mut |_, _| {}).unwrap_err();
    assert_eq!(err.errno(), 5);
    assert!(!kvm.failure_pending());
}
