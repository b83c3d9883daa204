//! Working-set prefetch on real KVM: a lazy (`uffd`) restore records the pages the test guest
//! touches first, the next restore of the same snapshot fetches them ahead of the guest, and
//! the guest's memory verifies; a list of another snapshot, one naming pages the snapshot does
//! not have, or a list given to a restore that is not lazy is refused with the reason before
//! anything runs. A Linux guest (Debian's kernel, where `resources/fetch-kernel.sh` fetched it)
//! records and prefetches the same way, through `tinyvmm boot` and `restore` processes; booted
//! in 2 MiB hugetlb pages it restores lazily (whole huge pages), by copy and in 4 KiB pages, and
//! a 4 KiB snapshot of it restores in 2 MiB pages, each restored guest printing on.

use std::ffi::OsStr;
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

/// The list file at `path`.
fn list_at(path: &Path) -> WorkingSet {
    WorkingSet::from_bytes(&std::fs::read(path).expect("the list")).expect("valid")
}

fn snapshot_id(state: &Path) -> u128 {
    saved(state).snapshot.expect("a snapshot's state").id.0
}

/// [`prefetched`], checked: every page of `set` (the list at `list`) was prefetched, and the
/// test guest verifies each of `ranges` (start, end, seed) with no page faulting in. The VM
/// (its vCPUs shut down) and the memory file it restored from.
fn verify_prefetched(
    (state, mem, list): (&Path, &Path, &Path),
    saved: &SnapshotState,
    set: &WorkingSet,
    ranges: &[(u64, u64, u64)],
) -> (TestVm, std::fs::File) {
    let (vm, memory) = prefetched(state, mem, list, saved);
    let stats = vm.loader().expect("a lazy restore's loader").stats();
    assert_eq!(stats.prefetched.load(Ordering::Acquire), set.pages());
    let stopped = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("an eventfd"));
    let mut vcpus = vm
        .start_restored_vcpus(&saved.vcpus, &stopped)
        .expect("vCPUs");
    for &(start, end, seed) in ranges {
        verifies(&mut vcpus, start, end, seed);
    }
    assert_eq!(
        stats.copied.load(Ordering::Acquire),
        0,
        "no page faulted in"
    );
    vcpus.shut_down().expect("stopped");
    (vm, memory)
}

/// Has the test guest verify `[start, end)` (written with `seed`), a 4 KiB page at a time: no
/// mismatch.
fn verifies(vcpus: &mut tinyvmm::test_guest::vcpus::Vcpus, start: u64, end: u64, seed: u64) {
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
    let files = (state.as_path(), mem.as_path(), list.as_path());
    let (_vm, _memory) = verify_prefetched(files, &saved, &set, &[(AREA, AREA + AREA_SIZE, 5)]);

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
    if !support::require_hugetlb_pages(test, 8, "8") {
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
    let files = (state.as_path(), mem.as_path(), list.as_path());
    let ranges = [(HUGE, HUGE + HUGE_WRITTEN, 11), (AREA, AREA + AREA_SIZE, 5)];
    let (vm, memory) = verify_prefetched(files, &saved, &set, &ranges);
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
    let stopped = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("an eventfd"));
    let mut vcpus = vm
        .start_restored_vcpus(&saved.vcpus, &stopped)
        .expect("vCPUs");
    // The area first: the guest's own pages (code, stack, mailbox) fault in meanwhile.
    verifies(&mut vcpus, AREA, AREA + AREA_SIZE, 5);
    let before = stats.copy_calls.load(Ordering::Acquire);
    verifies(&mut vcpus, HUGE, HUGE + HUGE_WRITTEN, 11);
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
    let tinyvmm = |extra: &[&OsStr]| {
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

/// What a Linux guest's console shows early, a few seconds into the boot and a fraction of a
/// second of guest time before a stretch of lines: where [`linux_snapshot`] pauses it.
const EARLY_LINE: &str = "Command line:";

/// The hugetlb pages a 128 MiB Linux guest in 2 MiB pages takes of the pool.
const LINUX_HUGE_PAGES: u64 = 64;

/// A scratch folder of a Linux test (its snapshots are large), removed at the end even if
/// the test fails.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tinyvmm-test-{}-wset-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a folder");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `tinyvmm` process of a Linux guest, its console in a file.
struct Linux {
    name: String,
    vmm: Process,
}

impl Linux {
    /// Runs `tinyvmm ARGS --api-sock SOCKET`, its console in `dir/NAME.console` (its stderr
    /// kept), and waits until it serves its API.
    fn start(dir: &Path, name: &str, args: &[&OsStr]) -> Linux {
        let console = dir.join(format!("{name}.console"));
        let vmm = Process::command(name)
            .args(args)
            .api_sock(socket(name))
            .stdout_file(console)
            .serving();
        Linux {
            name: name.to_owned(),
            vmm,
        }
    }

    /// A restore of `state` and `mem` with `extra` arguments, paused.
    fn restore(dir: &Path, name: &str, (state, mem): (&Path, &Path), extra: &[&OsStr]) -> Linux {
        let restore: [&OsStr; 5] = [
            "restore".as_ref(),
            "--snapshot".as_ref(),
            state.as_os_str(),
            "--mem-file".as_ref(),
            mem.as_os_str(),
        ];
        Linux::start(dir, name, &[&restore[..], extra].concat())
    }

    /// [`restore`](Self::restore) lazily (`--mem-backend uffd`).
    fn restore_lazily(dir: &Path, name: &str, snapshot: (&Path, &Path), extra: &[&OsStr]) -> Linux {
        let uffd: [&OsStr; 2] = ["--mem-backend".as_ref(), "uffd".as_ref()];
        Linux::restore(dir, name, snapshot, &[&uffd[..], extra].concat())
    }

    /// Ends the recording of the working set (`PUT /working-set/stop`).
    fn stop_recording(&self) {
        let (status, body) = self.vmm.call("PUT", "/working-set/stop", None);
        assert_eq!(status, 204, "{body}");
    }

    fn console(&self) -> String {
        self.vmm.stdout_now()
    }

    fn set_state(&self, state: &str) {
        let (status, body) = self
            .vmm
            .call("PATCH", "/vm", Some(json!({ "state": state })));
        assert_eq!(status, 204, "{body}");
    }

    /// Waits until the console shows `marker`; fails if the VMM exits first, or if the guest
    /// prints nothing for the host's patience.
    fn wait_for(&self, marker: &str) {
        self.vmm.wait_for_console(marker);
    }

    /// Resumes the VM and waits until its guest prints a whole line that `before` (the console
    /// of the VM it was restored from, up to its pause) does not have: the guest ran on. Then
    /// it must still be running.
    fn runs_on(&self, before: &str) {
        self.set_state("Resumed");
        let mut progress = support::Progress::default();
        loop {
            let console = self.console();
            let mut lines = console.split_inclusive('\n');
            if lines.any(|l| l.ends_with('\n') && !before.contains(l)) {
                break;
            }
            assert!(
                self.vmm.running(),
                "tinyvmm ended before its guest printed a new line:\n{console}"
            );
            assert!(
                !progress.stalled(console.len()),
                "the guest printed no new line for {:?}:\n{console}",
                progress.patience()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let (status, vm) = self.vmm.call("GET", "/vm", None);
        assert_eq!((status, &vm["state"]), (200, &json!("Running")), "{vm}");
    }

    /// Pauses the VM (no fault comes meanwhile) and checks that its lazy restore filled RAM,
    /// all in 2 MiB pages, in whole huge pages: the 4 KiB pages it counts filled (`GET /vm`'s
    /// `lazy_restore`) are 512 for each huge page its smaps show, in about one `UFFDIO_COPY`
    /// each (a prefetch copies neighbouring pages at once; a fault on a page filled meanwhile
    /// costs a call more; 4 KiB pages would take 512 each). Returns the huge pages.
    fn whole_huge_pages(&self) -> u64 {
        self.set_state("Paused");
        let (status, vm) = self.vmm.call("GET", "/vm", None);
        assert_eq!(status, 200, "{vm}");
        let lazy = &vm["lazy_restore"];
        let count = |name: &str| {
            lazy[name]
                .as_u64()
                .unwrap_or_else(|| panic!("{name}: {vm}"))
        };
        let (page_size, hugetlb) = self.ram();
        assert_eq!(page_size, "2m");
        let huge_pages = hugetlb >> 21;
        assert!(huge_pages > 0, "{vm}");
        assert_eq!(
            count("copied_pages") + count("zeroed_pages") + count("prefetched_pages"),
            huge_pages * 512,
            "{huge_pages} huge pages in smaps: {vm}"
        );
        let copies = count("copy_calls");
        assert!(
            (1..=2 * huge_pages).contains(&copies),
            "{huge_pages} huge pages in smaps: {vm}"
        );
        eprintln!("{}: {huge_pages} huge pages, {copies} copies", self.name);
        huge_pages
    }

    /// The page size `GET /memory` names for the guest's RAM (one region, checked), and the
    /// bytes of hugetlb pages the process has mapped there (its smaps).
    fn ram(&self) -> (String, u64) {
        let (status, memory) = self.vmm.call("GET", "/memory", None);
        assert_eq!(status, 200, "{memory}");
        let regions = memory["regions"].as_array().expect("regions");
        assert_eq!(regions.len(), 1, "{memory}");
        let ram = &regions[0];
        let (hva, size) = (
            ram["host_address"].as_u64().expect("a host address"),
            ram["size"].as_u64().expect("a size"),
        );
        let pid = self.vmm.pid().to_string();
        let page_size = ram["page_size"].as_str().expect("a page size").to_owned();
        (page_size, support::hugetlb_bytes_of(&pid, hva, size))
    }

    /// Ends it (SIGTERM) and returns what it said on stderr, which must name no failure.
    fn end(mut self) -> String {
        self.vmm.signal(libc::SIGTERM);
        let output = self.vmm.wait(Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        let lower = stderr.to_lowercase();
        for failure in ["error", "fail", "could not", "panicked", "prefetch stopped"] {
            assert!(!lower.contains(failure), "{failure:?} on stderr:\n{stderr}");
        }
        stderr
    }
}

/// Boots Linux (Debian's kernel, which `test` checked it has) with 128 MiB of RAM in
/// `page_size` pages (`4k` or `2m`), pauses it early in its boot ([`EARLY_LINE`]) and takes a
/// Full into `dir`: the state file, the memory file and the console up to the pause.
fn linux_snapshot(test: &str, dir: &Path, page_size: &str) -> (PathBuf, PathBuf, String) {
    let (_, vmlinux) = support::debian_kernel(test).expect("checked");
    let vmlinux = vmlinux.as_path();
    let state = dir.join(format!("{page_size}.state"));
    let mem = dir.join(format!("{page_size}.mem"));
    let boot = Linux::start(
        dir,
        &format!("linux-boot-{page_size}"),
        &[
            "boot".as_ref(),
            "--kernel".as_ref(),
            vmlinux.as_os_str(),
            "--cmdline".as_ref(),
            support::CMDLINE.as_ref(),
            "--mem-mib".as_ref(),
            "128".as_ref(),
            "--page-size".as_ref(),
            page_size.as_ref(),
        ],
    );
    boot.wait_for(EARLY_LINE);
    boot.set_state("Paused");
    let (size, hugetlb) = boot.ram();
    assert_eq!(size, page_size);
    if page_size == "2m" {
        assert!(hugetlb > 0, "hugetlb pages back the booted guest's RAM");
    } else {
        assert_eq!(hugetlb, 0);
    }
    let console = boot.console();
    let create = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
    let (status, body) = boot.vmm.call("PUT", "/snapshot/create", Some(create));
    assert_eq!(status, 204, "{body}");
    boot.end();
    (state, mem, console)
}

/// A Linux guest's snapshot ([`linux_snapshot`]) in a scratch folder of its own, and where
/// its restores record their working set.
struct LinuxSnapshot {
    /// Held until the test ends.
    _scratch: Scratch,
    dir: PathBuf,
    /// The working set's list, once recorded.
    list: PathBuf,
    state: PathBuf,
    mem: PathBuf,
    /// The console up to the pause.
    before: String,
}

impl LinuxSnapshot {
    /// [`linux_snapshot`] in `page_size` pages, in the scratch folder `tag`.
    fn take(test: &str, tag: &str, page_size: &str) -> LinuxSnapshot {
        let scratch = Scratch::new(tag);
        let dir = scratch.0.clone();
        let (state, mem, before) = linux_snapshot(test, &dir, page_size);
        LinuxSnapshot {
            _scratch: scratch,
            list: dir.join("l.wset"),
            dir,
            state,
            mem,
            before,
        }
    }
}

/// The snapshot id of the Linux state file `state`.
fn linux_snapshot_id(state: &Path) -> u128 {
    tinyvmm::linux::state::LinuxState::read_file(state)
        .expect("the Linux state file")
        .snapshot
        .expect("a snapshot")
        .id
        .0
}

/// The working set recorded at `list` from the snapshot `state` (it names its id), by a VMM
/// that said `stderr`.
fn recorded(list: &Path, state: &Path, stderr: &str) -> WorkingSet {
    let set = list_at(list);
    assert_eq!(set.snapshot, linux_snapshot_id(state), "{stderr}");
    set
}

/// Whether the hugetlb pool can hold a 128 MiB Linux guest; says SKIPPED for `what` if not.
fn pool_holds_linux(test: &str, what: &str) -> bool {
    support::require_hugetlb_pages(
        &format!("{test}{what}"),
        LINUX_HUGE_PAGES,
        &format!("{LINUX_HUGE_PAGES}: a 128 MiB Linux guest"),
    )
}

#[test]
fn kvm_a_linux_guest_records_and_prefetches_its_working_set() {
    let test = "tinyvmm::kvm_a_linux_guest_records_and_prefetches_its_working_set";
    if !support::ready(test) {
        return;
    }
    // A kernel booting, paused early and snapshotted.
    let linux = LinuxSnapshot::take(test, "linux", "4k");
    let (dir, list, state, before) = (&linux.dir, &linux.list, &linux.state, &linux.before);
    let snapshot = (state.as_path(), linux.mem.as_path());

    // Restored lazily, recording 3 s of the guest's run until a client ends it (long before
    // its --record-secs).
    let record: [&OsStr; 4] = [
        "--record-working-set".as_ref(),
        list.as_os_str(),
        "--record-secs".as_ref(),
        "600".as_ref(),
    ];
    let recording = Linux::restore_lazily(dir, "linux-record", snapshot, &record);
    recording.runs_on(before);
    std::thread::sleep(Duration::from_secs(3));
    recording.stop_recording();
    assert!(list.exists(), "the list is written before the answer");
    assert_eq!(recording.vmm.call("PUT", "/working-set/stop", None).0, 409);
    let stderr = recording.end();
    let set = recorded(list, state, &stderr);
    assert!(set.pages() > 0, "{stderr}");

    // Restored again with the list: it runs on, nothing failed.
    let prefetch: [&OsStr; 2] = ["--prefetch".as_ref(), list.as_os_str()];
    let prefetching = Linux::restore_lazily(dir, "linux-prefetch", snapshot, &prefetch);
    prefetching.runs_on(before);
    prefetching.end();

    // Restored lazily in 2 MiB pages (issue 38): whole huge pages back it, and it runs on.
    if pool_holds_linux(test, " (its restore in 2 MiB pages)") {
        let huge: [&OsStr; 2] = ["--page-size".as_ref(), "2m".as_ref()];
        let in_2m = Linux::restore_lazily(dir, "linux-4k-in-2m", snapshot, &huge);
        assert_eq!(
            in_2m.ram(),
            ("2m".to_owned(), 0),
            "nothing filled before it runs"
        );
        in_2m.runs_on(before);
        in_2m.whole_huge_pages();
        in_2m.end();
    }
}

#[test]
fn kvm_a_linux_guest_in_2m_pages_restores_every_way() {
    let test = "tinyvmm::kvm_a_linux_guest_in_2m_pages_restores_every_way";
    if !support::ready(test) || !pool_holds_linux(test, "") {
        return;
    }
    // Booted in 2 MiB pages (checked there), paused early, snapshotted.
    let linux = LinuxSnapshot::take(test, "linux2m", "2m");
    let (dir, list, state, before) = (&linux.dir, &linux.list, &linux.state, &linux.before);
    let snapshot = (state.as_path(), linux.mem.as_path());
    let layout = tinyvmm::linux::state::LinuxState::read_file(state)
        .expect("the Linux state file")
        .layout;
    assert_eq!(layout.regions.len(), 1);
    assert_eq!(
        layout.regions[0].page_size,
        kvm_memslots_persist::LayoutPageSize::Huge2M
    );
    assert_eq!(layout.regions[0].file_offset, 0);

    // Restored lazily, recording: nothing is filled before the guest runs, then whole 2 MiB
    // pages, each the guest touched (the list) among them.
    let record: [&OsStr; 2] = ["--record-working-set".as_ref(), list.as_os_str()];
    let recording = Linux::restore_lazily(dir, "linux-2m-record", snapshot, &record);
    assert_eq!(recording.ram(), ("2m".to_owned(), 0));
    recording.runs_on(before);
    recording.stop_recording();
    let filled = recording.whole_huge_pages();
    let stderr = recording.end();
    let set = recorded(list, state, &stderr);
    assert!(
        set.runs
            .iter()
            .all(|r| r.start % 512 == 0 && (r.end - r.start) % 512 == 0),
        "whole 2 MiB pages: {:?}",
        set.runs
    );
    assert!(set.pages() > 0);
    assert!(
        filled * 512 >= set.pages(),
        "{filled} huge pages filled hold the {} listed pages",
        set.pages()
    );

    // Restored lazily with the list: its pages are fetched into hugetlb pages, the guest runs
    // on.
    let prefetch: [&OsStr; 2] = ["--prefetch".as_ref(), list.as_os_str()];
    let prefetching = Linux::restore_lazily(dir, "linux-2m-prefetch", snapshot, &prefetch);
    prefetching.runs_on(before);
    prefetching
        .vmm
        .wait_until("prefetch the list", Duration::from_secs(120), |vmm| {
            vmm.call("GET", "/vm", None).1["lazy_restore"]["prefetch_done"] == json!(true)
        });
    prefetching.whole_huge_pages();
    // Whole listed pages, less any the guest faulted in before the prefetch reached them.
    let (_, vm) = prefetching.vmm.call("GET", "/vm", None);
    let prefetched = vm["lazy_restore"]["prefetched_pages"]
        .as_u64()
        .expect("a count");
    assert!(
        prefetched > 0 && prefetched <= set.pages() && prefetched % 512 == 0,
        "{} listed: {vm}",
        set.pages()
    );
    prefetching.end();

    // Restored by copy: in hugetlb pages before the guest runs.
    let copy: [&OsStr; 2] = ["--mem-backend".as_ref(), "copy".as_ref()];
    let copied = Linux::restore(dir, "linux-2m-copy", snapshot, &copy);
    let (page_size, hugetlb) = copied.ram();
    assert_eq!(page_size, "2m");
    assert!(hugetlb > 0, "copied into hugetlb pages");
    let (_, vm) = copied.vmm.call("GET", "/vm", None);
    assert!(vm.get("lazy_restore").is_none(), "not a lazy restore: {vm}");
    copied.runs_on(before);
    copied.end();

    // Restored in 4 KiB pages (the default backend: the memory file mapped privately), no
    // hugetlb page taken.
    let small: [&OsStr; 2] = ["--page-size".as_ref(), "4k".as_ref()];
    let in_4k = Linux::restore(dir, "linux-2m-in-4k", snapshot, &small);
    in_4k.runs_on(before);
    assert_eq!(in_4k.ram(), ("4k".to_owned(), 0));
    in_4k.end();
}
