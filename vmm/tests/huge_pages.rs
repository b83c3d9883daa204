//! A VM's own memory in 2 MiB hugetlb pages, on real `/dev/kvm`: the test guest served with
//! them (`serve --page-size 2m`, anonymous and memfd) writes and verifies its memory, and a
//! Full snapshot restored by copy brings the pages and their size back; the hotplug area with
//! 2 MiB pages plugs, holds what is written, gives a huge page back on each unplugged block and
//! plugs zeros again, through the API too, across a copy restore. A pool too small for the
//! initial memory refuses the start, and for a piece the plug (409), each naming its free
//! pages. A Full written on a hugetlbfs mount is a template: clones restored from it with the
//! file backend map it in 2 MiB pages, verify it and do not see each other's writes, and a
//! clone whose private copies the pool cannot reserve is refused before it runs.
//!
//! They need free pages in the host's hugetlb pool (`resources/setup-host.sh` reserves some);
//! without them they say so loudly (`SKIPPED <test>: <why>`) and return.

mod support;
use std::path::Path;

use kvm_memslots::{hugetlb_pages_available, PageSize};
use serde_json::{json, Value};
use support::vmm::{temp_path, InProcess};
use support::HugetlbfsMount;
use tinyvmm::control::hotplug::HotplugConfig;
use tinyvmm::control::memory::RegionPageSize;
use tinyvmm::jobs::restore::RestoreFrom;
use tinyvmm::jobs::serve::{serve_in_background, ServeConfig};
use tinyvmm::test_guest::area::AREA_GPA;
use tinyvmm::test_guest::hotplug::HotplugArea;
use tinyvmm::test_guest::layout;
use tinyvmm::test_guest::vcpus::{MemBackend, TestVm};
use vm_memory::{Bytes, GuestAddress};

const MIB: u64 = 1 << 20;

/// Whether the test can run: KVM, and `pages` free 2 MiB pages in the pool; if not, a loud
/// line saying why it did not.
fn can_run(test: &str, pages: u64) -> bool {
    let name = format!("tinyvmm::{test}");
    if !kvm_test_support::require_kvm(&name) {
        return false;
    }
    support::require_hugetlb_pages(&name, pages, &pages.to_string())
}

/// A VMM serving its API from a thread of this process on [`temp_path`]`("NAME.sock")`, with
/// the configuration `configure` makes of the default.
fn serve(name: &str, configure: impl FnOnce(ServeConfig) -> ServeConfig) -> InProcess {
    InProcess::start(configure(ServeConfig::new(temp_path(&format!(
        "{name}.sock"
    )))))
}

/// The regions of `GET /memory` in the initial memory (from [`AREA_GPA`]).
fn area_regions(vmm: &InProcess) -> Vec<Value> {
    let memory = vmm.ok("GET", "/memory", None);
    memory["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .filter(|r| r["guest_address"].as_u64() >= Some(AREA_GPA))
        .cloned()
        .collect()
}

/// Has the guest `op` ("write" or "verify") one u64 a page over `[start, end)`.
fn guest(vmm: &InProcess, op: &str, start: u64, end: u64, seed: u64) {
    let command = support::guest_command(op, start, end, seed);
    let done = vmm.ok("PUT", "/guest/command", Some(command));
    assert_eq!(done["result"], "ok", "{op}: {done}");
}

/// Serves the test guest with 8 MiB of initial memory in 2 MiB pages over two slots (in a
/// memfd if `memfd`): the guest writes and verifies it, the region is hugetlb-backed, a Full
/// snapshot restored by copy reports 2 MiB pages and the guest verifies what it wrote.
fn served_with_huge_pages(test: &str, memfd: bool) {
    let short = if memfd { "huge-memfd" } else { "huge-anon" };
    // The source's four pages, then the restored VM's four once the source is gone.
    if !can_run(test, 4) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-{short}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let file = |name: &str| dir.join(name);
    let (start, end) = (AREA_GPA, AREA_GPA + 8 * MIB);
    let vmm = serve(short, |config| ServeConfig {
        slots: 3,
        area_size: 8 * MIB,
        memfd,
        page_size: PageSize::Huge2M,
        ..config
    });
    let regions = area_regions(&vmm);
    assert_eq!(regions.len(), 1, "{regions:?}");
    assert_eq!(regions[0]["page_size"], "2m", "{regions:?}");
    assert_eq!(regions[0]["slots"], 2, "{regions:?}");
    assert_eq!(
        regions[0]["backing"],
        if memfd { "memfd" } else { "anonymous" }
    );
    guest(&vmm, "write", start, end, 38);
    guest(&vmm, "verify", start, end, 38);
    let hva = regions[0]["host_address"].as_u64().expect("an address");
    assert_eq!(
        support::hugetlb_bytes(hva, 8 * MIB),
        8 * MIB,
        "the guest's writes landed in huge pages"
    );
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let create = json!({"snapshot_type": "Full", "snapshot_path": file("full.state"),
                        "mem_file_path": file("full.mem")});
    vmm.ok("PUT", "/snapshot/create", Some(create));
    vmm.stop();

    let restored = serve(&format!("{short}-restored"), |config| ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: file("full.state"),
            mem_file: file("full.mem"),
            backend: MemBackend::Copy,
            working_set: Default::default(),
            page_size: None,
        }),
        ..config
    });
    let regions = area_regions(&restored);
    assert_eq!(regions.len(), 1, "{regions:?}");
    assert_eq!(
        regions[0]["page_size"], "2m",
        "the restore keeps the page size: {regions:?}"
    );
    let hva = regions[0]["host_address"].as_u64().expect("an address");
    assert_eq!(
        support::hugetlb_bytes(hva, 8 * MIB),
        8 * MIB,
        "copied into huge pages"
    );
    restored.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    guest(&restored, "verify", start, end, 38);
    restored.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kvm_served_with_2m_pages_the_guest_verifies_and_a_copy_restore_keeps_them() {
    served_with_huge_pages(
        "kvm_served_with_2m_pages_the_guest_verifies_and_a_copy_restore_keeps_them",
        false,
    );
}

#[test]
fn kvm_served_with_2m_pages_in_a_memfd_the_guest_verifies_and_a_copy_restore_keeps_them() {
    served_with_huge_pages(
        "kvm_served_with_2m_pages_in_a_memfd_the_guest_verifies_and_a_copy_restore_keeps_them",
        true,
    );
}

/// A serve whose initial memory the pool cannot hold is refused before anything runs, naming
/// the pool's free pages.
#[test]
fn kvm_initial_memory_the_pool_cannot_hold_is_refused_naming_the_free_pages() {
    let test = "kvm_initial_memory_the_pool_cannot_hold_is_refused_naming_the_free_pages";
    if !kvm_test_support::require_kvm(&format!("tinyvmm::{test}")) {
        return;
    }
    // More than the pool has, whatever its size (a pool of 1 TiB is not reserved here).
    let pages = hugetlb_pages_available() + 512;
    let socket = temp_path("pool.sock");
    let config = ServeConfig {
        slots: 2,
        area_size: pages * 2 * MIB,
        page_size: PageSize::Huge2M,
        ..ServeConfig::new(socket.clone())
    };
    let error = serve_in_background(config)
        .map(drop)
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("hugetlb pool has") && error.contains(&format!("need {pages}")),
        "{error}"
    );
}

/// The test guest's hotplug area in 2 MiB pages, one 4 MiB piece of two blocks: plugged
/// memory holds what is written in huge pages; an unplugged block of a piece that stays gives
/// its huge page back, and the piece's removal the rest; plugged again, it reads zeros.
#[test]
fn kvm_the_hotplug_area_with_2m_pages_gives_huge_pages_back_on_unplug() {
    let test = "kvm_the_hotplug_area_with_2m_pages_gives_huge_pages_back_on_unplug";
    if !can_run(test, 2) {
        return;
    }
    let vm = TestVm::new().expect("the test guest's VM");
    let memory = vm.memory();
    let config = HotplugConfig {
        total_size_mib: 8,
        block_size_mib: 2,
        slot_size_mib: Some(4),
        page_size: RegionPageSize::Huge2M,
    };
    let gpa = 1 << 30;
    let mut area = HotplugArea::new(config, gpa, layout::IDENTITY_MAPPED, 16).expect("area");
    let mut plug = |blocks: u64| {
        let plan = area.plan_blocks(blocks);
        let failures = area.carry_out(memory, &plan).expect("plugged");
        assert!(failures.is_empty(), "{failures:?}");
    };
    let piece = || {
        let regions = memory.regions();
        let r = regions.iter().find(|r| r.gpa.0 == gpa)?;
        assert_eq!(r.page_size, PageSize::Huge2M, "{r:?}");
        Some(r.hva.0)
    };
    let write = |at: u64, value: u64| {
        memory
            .current()
            .write_obj(value, GuestAddress(at))
            .expect("plugged memory is writable");
    };
    let read = |at: u64| -> u64 {
        memory
            .current()
            .read_obj(GuestAddress(at))
            .expect("plugged memory is readable")
    };
    let pool_before = hugetlb_pages_available();

    plug(2);
    let hva = piece().expect("the piece is mapped");
    write(gpa + 8, 0x38_0001);
    write(gpa + 3 * MIB, 0x38_0002);
    assert_eq!((read(gpa + 8), read(gpa + 3 * MIB)), (0x38_0001, 0x38_0002));
    assert_eq!(
        support::hugetlb_bytes(hva, 4 * MIB),
        4 * MIB,
        "two huge pages"
    );

    // One block unplugged, the piece stays: its huge page goes back to the pool.
    plug(1);
    assert_eq!(piece(), Some(hva), "the piece stays");
    assert_eq!(
        support::hugetlb_bytes(hva, 4 * MIB),
        2 * MIB,
        "the unplugged block's huge page is freed"
    );
    assert_eq!(read(gpa + 8), 0x38_0001, "the plugged block keeps its data");

    // All unplugged: the piece goes, and its pages with it.
    plug(0);
    assert_eq!(piece(), None);
    eprintln!(
        "{test}: the pool had {pool_before} free pages before the plug, {} after the unplug",
        hugetlb_pages_available()
    );

    // Plugged again: zeros.
    plug(2);
    assert_eq!(
        (read(gpa + 8), read(gpa + 3 * MIB)),
        (0, 0),
        "re-plugged memory is new"
    );
    plug(0);
}

/// The test guest's hotplug area with `"page_size": "2m"` through the API: the guest checks
/// what is plugged, `GET /hotplug/memory` and `GET /memory` report 2 MiB pages, and a snapshot
/// restored by copy keeps them for the plugged piece and for the pieces it plugs next.
#[test]
fn kvm_the_api_hotplug_area_in_2m_pages_survives_a_copy_restore() {
    let test = "kvm_the_api_hotplug_area_in_2m_pages_survives_a_copy_restore";
    // A 4 MiB piece in the source, then two in the restored VM.
    if !can_run(test, 4) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-huge-plug", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let file = |name: &str| dir.join(name);
    let vmm = serve("huge-plug", |config| ServeConfig {
        area_size: 8 * MIB,
        ..config
    });
    let area = json!({"total_size_mib": 8, "block_size_mib": 2, "slot_size_mib": 4,
                      "page_size": "2m"});
    vmm.ok("PUT", "/hotplug/memory", Some(area));
    vmm.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 4})),
    );
    let info = vmm.ok("GET", "/hotplug/memory", None);
    assert_eq!(info["page_size"], "2m", "{info}");
    let base = info["guest_address"].as_u64().expect("an address");
    let pieces = |vmm: &InProcess| -> Vec<Value> {
        let memory = vmm.ok("GET", "/memory", None);
        memory["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .filter(|r| r["guest_address"].as_u64() >= Some(base))
            .cloned()
            .collect()
    };
    let plugged = pieces(&vmm);
    assert_eq!(plugged.len(), 1, "{plugged:?}");
    assert_eq!(plugged[0]["page_size"], "2m", "{plugged:?}");
    guest(&vmm, "write", base, base + 4 * MIB, 7);
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let create = json!({"snapshot_type": "Full", "snapshot_path": file("s.state"),
                        "mem_file_path": file("s.mem")});
    vmm.ok("PUT", "/snapshot/create", Some(create));
    vmm.stop();

    let restored = serve("huge-plug-restored", |config| ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: file("s.state"),
            mem_file: file("s.mem"),
            backend: MemBackend::Copy,
            working_set: Default::default(),
            page_size: None,
        }),
        ..config
    });
    let info = restored.ok("GET", "/hotplug/memory", None);
    assert_eq!(
        (info["page_size"].clone(), info["plugged_size_mib"].clone()),
        (json!("2m"), json!(4)),
        "{info}"
    );
    restored.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    guest(&restored, "verify", base, base + 4 * MIB, 7);
    restored.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 8})),
    );
    let plugged = pieces(&restored);
    assert_eq!(plugged.len(), 2, "{plugged:?}");
    assert!(
        plugged.iter().all(|r| r["page_size"] == "2m"),
        "the restored area plugs 2 MiB pages: {plugged:?}"
    );
    restored.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plug into a 2 MiB hotplug area whose piece the pool cannot hold is a 409 naming the
/// pool's free pages, and plugs nothing.
#[test]
fn kvm_a_2m_plug_the_pool_cannot_hold_is_refused_naming_the_free_pages() {
    let test = "kvm_a_2m_plug_the_pool_cannot_hold_is_refused_naming_the_free_pages";
    if !kvm_test_support::require_kvm(&format!("tinyvmm::{test}")) {
        return;
    }
    let vmm = serve("huge-short", |config| config);
    // One piece of more pages than the pool has, whatever its size.
    let piece_mib = (hugetlb_pages_available() + 64) * 2;
    let area = json!({"total_size_mib": piece_mib, "block_size_mib": 2,
                      "slot_size_mib": piece_mib, "page_size": "2m"});
    vmm.ok("PUT", "/hotplug/memory", Some(area));
    let (status, answer) = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 2})),
    );
    assert_eq!(status, 409, "{answer}");
    let message = answer["fault_message"].as_str().unwrap_or_default();
    assert!(message.contains("free 2 MiB pages"), "{answer}");
    let info = vmm.ok("GET", "/hotplug/memory", None);
    assert_eq!(
        (
            info["plugged_size_mib"].clone(),
            info["mapped_slots"].clone()
        ),
        (json!(0), json!(0)),
        "{info}"
    );
    vmm.stop();
}

/// A hugetlbfs mount for `test`, or `None` after a loud SKIPPED line saying why it cannot be
/// made (mounting needs root).
fn hugetlbfs_mount(test: &str, name: &str) -> Option<HugetlbfsMount> {
    let dir = std::env::temp_dir().join(format!(
        "tinyvmm-test-{}-{name}-hugetlbfs",
        std::process::id()
    ));
    HugetlbfsMount::mount(dir.clone())
        .inspect_err(|why| {
            eprintln!(
                "SKIPPED tinyvmm::{test}: cannot mount hugetlbfs on {}: {why} (the test needs \
                 root)",
                dir.display()
            )
        })
        .ok()
}

/// A VM restored from `state` and the memory file `mem` with the file backend: the memory
/// file mapped privately.
fn file_clone(name: &str, state: &Path, mem: &Path) -> InProcess {
    serve(name, |config| ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: state.to_path_buf(),
            mem_file: mem.to_path_buf(),
            backend: MemBackend::File,
            working_set: Default::default(),
            page_size: None,
        }),
        ..config
    })
}

/// The test guest in 2 MiB pages snapshotted with its memory file on a hugetlbfs mount: two
/// clones restored from it with the file backend map every region in 2 MiB pages, each
/// guest verifies the template's data, then writes its own and verifies it; neither sees the
/// other's writes, and a clone started after them still reads the template's. A Diff on the
/// mount is refused; a live Full there (its later rounds written over its first) restores
/// its point.
#[test]
fn kvm_clones_of_a_template_on_hugetlbfs_map_2m_pages_and_keep_their_writes_apart() {
    let test = "kvm_clones_of_a_template_on_hugetlbfs_map_2m_pages_and_keep_their_writes_apart";
    // The source's 4 pages and two templates' 5 each (the 2 MiB system region's one too),
    // then the templates' 10 and each of two clones' 5 reserved for its private copies.
    if !can_run(test, 20) {
        return;
    }
    let Some(mount) = hugetlbfs_mount(test, "clones") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-clones", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let state = dir.join("template.state");
    let mem = mount.path("template.mem");
    let (start, end) = (AREA_GPA, AREA_GPA + 8 * MIB);
    let source = serve("clones-source", |config| ServeConfig {
        slots: 3,
        area_size: 8 * MIB,
        page_size: PageSize::Huge2M,
        ..config
    });
    guest(&source, "write", start, end, 38);
    source.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let create = json!({"snapshot_type": "Full", "snapshot_path": state,
                        "mem_file_path": mem});
    source.ok("PUT", "/snapshot/create", Some(create));
    // A Diff cannot live on hugetlbfs (its files have no holes to tell its pages by): a 400
    // naming why, and no file left.
    let diff_mem = mount.path("diff.mem");
    let diff = json!({"snapshot_type": "Diff", "snapshot_path": dir.join("diff.state"),
                      "mem_file_path": diff_mem});
    let (status, answer) = source.call("PUT", "/snapshot/create", Some(diff));
    assert_eq!(status, 400, "{answer}");
    let message = answer["fault_message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Diff") && message.contains("hugetlbfs"),
        "{answer}"
    );
    assert!(!diff_mem.exists(), "a refused Diff leaves no file");
    // A live Full there too, its later rounds written over its first: half the area
    // rewritten first.
    source.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    guest(&source, "write", start, start + 4 * MIB, 39);
    let (live_state, live_mem) = (dir.join("live.state"), mount.path("live.mem"));
    let live = json!({"snapshot_type": "Full", "snapshot_path": live_state,
                      "mem_file_path": live_mem, "live": true});
    source.ok("PUT", "/snapshot/create", Some(live));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let info = source.ok("GET", "/snapshot", None);
        let phase = info["phase"].as_str().expect("a phase").to_owned();
        if !["setup", "pre_copy", "stop_and_copy"].contains(&phase.as_str()) {
            assert_eq!(phase, "completed", "{info}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the live Full never ended: {info}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    source.stop();
    let meta = std::fs::metadata(&mem).expect("the template");
    assert_eq!(
        meta.len(),
        10 * MIB,
        "the system region's 2 MiB and the area's 8"
    );
    eprintln!(
        "{test}: the template holds {} MiB of 2 MiB pages on hugetlbfs",
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512 / MIB
    );

    let pool_before = hugetlb_pages_available();
    let clones = [
        file_clone("clone-a", &state, &mem),
        file_clone("clone-b", &state, &mem),
    ];
    eprintln!(
        "{test}: the pool had {pool_before} free, unreserved pages before the clones, {} with \
         both mapped (each reserves its whole memory for its copies on write)",
        hugetlb_pages_available()
    );
    for (clone, name) in clones.iter().zip(["a", "b"]) {
        let memory = clone.ok("GET", "/memory", None);
        let regions = memory["regions"].as_array().expect("regions");
        assert!(
            regions.iter().all(|r| r["page_size"] == "2m"),
            "clone {name}: every region maps the hugetlbfs file in 2 MiB pages: {regions:?}"
        );
        clone.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
        guest(clone, "verify", start, end, 38);
        let hva = area_regions(clone)[0]["host_address"]
            .as_u64()
            .expect("an address");
        assert_eq!(
            support::hugetlb_bytes(hva, 8 * MIB),
            8 * MIB,
            "clone {name}: the template's pages are mapped as 2 MiB pages"
        );
    }
    // Each writes its own data over the whole area, then verifies it: the other's writes
    // would show as a mismatch.
    guest(&clones[0], "write", start, end, 0xa);
    guest(&clones[1], "write", start, end, 0xb);
    guest(&clones[0], "verify", start, end, 0xa);
    guest(&clones[1], "verify", start, end, 0xb);
    let [a, b] = clones;
    a.stop();
    b.stop();
    // The template is unchanged: a new clone reads what the source wrote.
    let third = file_clone("clone-c", &state, &mem);
    third.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    guest(&third, "verify", start, end, 38);
    third.stop();
    // A clone of the live Full reads its point.
    let fourth = file_clone("clone-d", &live_state, &live_mem);
    fourth.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    guest(&fourth, "verify", start, start + 4 * MIB, 39);
    guest(&fourth, "verify", start + 4 * MIB, end, 38);
    fourth.stop();
    let _ = std::fs::remove_dir_all(&dir);
    drop(mount);
}

/// A template on hugetlbfs of more memory than the pool can reserve for a clone's private
/// copies: the clone is refused before it runs, naming the pool's free pages, rather than
/// mapped without a reservation (a copy on write the pool could not give would kill the VMM
/// with `SIGBUS`). The source serves 4 KiB pages, so a template on hugetlbfs needs only its
/// written pages; the clone maps every region of it in 2 MiB pages.
#[test]
fn kvm_a_clone_the_pool_cannot_reserve_is_refused_naming_the_free_pages() {
    let test = "kvm_a_clone_the_pool_cannot_reserve_is_refused_naming_the_free_pages";
    // The template's written pages: the system region's and the area's first.
    if !can_run(test, 2) {
        return;
    }
    let Some(mount) = hugetlbfs_mount(test, "short") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-short", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let state = dir.join("template.state");
    let mem = mount.path("template.mem");
    // More than the pool could reserve, whatever other tests take meanwhile.
    let pages = hugetlb_pages_available() + 512;
    let source = serve("short-source", |config| ServeConfig {
        slots: 2,
        area_size: pages * 2 * MIB,
        ..config
    });
    guest(&source, "write", AREA_GPA, AREA_GPA + 4096, 5);
    source.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let create = json!({"snapshot_type": "Full", "snapshot_path": state,
                        "mem_file_path": mem});
    source.ok("PUT", "/snapshot/create", Some(create));
    source.stop();

    let socket = temp_path("short.sock");
    let config = ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: state.clone(),
            mem_file: mem.clone(),
            backend: MemBackend::File,
            working_set: Default::default(),
            page_size: None,
        }),
        ..ServeConfig::new(socket)
    };
    let error = serve_in_background(config)
        .map(drop)
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("hugetlb pool has") && error.contains(&format!("need {}", pages + 1)),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    drop(mount);
}
