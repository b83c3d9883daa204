//! The exit handler against synthetic exits: ports, MMIO, changes under way, emulation
//! failures.

use super::*;
use crate::vm::ports::Unmapped;
use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{MemoryManager, RegionSpec, SlotFlags};

const RAM: u64 = 0x10_0000;

fn memory() -> MemoryManager<FakeKvm> {
    let m = MemoryManager::new(FakeKvm::new(8, false));
    m.add_region(RegionSpec::new(GuestAddress(RAM), 0x4000))
        .unwrap();
    m.add_region(
        RegionSpec::new(GuestAddress(0x20_0000), 0x1000).with_flags(SlotFlags {
            read_only: true,
            log_dirty: false,
        }),
    )
    .unwrap();
    m
}

/// A bus with a device `'D'` on port 0x510 and `'S'` on 0x3f8..0x400.
fn bus(unmapped: Unmapped) -> PortBus<char> {
    let mut bus = PortBus::new(unmapped);
    bus.insert(0x510, 1, 'D').unwrap();
    bus.insert(0x3f8, 8, 'S').unwrap();
    bus
}

fn decide_on(
    m: &MemoryManager<FakeKvm>,
    bus: &PortBus<char>,
    exit: Exit<'_>,
    at_entry: u64,
    now: u64,
) -> ExitAction<char> {
    let map = m.load();
    let mut mmio = MmioBus::new();
    mmio.insert_device(0xd000_0000, 0x200, 7).expect("free");
    mmio.insert_absent(0x1_0000_0000, 0x4000_0000)
        .expect("free");
    let context = ExitContext {
        memory: &map,
        sequence_at_entry: at_entry,
        sequence_now: now,
        expected_mmio: Some(0x30_0000..0x30_1000),
        ports: bus,
        mmio: Some(&mmio),
    };
    handle_exit(&exit, &context)
}

#[test]
fn device_windows_and_absent_memory_answer_where_there_is_no_slot() {
    let m = memory();
    let read = Exit::MmioRead {
        gpa: 0xd000_0010,
        len: 4,
    };
    assert_eq!(
        decide(&m, read, 2, 2),
        ExitAction::MmioRead {
            device: 7,
            offset: 0x10
        }
    );
    let write = Exit::MmioWrite {
        gpa: 0xd000_0050,
        data: &[1, 0, 0, 0],
    };
    assert_eq!(
        decide(&m, write, 2, 2),
        ExitAction::MmioWrite {
            device: 7,
            offset: 0x50
        }
    );
    let unplugged = Exit::MmioWrite {
        gpa: 0x1_2000_0000,
        data: &[1; 8],
    };
    assert_eq!(decide(&m, unplugged, 2, 2), ExitAction::AbsentMemory);
    // While a block is being plugged the access waits for the change, then finds memory
    // or, if the block stayed unplugged, absent memory.
    let racing = Exit::MmioRead {
        gpa: 0x1_2000_0000,
        len: 8,
    };
    assert_eq!(decide(&m, racing, 2, 3), ExitAction::WaitForChange);
    let past = Exit::MmioRead {
        gpa: 0xd000_0200,
        len: 4,
    };
    assert!(matches!(
        decide(&m, past, 2, 2),
        ExitAction::Fatal(ExitError::UnexpectedMmio { .. })
    ));
}

fn decide(m: &MemoryManager<FakeKvm>, exit: Exit<'_>, at_entry: u64, now: u64) -> ExitAction<char> {
    decide_on(m, &bus(Unmapped::Fatal), exit, at_entry, now)
}

/// `KVM_EXIT_MEMORY_FAULT` (KVM could not map a page the guest touched, and says which) is
/// decoded with its address, counted as its own kind, and fatal naming that address: it
/// was once "an exit kind tinyvmm does not handle".
#[test]
fn a_memory_fault_exit_names_the_guest_address() {
    let fault = kvm_ioctls::VcpuExit::MemoryFault {
        flags: 0,
        gpa: RAM + 0x2000,
        size: 0x1000,
    };
    let (exit, buffer) = Exit::from_kvm(Ok(fault)).expect("an exit");
    assert!(buffer.is_none());
    assert_eq!(
        exit,
        Exit::MemoryFault {
            gpa: RAM + 0x2000,
            size: 0x1000,
            flags: 0
        }
    );
    assert_eq!(EXIT_KINDS[exit.kind()], "memory_fault");
    let ExitAction::Fatal(e) = decide(&memory(), exit, 0, 0) else {
        panic!("a memory fault is fatal here");
    };
    assert_eq!(
        e.to_string(),
        "KVM could not map the guest's memory at guest address 0x102000 (4096 bytes; \
         KVM_EXIT_MEMORY_FAULT, flags 0x0)"
    );
}

#[test]
fn ports_go_to_the_bus_devices_and_the_rest_by_its_policy() {
    let m = memory();
    let out = |port| Exit::IoOut { port, data: &[1] };
    let read = |port| Exit::IoIn { port, len: 1 };
    for unmapped in [Unmapped::Fatal, Unmapped::Absent] {
        let bus = bus(unmapped);
        assert_eq!(
            decide_on(&m, &bus, out(0x510), 0, 0),
            ExitAction::PortWrite {
                device: 'D',
                offset: 0
            }
        );
        assert_eq!(
            decide_on(&m, &bus, read(0x3fd), 0, 0),
            ExitAction::PortRead {
                device: 'S',
                offset: 5
            }
        );
    }
    let strict = bus(Unmapped::Fatal);
    assert_eq!(
        decide_on(&m, &strict, out(0x80), 0, 0),
        ExitAction::Fatal(ExitError::UnexpectedPort {
            port: 0x80,
            write: true
        })
    );
    assert_eq!(
        decide_on(&m, &strict, read(0x60), 0, 0),
        ExitAction::Fatal(ExitError::UnexpectedPort {
            port: 0x60,
            write: false
        })
    );
    let isa = bus(Unmapped::Absent);
    assert_eq!(decide_on(&m, &isa, out(0x80), 0, 0), ExitAction::Resume);
    assert_eq!(
        decide_on(&m, &isa, read(0x2f8), 0, 0),
        ExitAction::ReadAllOnes
    );
}

#[test]
fn an_exit_on_memory_during_a_change_waits_then_completes_against_the_map() {
    let m = memory();
    let write = Exit::MmioWrite {
        gpa: RAM + 8,
        data: &[1, 2, 3, 4],
    };
    let read = Exit::MmioRead {
        gpa: RAM + 16,
        len: 8,
    };
    assert!(write.is_mmio() && read.is_mmio());
    assert!(!Exit::Hlt.is_mmio());
    // A change is being applied: wait for it.
    assert_eq!(decide(&m, write, 4, 5), ExitAction::WaitForChange);
    assert_eq!(decide(&m, read, 5, 5), ExitAction::WaitForChange);
    // It finished during the run: finish the access in memory.
    assert_eq!(
        decide(&m, write, 4, 6),
        ExitAction::WriteMemory {
            gpa: GuestAddress(RAM + 8),
            data: vec![1, 2, 3, 4]
        }
    );
    assert_eq!(
        decide(&m, read, 5, 6),
        ExitAction::ReadMemory {
            gpa: GuestAddress(RAM + 16),
            len: 8
        }
    );
}

#[test]
fn an_exit_on_memory_with_no_change_is_a_mismatch_never_mmio() {
    let m = memory();
    let action = decide(&m, Exit::MmioRead { gpa: RAM, len: 4 }, 6, 6);
    let ExitAction::Fatal(error) = action else {
        panic!("{action:?}")
    };
    assert!(
        error
            .to_string()
            .contains("KVM's slots and the map disagree"),
        "{error}"
    );
}

#[test]
fn other_addresses_are_counted_in_the_window_or_fatal() {
    let m = memory();
    let window = Exit::MmioWrite {
        gpa: 0x30_0008,
        data: &[0; 8],
    };
    assert_eq!(decide(&m, window, 2, 2), ExitAction::CountExpected);
    // Also after a change: the window is not memory then either.
    assert_eq!(decide(&m, window, 2, 4), ExitAction::CountExpected);
    let stray = Exit::MmioRead {
        gpa: 0x40_0000,
        len: 2,
    };
    let ExitAction::Fatal(error) = decide(&m, stray, 2, 4) else {
        panic!()
    };
    assert_eq!(
        error.to_string(),
        "guest read 2 byte(s) at 0x400000, which is neither memory nor a device"
    );
}

#[test]
fn writes_to_read_only_memory_are_dropped_and_other_stops_are_named() {
    let m = memory();
    let rom = Exit::MmioWrite {
        gpa: 0x20_0010,
        data: &[9],
    };
    assert_eq!(decide(&m, rom, 0, 0), ExitAction::DropReadOnlyWrite);
    assert_eq!(decide(&m, rom, 0, 2), ExitAction::DropReadOnlyWrite);
    assert_eq!(decide(&m, Exit::Interrupted, 0, 0), ExitAction::Resume);
    assert_eq!(
        decide(&m, Exit::DirtyRingFull, 0, 0),
        ExitAction::CollectDirtyRings
    );
    let ExitAction::Fatal(e) = decide(&m, Exit::internal_error(3, 0), 0, 0) else {
        panic!()
    };
    assert_eq!(e.to_string(), "KVM_EXIT_INTERNAL_ERROR (suberror 3)");
    assert_eq!(
        decide(&m, Exit::Hlt, 0, 0),
        ExitAction::Fatal(ExitError::Halted)
    );
}

#[test]
fn an_emulation_failure_in_a_change_waits_and_runs_again() {
    let m = memory();
    for cpl in [0, 3] {
        let failed = Exit::internal_error(KVM_INTERNAL_ERROR_EMULATION, cpl);
        assert_eq!(failed.kind(), 6, "counted as an internal error");
        // A change is under way (the sequence is odd): wait for it, whether it began
        // before the entry or during the run, at any CPL.
        assert_eq!(decide(&m, failed, 4, 5), ExitAction::WaitForChange);
        assert_eq!(decide(&m, failed, 5, 5), ExitAction::WaitForChange);
        // A change ended during the run (or the wait): enter again, never MMIO, never
        // fatal, never #UD.
        assert_eq!(decide(&m, failed, 4, 6), ExitAction::RetryAfterChange);
        assert_eq!(decide(&m, failed, 5, 6), ExitAction::RetryAfterChange);
        assert_eq!(decide(&m, failed, 4, 10), ExitAction::RetryAfterChange);
    }
    // Other internal errors stay fatal, changes or not, at any CPL.
    for cpl in [0, 3] {
        assert_eq!(
            decide(&m, Exit::internal_error(2, cpl), 4, 5),
            ExitAction::Fatal(ExitError::InternalError { suberror: 2 })
        );
    }
}

/// Outside a change's window, KVM's behaviour without `KVM_CAP_EXIT_ON_EMULATION_FAILURE`:
/// the guest gets `#UD` at CPL > 0 (its kernel handles it), the VM stops at CPL 0.
#[test]
fn an_emulation_failure_with_no_change_is_ud_in_user_mode_and_fatal_in_ring_0() {
    let m = memory();
    for cpl in [1, 2, 3] {
        let failed = Exit::internal_error(KVM_INTERNAL_ERROR_EMULATION, cpl);
        assert_eq!(
            decide(&m, failed, 6, 6),
            ExitAction::InjectInvalidOpcode,
            "ring {cpl}"
        );
    }
    let kernel = Exit::internal_error(KVM_INTERNAL_ERROR_EMULATION, 0);
    let ExitAction::Fatal(error) = decide(&m, kernel, 6, 6) else {
        panic!("a failure in ring 0 with no change is fatal")
    };
    assert_eq!(error, ExitError::EmulationFailure);
    assert!(
        error.to_string().contains("ring 0") && error.to_string().contains("no slot change"),
        "{error}"
    );
    // A sequence of retries: each one needs a change between its entry and its exit; the
    // first run with none ends them (#UD in user mode, fatal in ring 0), so a failure
    // that repeats never loops.
    for (cpl, last) in [
        (3, ExitAction::InjectInvalidOpcode),
        (0, ExitAction::Fatal(ExitError::EmulationFailure)),
    ] {
        let failed = Exit::internal_error(KVM_INTERNAL_ERROR_EMULATION, cpl);
        let mut entry = 4;
        let mut retries = 0;
        let mut ended = None;
        for now in [5, 6, 8, 8, 10] {
            match decide(&m, failed, entry, now) {
                ExitAction::WaitForChange => {}
                ExitAction::RetryAfterChange => {
                    retries += 1;
                    entry = now;
                }
                other => {
                    ended = Some((other, entry, now));
                    break;
                }
            }
        }
        assert_eq!(retries, 2, "ring {cpl}");
        assert_eq!(ended, Some((last, 8, 8)), "ring {cpl}");
    }
}
