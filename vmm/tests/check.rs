//! The main job on real `/dev/kvm`: the test guest writes both ends of every slot and the host
//! reads them back, then the other way round, at KVM's maximum slot count and with several
//! vCPUs; and bad slot counts are refused.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tinyvmm::jobs::check::{run_check, CheckConfig, CheckError};
use vmm_sys_util::eventfd::EventFd;

fn check(slots: usize, vcpus: usize) -> Result<tinyvmm::jobs::check::CheckReport, CheckError> {
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let config = CheckConfig {
        slots,
        area_size: 512 << 20,
        vcpus,
        limits: None,
    };
    run_check(config, &AtomicBool::new(false), &stopped)
}

#[test]
fn kvm_every_one_of_the_maximum_slots_is_checked_both_ways() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_every_one_of_the_maximum_slots_is_checked_both_ways",
    ) {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("KVM").get_nr_memslots();
    let report = check(max, 1).expect("check at the maximum slot count");
    assert_eq!(report.slots, max);
    assert_eq!(report.area_slots, max as u64 - 1);
    assert_eq!(report.addresses_checked, 2 * (max as u64 - 1));
    eprintln!("{report}");
}

#[test]
fn kvm_several_vcpus_share_the_slots() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_several_vcpus_share_the_slots") {
        return;
    }
    for (slots, vcpus) in [(2, 1), (10, 3), (509, 2)] {
        let report =
            check(slots, vcpus).unwrap_or_else(|e| panic!("{slots} slots, {vcpus} vCPUs: {e}"));
        assert_eq!((report.slots, report.vcpus), (slots, vcpus));
    }
}

#[test]
fn kvm_bad_slot_counts_are_refused_with_the_limit_named() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_bad_slot_counts_are_refused_with_the_limit_named",
    ) {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("KVM").get_nr_memslots();
    for slots in [0, 1, max + 1] {
        let err = check(slots, 1).expect_err("refused");
        assert_eq!(
            err.to_string(),
            format!("{slots} slots asked for; KVM offers 2 to {max} (one is the system region's)")
        );
    }
    let err = check(4, 16).expect_err("too many vCPUs");
    assert_eq!(
        err.to_string(),
        "16 vCPUs asked for; the test guest supports 1 to 15"
    );
}

#[test]
fn kvm_a_vcpu_whose_command_timed_out_takes_no_other() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_vcpu_whose_command_timed_out_takes_no_other")
    {
        return;
    }
    use std::time::Duration;
    use tinyvmm::test_guest::area::{TestArea, AREA_GPA};
    use tinyvmm::test_guest::vcpus::{GuestError, TestVm};
    use tinyvmm::test_guest::{Command, Op};
    let vm = TestVm::new().expect("VM");
    let area = TestArea::add(vm.memory(), AREA_GPA, 64 << 20, 16).expect("area");
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let mut vcpus = vm.start_vcpus(1, &stopped).expect("vCPU");
    let write = |start, end| Command {
        op: Op::Write,
        start,
        end,
        stride: 4096,
        seed: 5,
    };
    // Faulting in 16384 pages takes far longer than a microsecond.
    vcpus.set_timeout(Duration::from_micros(1));
    let err = vcpus
        .run(0, write(area.gpa, area.end()))
        .expect_err("times out");
    assert!(matches!(err, GuestError::Timeout { vcpu: 0, .. }), "{err}");
    vcpus.set_timeout(Duration::from_secs(60));
    // Its late answer must not be taken for the next command's.
    let err = vcpus
        .run(0, write(area.gpa, area.gpa + 4096))
        .expect_err("refused");
    assert_eq!(
        err.to_string(),
        "vCPU 0 takes no command since one timed out or was interrupted"
    );
    vcpus.shut_down().expect("the vCPU still stops cleanly");
}

#[test]
fn kvm_an_interrupt_ends_a_wait_for_a_command_that_would_run_on() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_an_interrupt_ends_a_wait_for_a_command_that_would_run_on",
    ) {
        return;
    }
    use std::sync::atomic::Ordering;
    use tinyvmm::test_guest::area::{TestArea, AREA_GPA};
    use tinyvmm::test_guest::vcpus::{GuestError, TestVm};
    use tinyvmm::test_guest::{Command, Op};
    let vm = TestVm::new().expect("VM");
    let area = TestArea::add(vm.memory(), AREA_GPA, 4 << 20, 4).expect("area");
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let mut vcpus = vm.start_vcpus(1, &stopped).expect("vCPU");
    let interrupt: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    vcpus.set_interrupt(interrupt);
    // A write loop runs until it is told to stop: only the interrupt can end this wait.
    vcpus.start(
        0,
        Command {
            op: Op::WriteLoop,
            start: area.gpa,
            end: area.end(),
            stride: 4096,
            seed: 9,
        },
    );
    let setter = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        interrupt.store(true, Ordering::Release);
    });
    let err = vcpus.wait(0).expect_err("interrupted");
    setter.join().expect("setter");
    assert!(matches!(err, GuestError::Interrupted), "{err}");
    // The guest may still be in its loop: the vCPU takes no other command, and stops.
    vcpus.start(0, Command::exit());
    let err = vcpus.wait(0).expect_err("refused");
    assert!(matches!(err, GuestError::Wedged(0)), "{err}");
    vcpus.shut_down().expect("the vCPU still stops cleanly");
}
