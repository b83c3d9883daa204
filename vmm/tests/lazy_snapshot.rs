//! Snapshots and migrations of a VM restored lazily (`restore --mem-backend uffd`), on
//! /dev/kvm, through `tinyvmm` processes: the pages the guest has not touched since the restore
//! are still the snapshot's, though no page table has them yet, and a paused Full, a live
//! Full and the Diff after it, and a migration must carry them. The guest wrote its whole test
//! area with seed 7 before the first snapshot; after the lazy restore it rewrites only the
//! first MiB (seed 9), so the rest is untouched, and it is that rest that must verify with
//! seed 7 wherever the VM goes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvm_test_support::files::{maps_memfd, memfd_at};
use serde_json::{json, Value};

mod support;
use support::merge_chain;
use support::vmm::Vmm;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;
/// The guest memory `serve` starts with.
const MEM_MIB: u64 = 16;

/// This binary's scratch folder (every test holds it: [`scratch`]).
fn dir() -> PathBuf {
    let dir = support::scratch::folder("lazy");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// A hold on [`dir`], which its last holder removes: each test's first local.
fn scratch() -> support::scratch::Scratch {
    support::scratch::Scratch::hold("lazy")
}

fn file(name: &str) -> PathBuf {
    dir().join(name)
}

/// `tinyvmm serve` with `extra` arguments.
fn serve(name: &str, extra: &[&str]) -> Vmm {
    Vmm::serve(name, 4, MEM_MIB, extra)
}

/// `tinyvmm restore` of `(state, mem)` with `backend`, paused as restored.
fn restore(name: &str, (state, mem): &(PathBuf, PathBuf), backend: &str) -> Vmm {
    Vmm::restore(name, state, mem, &["--mem-backend", backend])
}

fn area_end(vmm: &Vmm) -> u64 {
    support::area_end(vmm.api(), AREA)
}

/// Takes a snapshot of `kind` into `files`, with `extra` fields (`live`); a live one is waited
/// for and must complete.
fn snapshot(vmm: &Vmm, kind: &str, (state, mem): &(PathBuf, PathBuf), extra: Value) {
    let _ = std::fs::remove_file(state);
    let _ = std::fs::remove_file(mem);
    let mut body = json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem});
    for (k, v) in extra.as_object().expect("an object") {
        body[k] = v.clone();
    }
    vmm.ok("PUT", "/snapshot/create", Some(body.clone()));
    if body["live"] != json!(true) {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let info = vmm.ok("GET", "/snapshot", None);
        let phase = info["phase"].as_str().expect("a phase");
        if !["setup", "pre_copy", "stop_and_copy"].contains(&phase) {
            assert_eq!(phase, "completed", "{info}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the snapshot never ended: {info}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn snap(name: &str) -> (PathBuf, PathBuf) {
    (file(&format!("{name}.state")), file(&format!("{name}.mem")))
}

/// The first VM (of test `tag`, `serve` with `extra` arguments): its test area written with
/// seed 7, then a paused Full snapshot `s1`; the snapshot's files and where the area ends.
fn first_snapshot(tag: &str, extra: &[&str]) -> ((PathBuf, PathBuf), u64) {
    let vmm = serve(&format!("{tag}-first"), extra);
    let end = area_end(&vmm);
    assert_eq!(vmm.guest("write", AREA, end, 7)["result"], "ok");
    vmm.set_state("Paused");
    let s1 = snap(&format!("{tag}-s1"));
    snapshot(&vmm, "Full", &s1, json!({}));
    let output = vmm.stop();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    (s1, end)
}

/// Checks that `vmm`'s area holds seed 7 past its first MiB (the pages the lazy restore
/// never touched) and, in its first MiB, the seed it was `rewritten` with (7 if it was not).
fn verify(vmm: &Vmm, end: u64, rewritten: Option<u64>, what: &str) {
    let seven = vmm.guest("verify", AREA + MIB, end, 7);
    assert_eq!(
        seven["result"], "ok",
        "{what}: the pages the lazy restore never touched: {seven}"
    );
    let first = vmm.guest("verify", AREA, AREA + MIB, rewritten.unwrap_or(7));
    assert_eq!(first["result"], "ok", "{what}: the first MiB: {first}");
}

/// The snapshot `files` restored by copying, resumed, and verified.
fn verify_copy_restore(name: &str, files: &(PathBuf, PathBuf), end: u64, rewritten: Option<u64>) {
    let copy = restore(name, files, "copy");
    copy.set_state("Resumed");
    verify(&copy, end, rewritten, name);
    copy.stop();
}

/// `s1` restored lazily and resumed, its guest rewriting the first MiB with seed 9.
fn lazy_restore(name: &str, s1: &(PathBuf, PathBuf), end: u64) -> Vmm {
    let lazy = restore(name, s1, "uffd");
    lazy.set_state("Resumed");
    assert!(end > AREA + MIB);
    assert_eq!(lazy.guest("write", AREA, AREA + MIB, 9)["result"], "ok");
    lazy
}

#[test]
fn kvm_a_lazily_restored_vm_keeps_its_untouched_pages_in_snapshots() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_lazily_restored_vm_keeps_its_untouched_pages_in_snapshots",
    ) {
        return;
    }
    let _scratch = scratch();
    let (s1, end) = first_snapshot("snapshots", &[]);

    // A paused Full of the fresh lazy restore, before the guest ran at all.
    let fresh = restore("snapshots-fresh", &s1, "uffd");
    let s2 = snap("snapshots-s2");
    snapshot(&fresh, "Full", &s2, json!({}));
    fresh.stop();
    verify_copy_restore("snapshots-s2-copy", &s2, end, None);

    // A paused Full of a lazy restore whose guest ran and rewrote its first MiB.
    let paused = lazy_restore("snapshots-paused", &s1, end);
    paused.set_state("Paused");
    let p2 = snap("snapshots-p2");
    snapshot(&paused, "Full", &p2, json!({}));
    paused.stop();
    verify_copy_restore("snapshots-p2-copy", &p2, end, Some(9));

    // A live Full while the restored guest runs, then a live Diff of a later write.
    let lazy = lazy_restore("snapshots-live", &s1, end);
    let s3 = snap("snapshots-s3");
    snapshot(&lazy, "Full", &s3, json!({"live": true}));
    verify_copy_restore("snapshots-s3-copy", &s3, end, Some(9));
    assert_eq!(lazy.guest("write", AREA, AREA + MIB, 10)["result"], "ok");
    let d4 = snap("snapshots-d4");
    snapshot(&lazy, "Diff", &d4, json!({"live": true}));
    lazy.stop();
    let merged = (d4.0.clone(), file("snapshots-d4-merged.mem"));
    merge_chain(&merged.1, &[&s3.0, &s3.1, &d4.0, &d4.1]);
    verify_copy_restore("snapshots-d4-copy", &merged, end, Some(10));
    clean("snapshots");
}

/// Removes the files of test `tag` from the scratch directory.
fn clean(tag: &str) {
    for entry in std::fs::read_dir(dir()).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(tag) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[test]
fn kvm_a_lazily_restored_vm_migrates_with_its_untouched_pages() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_lazily_restored_vm_migrates_with_its_untouched_pages",
    ) {
        return;
    }
    let _scratch = scratch();
    migrate_a_lazy_restore("migrate", &[], false);
}

/// A local migration hands the memfd over instead of copying its pages: the pages the loader
/// has not filled are not in the memfd until something fills them.
#[test]
fn kvm_a_lazily_restored_vm_hands_its_untouched_pages_over_in_its_memfd() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_lazily_restored_vm_hands_its_untouched_pages_over_in_its_memfd",
    ) {
        return;
    }
    let _scratch = scratch();
    migrate_a_lazy_restore("local", &["--memfd"], true);
}

/// A lazy restore of the first VM (`serve` with `extra`) migrates (`local`ly: handing its
/// memfd over) to a `receive`, where its whole area verifies.
fn migrate_a_lazy_restore(tag: &str, extra: &[&str], local: bool) {
    let (s1, end) = first_snapshot(tag, extra);
    let mut source = lazy_restore(&format!("{tag}-source"), &s1, end);
    let (destination, listen) = Vmm::receive(&format!("{tag}-destination"), &[]);
    let body = json!({"destination": format!("unix:{}", listen.display()), "local": local});
    source.ok("PUT", "/migrate", Some(body));
    source.wait_migrated(Duration::from_secs(120));
    destination.wait_for_vm();
    verify(&destination, end, Some(9), "the received VM");
    destination.stop();
    clean(tag);
}

/// A region removed from a lazily restored VM gives its memory back, as it does on a VM that
/// was not restored: its mapping goes (the loader does not hold it), and the rest of the
/// guest's memory still verifies, touched or not. The region is a memfd, so that its mapping
/// is told from any other the VMM may make where it was.
#[test]
fn kvm_a_region_removed_from_a_lazily_restored_vm_gives_its_memory_back() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_region_removed_from_a_lazily_restored_vm_gives_its_memory_back",
    ) {
        return;
    }
    let _scratch = scratch();
    const GIB: u64 = 1 << 30;
    let size = 64 * MIB;
    let first = serve("removed-first", &[]);
    let end = area_end(&first);
    let added = first.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": size, "guest_address": GIB, "backing": "memfd"})),
    );
    let id = added["id"].as_u64().expect("an id");
    assert_eq!(first.guest("write", AREA, end, 7)["result"], "ok");
    assert_eq!(first.guest("write", GIB, GIB + size, 5)["result"], "ok");
    first.set_state("Paused");
    let s1 = snap("removed-s1");
    snapshot(&first, "Full", &s1, json!({}));
    assert_eq!(first.stop().status.code(), Some(0));

    let lazy = restore("removed-lazy", &s1, "uffd");
    lazy.set_state("Resumed");
    // Every page of the region filled by the loader.
    assert_eq!(lazy.guest("verify", GIB, GIB + size, 5)["result"], "ok");
    let region = lazy.ok("GET", &format!("/memory/regions/{id}"), None);
    assert_eq!(region["guest_address"], json!(GIB), "{region}");
    let hva = region["host_address"].as_u64().expect("a host address");
    let pid = lazy.pid();
    let memfd = memfd_at(&pid.to_string(), hva).expect("the region's memfd is mapped");
    lazy.ok("DELETE", &format!("/memory/regions/{id}"), None);
    assert!(
        !maps_memfd(&pid.to_string(), &memfd),
        "the removed region's memory ({memfd}, at {hva:#x}) is still mapped in the VMM"
    );
    // The rest is intact: the area (the loader has not filled most of it yet) verifies.
    verify(&lazy, end, None, "the lazy restore after the remove");
    let output = lazy.stop();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    clean("removed");
}

/// The page sizes `GET /memory` reports, region by region.
fn page_sizes(vmm: &Vmm) -> Vec<String> {
    let memory = vmm.ok("GET", "/memory", None);
    memory["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .map(|r| r["page_size"].as_str().expect("a page size").to_owned())
        .collect()
}

/// `restore --page-size` rebuilds every region in pages of another size than the snapshot's,
/// both ways, with each backend that can map it; a layout off the new grid is refused, naming
/// the region, before the guest runs.
#[test]
fn kvm_a_restore_overrides_the_page_size_both_ways() {
    let test = "tinyvmm::kvm_a_restore_overrides_the_page_size_both_ways";
    if !kvm_test_support::require_kvm(test) {
        return;
    }
    let _scratch = scratch();
    // The first VM's 2 MiB region (2 pages), then a restore of everything in 2 MiB pages
    // (system region, area and that region: 11 pages), one VM at a time.
    if !support::require_hugetlb_pages(test, 11, "11") {
        return;
    }
    const GIB: u64 = 1 << 30;
    let huge = 4 * MIB;
    // One area slot of 16 MiB: on the 2 MiB grid.
    let first = Vmm::serve("pagesize-first", 2, MEM_MIB, &[]);
    let end = area_end(&first);
    first.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": huge, "guest_address": GIB, "page_size": "2m"})),
    );
    assert_eq!(first.guest("write", AREA, end, 7)["result"], "ok");
    assert_eq!(first.guest("write", GIB, GIB + huge, 8)["result"], "ok");
    first.set_state("Paused");
    assert_eq!(page_sizes(&first), ["4k", "4k", "2m"]);
    let s1 = snap("pagesize-s1");
    snapshot(&first, "Full", &s1, json!({}));
    // A region off the 2 MiB grid, in a second snapshot.
    first.set_state("Resumed");
    first.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": MIB, "guest_address": 2 * GIB})),
    );
    first.set_state("Paused");
    let off_grid = snap("pagesize-off-grid");
    snapshot(&first, "Full", &off_grid, json!({}));
    assert_eq!(first.stop().status.code(), Some(0));

    let restore = |name: &str, files: &(PathBuf, PathBuf), backend: &str, size: &str| {
        Vmm::command(name)
            .args(["restore", "--snapshot"])
            .arg(&files.0)
            .arg("--mem-file")
            .arg(&files.1)
            .args(["--mem-backend", backend, "--page-size", size])
    };
    let verified = |vmm: &Vmm, what: &str| {
        vmm.set_state("Resumed");
        let area = vmm.guest("verify", AREA, end, 7);
        assert_eq!(area["result"], "ok", "{what}: the area: {area}");
        let region = vmm.guest("verify", GIB, GIB + huge, 8);
        assert_eq!(region["result"], "ok", "{what}: the 2 MiB region: {region}");
    };

    // 4 KiB → 2 MiB, lazily and by copy: every region in 2 MiB pages, every page verified,
    // and a snapshot of it records 2 MiB pages.
    for backend in ["uffd", "copy"] {
        let name = format!("pagesize-2m-{backend}");
        let vmm = restore(&name, &s1, backend, "2m").serving();
        assert_eq!(page_sizes(&vmm), ["2m", "2m", "2m"], "{backend}");
        verified(&vmm, &name);
        vmm.set_state("Paused");
        let s2 = snap(&format!("{name}-s2"));
        snapshot(&vmm, "Full", &s2, json!({}));
        assert_eq!(vmm.stop().status.code(), Some(0));
        let bytes = std::fs::read(&s2.0).expect("the state file");
        let state =
            tinyvmm::test_guest::snapshot::SnapshotState::from_bytes(&bytes).expect("a state file");
        assert!(
            state
                .layout
                .regions
                .iter()
                .all(|r| r.page_size == kvm_memslots_persist::LayoutPageSize::Huge2M),
            "{:?}",
            state.layout
        );
    }

    // 2 MiB → 4 KiB: the file restore, which maps no 2 MiB pages off hugetlbfs, maps the
    // snapshot's 2 MiB region in 4 KiB pages.
    let vmm = restore("pagesize-4k-file", &s1, "file", "4k").serving();
    assert_eq!(page_sizes(&vmm), ["4k", "4k", "4k"]);
    verified(&vmm, "4k file");
    assert_eq!(vmm.stop().status.code(), Some(0));

    // Off the grid: refused, naming the region, and nothing runs.
    let mut refused = restore("pagesize-refused", &off_grid, "copy", "2m").spawn();
    let output = refused.wait(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(output.status.code(), Some(0));
    assert!(
        stderr.contains("--page-size 2m") && stderr.contains("pages of 0x200000 bytes"),
        "{stderr}"
    );
    clean("pagesize");
}
