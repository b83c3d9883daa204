//! Working-set prefetch on real KVM: a lazy (`uffd`) restore records the pages the test guest
//! touches first, the next restore of the same snapshot fetches them ahead of the guest, and
//! the guest's memory verifies; a list of another snapshot, one naming pages the snapshot does
//! not have, or a list given to a restore that is not lazy is refused with the reason before
//! anything runs. A Linux guest (Debian's kernel, where `resources/fetch-kernel.sh` fetched it)
//! records and prefetches the same way, through `tinyvmm boot` and `restore` processes.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots_persist::WorkingSet;
use serde_json::{json, Value};
use tinyvmm::jobs::restore::RestoreFrom;
use tinyvmm::jobs::serve::{serve, ServeConfig};
use tinyvmm::jobs::working_set::WorkingSetFiles;
use tinyvmm::test_guest::snapshot::SnapshotState;
use tinyvmm::test_guest::vcpus::{MemBackend, TestVm};
use tinyvmm::test_guest::{Command, Op};
use tinyvmm::vm::VmOptions;
use vmm_sys_util::eventfd::EventFd;

mod support;
use support::vmm::{InProcess as Vmm, Vmm as Process};

/// The test area's guest address and size (`serve` with 8 MiB over one slot).
const AREA: u64 = 256 << 20;
const AREA_SIZE: u64 = 8 << 20;

/// Runs `op` with `seed` over the test area; it must be answered 200.
fn run_over_area(vmm: &Vmm, op: &str, seed: u64) -> Value {
    let command =
        json!({"op": op, "start": AREA, "end": AREA + AREA_SIZE, "stride": 4096, "seed": seed});
    let (status, body) = vmm.call("PUT", "/guest/command", Some(command));
    assert_eq!(status, 200, "{body}");
    body
}

fn set_state(vmm: &Vmm, state: &str) {
    let (status, body) = vmm.call("PATCH", "/vm", Some(json!({"state": state})));
    assert_eq!(status, 204, "{body}");
}

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tinyvmm-test-{}-wset-{name}.sock",
        std::process::id()
    ))
}

/// A restore of `state`/`mem` with `backend` and `working_set`.
fn restore_config(
    name: &str,
    state: &Path,
    mem: &Path,
    backend: MemBackend,
    working_set: WorkingSetFiles,
) -> ServeConfig {
    ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: state.to_path_buf(),
            mem_file: mem.to_path_buf(),
            backend,
            working_set,
            page_size: None,
        }),
        ..ServeConfig::new(socket(name))
    }
}

/// A new folder for the test `name` with two Full snapshots of one VM whose test area the
/// guest wrote with seed 5: `a.state` and `a.mem`, then `b.state` and `b.mem` (another
/// snapshot id, the same layout).
fn snapshots(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-wset-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let vmm = Vmm::start(ServeConfig {
        area_size: AREA_SIZE,
        ..ServeConfig::new(socket(&format!("{name}-source")))
    });
    run_over_area(&vmm, "write", 5);
    set_state(&vmm, "Paused");
    for name in ["a", "b"] {
        let create = json!({
            "snapshot_type": "Full",
            "snapshot_path": dir.join(format!("{name}.state")),
            "mem_file_path": dir.join(format!("{name}.mem")),
        });
        let (status, body) = vmm.call("PUT", "/snapshot/create", Some(create));
        assert_eq!(status, 204, "{body}");
    }
    vmm.stop();
    dir
}

/// The state file at `path`.
fn saved(path: &Path) -> SnapshotState {
    SnapshotState::from_bytes(&std::fs::read(path).expect("state")).expect("valid")
}

/// A uffd restore of `state`/`mem` with `files`, resumed.
fn resumed(name: &str, state: &Path, mem: &Path, files: WorkingSetFiles) -> Vmm {
    let vmm = Vmm::start(restore_config(name, state, mem, MemBackend::Uffd, files));
    set_state(&vmm, "Resumed");
    vmm
}

/// The list file at `path`.
/// `state` and `mem` restored lazily in this process with `list` prefetched, once the
/// prefetch has ended; and the memory file it restored from.
fn prefetched(
    state: &Path,
    mem: &Path,
    list: &Path,
    saved: &SnapshotState,
) -> (TestVm, std::fs::File) {
    let lazy = WorkingSetFiles {
        prefetch: Some(list.to_path_buf()),
        ..WorkingSetFiles::default()
    }
    .lazy_options(snapshot_id(state), &saved.layout)
    .expect("the list fits");
    let memory = std::fs::File::open(mem).expect("the memory file");
    let vm = TestVm::restore_with(
        &saved.layout,
        &memory,
        MemBackend::Uffd,
        lazy,
        VmOptions::default(),
    )
    .expect("restored");
    let stats = vm.loader().expect("a lazy restore's loader").stats();
    let start = Instant::now();
    while !stats.prefetch_done.load(Ordering::Acquire) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the prefetch ends"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    (vm, memory)
}

fn list_at(path: &Path) -> WorkingSet {
    WorkingSet::from_bytes(&std::fs::read(path).expect("the list")).expect("valid")
}

fn snapshot_id(state: &Path) -> u128 {
    saved(state).snapshot.expect("a snapshot's state").id.0
}

#[test]
fn kvm_a_recorded_working_set_is_prefetched_and_the_guest_verifies() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_recorded_working_set_is_prefetched_and_the_guest_verifies",
    ) {
        return;
    }
    let dir = snapshots("prefetch");
    let (state, mem, list) = (dir.join("a.state"), dir.join("a.mem"), dir.join("a.wset"));

    // Recorded until the VMM stops: the guest verifies its area meanwhile.
    let record = WorkingSetFiles {
        record: Some(list.clone()),
        ..WorkingSetFiles::default()
    };
    let vmm = resumed("record", &state, &mem, record);
    assert_eq!(run_over_area(&vmm, "verify", 5)["result"], json!("ok"));
    assert!(!list.exists(), "written when the recording ends");
    // A client ends it: the list is written before the answer, and nothing records after.
    let (status, body) = vmm.call("PUT", "/working-set/stop", None);
    assert_eq!(status, 204, "{body}");
    assert!(list.exists(), "written when the recording ended");
    let (status, body) = vmm.call("PUT", "/working-set/stop", None);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["fault_message"]
            .as_str()
            .expect("a message")
            .contains("no working-set recording is under way"),
        "{body}"
    );
    run_over_area(&vmm, "write", 7);
    let stopped_at = std::fs::read(&list).expect("the list");
    vmm.stop();
    assert_eq!(
        std::fs::read(&list).expect("the list"),
        stopped_at,
        "the VMM's stop writes nothing more"
    );
    let set = list_at(&list);
    assert_eq!(set.snapshot, snapshot_id(&state));
    let area_pages = AREA_SIZE / 4096;
    assert!(
        set.pages() >= area_pages,
        "every page of the area is in it: {} pages in {} runs",
        set.pages(),
        set.runs.len()
    );

    // The next restore fetches them ahead of the guest; the guest finds its data.
    let prefetch = WorkingSetFiles {
        prefetch: Some(list.clone()),
        ..WorkingSetFiles::default()
    };
    let vmm = resumed("prefetch", &state, &mem, prefetch);
    assert_eq!(run_over_area(&vmm, "verify", 5)["result"], json!("ok"));
    // And it goes on: new writes, verified.
    run_over_area(&vmm, "write", 6);
    assert_eq!(run_over_area(&vmm, "verify", 6)["result"], json!("ok"));
    vmm.stop();

    // The prefetch, seen from the loader: every page of the list filled ahead of the guest,
    // whose verify then faults on none of them.
    let saved = saved(&state);
    let (vm, _memory) = prefetched(&state, &mem, &list, &saved);
    let stats = vm.loader().expect("a lazy restore's loader").stats();
    assert_eq!(stats.prefetched.load(Ordering::Acquire), set.pages());
    let stopped = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("an eventfd"));
    let mut vcpus = vm
        .start_restored_vcpus(&saved.vcpus, &stopped)
        .expect("vCPUs");
    let verify = Command {
        op: Op::Verify,
        start: AREA,
        end: AREA + AREA_SIZE,
        stride: 4096,
        seed: 5,
    };
    let outcome = vcpus.run(0, verify).expect("ran");
    assert_eq!(outcome.mismatch, None);
    assert_eq!(
        stats.copied.load(Ordering::Acquire),
        0,
        "no page faulted in"
    );
    vcpus.shut_down().expect("stopped");

    // A timed recording writes its list while the VM runs on.
    let timed_list = dir.join("timed.wset");
    let timed = WorkingSetFiles {
        record: Some(timed_list.clone()),
        record_for: Some(Duration::from_millis(300)),
        ..WorkingSetFiles::default()
    };
    let vmm = resumed("timed", &state, &mem, timed);
    assert_eq!(run_over_area(&vmm, "verify", 5)["result"], json!("ok"));
    let start = Instant::now();
    while !timed_list.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the list is written in time"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let timed_set = list_at(&timed_list);
    assert_eq!(timed_set.snapshot, snapshot_id(&state));
    vmm.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where the 2 MiB hugetlb region of [`kvm_a_2m_region_restores_lazily_and_the_guest_verifies`]
/// lies, its size, and how much of it the guest writes (the rest of its last page stays a hole
/// of the memory file).
const HUGE: u64 = 1 << 30;
const HUGE_SIZE: u64 = 8 << 20;
const HUGE_WRITTEN: u64 = 7 << 20;

/// Runs `op` with `seed` over the written part of the 2 MiB region.
fn run_huge(vmm: &Vmm, op: &str, seed: u64) -> Value {
    let command = support::guest_command(op, HUGE, HUGE + HUGE_WRITTEN, seed);
    let (status, body) = vmm.call("PUT", "/guest/command", Some(command));
    assert_eq!(status, 200, "{body}");
    body
}

#[test]
fn kvm_a_2m_region_restores_lazily_and_the_guest_verifies() {
    let test = "tinyvmm::kvm_a_2m_region_restores_lazily_and_the_guest_verifies";
    if !kvm_test_support::require_kvm(test) {
        return;
    }
    // The source's 4 pages, then one restore at a time.
    let available = kvm_memslots::hugetlb_pages_available();
    if available < 8 {
        eprintln!(
            "SKIPPED {test}: the hugetlb pool has {available} free 2 MiB pages, the test needs 8 \
             (resources/setup-host.sh reserves a pool)"
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-wset-huge", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let (state, mem, list) = (dir.join("a.state"), dir.join("a.mem"), dir.join("a.wset"));

    // The source: its area and 7 of the 8 MiB of a region of 2 MiB pages written.
    let vmm = Vmm::start(ServeConfig {
        area_size: AREA_SIZE,
        ..ServeConfig::new(socket("huge-source"))
    });
    let add = json!({"size": HUGE_SIZE, "guest_address": HUGE, "page_size": "2m"});
    let (status, body) = vmm.call("PUT", "/memory/regions", Some(add));
    assert_eq!(status, 201, "{body}");
    run_over_area(&vmm, "write", 5);
    assert_eq!(run_huge(&vmm, "write", 11)["result"], json!("ok"));
    set_state(&vmm, "Paused");
    let create = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
    let (status, body) = vmm.call("PUT", "/snapshot/create", Some(create));
    assert_eq!(status, 204, "{body}");
    vmm.stop();
    let layout = saved(&state).layout;
    let region = layout
        .regions
        .iter()
        .find(|r| r.gpa == HUGE)
        .expect("the 2 MiB region");
    assert_eq!(
        region.page_size,
        kvm_memslots_persist::LayoutPageSize::Huge2M
    );
    let region_pages = region.file_offset / 4096..(region.file_offset + HUGE_SIZE) / 4096;

    // Restored lazily, recording: the guest verifies every page it wrote.
    let record = WorkingSetFiles {
        record: Some(list.clone()),
        ..WorkingSetFiles::default()
    };
    let vmm = resumed("huge-record", &state, &mem, record);
    assert_eq!(run_huge(&vmm, "verify", 11)["result"], json!("ok"));
    assert_eq!(run_over_area(&vmm, "verify", 5)["result"], json!("ok"));
    vmm.stop();
    // The region's entries are whole 2 MiB pages: the four it has (the guest touched each).
    let set = list_at(&list);
    let mut huge: Vec<_> = set
        .runs
        .iter()
        .filter(|r| region_pages.contains(&r.start))
        .cloned()
        .collect();
    assert!(
        huge.iter()
            .all(|r| (r.start - region_pages.start) % 512 == 0 && (r.end - r.start) % 512 == 0),
        "whole 2 MiB pages: {huge:?}"
    );
    huge.sort_by_key(|r| r.start);
    assert_eq!(huge.iter().map(|r| r.end - r.start).sum::<u64>(), 4 * 512);

    // Restored lazily with the list prefetched: the guest verifies, and faults on nothing.
    let saved = saved(&state);
    let (vm, memory) = prefetched(&state, &mem, &list, &saved);
    let stats = vm.loader().expect("a lazy restore's loader").stats();
    assert_eq!(stats.prefetched.load(Ordering::Acquire), set.pages());
    let stopped = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("an eventfd"));
    let mut vcpus = vm
        .start_restored_vcpus(&saved.vcpus, &stopped)
        .expect("vCPUs");
    for (start, end, seed) in [(HUGE, HUGE + HUGE_WRITTEN, 11), (AREA, AREA + AREA_SIZE, 5)] {
        let verify = Command {
            op: Op::Verify,
            start,
            end,
            stride: 4096,
            seed,
        };
        let outcome = vcpus.run(0, verify).expect("ran");
        assert_eq!(outcome.mismatch, None);
    }
    assert_eq!(
        stats.copied.load(Ordering::Acquire),
        0,
        "no page faulted in"
    );
    vcpus.shut_down().expect("stopped");
    // Its hugetlb pages go back to the pool before the next restore takes theirs.
    drop(vm);

    // Restored lazily without a list: each 2 MiB page is one copy on the guest's first touch.
    let vm = TestVm::restore_with(
        &saved.layout,
        &memory,
        MemBackend::Uffd,
        Default::default(),
        VmOptions::default(),
    )
    .expect("restored");
    let stats = vm.loader().expect("a lazy restore's loader").stats();
    let mut vcpus = vm
        .start_restored_vcpus(&saved.vcpus, &stopped)
        .expect("vCPUs");
    // The area first: the guest's own pages (code, stack, mailbox) fault in meanwhile.
    let area = Command {
        op: Op::Verify,
        start: AREA,
        end: AREA + AREA_SIZE,
        stride: 4096,
        seed: 5,
    };
    assert_eq!(vcpus.run(0, area).expect("ran").mismatch, None);
    let before = stats.copy_calls.load(Ordering::Acquire);
    let verify = Command {
        op: Op::Verify,
        start: HUGE,
        end: HUGE + HUGE_WRITTEN,
        stride: 4096,
        seed: 11,
    };
    let outcome = vcpus.run(0, verify).expect("ran");
    assert_eq!(outcome.mismatch, None);
    // One copy a 2 MiB page (the guest's page tables for the range may take a 4 KiB page or
    // two besides); in 4 KiB pages that would be 1,792 copies.
    let copies = stats.copy_calls.load(Ordering::Acquire) - before;
    assert!((4..8).contains(&copies), "{copies} copies");
    assert!(stats.copied.load(Ordering::Acquire) >= 4 * 512);
    vcpus.shut_down().expect("stopped");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kvm_a_working_set_that_does_not_fit_is_refused_with_the_reason() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_working_set_that_does_not_fit_is_refused_with_the_reason",
    ) {
        return;
    }
    let dir = snapshots("refused");
    let (state, mem) = (dir.join("a.state"), dir.join("a.mem"));
    let layout = saved(&state).layout;
    let write = |name: &str, set: &WorkingSet| {
        let path = dir.join(name);
        std::fs::write(&path, set.to_bytes()).expect("written");
        path
    };
    // Snapshot b's list (same VM, same layout, another snapshot).
    let mut other = WorkingSet::new(snapshot_id(&dir.join("b.state")), &layout);
    other.push(0);
    // Snapshot a's, naming a page past its memory.
    let mut past = WorkingSet::new(snapshot_id(&state), &layout);
    let pages = layout.memory_file_size() / 4096;
    past.push(1);
    past.push(pages);
    let mut own = WorkingSet::new(snapshot_id(&state), &layout);
    own.push(1);
    let own = write("own.wset", &own);
    let new = dir.join("new.wset");
    let cases = [
        (
            Some(write("other.wset", &other)),
            MemBackend::Uffd,
            None,
            "recorded on snapshot",
        ),
        (
            Some(write("past.wset", &past)),
            MemBackend::Uffd,
            None,
            "which has",
        ),
        (
            Some(own.clone()),
            MemBackend::File,
            None,
            "needs the uffd memory backend, not file",
        ),
        (
            None,
            MemBackend::Copy,
            Some(new.clone()),
            "needs the uffd memory backend, not copy",
        ),
        (
            Some(own.clone()),
            MemBackend::Uffd,
            Some(new.clone()),
            "cannot record one",
        ),
        (
            Some(dir.join("absent.wset")),
            MemBackend::Uffd,
            None,
            "No such file",
        ),
        (
            Some(dir.clone()),
            MemBackend::Uffd,
            None,
            "a directory, not a regular file",
        ),
        (
            Some(state.clone()),
            MemBackend::Uffd,
            None,
            "no KVMSWST magic",
        ),
    ];
    for (i, (prefetch, backend, record, reason)) in cases.into_iter().enumerate() {
        let files = WorkingSetFiles {
            prefetch,
            record,
            ..WorkingSetFiles::default()
        };
        let config = restore_config(&format!("refused-{i}"), &state, &mem, backend, files);
        let err = serve(&config, || panic!("case {i}: served")).expect_err("refused");
        assert!(err.to_string().contains(reason), "case {i}: {err}");
    }
    // A refused restore leaves no recording behind, not even a partial one.
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("the folder")
        .map(|e| e.expect("an entry").file_name())
        .collect();
    assert!(
        !files
            .iter()
            .any(|f| f.to_string_lossy().starts_with("new.wset")),
        "{files:?}"
    );

    // The same from the command line: one line naming the list and the reason, exit 1.
    let tinyvmm = |extra: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
            .arg("restore")
            .arg("--snapshot")
            .arg(&state)
            .arg("--mem-file")
            .arg(&mem)
            .args(["--mem-backend", "uffd", "--api-sock"])
            .arg(socket("cli"))
            .args(extra)
            .output()
            .expect("tinyvmm runs")
    };
    let other = dir.join("other.wset");
    let refused = tinyvmm(&["--prefetch".as_ref(), other.as_os_str()]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("other.wset") && stderr.contains("recorded on snapshot"),
        "{stderr}"
    );
    let both = tinyvmm(&[
        "--prefetch".as_ref(),
        own.as_os_str(),
        "--record-working-set".as_ref(),
        dir.join("new.wset").as_os_str(),
    ]);
    assert_eq!(both.status.code(), Some(64), "a usage error");
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `tinyvmm ARGS --api-sock SOCKET` (its console discarded, its stderr kept) and waits
/// until it serves its API.
fn start(name: &str, args: &[&std::ffi::OsStr]) -> Process {
    Process::command(name)
        .args(args)
        .api_sock(socket(name))
        .serving()
}

/// Ends it (SIGTERM) and returns what it said on stderr.
fn end(mut vmm: Process) -> String {
    vmm.signal(libc::SIGTERM);
    let output = vmm.wait(Duration::from_secs(120));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn kvm_a_linux_guest_records_and_prefetches_its_working_set() {
    let test = "tinyvmm::kvm_a_linux_guest_records_and_prefetches_its_working_set";
    if !support::ready(test) {
        return;
    }
    let (_, vmlinux) = support::debian_kernel(test).expect("checked");
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-wset-linux", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let (state, mem, list) = (dir.join("l.state"), dir.join("l.mem"), dir.join("l.wset"));
    let resume = json!({"state": "Resumed"});

    // A kernel booting, paused a few seconds in and snapshotted.
    let boot = start(
        "linux-boot",
        &[
            "boot".as_ref(),
            "--kernel".as_ref(),
            vmlinux.as_os_str(),
            "--cmdline".as_ref(),
            support::CMDLINE.as_ref(),
            "--mem-mib".as_ref(),
            "128".as_ref(),
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        boot.call("PATCH", "/vm", Some(json!({"state": "Paused"})))
            .0,
        204
    );
    let create = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
    let (status, body) = boot.call("PUT", "/snapshot/create", Some(create));
    assert_eq!(status, 204, "{body}");
    end(boot);

    // Restored lazily, recording 3 s of the guest's run until a client ends it (long before
    // its --record-secs).
    let lazy: [&std::ffi::OsStr; 7] = [
        "restore".as_ref(),
        "--snapshot".as_ref(),
        state.as_os_str(),
        "--mem-file".as_ref(),
        mem.as_os_str(),
        "--mem-backend".as_ref(),
        "uffd".as_ref(),
    ];
    let record = [
        &lazy[..],
        &[
            "--record-working-set".as_ref(),
            list.as_os_str(),
            "--record-secs".as_ref(),
            "600".as_ref(),
        ],
    ]
    .concat();
    let recording = start("linux-record", &record);
    assert_eq!(recording.call("PATCH", "/vm", Some(resume.clone())).0, 204);
    std::thread::sleep(Duration::from_secs(3));
    let (status, body) = recording.call("PUT", "/working-set/stop", None);
    assert_eq!(status, 204, "{body}");
    assert!(list.exists(), "the list is written before the answer");
    assert_eq!(recording.call("PUT", "/working-set/stop", None).0, 409);
    let stderr = end(recording);
    let set = list_at(&list);
    let id = tinyvmm::linux::state::LinuxState::read_file(&state)
        .expect("the Linux state file")
        .snapshot
        .expect("a snapshot")
        .id
        .0;
    assert_eq!(set.snapshot, id, "{stderr}");
    assert!(set.pages() > 0, "{stderr}");

    // Restored again with the list: it runs on, nothing failed.
    let prefetching = start(
        "linux-prefetch",
        &[&lazy[..], &["--prefetch".as_ref(), list.as_os_str()]].concat(),
    );
    assert_eq!(prefetching.call("PATCH", "/vm", Some(resume)).0, 204);
    std::thread::sleep(Duration::from_secs(3));
    let (status, vm) = prefetching.call("GET", "/vm", None);
    assert_eq!((status, &vm["state"]), (200, &json!("Running")), "{vm}");
    let stderr = end(prefetching);
    assert!(
        !stderr.contains("could not fill") && !stderr.contains("prefetch stopped"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
