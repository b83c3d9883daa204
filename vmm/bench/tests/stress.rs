//! The stress mode on real `/dev/kvm`: vCPUs write continuously while the host adds, removes,
//! moves and re-flags slots next to their memory; no write may be lost, no dirty page missed,
//! and reads of a slot that is away during a change must complete against memory.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tinyvmm::test_guest::area::AREA_GPA;
use tinyvmm_bench::stress::{run_stress, StressConfig, StressError, StressReport};
use vmm_sys_util::eventfd::EventFd;

fn stress(config: StressConfig) -> Result<StressReport, StressError> {
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    run_stress(config, &AtomicBool::new(false), &stopped)
}

fn brief(vcpus: usize, part_size: u64) -> StressConfig {
    StressConfig {
        vcpus,
        part_size,
        iterations: 100_000,
        duration: Duration::from_millis(1500),
        ..StressConfig::default()
    }
}

fn assert_every_kind_of_change_happened(report: &StressReport) {
    let c = &report.changes;
    assert!(c.iterations > 0, "{report}");
    assert!(c.read_only_toggles >= 2, "{report}");
    assert!(c.dirty_log_starts > 0 && c.dirty_log_stops > 0, "{report}");
    assert!(c.harvests >= 2 && c.dirty_pages_harvested > 0, "{report}");
    // The last period of logging always ends with a checked full pass.
    assert!(c.dirty_rounds_checked > 0 && c.scans > 0, "{report}");
    assert_eq!(report.passes.len(), report.vcpus);
    assert!(report.passes.iter().all(|p| *p > 0), "{report}");
    assert!(report.verifies > 0, "{report}");
    assert_eq!(report.read_only_writes, 0, "{report}");
}

#[test]
fn kvm_stress_loses_nothing_while_slots_change_around_running_vcpus() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_stress_loses_nothing_while_slots_change_around_running_vcpus",
    ) {
        return;
    }
    // A read lands inside a read-only toggle's window by chance (a few times a second here);
    // run again, a bounded number of times, until one did.
    let mut completed = 0;
    for attempt in 1..=8 {
        let report = stress(brief(2, 1 << 20))
            .unwrap_or_else(|e| panic!("stress run {attempt} failed: {e}"));
        eprintln!("{report}");
        assert!(report.verifier_alongside, "{report}");
        assert_every_kind_of_change_happened(&report);
        let c = &report.changes;
        assert!(
            c.below_add_removes > 0 && c.above_add_removes > 0,
            "{report}"
        );
        assert!(c.moves > 0, "{report}");
        // Only the verifier reads the toggled region; the writers' slots never go away.
        assert!(
            report.completed_after_change[..report.vcpus]
                .iter()
                .all(|n| *n == 0),
            "{report}"
        );
        completed = report.total_completed_after_change();
        if completed > 0 {
            break;
        }
    }
    assert!(
        completed > 0,
        "no read landed in a read-only toggle's window in 8 runs"
    );
}

#[test]
fn kvm_stress_with_fifteen_writers_verifies_in_a_phase_of_its_own() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_stress_with_fifteen_writers_verifies_in_a_phase_of_its_own",
    ) {
        return;
    }
    let config = StressConfig {
        stride: 512,
        slots_per_vcpu: 1,
        duration: Duration::from_secs(1),
        ..brief(15, 256 << 10)
    };
    let report = stress(config).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{report}");
    assert!(!report.verifier_alongside);
    assert_eq!(report.verifier_vcpu, 0);
    assert_eq!(report.area_slots, 15);
    assert_every_kind_of_change_happened(&report);
}

#[test]
fn kvm_stress_detects_a_lost_write_and_names_its_address() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_stress_detects_a_lost_write_and_names_its_address",
    ) {
        return;
    }
    let page = 300; // in the second writer's part
    let config = StressConfig {
        iterations: 3,
        corrupt_page: Some(page),
        ..brief(2, 1 << 20)
    };
    let err = stress(config).expect_err("the lost write is found");
    let gpa = AREA_GPA + page * 4096;
    assert!(
        matches!(err, StressError::LostWrite { vcpu: 1, gpa: at, .. } if at == gpa),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .starts_with(&format!("lost write at {gpa:#x} (vCPU 1)")),
        "{err}"
    );
}

#[test]
fn kvm_stress_refuses_what_the_guest_cannot_run() {
    if !kvm_test_support::require_kvm("tinyvmm-bench::kvm_stress_refuses_what_the_guest_cannot_run")
    {
        return;
    }
    for vcpus in [0, 16] {
        let err = stress(brief(vcpus, 1 << 20)).expect_err("refused");
        assert_eq!(
            err.to_string(),
            format!("{vcpus} writer vCPUs asked for; the stress mode runs 1 to 15")
        );
    }
    for stride in [0, 12, 2 << 20] {
        let config = StressConfig {
            stride,
            ..brief(1, 1 << 20)
        };
        let err = stress(config).expect_err("refused");
        assert!(
            matches!(err, StressError::Stride { stride: s, .. } if s == stride),
            "{err:?}"
        );
    }
    let err = stress(brief(2, 1 << 40)).expect_err("refused");
    assert!(matches!(err, StressError::AreaSize { .. }), "{err:?}");
    let config = StressConfig {
        corrupt_page: Some(256),
        ..brief(1, 1 << 20)
    };
    let err = stress(config).expect_err("refused");
    assert_eq!(
        err.to_string(),
        "page 256 is outside the test area of 256 pages"
    );
}

#[test]
fn kvm_stress_in_ring_mode_loses_nothing_and_survives_full_rings() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_stress_in_ring_mode_loses_nothing_and_survives_full_rings",
    ) {
        return;
    }
    // The smallest ring: the writers fill it again and again, and each full ring is an exit
    // that collects the rings and goes on; every harvest is still checked for exactness.
    let report = stress(StressConfig {
        dirty_ring: Some(kvm_memslots::MIN_RING_ENTRIES),
        ..brief(2, 1 << 20)
    })
    .unwrap_or_else(|e| panic!("stress in ring mode failed: {e}"));
    eprintln!("{report}");
    assert_every_kind_of_change_happened(&report);
    assert_eq!(report.dirty_ring, Some(256));
    assert!(report.dirty_ring_full > 0, "{report}");
    // An invalid size is refused before anything is made, naming the bounds.
    let err = stress(StressConfig {
        dirty_ring: Some(1000),
        ..brief(1, 1 << 20)
    })
    .expect_err("refused");
    assert!(
        err.to_string()
            .contains("must be a power of two from 256 to"),
        "{err}"
    );
}
