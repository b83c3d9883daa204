//! Allocation failures become errors, never aborts: with an address-space limit (`RLIMIT_AS`)
//! that no large buffer fits in, adding a huge region under no admission limit, reading dirty
//! logs and discarding fail cleanly and leave the manager as it was. One test in its own
//! process, since the limit is the process's.

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Error, MappingError, MemoryLimits, MemoryManager, RegionSpec};
use vm_memory::GuestAddress;

const GIB: u64 = 1 << 30;

fn address_space_limit() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid `limit`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) }, 0);
    limit
}

fn set_address_space_limit(limit: libc::rlimit) {
    // SAFETY: setrlimit reads one valid `rlimit`.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
}

/// Bytes of address space the process uses now.
fn address_space_used() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmSize");
    kib * 1024
}

#[test]
fn allocation_failures_are_errors_and_change_nothing() {
    // No admission limit: only the host can refuse.
    let m = MemoryManager::with_limits(FakeKvm::new(64, true), MemoryLimits::unlimited());
    m.add_region(RegionSpec::new(GuestAddress(0), 64 << 20))
        .expect("a small region");
    let original = address_space_limit();
    // Room for this test's own bookkeeping, but not for 2^40 bytes of guest memory (the
    // mapping) nor for 2^46 bytes' write bitmap (2 GiB).
    set_address_space_limit(libc::rlimit {
        rlim_cur: address_space_used() + GIB,
        ..original
    });
    let results: Vec<Result<_, Error>> = [1u64 << 40, 1 << 46]
        .iter()
        .map(|&size| m.add_region(RegionSpec::new(GuestAddress(1 << 47), size)))
        .collect();
    let harvest = m.harvest_dirty(kvm_memslots::Target::All);
    set_address_space_limit(original);

    assert!(
        matches!(&results[0], Err(Error::Mapping(MappingError::Mmap { .. }))),
        "{:?}",
        results[0]
    );
    match &results[1] {
        Err(e @ Error::Mapping(MappingError::Bitmap { bytes })) => {
            assert_eq!(*bytes, (1 << 46) / 4096 / 8);
            assert!(e.to_string().contains("out of host memory"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(m.regions().len(), 1, "nothing was added");
    assert_eq!(m.memory_use().guest_memory, 64 << 20);
    assert_eq!(harvest.expect("small buffers still fit").len(), 1);
}
