//! The perf suite on real `/dev/kvm`: every scenario briefly, at a small slot count and at KVM's
//! maximum where that is cheap, checking that iterations ran, that the data the scenario checks
//! was right, that the move tests count the guest's exits, and that bad configurations are
//! refused. No timing is asserted: the figures are the bench's job.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tinyvmm_bench::perf::{
    run_perf, run_test, Outcome, PerfConfig, Scenario, Skipped, TestResult, TestSpec,
};
use vmm_sys_util::eventfd::EventFd;

const BRIEF: Duration = Duration::from_millis(200);

fn outcome(test: Scenario, slots: usize, area_mib: u64) -> Outcome {
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let spec = TestSpec {
        test,
        slots,
        area_size: area_mib << 20,
        duration: BRIEF,
        limits: None,
        keep_slot_zap_all: false,
    };
    run_test(&spec, &AtomicBool::new(false), &stopped, &mut |_| {})
        .unwrap_or_else(|e| panic!("{test} at {slots} slots: {e}"))
}

fn ran(test: Scenario, slots: usize, area_mib: u64) -> TestResult {
    match outcome(test, slots, area_mib) {
        Outcome::Ran(result) => {
            assert_eq!((result.test, result.slots), (test, slots));
            assert!(result.iterations > 0, "{result:?}");
            assert!(result.per_iteration > Duration::ZERO, "{result:?}");
            result
        }
        Outcome::Skipped(s) => panic!("{test} at {slots} slots skipped: {}", s.reason),
    }
}

fn skipped(test: Scenario, slots: usize, area_mib: u64) -> Skipped {
    match outcome(test, slots, area_mib) {
        Outcome::Skipped(s) => s,
        Outcome::Ran(r) => panic!("{test} at {slots} slots ran: {r:?}"),
    }
}

fn max_slots() -> usize {
    kvm_ioctls::Kvm::new().expect("KVM").get_nr_memslots()
}

#[test]
fn kvm_perf_map_faults_in_one_half_while_the_host_discards_the_other() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_map_faults_in_one_half_while_the_host_discards_the_other",
    ) {
        return;
    }
    let r = ran(Scenario::Map, 64, 512);
    assert_eq!(r.area_size, 32 << 20);
    // The first and last page of every half the guest wrote, read back by the host.
    assert_eq!(r.data_checks, 2 * r.iterations);
    // 32 MiB has 8192 pages: one per test slot at 8193 slots, none to spare at 8194.
    let r = ran(Scenario::Map, 8193, 512);
    assert_eq!((r.slot_size, r.last_slot_size), (4096, 4096));
    let s = skipped(Scenario::Map, 8194, 512);
    assert_eq!(
        s.reason.to_string(),
        "the 32 MiB area has 8192 pages, fewer than its 8193 test slots (at most 8193 slots)"
    );
}

#[test]
fn kvm_perf_unmap_discards_halves_page_by_page_and_in_chunks() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_unmap_discards_halves_page_by_page_and_in_chunks",
    ) {
        return;
    }
    for test in [Scenario::Unmap, Scenario::UnmapChunked] {
        let r = ran(test, 64, 512);
        assert_eq!(r.area_size, 128 << 20);
        // The two pages the guest kept writing hold its last pass.
        assert_eq!(r.data_checks, 2);
        assert!(r.exits.is_none());
    }
}

#[test]
fn kvm_perf_move_active_area_counts_the_guests_exits_on_the_moved_slot() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_move_active_area_counts_the_guests_exits_on_the_moved_slot",
    ) {
        return;
    }
    // Whether the guest touches the slot while it is away is a race: retry a bounded number of
    // times until an exit was counted in the expected window.
    let mut attempts = Vec::new();
    for _ in 0..20 {
        let r = ran(Scenario::MoveActive, 64, 512);
        // Every page of the window holds the guest's last pass, across the moved slot too.
        assert_eq!(r.data_checks, 48);
        let exits = r.exits.expect("a move test reports exits");
        attempts.push(exits);
        if exits.mmio_counted > 0 {
            return;
        }
    }
    panic!("no MMIO exit counted in 20 runs: {attempts:?}");
}

#[test]
fn kvm_perf_move_inactive_area_sees_no_exit_on_the_moved_slot() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_move_inactive_area_sees_no_exit_on_the_moved_slot",
    ) {
        return;
    }
    let r = ran(Scenario::MoveInactive, 64, 512);
    assert_eq!(r.data_checks, 48);
    let exits = r.exits.expect("a move test reports exits");
    assert_eq!(exits.on_moved_slot(), 0, "{exits:?}");
}

#[test]
fn kvm_perf_rw_checks_every_page_both_ways() {
    if !kvm_test_support::require_kvm("tinyvmm-bench::kvm_perf_rw_checks_every_page_both_ways") {
        return;
    }
    let r = ran(Scenario::Rw, 64, 8);
    assert_eq!(r.area_size, 8 << 20);
    // Every page read by the host after the guest wrote it, and by the guest after the host.
    assert_eq!(r.data_checks, 2 * 2048 * r.iterations);
}

#[test]
fn kvm_perf_moves_and_unmaps_at_the_maximum_slot_count() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_moves_and_unmaps_at_the_maximum_slot_count",
    ) {
        return;
    }
    let max = max_slots();
    let r = ran(Scenario::MoveActive, max, 512);
    // The kernel's layout: the last slot also holds the remainder of the pages.
    let pages = (512 << 20) / 4096;
    let test_slots = max as u64 - 1;
    assert_eq!(r.slot_size, pages / test_slots * 4096);
    assert_eq!(
        r.last_slot_size,
        (pages / test_slots + pages % test_slots) * 4096
    );
    assert_eq!(r.area_size, 512 << 20);
    assert_eq!(r.data_checks, 48);
    // One page per slot: every 2 MiB chunk is discarded across 512 slots.
    let r = ran(Scenario::UnmapChunked, max, 512);
    assert_eq!((r.slot_size, r.area_size), (4096, 128 << 20));
    assert_eq!(r.data_checks, 2);
}

#[test]
fn kvm_perf_suite_prints_a_table_and_json_with_skips_named() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_suite_prints_a_table_and_json_with_skips_named",
    ) {
        return;
    }
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let config = PerfConfig {
        slots: vec![2, 64],
        area_size: 4 << 20,
        seconds: 0.05,
        runs: 2,
        scenarios: Vec::new(),
        limits: None,
        keep_slot_zap_all: false,
    };
    let mut events = 0;
    let report = run_perf(&config, &AtomicBool::new(false), &stopped, &mut |_| {
        events += 1
    })
    .expect("the suite runs");
    assert!(!report.interrupted);
    // At 2 slots the one test slot is the moved one: no room below it for the move windows.
    let skipped: Vec<_> = report.skipped.iter().map(|s| (s.slots, s.test)).collect();
    assert_eq!(
        skipped,
        [(2, Scenario::MoveActive), (2, Scenario::MoveInactive)]
    );
    // Two runs of every other test; a skip is reported once.
    assert_eq!(report.results.len(), 2 * (4 + 6));
    assert!(report.results.iter().all(|r| r.iterations > 0));
    assert!(events > report.results.len());
    let table = report.to_string();
    assert!(table.contains("move active area"), "{table}");
    assert!(
        table.contains("skipped: the slots below the last hold 0 bytes"),
        "{table}"
    );
    let json = serde_json::to_value(&report).expect("JSON");
    let first = &json["results"][0];
    assert_eq!(first["test"], "map");
    assert!(first["per_iteration_ms"].as_f64().expect("a number") > 0.0);
    assert_eq!(json["skipped"][0]["test"], "move-active");
}

#[test]
fn kvm_perf_bad_configurations_are_refused() {
    if !kvm_test_support::require_kvm("tinyvmm-bench::kvm_perf_bad_configurations_are_refused") {
        return;
    }
    let max = max_slots();
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let run = |config: PerfConfig| {
        run_perf(&config, &AtomicBool::new(false), &stopped, &mut |_| {})
            .expect_err("refused")
            .to_string()
    };
    let base = PerfConfig {
        slots: vec![64],
        seconds: 0.05,
        scenarios: vec![Scenario::MoveInactive],
        ..PerfConfig::default()
    };
    for slots in [1, max + 1] {
        assert_eq!(
            run(PerfConfig {
                slots: vec![64, slots],
                ..base.clone()
            }),
            format!("{slots} slots asked for; KVM offers 2 to {max} (one is the system region's)")
        );
    }
    for seconds in [0.0, -1.0, f64::NAN] {
        assert_eq!(
            run(PerfConfig {
                seconds,
                ..base.clone()
            }),
            format!("the time per test must be a positive number of seconds, not {seconds}")
        );
    }
    assert_eq!(
        run(PerfConfig {
            runs: 0,
            ..base.clone()
        }),
        "the number of runs must be at least 1"
    );
    let err = run(PerfConfig {
        area_size: 0,
        ..base.clone()
    });
    assert!(err.starts_with("a test area of 0x0 bytes"), "{err}");
    // A stop before the first test: nothing ran, and the report says so.
    let report = run_perf(&base, &AtomicBool::new(true), &stopped, &mut |_| {})
        .expect("an interrupted suite still reports");
    assert!(report.interrupted && report.results.is_empty());
    assert!(matches!(
        "nope".parse::<Scenario>(),
        Err(e) if e.to_string().starts_with("unknown test \"nope\"")
    ));
}

#[test]
fn kvm_the_harvest_bench_checks_every_harvest_in_both_modes() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_the_harvest_bench_checks_every_harvest_in_both_modes",
    ) {
        return;
    }
    use tinyvmm::jobs::check::CheckConfig;
    use tinyvmm_bench::harvest::{run_harvest_bench, HarvestConfig};
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let config = HarvestConfig {
        area: CheckConfig {
            slots: 65,
            area_size: 8 << 20,
            vcpus: 1,
            limits: None,
        },
        ring_entries: 256,
        runs: 1,
    };
    // Every harvest is checked against the pages the guest wrote (an inexact one is an
    // error), in bitmap and in ring mode; the smallest ring fills during the full writes.
    let report = run_harvest_bench(&config, &AtomicBool::new(false), &stopped)
        .unwrap_or_else(|e| panic!("{e}"));
    let pages: Vec<(&str, u64)> = report
        .rows
        .iter()
        .map(|r| (r.pattern, r.dirty_pages))
        .collect();
    let scattered = [0, 3, 21, 205, 2048].map(|p| ("scattered", p));
    let clustered = [3, 21, 205].map(|p| ("clustered", p));
    assert_eq!(pages, [&scattered[..], &clustered[..]].concat(), "{report}");
    assert!(report.ring_full_exits > 0, "{report}");
    let bad = HarvestConfig {
        area: CheckConfig {
            slots: 1,
            ..config.area
        },
        ..config
    };
    let err = run_harvest_bench(&bad, &AtomicBool::new(false), &stopped).expect_err("refused");
    assert!(err.to_string().contains("KVM offers 2 to"), "{err}");
}

#[test]
fn kvm_the_snapshot_bench_restores_with_every_backend() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_the_snapshot_bench_restores_with_every_backend",
    ) {
        return;
    }
    use tinyvmm_bench::snapshot::{run_snapshot_bench, SnapshotBenchConfig};
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-snapbench", std::process::id()));
    // 2 MiB pages too where the pool holds the area (4 pages), at 2 slots: 8 MiB cannot be
    // split into 32 slots of whole 2 MiB pages, which the report says.
    let huge = kvm_memslots::hugetlb_pages_available() >= 4;
    if !huge {
        eprintln!(
            "SKIPPED the 2 MiB rows of tinyvmm-bench::kvm_the_snapshot_bench_restores_with_every_backend: \
             the hugetlb pool has fewer than 4 free 2 MiB pages"
        );
    }
    let mut page_sizes = vec![kvm_memslots::PageSize::Base];
    if huge {
        page_sizes.push(kvm_memslots::PageSize::Huge2M);
    }
    let config = SnapshotBenchConfig {
        slots: vec![2, 33],
        area_size: 8 << 20,
        dir: dir.clone(),
        limits: None,
        page_sizes,
        touch_all: false,
    };
    // Every restore is verified by the guest (a failed verify is an error).
    let report = run_snapshot_bench(&config, &AtomicBool::new(false), &stopped)
        .unwrap_or_else(|e| panic!("{e}"));
    let base: Vec<_> = report.rows.iter().filter(|r| r.page_size == "4k").collect();
    assert_eq!(base.len(), 2, "{report}");
    if huge {
        let rows: Vec<_> = report.rows.iter().filter(|r| r.page_size == "2m").collect();
        assert_eq!(rows.len(), 1, "{report}");
        let backends: Vec<&str> = rows[0]
            .restores
            .iter()
            .map(|r| r.backend.as_str())
            .collect();
        assert_eq!(backends, ["copy", "uffd"], "no file restore off hugetlbfs");
        let copies = |r: &tinyvmm_bench::snapshot::SnapshotRow| {
            r.restores
                .iter()
                .find(|x| x.backend == "uffd")
                .and_then(|x| x.copy_calls)
                .expect("the uffd restore's copies")
        };
        // 1024 pages of data in 4 KiB pages; four 2 MiB pages (and the guest's own pages).
        assert!(copies(base[0]) >= 1024, "{report}");
        assert!(copies(rows[0]) < 64, "{report}");
        // The VMM alone reading the written pages: one copy a written 4 KiB page, one a 2 MiB
        // page.
        assert_eq!(base[0].host_touch.copy_calls, Some(1024), "{report}");
        assert_eq!(rows[0].host_touch.copy_calls, Some(4), "{report}");
        assert_eq!(report.skipped.len(), 1, "{report}");
        assert!(
            report.skipped[0].contains("cannot be split into 32 slots of whole 2048 KiB pages"),
            "{report}"
        );
    }
    for row in &base {
        let backends: Vec<&str> = row.restores.iter().map(|r| r.backend.as_str()).collect();
        assert_eq!(backends, ["copy", "file", "uffd"]);
        // The uffd restore recorded every page the guest verified (half of 8 MiB), and the
        // restore that prefetched them verified too.
        assert!(row.working_set_pages >= 1024, "{report}");
        assert_eq!(row.prefetch.backend, "uffd+prefetch");
        assert!(row.prefetch_faults < row.working_set_pages, "{report}");
        // Half of 8 MiB written: the full file holds about 4 MiB, the diff a sixteenth.
        assert!((4 << 20..=5 << 20).contains(&row.full_bytes), "{report}");
        assert!(row.diff_bytes < row.full_bytes / 2, "{report}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The move and unmap scenarios with KVM's zap-everything quirk kept, as
/// `tinyvmm-bench bench --keep-slot-zap-all` runs them to compare: the same checks pass.
#[test]
fn kvm_perf_moves_and_unmaps_also_run_with_kvms_zap_all_quirk_kept() {
    if !kvm_test_support::require_kvm(
        "tinyvmm-bench::kvm_perf_moves_and_unmaps_also_run_with_kvms_zap_all_quirk_kept",
    ) {
        return;
    }
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let config = PerfConfig {
        slots: vec![64],
        area_size: 4 << 20,
        seconds: 0.05,
        runs: 1,
        scenarios: vec![
            Scenario::Unmap,
            Scenario::MoveActive,
            Scenario::MoveInactive,
        ],
        limits: None,
        keep_slot_zap_all: true,
    };
    let report =
        run_perf(&config, &AtomicBool::new(false), &stopped, &mut |_| {}).expect("the suite runs");
    assert_eq!(report.results.len(), 3, "{report:?}");
    assert!(report.skipped.is_empty(), "{report:?}");
    for result in &report.results {
        assert!(result.iterations > 0, "{result:?}");
    }
}
