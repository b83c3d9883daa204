//! Snapshot chains as a user handles them with the `tinyvmm` binary: every state file knows
//! its kind, its id, its parent and its place in its chain, so `restore` refuses an unmerged
//! Diff or another VM's memory, and `snapshot-merge` a chain that is not one; and bad input
//! files (a memory file, an empty file, a folder, a FIFO, a flipped byte, an old version, a
//! state that contradicts itself) get a one-line error naming the file, changing nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::snapshot::state::{STATE_MAGIC, STATE_VERSION};

mod support;
use support::vmm::Vmm;

/// The test area's guest address (`serve --mem-mib 4`).
const AREA: u64 = 256 << 20;
const MIB: u64 = 1 << 20;

/// The folder this test process keeps its files in.
fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-chain", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a folder");
        dir
    })
}

fn file(name: &str) -> PathBuf {
    dir().join(name)
}

/// The tests of this file, which share [`dir`]: the last one to end removes it.
const TESTS: usize = 7;

/// Counts a test as ended when dropped (even by a panic).
struct Ended;

impl Drop for Ended {
    fn drop(&mut self) {
        static ENDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        if ENDED.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1 == TESTS {
            let _ = std::fs::remove_dir_all(dir());
        }
    }
}

/// A `tinyvmm` process serving its API.
struct Served(Vmm);

/// How a `tinyvmm serve` or `restore` started.
enum Started {
    /// It serves its API.
    Served(Served),
    /// It exited first.
    Exited { code: Option<i32>, stderr: String },
    /// It neither served nor exited within the time allowed (killed).
    Hung,
}

/// Runs `tinyvmm ARGS --api-sock SOCKET` until it says it serves, exits, or 20 s have passed.
fn start(name: &str, args: &[&std::ffi::OsStr]) -> Started {
    let mut vmm = Vmm::command(name)
        .args(args)
        .api_sock(file(&format!("{name}.sock")))
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if vmm.stderr_now().contains("serving the API") {
            return Started::Served(Served(vmm));
        }
        if let Some(output) = vmm.try_exited() {
            return Started::Exited {
                code: output.status.code(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            };
        }
        if Instant::now() > deadline {
            vmm.kill();
            return Started::Hung;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Served {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.0.call(method, path, body)
    }

    /// Asks the guest to write (or verify) `seed`'s pattern over `[start, end)`.
    fn command(&self, op: &str, start: u64, end: u64, seed: u64) -> Value {
        let command = json!({"op": op, "start": start, "end": end, "stride": 4096, "seed": seed});
        let (status, body) = self.call("PUT", "/guest/command", Some(command));
        assert_eq!(status, 200, "{op} {start:#x}..{end:#x}: {body}");
        body
    }

    fn write(&self, start: u64, end: u64, seed: u64) {
        let body = self.command("write", start, end, seed);
        assert_eq!(body["result"], json!("ok"), "{body}");
    }

    fn vm(&self, state: &str) {
        let (status, body) = self.call("PATCH", "/vm", Some(json!({"state": state})));
        assert_eq!(status, 204, "{state}: {body}");
    }

    fn snapshot(&self, kind: &str, snap: &Snap) {
        let create =
            json!({"snapshot_type": kind, "snapshot_path": snap.state, "mem_file_path": snap.mem});
        let (status, body) = self.call("PUT", "/snapshot/create", Some(create));
        assert_eq!(status, 204, "{kind}: {body}");
    }

    /// Stops the VMM; its exit status.
    fn stop(self) -> Option<i32> {
        self.0.stop().status.code()
    }
}

/// A snapshot's two files.
#[derive(Debug, Clone)]
struct Snap {
    state: PathBuf,
    mem: PathBuf,
}

impl Snap {
    fn named(name: &str) -> Snap {
        Snap {
            state: file(&format!("{name}.state")),
            mem: file(&format!("{name}.mem")),
        }
    }
}

/// Two chains of two VMs set up alike (the same memory layout), with different data: A is a
/// Full and two Diffs, B a Full and a Diff.
struct Chains {
    a: [Snap; 3],
    b: [Snap; 2],
    /// The hotplug area's guest address.
    plugged: u64,
}

/// A VM with 4 MiB of test area and a hotplug area with 10 MiB plugged, each written with
/// seeds from `seed`; a Full, then after each further write a Diff.
fn make_chain(name: &str, seed: u64, snaps: &[Snap]) -> u64 {
    let Started::Served(vmm) = start(
        name,
        &["serve".as_ref(), "--mem-mib".as_ref(), "4".as_ref()],
    ) else {
        panic!("{name}: tinyvmm serve did not start");
    };
    let area = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    assert_eq!(vmm.call("PUT", "/hotplug/memory", Some(area)).0, 204);
    let plug = json!({"requested_size_mib": 10});
    assert_eq!(vmm.call("PATCH", "/hotplug/memory", Some(plug)).0, 204);
    let plugged = vmm.call("GET", "/hotplug/memory", None).1["guest_address"]
        .as_u64()
        .expect("the area's address");
    vmm.write(AREA, AREA + 4 * MIB, seed);
    vmm.write(plugged, plugged + 10 * MIB, seed + 3);
    vmm.vm("Paused");
    vmm.snapshot("Full", &snaps[0]);
    // Then: the first 2 MiB, then its second MiB.
    let writes = [(AREA, AREA + 2 * MIB), (AREA + MIB, AREA + 2 * MIB)];
    for (i, snap) in snaps.iter().enumerate().skip(1) {
        vmm.vm("Resumed");
        let (start, end) = writes[i - 1];
        vmm.write(start, end, seed + i as u64);
        vmm.vm("Paused");
        vmm.snapshot("Diff", snap);
    }
    assert_eq!(vmm.stop(), Some(0), "{name}");
    plugged
}

fn chains() -> &'static Chains {
    static CHAINS: OnceLock<Chains> = OnceLock::new();
    CHAINS.get_or_init(|| {
        let a = ["a1", "a2", "a3"].map(Snap::named);
        let b = ["b1", "b2"].map(Snap::named);
        let plugged = make_chain("chain-a", 1, &a);
        make_chain("chain-b", 11, &b);
        Chains { a, b, plugged }
    })
}

/// Runs `tinyvmm snapshot-merge --out OUT FILES...` (20 s at most); its exit status and stderr.
fn merge(out: &Path, files: &[&Path]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(["snapshot-merge", "--out"])
        .arg(out)
        .args(files)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tinyvmm runs");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return (None, "hung: killed after 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("wait");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The chain's files as `snapshot-merge` takes them: state, memory, state, memory...
fn pairs<'a>(snaps: &[&'a Snap]) -> Vec<&'a Path> {
    snaps
        .iter()
        .flat_map(|s| [s.state.as_path(), s.mem.as_path()])
        .collect()
}

/// Asserts that a `tinyvmm` that ended with `code` and `stderr` failed with exit status 1 and
/// one line that contains each of `names`.
fn assert_one_line_error(case: &str, code: Option<i32>, stderr: &str, names: &[&str]) {
    assert_eq!(code, Some(1), "{case}: {stderr}");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "{case}: one line: {stderr}"
    );
    for name in names {
        assert!(stderr.contains(name), "{case}: names {name}: {stderr}");
    }
}

/// Asserts that `snapshot-merge` refuses `files` with one line that contains each of `names`,
/// exit status 1, and writes nothing.
fn assert_merge_refused(case: &str, files: &[&Path], names: &[&str]) {
    let out = file(&format!("refused-{case}.mem"));
    let (code, stderr) = merge(&out, files);
    assert_one_line_error(case, code, &stderr, names);
    assert!(!out.exists(), "{case}: nothing is written");
}

/// `tinyvmm restore`'s arguments for `state` and `mem`.
fn restore_args<'a>(state: &'a Path, mem: &'a Path) -> [&'a std::ffi::OsStr; 5] {
    [
        "restore".as_ref(),
        "--snapshot".as_ref(),
        state.as_os_str(),
        "--mem-file".as_ref(),
        mem.as_os_str(),
    ]
}

/// Asserts that `tinyvmm restore` of `state` and `mem` exits 1 before serving, with one line
/// that contains each of `names`, and leaves no socket; returns the line.
fn assert_restore_refused(case: &str, state: &Path, mem: &Path, names: &[&str]) -> String {
    let socket = file(&format!("restore-{case}.sock"));
    match start(&format!("restore-{case}"), &restore_args(state, mem)) {
        Started::Exited { code, stderr } => {
            assert_one_line_error(case, code, &stderr, names);
            assert!(!socket.exists(), "{case}: the socket is removed");
            stderr
        }
        Started::Served(vmm) => {
            // Show what a user of it would meet.
            let resumed = vmm.call("PATCH", "/vm", Some(json!({"state": "Resumed"})));
            let command = json!({"op": "verify", "start": AREA, "end": AREA + 4096, "stride": 4096, "seed": 1});
            let first = vmm.call("PUT", "/guest/command", Some(command));
            let code = vmm.stop();
            panic!("{case}: restored and served: resume {resumed:?}, first command {first:?}, exit {code:?}")
        }
        Started::Hung => panic!("{case}: the restore hung (killed after 20 s)"),
    }
}

#[test]
fn kvm_a_merged_chain_restores_with_its_last_state_file() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_merged_chain_restores_with_its_last_state_file",
    ) {
        return;
    }
    let c = chains();
    for (case, last) in [("to-a2", 2), ("to-a3", 3)] {
        let out = file(&format!("merged-{case}.mem"));
        let chain: Vec<&Snap> = c.a[..last].iter().collect();
        let (code, stderr) = merge(&out, &pairs(&chain));
        assert_eq!(code, Some(0), "{case}: {stderr}");
        let args = restore_args(&c.a[last - 1].state, &out);
        let Started::Served(vmm) = start(&format!("merged-{case}"), &args) else {
            panic!("{case}: the merged chain did not restore");
        };
        vmm.vm("Resumed");
        // a1: seed 1 everywhere, a2: seed 2 over the first 2 MiB, a3: seed 3 over its second.
        let second = if last == 3 { 3 } else { 2 };
        for (start, end, seed) in [
            (AREA, AREA + MIB, 2),
            (AREA + MIB, AREA + 2 * MIB, second),
            (AREA + 2 * MIB, AREA + 4 * MIB, 1),
            (c.plugged, c.plugged + 10 * MIB, 4),
        ] {
            let verified = vmm.command("verify", start, end, seed);
            assert_eq!(verified["result"], json!("ok"), "{case}: {verified}");
        }
        assert_eq!(vmm.stop(), Some(0), "{case}");
    }
}

#[test]
fn kvm_restore_refuses_an_unmerged_diff_naming_the_fix() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_restore_refuses_an_unmerged_diff_naming_the_fix",
    ) {
        return;
    }
    let c = chains();
    // A Diff's own memory file holds only the pages changed since its parent.
    for (case, snap) in [("a2", &c.a[1]), ("a3", &c.a[2])] {
        let line = assert_restore_refused(
            &format!("unmerged-{case}"),
            &snap.state,
            &snap.mem,
            &[&format!("{case}.state"), "tinyvmm snapshot-merge"],
        );
        assert!(line.contains("last state file"), "{line}");
    }
    // Nor does the Full's memory file hold a Diff's point.
    assert_restore_refused(
        "diff-on-full",
        &c.a[1].state,
        &c.a[0].mem,
        &["a2.state", "a1.mem", "tinyvmm snapshot-merge"],
    );
}

#[test]
fn kvm_restore_refuses_memory_of_another_vm() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm("tinyvmm::kvm_restore_refuses_memory_of_another_vm") {
        return;
    }
    let c = chains();
    let merged_b = file("merged-b.mem");
    let (code, stderr) = merge(&merged_b, &pairs(&[&c.b[0], &c.b[1]]));
    assert_eq!(code, Some(0), "{stderr}");
    // B's merged memory under A's last state, B's Full memory under A's Full state.
    assert_restore_refused(
        "other-vm-diff",
        &c.a[1].state,
        &merged_b,
        &["a2.state", "merged-b.mem"],
    );
    assert_restore_refused(
        "other-vm-full",
        &c.a[0].state,
        &c.b[0].mem,
        &["a1.state", "b1.mem"],
    );
}

#[test]
fn kvm_snapshot_merge_refuses_what_is_not_a_chain() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm("tinyvmm::kvm_snapshot_merge_refuses_what_is_not_a_chain") {
        return;
    }
    let c = chains();
    let [a1, a2, a3] = &c.a;
    let [_, b2] = &c.b;
    for (case, chain, names) in [
        ("diff-first", vec![a2, a3], ["a2.state", "Full"]),
        ("diff-alone", vec![a2], ["a2.state", "Full"]),
        ("full-twice", vec![a1, a1, a2], ["a1.state", "repeat"]),
        ("diff-twice", vec![a1, a2, a2], ["a2.state", "repeat"]),
        ("skipped", vec![a1, a3], ["a3.state", "a1.state"]),
        ("reordered", vec![a1, a3, a2], ["a3.state", "a1.state"]),
        ("mixed-vms", vec![a1, a2, b2], ["b2.state", "another VM"]),
    ] {
        assert_merge_refused(case, &pairs(&chain), &names);
    }
    // Each memory file must be its state file's: the merge checks what it built.
    assert_merge_refused(
        "swapped-memory",
        &[&a1.state, &a1.mem, &a2.state, &a3.mem],
        &["a2.state", "memory"],
    );
}

/// Makes a FIFO at `path`.
fn fifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("a path");
    // SAFETY: `name` is a valid NUL-terminated path; mkfifo reads nothing else.
    let made = unsafe { libc::mkfifo(name.as_ptr(), 0o600) };
    assert_eq!(made, 0, "mkfifo: {}", std::io::Error::last_os_error());
}

#[test]
fn kvm_bad_input_files_are_refused_in_one_line() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm("tinyvmm::kvm_bad_input_files_are_refused_in_one_line") {
        return;
    }
    let c = chains();
    let [a1, a2, _] = &c.a;
    // A memory file of a large VM (sparse) given as the state file.
    let huge = file("huge.mem");
    std::fs::File::create(&huge)
        .and_then(|f| f.set_len(1 << 40))
        .expect("a sparse file");
    let empty = file("empty.state");
    std::fs::write(&empty, b"").expect("write");
    let folder = file("folder.state");
    std::fs::create_dir(&folder).expect("a folder");
    let pipe = file("pipe.state");
    fifo(&pipe);
    let mut bytes = std::fs::read(&a1.state).expect("the state");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    let flipped = file("flipped.state");
    std::fs::write(&flipped, &bytes).expect("write");
    // A header that announces 100 MiB (a sparse file that large).
    let oversized = file("oversized.state");
    let mut header = STATE_MAGIC.to_vec();
    header.extend_from_slice(&STATE_VERSION.to_le_bytes());
    header.extend_from_slice(&(100u64 << 20).to_le_bytes());
    std::fs::write(&oversized, &header).expect("write");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&oversized)
        .and_then(|f| f.set_len((100 << 20) + 24))
        .expect("sized");
    // A state file of the test guest's first format version.
    let old = file("old.state");
    let current = std::fs::read(&a1.state).expect("the state");
    let json = kvm_memslots_persist::unframe(STATE_MAGIC, STATE_VERSION, &current)
        .expect("a valid state file");
    let json = serde_json::from_slice(json).expect("JSON");
    std::fs::write(&old, as_older(json, 1)).expect("write");

    for (case, state, why) in [
        ("memory-as-state", &huge, "no TVMSTATE magic"),
        ("empty", &empty, "empty"),
        ("folder", &folder, "directory"),
        ("fifo", &pipe, "FIFO"),
        ("flipped", &flipped, "checksum"),
        ("oversized", &oversized, "64 MiB"),
        (
            "old-version",
            &old,
            "format version 1; this build reads versions 2 to 3",
        ),
    ] {
        let name = state.file_name().and_then(|n| n.to_str()).expect("a name");
        assert_restore_refused(case, state, &a1.mem, &[name, why]);
        assert_merge_refused(
            case,
            &[state.as_path(), &a1.mem, &a2.state, &a2.mem],
            &[name, why],
        );
    }
    // Memory files that cannot be one: a FIFO, a folder.
    let pipe_mem = file("pipe.mem");
    fifo(&pipe_mem);
    for (case, mem, why) in [
        ("fifo-mem", &pipe_mem, "FIFO"),
        ("folder-mem", &folder, "directory"),
    ] {
        let name = mem.file_name().and_then(|n| n.to_str()).expect("a name");
        assert_restore_refused(case, &a1.state, mem, &[name, why]);
        assert_merge_refused(case, &[&a1.state, mem, &a2.state, &a2.mem], &[name, why]);
    }
    assert_eq!(
        std::fs::read(&a1.state).expect("the state").len(),
        bytes.len(),
        "the inputs are untouched"
    );
}

/// `a1.state` with its JSON changed by `change`, framed again with a valid checksum.
fn tampered(name: &str, change: impl FnOnce(&mut Value)) -> PathBuf {
    tampered_as(name, STATE_VERSION, change)
}

/// As [`tampered`], written as a state file of format `version`: this build's, or an older
/// one of the test guest's own ([`as_older`]).
fn tampered_as(name: &str, version: u32, change: impl FnOnce(&mut Value)) -> PathBuf {
    let bytes = std::fs::read(&chains().a[0].state).expect("the state");
    let json = kvm_memslots_persist::unframe(STATE_MAGIC, STATE_VERSION, &bytes).expect("valid");
    let mut state: Value = serde_json::from_slice(json).expect("JSON");
    change(&mut state);
    let path = file(&format!("{name}.state"));
    let bytes = if version == STATE_VERSION {
        let json = serde_json::to_vec(&state).expect("JSON");
        kvm_memslots_persist::frame(STATE_MAGIC, version, &json)
    } else {
        as_older(state, version)
    };
    std::fs::write(&path, bytes).expect("write");
    path
}

/// `state` (this build's JSON of a test guest's state file) as the builds before the one
/// envelope wrote it, format `version` of the test guest's own (`TVMSNAP`): no guest kind, VM
/// state or `paused`, and the hotplug area beside the layout rather than in a guest part.
fn as_older(mut state: Value, version: u32) -> Vec<u8> {
    let fields = state.as_object_mut().expect("an object");
    let guest = fields.remove("guest").expect("the guest part");
    for envelope_only in ["kind", "vm", "paused"] {
        fields.remove(envelope_only);
    }
    fields.insert("hotplug".into(), guest["hotplug"].clone());
    fields.insert("version".into(), json!(version));
    let json = serde_json::to_vec(&state).expect("JSON");
    kvm_memslots_persist::frame(b"TVMSNAP\0", version, &json)
}

/// The layout's region of chain A's second hotplug piece (8 MiB at `plugged` + 8 MiB, 2 MiB of
/// it plugged).
fn partly_plugged_piece(state: &mut Value, plugged: u64) -> &mut Value {
    state["layout"]["regions"]
        .as_array_mut()
        .expect("regions")
        .iter_mut()
        .find(|r| r["gpa"] == json!(plugged + 8 * MIB))
        .expect("the piece is a region")
}

/// A partly plugged hotplug piece keeps one slot, its unplugged blocks unreachable under it:
/// the layout carries the slot, not the reachability, which the restore puts back. A state as
/// written now, one written when pieces had holes (slots over the plugged blocks only), one
/// written before that (format version 2, the piece slotted whole) and one of the format before
/// the one envelope (the test guest's own, version 3) restore alike: one slot,
/// the unplugged blocks no memory the guest may use, what the guest wrote kept, and the area
/// plugs on from there.
#[test]
fn kvm_a_partly_plugged_hotplug_piece_restores_with_its_unplugged_blocks_unreachable() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_partly_plugged_hotplug_piece_restores_with_its_unplugged_blocks_unreachable",
    ) {
        return;
    }
    let c = chains();
    let current = STATE_VERSION;
    let mut recorded = None;
    let as_written = tampered_as("one-slot", current, |s| {
        let piece = partly_plugged_piece(s, c.plugged);
        recorded = Some((
            piece["slot_size"].clone(),
            piece.get("slot_ranges").cloned(),
        ));
    });
    assert_eq!(
        recorded,
        Some((json!(8 * MIB), None)),
        "the piece's one slot, nothing of its unplugged blocks"
    );
    let with_holes = tampered_as("with-holes", current, |s| {
        let piece = partly_plugged_piece(s, c.plugged);
        piece["slot_size"] = json!(2 * MIB);
        piece["slot_ranges"] = json!([[0, 2 * MIB]]);
    });
    let legacy = tampered_as("whole-slotted", 2, |_| {});
    let older = tampered_as("older-format", 3, |_| {});
    for (name, state) in [
        ("one-slot", as_written),
        ("with-holes", with_holes),
        ("whole-slotted", legacy),
        ("older-format", older),
    ] {
        let vmm = match start(name, &restore_args(&state, &c.a[0].mem)) {
            Started::Served(vmm) => vmm,
            Started::Exited { code, stderr } => {
                panic!("{name}: the state did not restore: exit {code:?}: {stderr}")
            }
            Started::Hung => panic!("{name}: the restore hung"),
        };
        vmm.vm("Resumed");
        let piece = vmm.call("GET", "/memory", None).1["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .find(|r| r["guest_address"] == json!(c.plugged + 8 * MIB))
            .cloned()
            .expect("the piece");
        assert_eq!(piece["slots"], json!(1), "{name}: {piece}");
        let hole = json!({"op": "write", "start": c.plugged + 10 * MIB, "end": c.plugged + 11 * MIB, "stride": 4096, "seed": 9});
        let (status, body) = vmm.call("PUT", "/guest/command", Some(hole));
        assert_eq!(
            status, 400,
            "{name}: the unplugged blocks are no memory: {body}"
        );
        let verified = vmm.command("verify", c.plugged, c.plugged + 10 * MIB, 1 + 3);
        assert_eq!(verified["result"], json!("ok"), "{name}: {verified}");
        let (status, body) = vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": 16})),
        );
        assert_eq!(status, 204, "{name}: {body}");
        vmm.write(c.plugged + 10 * MIB, c.plugged + 16 * MIB, 5);
        assert_eq!(vmm.stop(), Some(0), "{name}");
    }
}

#[test]
fn kvm_a_state_file_that_contradicts_itself_is_refused_before_anything_runs() {
    let _ended = Ended;
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_state_file_that_contradicts_itself_is_refused_before_anything_runs",
    ) {
        return;
    }
    let c = chains();
    // Before any check, this one was served and the VMM panicked at the first plug (exit 101).
    let short_map = tampered("short-map", |s| {
        s["guest"]["hotplug"]["mapped"] = json!([true, true]);
    });
    if let Started::Served(vmm) = start("short-map-served", &restore_args(&short_map, &c.a[0].mem))
    {
        let plug = Client::connect(vmm.0.api()).and_then(|mut client| {
            let plug = json!({"requested_size_mib": 64});
            client.call("PATCH", "/hotplug/memory", Some(&plug))
        });
        let code = vmm.stop();
        panic!("a short hotplug map was restored: the plug answered {plug:?}, exit {code:?}");
    }
    let cases: Vec<(&str, PathBuf, &str)> = vec![
        ("short-map", short_map, "mapped"),
        (
            "absurd-plugged",
            tampered("absurd-plugged", |s| {
                s["guest"]["hotplug"]["plugged_blocks"] = json!(1u64 << 62);
            }),
            "plugged_blocks",
        ),
        (
            "map-against-plugged",
            tampered("map-against-plugged", |s| {
                s["guest"]["hotplug"]["plugged_blocks"] = json!(0);
            }),
            "mapped",
        ),
        (
            "bad-block-size",
            tampered("bad-block-size", |s| {
                s["guest"]["hotplug"]["config"]["block_size_mib"] = json!(3);
            }),
            "block_size_mib",
        ),
        (
            "slot-over-unplugged",
            tampered("slot-over-unplugged", |s| {
                let piece = partly_plugged_piece(s, c.plugged);
                piece["slot_size"] = json!(4 * MIB);
                piece["slot_ranges"] = json!([[0, 4 * MIB]]);
            }),
            "need [0..800000]",
        ),
        (
            "header-against-json",
            tampered("header-against-json", |s| s["version"] = json!(2)),
            "the header's version is 4, the state's 2",
        ),
        (
            "short-regs",
            tampered("short-regs", |s| {
                let regs = s["vcpus"][0]["regs"].as_array_mut().expect("bytes");
                regs.truncate(regs.len() - 8);
            }),
            "regs",
        ),
        (
            "short-xsave",
            tampered("short-xsave", |s| {
                let xsave = s["vcpus"][0]["xsave"].as_array_mut().expect("bytes");
                xsave.truncate(xsave.len() - 8);
            }),
            "xsave",
        ),
        (
            "missing-msr",
            tampered("missing-msr", |s| {
                s["vcpus"][0]["msrs"].as_array_mut().expect("msrs").pop();
            }),
            "MSR",
        ),
    ];
    for (case, state, why) in &cases {
        let name = state.file_name().and_then(|n| n.to_str()).expect("a name");
        assert_restore_refused(case, state, &c.a[0].mem, &[name, why]);
    }
}
