//! Live migration between two `tinyvmm` processes on /dev/kvm: a guest that keeps writing
//! across every slot moves and verifies on the destination (bitmap and ring harvests, hotplugged
//! and read-only memory, up to KVM's slot count); either side killed mid-transfer; corrupted,
//! foreign-version and refused streams; cancel and timeout.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvm_memslots_persist::stream::{send_answer, Record, StreamReader, StreamWriter};
use kvm_memslots_persist::{LayoutBacking, MemoryLayout, RegionLayout, LAYOUT_VERSION};
use serde_json::{json, Value};
use tinyvmm::api::client::Client;

mod support;
use support::vmm::Vmm;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;

/// A hold on this binary's scratch folder (`$TMPDIR/tinyvmm-migrate-PID`), which its last
/// holder removes: the first local of each test that puts a file there ([`path`]).
fn scratch() -> support::scratch::Scratch {
    support::scratch::Scratch::hold("migrate")
}

/// The socket `NAME-WHAT.sock` in the scratch folder (the test holds [`scratch`]).
fn path(name: &str, what: &str) -> PathBuf {
    let dir = support::scratch::folder("migrate");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir.join(format!("{name}-{what}.sock"))
}

fn area_end(vmm: &Vmm) -> u64 {
    support::area_end(vmm.api(), AREA)
}

fn guest(op: &str, start: u64, end: u64, seed: u64) -> Value {
    support::guest_command(op, start, end, seed)
}

fn migrate(source: &Vmm, listen: &std::path::Path, extra: Value) -> (u16, Value) {
    let mut body = json!({"destination": format!("unix:{}", listen.display())});
    for (k, v) in extra.as_object().expect("an object") {
        body[k] = v.clone();
    }
    source.call("PUT", "/migrate", Some(body))
}

/// How long a migration may show no progress ([`Progress`]) before a test calls it hung: a
/// guard against a hang only. A slow or busy machine makes progress slowly, not never.
const NO_PROGRESS_LIMIT: Duration = Duration::from_secs(240);

/// What a migration's status says it did so far: a change is progress.
#[derive(Debug, Default, PartialEq)]
struct Progress(Value, Value, Value, Value);

impl Progress {
    fn of(info: &Value) -> Progress {
        Progress(
            info["phase"].clone(),
            info["round"].clone(),
            info["bytes_sent"].clone(),
            info["pages_left"].clone(),
        )
    }
}

/// A deadline that moves on while a migration makes progress.
struct HangGuard {
    last: Progress,
    deadline: Instant,
}

impl HangGuard {
    fn new() -> HangGuard {
        HangGuard {
            last: Progress::default(),
            deadline: Instant::now() + NO_PROGRESS_LIMIT,
        }
    }

    /// Takes `info` (a `GET /migrate` answer) in; whether the migration made progress within
    /// [`NO_PROGRESS_LIMIT`] of the last.
    fn alive(&mut self, info: &Value) -> bool {
        let now = Progress::of(info);
        if now != self.last {
            self.last = now;
            self.deadline = Instant::now() + NO_PROGRESS_LIMIT;
        }
        Instant::now() < self.deadline
    }
}

/// Polls `GET /migrate` until `until` holds; returns that answer.
fn watch(source: &Vmm, until: impl Fn(&Value) -> bool) -> Value {
    let mut guard = HangGuard::new();
    loop {
        let (status, info) = source.call("GET", "/migrate", None);
        assert_eq!(status, 200, "{info}");
        if until(&info) {
            return info;
        }
        assert!(guard.alive(&info), "the migration never got there: {info}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn phase(info: &Value) -> &str {
    info["phase"].as_str().expect("a phase")
}

/// Stops vCPU 0's write loop on `vmm` and checks that `[start, end)` holds its last pass.
fn stop_and_verify(vmm: &Vmm, start: u64, end: u64) -> u64 {
    support::stop_and_verify(vmm.api(), start, end).0
}

/// A guest writing across `slots` slots migrates while it writes; every slot, a hotplugged
/// region and a read-only region verify on the destination, and the source exits 0.
/// With `local`, the initial memory is a memfd that the source hands over instead of copying.
/// Every region arrives with its page size.
fn migrate_a_writing_guest(
    name: &str,
    slots: usize,
    dirty_ring: Option<&str>,
    downtime_ms: u64,
    local: bool,
) {
    migrate_a_writing_guest_serving(name, slots, dirty_ring, downtime_ms, local, &[]);
}

/// [`migrate_a_writing_guest`], the source served with `serve_args` besides.
fn migrate_a_writing_guest_serving(
    name: &str,
    slots: usize,
    dirty_ring: Option<&str>,
    downtime_ms: u64,
    local: bool,
    serve_args: &[&str],
) {
    let mem_mib = 256;
    let mut args: Vec<&str> = dirty_ring
        .map(|entries| vec!["--dirty-ring", entries])
        .unwrap_or_default();
    if local {
        args.push("--memfd");
    }
    args.extend(serve_args);
    let mut source = Vmm::serve(name, slots, mem_mib, &args);
    // Hotplugged memory with a pattern, and a region made read-only after the guest wrote it.
    // The read-only one comes first, so that region ids are not in guest-address order: the
    // destination must keep them, not number the regions again.
    let ro = 4160 * MIB;
    let ro_region = source.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 16 * MIB, "guest_address": ro})),
    );
    let hot = source.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 64 * MIB, "guest_address": 4096 * MIB, "slot_size": 2 * MIB})),
    );
    assert_eq!(hot["guest_address"], 4096 * MIB, "{hot}");
    for (start, size, seed) in [(4096 * MIB, 64 * MIB, 11), (ro, 16 * MIB, 12)] {
        let wrote = source.ok(
            "PUT",
            "/guest/command",
            Some(guest("write", start, start + size, seed)),
        );
        assert_eq!(wrote["result"], "ok");
    }
    let id = ro_region["id"].as_u64().expect("an id");
    source.ok(
        "PATCH",
        &format!("/memory/regions/{id}"),
        Some(json!({"read_only": true})),
    );
    let end = area_end(&source);
    // Every page of the initial memory holds data before the move, so that what is copied does
    // not depend on how far the loop's first pass got when the rounds ended.
    let wrote = source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write", AREA, end, 999)),
    );
    assert_eq!(wrote["result"], "ok");
    let started = source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write_loop", AREA, end, 1000)),
    );
    assert_eq!(started["result"], "started");
    let before = source.ok("GET", "/memory", None);

    let (mut destination, listen) = Vmm::receive(name, &[]);
    // The guest rewrites its memory all the time: whether a round ever fits the budget within
    // the timeout depends on the machine's speed and load (at KVM's slot count a round's
    // harvest alone takes a large part of a second). These runs are about every slot arriving
    // intact, so they converge or stop and copy at the timeout rather than give up; the tests
    // of convergence itself and of cancelling are below.
    let (status, answer) = migrate(
        &source,
        &listen,
        json!({"downtime_ms": downtime_ms, "local": local, "on_timeout": "force"}),
    );
    assert_eq!(status, 204, "{answer}");
    // The source leaves once the destination runs the VM (a local migration may be over
    // before a first look); a migration that fails keeps it running.
    let mut guard = HangGuard::new();
    let mut alive = true;
    while source.running() {
        let info = Client::connect(source.api())
            .and_then(|mut c| c.call("GET", "/migrate", None))
            .map(|(_, info)| info);
        if let Ok(info) = info {
            assert!(!["failed", "cancelled"].contains(&phase(&info)), "{info}");
            alive = guard.alive(&info);
        }
        assert!(
            alive,
            "the migration made no progress in {NO_PROGRESS_LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    source.wait_migrated(Duration::from_secs(180));

    destination.wait_for_vm();
    let after = destination.ok("GET", "/memory", None);
    let shape = |m: &Value| -> Vec<(Value, Value, Value, Value, Value, Value)> {
        m["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .map(|r| {
                (
                    r["id"].clone(),
                    r["guest_address"].clone(),
                    r["size"].clone(),
                    r["slots"].clone(),
                    r["read_only"].clone(),
                    r["page_size"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(shape(&before), shape(&after), "the same layout arrives");
    assert_eq!(before["slots"]["used"], after["slots"]["used"]);
    // The loop goes on where it was: more passes after the move, then every slot holds the
    // last one.
    let passes = stop_and_verify(&destination, AREA, end);
    assert!(passes > 0);
    for (start, size, seed) in [(4096 * MIB, 64 * MIB, 11), (ro, 16 * MIB, 12)] {
        let verified = destination.ok(
            "PUT",
            "/guest/command",
            Some(guest("verify", start, start + size, seed)),
        );
        assert_eq!(verified["result"], "ok", "{verified}");
    }
    // The API's handle survived the move: the source's id of the read-only region removes
    // that region on the destination.
    let (status, body) = destination.call("DELETE", &format!("/memory/regions/{id}"), None);
    assert_eq!(status, 204, "{body}");
    let left = destination.ok("GET", "/memory", None);
    assert!(
        left["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .all(|r| r["guest_address"] != json!(ro) && r["id"] != json!(id)),
        "{left}"
    );
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    let output = destination.wait(Duration::from_secs(180));
    assert_eq!(output.status.code(), Some(0));
    // "the VM runs here after N rounds, M MiB, ...": what was copied.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let copied_mib: u64 = stderr
        .split_once(" rounds, ")
        .and_then(|(_, rest)| rest.split_once(" MiB")?.0.parse().ok())
        .unwrap_or_else(|| panic!("no summary line: {stderr}"));
    if local {
        // The hotplugged and the read-only region (80 MiB, anonymous) travel; the memfd does not.
        assert!(copied_mib < mem_mib, "{copied_mib} MiB copied: {stderr}");
    } else {
        assert!(
            copied_mib >= mem_mib + 80,
            "{copied_mib} MiB copied: {stderr}"
        );
    }
}

#[test]
fn kvm_a_writing_guest_migrates_with_bitmap_harvests() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_writing_guest_migrates_with_bitmap_harvests")
    {
        return;
    }
    migrate_a_writing_guest("bitmap", 4096, None, 300, false);
}

#[test]
fn kvm_a_writing_guest_migrates_with_ring_harvests() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_writing_guest_migrates_with_ring_harvests") {
        return;
    }
    migrate_a_writing_guest("ring", 4096, Some("4096"), 300, false);
}

#[test]
fn kvm_a_writing_guest_migrates_at_kvms_slot_count() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_writing_guest_migrates_at_kvms_slot_count") {
        return;
    }
    // 32764 slots on this host: the test area takes all but the system region's, the
    // hotplugged and the read-only region's 34. The guest rewrites every one of its 65536
    // pages in about a millisecond, and collecting and resetting that many ring entries takes
    // this host's emulated KVM some 600 ms: no 300 ms pause could hold it, and the default
    // budget would time out (correctly). This test is about every slot arriving intact.
    let max = kvm_ioctls::Kvm::new().expect("/dev/kvm").get_nr_memslots();
    migrate_a_writing_guest("max", max - 34, Some("65536"), 5000, false);
}

#[test]
fn kvm_a_writing_guest_migrates_at_kvms_slot_count_with_bitmap_harvests() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_writing_guest_migrates_at_kvms_slot_count_with_bitmap_harvests",
    ) {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("/dev/kvm").get_nr_memslots();
    // A bitmap harvest reads 32764 logs (about half a second here): a budget that fits it.
    migrate_a_writing_guest("max-bitmap", max - 34, None, 5000, false);
}

#[test]
fn kvm_a_writing_guest_migrates_locally_by_handing_its_memfd_over() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_writing_guest_migrates_locally_by_handing_its_memfd_over",
    ) {
        return;
    }
    migrate_a_writing_guest("local", 4096, None, 300, true);
}

/// A memfd of transparent huge pages handed over keeps them on the destination (it once
/// refused the memfd: a caller's file could not take THP).
#[test]
fn kvm_a_thp_memfd_migrates_locally_and_keeps_its_page_size() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_thp_memfd_migrates_locally_and_keeps_its_page_size",
    ) {
        return;
    }
    migrate_a_writing_guest_serving("local-thp", 64, None, 300, true, &["--page-size", "thp"]);
}

#[test]
fn kvm_a_local_migration_at_kvms_slot_count_copies_no_shared_memory() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_local_migration_at_kvms_slot_count_copies_no_shared_memory",
    ) {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("/dev/kvm").get_nr_memslots();
    // The memfd needs no harvest: the default budget holds even with the guest rewriting it.
    migrate_a_writing_guest("local-max", max - 34, Some("65536"), 300, true);
}

#[test]
fn kvm_local_mode_needs_a_unix_socket() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_local_mode_needs_a_unix_socket") {
        return;
    }
    let source = Vmm::serve("local-tcp", 8, 64, &["--memfd"]);
    let (status, answer) = source.call(
        "PUT",
        "/migrate",
        Some(json!({"destination": "tcp:127.0.0.1:1", "local": true})),
    );
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["fault_message"]
            .as_str()
            .is_some_and(|m| m.contains("Unix socket")),
        "{answer}"
    );
    let (status, _) = source.call("GET", "/migrate", None);
    assert_eq!(status, 404, "nothing started");
}

/// A guest that keeps writing, and a budget no round can meet: the migration stays in
/// pre-copy until its timeout.
fn never_converging(name: &str) -> (Vmm, u64) {
    let source = Vmm::serve(name, 64, 64, &[]);
    let end = area_end(&source);
    source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write_loop", AREA, end, 1)),
    );
    (source, end)
}

#[test]
fn kvm_the_source_runs_on_when_the_destination_dies() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_the_source_runs_on_when_the_destination_dies") {
        return;
    }
    let (source, end) = never_converging("dst-dies");
    let (mut destination, listen) = Vmm::receive("dst-dies", &[]);
    let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 0}));
    assert_eq!(status, 204, "{answer}");
    watch(&source, |i| i["round"].as_u64() >= Some(3));
    // Requests that would change what is moving wait for the migration.
    let (status, _) = source.call("POST", "/memory/regions", Some(json!({"size": MIB})));
    assert_eq!(status, 409);
    let output = destination.kill();
    assert!(!output.status.success());
    let info = watch(&source, |i| phase(i) == "failed");
    assert!(
        info["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{info}"
    );
    // The guest ran on: the loop still writes, and stops and verifies here.
    stop_and_verify(&source, AREA, end);
    // A second migration to a new destination succeeds.
    source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write_loop", AREA, end, 500)),
    );
    let (second, listen) = Vmm::receive("dst-dies-2", &[]);
    // It converges or stops and copies at the timeout: whether a guest that writes all the
    // time converges depends on the machine's speed, and this is about the move succeeding.
    let (status, answer) = migrate(&source, &listen, json!({"on_timeout": "force"}));
    assert_eq!(status, 204, "{answer}");
    let mut source = source;
    let output = source.wait(Duration::from_secs(120));
    assert_eq!(output.status.code(), Some(0));
    second.wait_for_vm();
    stop_and_verify(&second, AREA, end);
}

#[test]
fn kvm_the_destination_gives_up_when_the_source_dies() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_the_destination_gives_up_when_the_source_dies")
    {
        return;
    }
    let (mut source, _) = never_converging("src-dies");
    let (mut destination, listen) = Vmm::receive("src-dies", &[]);
    let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 0}));
    assert_eq!(status, 204, "{answer}");
    watch(&source, |i| i["round"].as_u64() >= Some(3));
    source.kill();
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("nothing runs here"), "{stderr}");
    assert!(stderr.contains("ended early"), "{stderr}");
    assert!(!destination.api().exists(), "no API: no VM");
}

#[test]
fn kvm_a_client_cancels_and_a_timeout_cancels() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_client_cancels_and_a_timeout_cancels") {
        return;
    }
    let (source, end) = never_converging("cancel");
    let (_destination, listen) = Vmm::receive("cancel", &[]);
    let (status, answer) = source.call("PUT", "/migrate/cancel", None);
    assert_eq!(status, 409, "nothing to cancel yet: {answer}");
    let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 0}));
    assert_eq!(status, 204, "{answer}");
    let (status, _) = migrate(&source, &listen, json!({}));
    assert_eq!(status, 409, "one migration at a time");
    watch(&source, |i| i["round"].as_u64() >= Some(2));
    let (status, answer) = source.call("PUT", "/migrate/cancel", None);
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "cancelled");
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("cancelled")),
        "{info}"
    );
    // Dirty logging is off again: it was off before.
    let log = source.ok("GET", "/dirty-log", None);
    assert_eq!(log["logging_regions"], json!([]), "{log}");

    // A timeout with `cancel`: it gives up on its own.
    let (_destination, listen) = Vmm::receive("cancel-2", &[]);
    let (status, answer) = migrate(
        &source,
        &listen,
        json!({"downtime_ms": 0, "timeout_s": 1, "on_timeout": "cancel"}),
    );
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "cancelled");
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("not converged")),
        "{info}"
    );
    stop_and_verify(&source, AREA, end);
}

#[test]
fn kvm_a_timeout_with_force_completes() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_timeout_with_force_completes") {
        return;
    }
    let (mut source, end) = never_converging("force");
    let (mut destination, listen) = Vmm::receive("force", &[]);
    let (status, answer) = migrate(
        &source,
        &listen,
        json!({"downtime_ms": 0, "timeout_s": 1, "on_timeout": "force"}),
    );
    assert_eq!(status, 204, "{answer}");
    let output = source.wait(Duration::from_secs(120));
    assert_eq!(output.status.code(), Some(0));
    destination.wait_for_vm();
    stop_and_verify(&destination, AREA, end);
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    destination.wait(Duration::from_secs(180));
}

#[test]
fn kvm_a_destination_that_cannot_hold_the_vm_refuses_it_before_memory_moves() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_destination_that_cannot_hold_the_vm_refuses_it_before_memory_moves",
    ) {
        return;
    }
    let source = Vmm::serve("refuse", 8, 256, &[]);
    let (mut destination, listen) = Vmm::receive("refuse", &["--max-guest-mib", "64"]);
    let (status, answer) = migrate(&source, &listen, json!({}));
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "failed");
    let error = info["error"].as_str().expect("an error");
    assert!(error.contains("refused"), "{error}");
    assert!(error.contains("over the limit"), "{error}");
    assert_eq!(info["round"], 0, "no round started: {info}");
    let output = destination.wait(Duration::from_secs(180));
    assert_eq!(output.status.code(), Some(1));
    // The source runs on.
    let ran = source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write", AREA, AREA + MIB, 3)),
    );
    assert_eq!(ran["result"], "ok");
}

/// A region of a crafted layout: `size` bytes at guest `gpa` and memory-file `file_offset`.
fn region_layout(
    id: u64,
    gpa: u64,
    size: u64,
    backing: LayoutBacking,
    file_offset: u64,
) -> RegionLayout {
    RegionLayout {
        id,
        gpa,
        size,
        slot_size: size,
        read_only: false,
        log_dirty: false,
        backing,
        file_offset,
        slot_ranges: None,
        page_size: Default::default(),
    }
}

/// A layout with the test guest's system region only (2 MiB at 0).
fn one_region_layout() -> MemoryLayout {
    MemoryLayout {
        version: LAYOUT_VERSION,
        regions: vec![region_layout(0, 0, 2 * MIB, LayoutBacking::Anonymous, 0)],
    }
}

/// A Hello record for a one-region layout, as bytes.
fn hello() -> Vec<u8> {
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&one_region_layout()).expect("hello");
    writer.get_ref().clone()
}

/// Sends `bytes` to a fresh `tinyvmm receive` as its source; returns its stderr.
fn receive_bytes(name: &str, bytes: &[u8]) -> String {
    let (destination, listen) = Vmm::receive(name, &[]);
    let mut stream = UnixStream::connect(&listen).expect("connect");
    stream.write_all(bytes).expect("send");
    refusal(destination)
}

/// Waits for a `tinyvmm receive` to refuse what it was sent: exit 1, nothing run; its stderr.
fn refusal(mut destination: Vmm) -> String {
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("nothing runs here"), "{stderr}");
    stderr
}

#[test]
fn kvm_a_corrupted_or_foreign_stream_is_refused_with_its_reason() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_corrupted_or_foreign_stream_is_refused_with_its_reason",
    ) {
        return;
    }
    // A flipped byte in the layout.
    let mut flipped = hello();
    let at = flipped.len() - 5;
    flipped[at] ^= 0x40;
    let stderr = receive_bytes("flipped", &flipped);
    assert!(stderr.contains("checksum"), "{stderr}");

    // Another version of the stream format, with a valid checksum.
    let mut foreign = hello();
    foreign[12 + 8..12 + 12].copy_from_slice(&99u32.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&foreign[..1]);
    crc.update(&foreign[4..8]);
    crc.update(&foreign[12..]);
    let sum = crc.finalize().to_le_bytes();
    foreign[8..12].copy_from_slice(&sum);
    let stderr = receive_bytes("foreign", &foreign);
    assert!(stderr.contains("stream version 99"), "{stderr}");

    // Not a stream at all.
    let stderr = receive_bytes("http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(stderr.contains("migration failed"), "{stderr}");
}

#[test]
fn kvm_pages_a_failed_migration_harvested_go_into_the_next_diff_snapshot() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_pages_a_failed_migration_harvested_go_into_the_next_diff_snapshot",
    ) {
        return;
    }
    let scratch = scratch();
    use std::os::unix::fs::MetadataExt;
    let dir = scratch.dir().join("diff");
    std::fs::create_dir_all(&dir).expect("a folder");
    let source = Vmm::serve("diff", 8, 64, &[]);
    let region = 4096 * MIB;
    source.ok(
        "PUT",
        "/memory/regions",
        Some(json!({"size": MIB, "guest_address": region})),
    );
    let snapshot = |kind: &str, name: &str| {
        source.call(
            "PUT",
            "/snapshot/create",
            Some(json!({
                "snapshot_type": kind,
                "snapshot_path": dir.join(format!("{name}.state")),
                "mem_file_path": dir.join(format!("{name}.mem")),
            })),
        )
    };
    let pause = |state: &str| {
        source.ok("PATCH", "/vm", Some(json!({"state": state})));
    };
    pause("Paused");
    assert_eq!(snapshot("Full", "full").0, 204);
    pause("Resumed");
    // The guest dirties all 256 pages of the region; then a migration harvests them and fails
    // (the destination cannot hold the VM).
    let wrote = source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write", region, region + MIB, 5)),
    );
    assert_eq!(wrote["result"], "ok");
    let (_destination, listen) = Vmm::receive("diff", &["--max-guest-mib", "16"]);
    let (status, answer) = migrate(&source, &listen, json!({}));
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "failed");
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("refused")),
        "{info}"
    );
    // The next Diff has every page the migration took from the log.
    pause("Paused");
    assert_eq!(snapshot("Diff", "diff").0, 204);
    let data = std::fs::metadata(dir.join("diff.mem"))
        .expect("the diff")
        .blocks()
        * 512;
    assert!(
        data >= MIB,
        "the diff holds the region's 256 pages: {data} bytes"
    );
}

#[test]
fn kvm_the_source_runs_on_when_the_destination_dies_at_once() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_source_runs_on_when_the_destination_dies_at_once",
    ) {
        return;
    }
    // Killed before it can answer the layout: the source's first step fails.
    let (source, end) = never_converging("dst-dies-early");
    let (mut destination, listen) = Vmm::receive("dst-dies-early", &[]);
    destination.kill();
    let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 0}));
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "failed");
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot connect")),
        "{info}"
    );
    stop_and_verify(&source, AREA, end);
}

/// A stream reader on a fake destination's connection.
type FakeReader = StreamReader<std::io::BufReader<UnixStream>>;

/// A destination written in the test, listening at the returned path: it accepts the layout
/// and hands the rest of the stream to `rest`, with the connection for answers.
fn fake_destination(
    name: &str,
    rest: impl FnOnce(&mut FakeReader, &mut UnixStream) + Send + 'static,
) -> (PathBuf, std::thread::JoinHandle<()>) {
    let listen = path(name, "fake");
    let _ = std::fs::remove_file(&listen);
    let listener = std::os::unix::net::UnixListener::bind(&listen).expect("bind");
    let thread = std::thread::spawn(move || {
        let (connection, _) = listener.accept().expect("the source connects");
        let mut answers = connection.try_clone().expect("clone");
        let mut reader = StreamReader::new(std::io::BufReader::new(connection));
        let hello = reader.next_record().expect("a record");
        assert!(matches!(hello, Some(Record::Hello { .. })), "{hello:?}");
        send_answer(&mut answers, Ok(())).expect("accept the layout");
        rest(&mut reader, &mut answers);
    });
    (listen, thread)
}

/// Migrates a writing guest to a fake destination that reads the whole stream up to Done,
/// then answers `after_done` (a refusal) or, with `None`, closes without a word (it died after
/// starting the VM, or its answer was lost). Checks that the migration ended in
/// `phase_expected` with `error` in its message; returns the source and the end of its written
/// area.
fn migrate_to_a_fake_destination(
    name: &str,
    after_done: Option<&'static str>,
    phase_expected: &str,
    error: &str,
) -> (Vmm, u64) {
    let (source, end) = never_converging(name);
    migrate_source_to_a_fake_destination(&source, name, after_done, phase_expected, error);
    (source, end)
}

/// [`migrate_to_a_fake_destination`] from a source the caller set up.
fn migrate_source_to_a_fake_destination(
    source: &Vmm,
    name: &str,
    after_done: Option<&'static str>,
    phase_expected: &str,
    error: &str,
) {
    let (listen, destination) = fake_destination(name, move |reader, answers| {
        let mut state = false;
        loop {
            match reader.next_record().expect("a whole stream") {
                Some(Record::State(_)) => state = true,
                Some(Record::Done) => break,
                Some(_) => {}
                None => panic!("no Done"),
            }
        }
        assert!(state, "the stream carried the VM's state");
        if let Some(reason) = after_done {
            send_answer(answers, Err(reason)).expect("refuse");
        }
    });
    // A budget the first round fits: stop-and-copy comes at once.
    let (status, answer) = migrate(source, &listen, json!({"downtime_ms": 600000}));
    assert_eq!(status, 204, "{answer}");
    let info = watch(source, |i| {
        !matches!(phase(i), "setup" | "pre_copy" | "stop_and_copy")
    });
    destination
        .join()
        .expect("the fake destination read everything");
    assert_eq!(phase(&info), phase_expected, "{info}");
    assert!(
        info["error"].as_str().is_some_and(|e| e.contains(error)),
        "{info}"
    );
    let _ = std::fs::remove_file(&listen);
}

#[test]
fn kvm_a_destination_silent_after_the_whole_vm_leaves_it_paused_here() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_destination_silent_after_the_whole_vm_leaves_it_paused_here",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = migrate_to_a_fake_destination(
        "silent-dst",
        None,
        "unconfirmed",
        "it may be running the VM",
    );
    // The VM may run there: here it is paused, runs no command and starts no migration.
    assert!(source.running(), "the source VMM keeps its VM");
    assert_eq!(source.ok("GET", "/vm", None)["state"], "Paused");
    let (status, _) = source.call(
        "PUT",
        "/guest/command",
        Some(json!({"op": "stop_loop", "vcpu": 0})),
    );
    assert_eq!(status, 409);
    let (status, answer) = migrate(&source, &path("silent-dst", "fake"), json!({}));
    assert_eq!(status, 409, "{answer}");
    // A client who knows the destination does not run it resumes it here: the write loop goes
    // on where it was paused, and the memory holds its last pass.
    source.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    stop_and_verify(&source, AREA, end);
}

/// Waits for the live snapshot under way to end; its last `GET /snapshot`.
fn live_snapshot_ended(vmm: &Vmm) -> Value {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let info = vmm.ok("GET", "/snapshot", None);
        if !matches!(
            info["phase"].as_str(),
            Some("setup" | "pre_copy" | "stop_and_copy")
        ) {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "the snapshot never ended: {info}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// vCPU 0's general registers in the state file at `path` (the frame: magic 8, version 4,
/// length 8, JSON, CRC-32 4).
fn saved_registers(path: &std::path::Path) -> Value {
    let bytes = std::fs::read(path).expect("a state file");
    let state: Value =
        serde_json::from_slice(&bytes[20..bytes.len() - 4]).expect("the state's JSON");
    state["vcpus"][0]["regs"].clone()
}

#[test]
fn kvm_a_live_snapshot_leaves_the_vcpus_an_unconfirmed_migration_holds_paused() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_live_snapshot_leaves_the_vcpus_an_unconfirmed_migration_holds_paused",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = never_converging("held-live");
    migrate_source_to_a_fake_destination(
        &source,
        "held-live",
        None,
        "unconfirmed",
        "it may be running the VM",
    );
    // The destination may run the VM: a live Full and then a live Diff of it are taken, and
    // neither lets the write loop the migration paused run on here.
    // Snapshot files (`path` names sockets).
    let files = |tag: &str| {
        let socket = path("held-live", tag);
        (socket.with_extension("state"), socket.with_extension("mem"))
    };
    let mut registers = Vec::new();
    for (kind, tag) in [("Full", "full"), ("Diff", "diff")] {
        let (state, mem) = files(tag);
        source.ok(
            "PUT",
            "/snapshot/create",
            Some(
                json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem,
                        "live": true}),
            ),
        );
        let info = live_snapshot_ended(&source);
        assert_eq!(info["phase"], "completed", "live {kind}: {info}");
        assert_eq!(source.ok("GET", "/vm", None)["state"], "Paused");
        registers.push(saved_registers(&state));
        if kind == "Diff" {
            // Nothing was written after the Full's point.
            assert_eq!(info["bytes_written"], 0, "the live Diff: {info}");
        }
    }
    // The loop is exactly where the Full found it.
    assert_eq!(
        registers[0], registers[1],
        "the vCPU ran between the two points"
    );
    // Resuming is still the way out: the loop goes on.
    source.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    stop_and_verify(&source, AREA, end);
    for tag in ["full", "diff"] {
        let (state, mem) = files(tag);
        let _ = std::fs::remove_file(state);
        let _ = std::fs::remove_file(mem);
    }
}

#[test]
fn kvm_a_destination_refusing_after_the_whole_vm_leaves_it_running_here() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_destination_refusing_after_the_whole_vm_leaves_it_running_here",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = migrate_to_a_fake_destination(
        "refusing-dst",
        Some("restoring the vCPUs failed"),
        "failed",
        "restoring the vCPUs failed",
    );
    // It said it runs nothing: the VM went on here without a word from a client.
    assert_eq!(source.ok("GET", "/vm", None)["state"], "Running");
    stop_and_verify(&source, AREA, end);
}

#[test]
fn kvm_a_budget_below_one_bitmap_harvest_ends_the_rounds_early() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_budget_below_one_bitmap_harvest_ends_the_rounds_early",
    ) {
        return;
    }
    let _scratch = scratch();
    // An idle guest in 4096 slots: each bitmap harvest reads 4096 logs (one ioctl each: a few
    // ms at the very least on any machine), and nothing is left to send. A 1 ms budget cannot
    // be met, however long the rounds go on: the migration says so after a few rounds, long
    // before its timeout. (KVM's slot count makes the harvests longer, not the test stronger:
    // the migrations at that count are the tests above.)
    let source = Vmm::serve("harvest-bound", 4096, 256, &[]);
    let (listen, destination) = fake_destination("harvest-bound", |reader, _| {
        // Until the source gives up and closes.
        while let Ok(Some(_)) = reader.next_record() {}
    });
    let (status, answer) = migrate(
        &source,
        &listen,
        json!({"downtime_ms": 1, "timeout_s": 600, "on_timeout": "cancel"}),
    );
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "cancelled");
    destination.join().expect("the fake destination");
    // The reason names the harvest, not the (600 s) timeout.
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("budget cannot be met") && e.contains("--dirty-ring")),
        "{info}"
    );
    assert!(info["round"].as_u64() >= Some(3), "{info}");
    assert_eq!(info["forced"], false, "{info}");
    // The VM runs on here, logging as it was (off).
    let log = source.ok("GET", "/dirty-log", None);
    assert_eq!(log["logging_regions"], json!([]), "{log}");

    // With `force`, the pause comes at that point instead, and says it was forced (the fake
    // destination then keeps silent: the VM stays paused here, to be resumed).
    let (listen, destination) = fake_destination("harvest-bound-2", |reader, _| {
        while !matches!(reader.next_record(), Ok(Some(Record::Done)) | Err(_)) {}
    });
    let (status, answer) = migrate(
        &source,
        &listen,
        json!({"downtime_ms": 1, "timeout_s": 600, "on_timeout": "force"}),
    );
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "unconfirmed");
    destination.join().expect("the fake destination");
    assert_eq!(info["forced"], true, "{info}");
    source.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
}

#[test]
fn kvm_a_writing_guest_migrates_over_tcp() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_writing_guest_migrates_over_tcp") {
        return;
    }
    let (source, end) = never_converging("tcp");
    // A port the kernel just handed out, free again for the destination.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let endpoint = format!("tcp:127.0.0.1:{port}");
    let mut destination = Vmm::command("tcp-dst")
        .args(["receive", "--listen", &endpoint])
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(180);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "receive never listened");
        assert!(destination.running(), "receive exited");
        std::thread::sleep(Duration::from_millis(10));
    }
    // That probe was the destination's one connection: it dropped it, said why and exited.
    let probed = destination.wait(Duration::from_secs(180));
    assert_eq!(probed.status.code(), Some(1));
    let destination = Vmm::command("tcp-dst")
        .args(["receive", "--listen", &endpoint])
        .listening();
    let (status, answer) = source.call(
        "PUT",
        "/migrate",
        Some(json!({"destination": endpoint, "downtime_ms": 1000, "timeout_s": 30, "on_timeout": "force"})),
    );
    assert_eq!(status, 204, "{answer}");
    migrated_away(source);
    destination.wait_for_vm();
    stop_and_verify(&destination, AREA, end);
}

#[test]
fn kvm_sigterm_stops_a_receiving_destination_with_130_and_the_source_runs_on() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_sigterm_stops_a_receiving_destination_with_130_and_the_source_runs_on",
    ) {
        return;
    }
    let (source, end) = never_converging("dst-sigterm");
    let (mut destination, listen) = Vmm::receive("dst-sigterm", &[]);
    let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 0}));
    assert_eq!(status, 204, "{answer}");
    watch(&source, |i| i["round"].as_u64() >= Some(2));
    destination.signal(libc::SIGTERM);
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("nothing runs here"), "{stderr}");
    watch(&source, |i| phase(i) == "failed");
    stop_and_verify(&source, AREA, end);
}

/// A destination that takes the connection (the kernel's backlog does) and never reads a byte
/// or answers: a listener the test holds and never accepts on.
fn silent_destination(name: &str) -> (PathBuf, std::os::unix::net::UnixListener) {
    let listen = path(name, "silent");
    let _ = std::fs::remove_file(&listen);
    let listener = std::os::unix::net::UnixListener::bind(&listen).expect("bind");
    (listen, listener)
}

/// A fake destination that accepts the layout and then reads nothing until `release` is
/// dropped: the source's writes block once the socket's buffer is full.
fn stalled_destination(name: &str) -> (PathBuf, std::sync::mpsc::Sender<()>) {
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let (listen, _thread) = fake_destination(name, move |_, _| {
        let _ = wait.recv();
    });
    (listen, release)
}

/// Half the waits a cancel, a signal or `timeout_s` cut short (a silent peer's 60 s stall: a
/// migration's wait on its destination, a destination's wait for the next record): a wait
/// that ends sooner was cut short, not waited out. Nothing but the clock tells the two apart:
/// a wait that runs out still reports the cancel or the signal set meanwhile, which wins over
/// the stall. It is not a bound on the machine's speed: acting on a cancel or a signal takes
/// a poll slice (20 ms) and one status request, and a machine that needs 30 s for that runs
/// no test of this suite; a wait not cut short ends 60 s after the peer went silent.
const CUT_SHORT: Duration = Duration::from_secs(30);

/// Migrates `source` (its guest writing `[AREA, end)` in a loop from `seed`) to `listen` with
/// `body`; with `cancel_after`, cancels it that long after the start. Checks that it ended
/// `cancelled` within `within` of the start (or of the cancel) and that the guest ran on
/// here; returns `GET /migrate`'s last answer.
fn cancelled_migration(
    source: &Vmm,
    end: u64,
    listen: &std::path::Path,
    body: Value,
    seed: u64,
    cancel_after: Option<Duration>,
    within: Duration,
) -> Value {
    if seed > 1 {
        source.ok(
            "PUT",
            "/guest/command",
            Some(guest("write_loop", AREA, end, seed)),
        );
    }
    let mut since = Instant::now();
    let (status, answer) = migrate(source, listen, body);
    assert_eq!(status, 204, "{answer}");
    if let Some(after) = cancel_after {
        std::thread::sleep(after);
        let (status, _) = source.call("POST", "/memory/regions", Some(json!({"size": MIB})));
        assert_eq!(status, 409, "a change waits for the migration");
        since = Instant::now();
        source.ok("PUT", "/migrate/cancel", None);
    }
    let info = watch(source, |i| {
        !matches!(phase(i), "setup" | "pre_copy" | "stop_and_copy")
    });
    let took = since.elapsed();
    assert_eq!(phase(&info), "cancelled", "{info}");
    assert!(took < within, "{took:?}: {info}");
    stop_and_verify(source, AREA, end);
    info
}

#[test]
fn kvm_a_cancel_ends_a_migration_to_a_silent_destination_at_once() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_cancel_ends_a_migration_to_a_silent_destination_at_once",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = never_converging("silent-cancel");
    let cancel_after = Some(Duration::from_millis(500));
    // It never answers the layout.
    let (listen, _listener) = silent_destination("silent-cancel");
    let info = cancelled_migration(&source, end, &listen, json!({}), 1, cancel_after, CUT_SHORT);
    let error = info["error"].as_str().expect("an error");
    assert!(error.contains("a client cancelled it"), "{error}");
    assert_eq!(info["round"], 0, "still in setup: {info}");
    // It takes the layout, then reads nothing: the source's writes block.
    let (listen, _release) = stalled_destination("stalled-cancel");
    let info = cancelled_migration(
        &source,
        end,
        &listen,
        json!({}),
        50,
        cancel_after,
        CUT_SHORT,
    );
    assert_eq!(info["round"], 1, "in round 1: {info}");
}

#[test]
fn kvm_timeout_s_ends_a_migration_to_a_silent_destination() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_timeout_s_ends_a_migration_to_a_silent_destination",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = never_converging("silent-timeout");
    let (listen, _listener) = silent_destination("silent-timeout");
    let within = CUT_SHORT;
    let started = Instant::now();
    let info = cancelled_migration(
        &source,
        end,
        &listen,
        json!({"timeout_s": 2}),
        1,
        None,
        within,
    );
    assert!(started.elapsed() >= Duration::from_millis(1900), "{info}");
    let error = info["error"].as_str().expect("an error");
    assert!(
        error.contains("within 2s") && error.contains("answer to the memory layout"),
        "{error}"
    );
    // Even with `force`: there is nothing to force without the destination's answer.
    let body = json!({"timeout_s": 2, "on_timeout": "force"});
    cancelled_migration(&source, end, &listen, body, 60, None, within);
    // It takes the layout and then nothing: the round's writes end at the timeout.
    let (listen, _release) = stalled_destination("stalled-timeout");
    let info = cancelled_migration(
        &source,
        end,
        &listen,
        json!({"timeout_s": 2}),
        70,
        None,
        within,
    );
    let error = info["error"].as_str().expect("an error");
    assert!(
        error.contains("within 2s") && error.contains("round 1"),
        "{error}"
    );
}

#[test]
fn kvm_sigterm_ends_a_source_waiting_on_a_silent_destination_at_once() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_sigterm_ends_a_source_waiting_on_a_silent_destination_at_once",
    ) {
        return;
    }
    let _scratch = scratch();
    let (mut source, _) = never_converging("silent-sigterm");
    let (listen, _listener) = silent_destination("silent-sigterm");
    let (status, answer) = migrate(&source, &listen, json!({}));
    assert_eq!(status, 204, "{answer}");
    std::thread::sleep(Duration::from_millis(500));
    let signalled = Instant::now();
    source.signal(libc::SIGTERM);
    let output = source.wait(Duration::from_secs(180));
    let took = signalled.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(took < CUT_SHORT, "{took:?}: {stderr}");
}

/// Waits for a source whose VM migrated to exit 0.
fn migrated_away(mut source: Vmm) {
    let output = source.wait(Duration::from_secs(120));
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The fault message of an answer.
fn fault(answer: &Value) -> &str {
    answer["fault_message"].as_str().unwrap_or_default()
}

#[test]
fn kvm_an_unconfirmed_migration_refuses_whatever_would_run_or_change_the_guest() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_an_unconfirmed_migration_refuses_whatever_would_run_or_change_the_guest",
    ) {
        return;
    }
    let _scratch = scratch();
    let (source, end) = never_converging("held");
    let area = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    source.ok("PUT", "/hotplug/memory", Some(area.clone()));
    migrate_source_to_a_fake_destination(
        &source,
        "held",
        None,
        "unconfirmed",
        "it may be running the VM",
    );
    // The destination may run the VM: here nothing may run its guest or change what moved.
    let plug = json!({"requested_size_mib": 10});
    let refused = [
        ("PATCH", "/hotplug/memory", Some(plug.clone())),
        ("PUT", "/hotplug/memory", Some(area)),
        ("PUT", "/memory/regions", Some(json!({"size": MIB}))),
        (
            "PUT",
            "/memory/regions",
            Some(json!({"size": MIB, "guest_check": false})),
        ),
        ("DELETE", "/memory/regions/1", None),
        (
            "PATCH",
            "/memory/regions/1",
            Some(json!({"read_only": true})),
        ),
        ("PUT", "/guest/command", Some(guest("write", AREA, end, 9))),
    ];
    for (method, route, body) in refused {
        let (status, answer) = source.call(method, route, body);
        assert_eq!(status, 409, "{method} {route}: {answer}");
        assert!(
            fault(&answer).contains("unconfirmed") && fault(&answer).contains("PATCH /vm"),
            "{method} {route}: {answer}"
        );
    }
    let hotplug = source.ok("GET", "/hotplug/memory", None);
    assert_eq!(hotplug["plugged_size_mib"], 0, "{hotplug}");
    // Reads answer, and so does the way out: the loop goes on, then the plug is checked.
    source.ok("GET", "/memory", None);
    source.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    stop_and_verify(&source, AREA, end);
    source.ok("PATCH", "/hotplug/memory", Some(plug));
}

#[test]
fn kvm_a_plug_that_maps_slots_waits_for_the_guest_like_a_checked_add() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_plug_that_maps_slots_waits_for_the_guest_like_a_checked_add",
    ) {
        return;
    }
    let vmm = Vmm::serve("paused-plug", 4, 16, &[]);
    let area = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    vmm.ok("PUT", "/hotplug/memory", Some(area));
    vmm.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 4})),
    );
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let (status, added) = vmm.call("PUT", "/memory/regions", Some(json!({"size": MIB})));
    assert_eq!(status, 409, "an add the guest checks: {added}");
    let (status, answer) = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 20})),
    );
    assert_eq!(status, 409, "{answer}");
    assert!(
        fault(&answer).contains("paused") && fault(&answer).contains("Resumed"),
        "{answer}"
    );
    let hotplug = vmm.ok("GET", "/hotplug/memory", None);
    assert_eq!(hotplug["plugged_size_mib"], 4, "nothing changed: {hotplug}");
    // Within the piece already mapped, its slot grows over new memory: checked, so refused
    // too. An unplug: the guest checks nothing.
    let (status, answer) = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 8})),
    );
    assert_eq!(status, 409, "{answer}");
    assert!(
        fault(&answer).contains("plugging 8 MiB maps new memory"),
        "{answer}"
    );
    vmm.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 2})),
    );
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    // A vCPU in a write loop cannot check either: refused, where the VMM used to panic.
    let end = area_end(&vmm);
    vmm.ok(
        "PUT",
        "/guest/command",
        Some(guest("write_loop", AREA, end, 3)),
    );
    for (route, body) in [
        ("/hotplug/memory", json!({"requested_size_mib": 20})),
        ("/memory/regions", json!({"size": MIB})),
    ] {
        let method = if route == "/hotplug/memory" {
            "PATCH"
        } else {
            "PUT"
        };
        let (status, answer) = vmm.call(method, route, Some(body));
        assert_eq!(status, 409, "{answer}");
        assert!(
            fault(&answer).contains("vCPU 0 runs a WriteLoop command")
                && fault(&answer).contains("stop_loop"),
            "{answer}"
        );
    }
    stop_and_verify(&vmm, AREA, end);
    vmm.ok(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 20})),
    );
    let hotplug = vmm.ok("GET", "/hotplug/memory", None);
    assert_eq!(hotplug["plugged_size_mib"], 20, "{hotplug}");
}

/// Unplugs inside a hotplug piece a vCPU keeps writing into (each makes blocks unreachable
/// under the piece's one slot, which stays; a piece emptied goes): no write is lost, and none
/// meets absent memory.
#[test]
fn kvm_a_write_loop_goes_on_through_unplugs_inside_its_piece() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_write_loop_goes_on_through_unplugs_inside_its_piece",
    ) {
        return;
    }
    let vmm = Vmm::serve("reslot-loop", 4, 16, &[]);
    let area = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    vmm.ok("PUT", "/hotplug/memory", Some(area));
    let base = vmm.ok("GET", "/hotplug/memory", None)["guest_address"]
        .as_u64()
        .expect("the area's address");
    let size = |mib: u64| Some(json!({ "requested_size_mib": mib }));
    for round in 0..3 {
        vmm.ok("PATCH", "/hotplug/memory", size(16));
        vmm.ok(
            "PUT",
            "/guest/command",
            Some(guest("write_loop", base, base + 2 * MIB, 10 * round + 1)),
        );
        // Piece 1 shrinks, goes; then piece 0, under the loop, shrinks to its first block.
        for mib in [14, 12, 10, 8, 6, 4, 2] {
            vmm.ok("PATCH", "/hotplug/memory", size(mib));
        }
        let (passes, _) = support::stop_and_verify(vmm.api(), base, base + 2 * MIB);
        assert!(passes > 0, "round {round}: the loop ran");
        let memory = vmm.ok("GET", "/memory", None);
        let piece = memory["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .find(|r| r["guest_address"] == json!(base))
            .cloned()
            .expect("piece 0");
        assert_eq!(piece["slots"], json!(1), "{piece}");
    }
    let metrics = vmm.ok("GET", "/metrics", None);
    let metrics = metrics.as_str().expect("text");
    let absent = "tinyvmm_vcpu_exits_handled_total{how=\"absent_memory\"} 0";
    assert!(metrics.lines().any(|l| l == absent), "{metrics}");
}

/// The State record of a one-vCPU VM of [`one_region_layout`], as JSON to tamper with.
fn state_json() -> Value {
    use tinyvmm::test_guest::snapshot::{SnapshotState, TestGuestPart};
    use tinyvmm::vm::state::VcpuState;
    let vcpu = VcpuState {
        regs: kvm_bindings::kvm_regs {
            rip: 0x10000,
            rflags: 2,
            ..Default::default()
        },
        sregs: Default::default(),
        xsave: Default::default(),
        xcrs: Default::default(),
        events: Default::default(),
        // A saved vCPU has exactly these (the State record is checked as a state file is).
        msrs: tinyvmm::vm::state::SAVED_MSRS
            .iter()
            .map(|&i| (i, 0))
            .collect(),
        lapic: None,
        debugregs: None,
        mp_state: None,
        cpuid: Vec::new(),
    };
    let state = SnapshotState::new(
        one_region_layout(),
        vec![vcpu],
        None,
        true,
        TestGuestPart::default(),
    );
    serde_json::to_value(&state).expect("a state serialises")
}

/// A whole stream of `layout`: Hello, one round of nothing, the State record `state` (its
/// JSON framed as `version` of the format) and Done; every checksum valid.
fn stream_with_state(layout: &MemoryLayout, state: &Value, version: u32) -> Vec<u8> {
    let json = serde_json::to_vec(state).expect("JSON");
    stream_with_record(
        layout,
        &kvm_memslots_persist::frame(tinyvmm::snapshot::state::STATE_MAGIC, version, &json),
    )
}

/// As [`stream_with_state`], with the State record's bytes `record` as they are.
fn stream_with_record(layout: &MemoryLayout, record: &[u8]) -> Vec<u8> {
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(layout).expect("hello");
    writer.end_round().expect("a round");
    writer.state(record).expect("state");
    writer.done().expect("done");
    writer.get_ref().clone()
}

#[test]
fn kvm_a_stream_with_valid_checksums_but_inconsistent_contents_is_refused() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_stream_with_valid_checksums_but_inconsistent_contents_is_refused",
    ) {
        return;
    }
    use tinyvmm::snapshot::state::STATE_VERSION;
    let layout = one_region_layout();
    // As sent, the stream is taken: the VM runs (paused) on the destination. So is one from
    // an older source: the test guest's own State record (`TVMMIGR`, version 3: the state
    // under `snapshot`, beside `paused`).
    let mut older = state_json();
    let fields = older.as_object_mut().expect("an object");
    for envelope_only in ["kind", "vm", "guest"] {
        fields.remove(envelope_only);
    }
    let paused = fields.remove("paused").expect("paused");
    older["version"] = json!(3);
    older["hotplug"] = Value::Null;
    let older = json!({"snapshot": older, "paused": paused});
    let older =
        kvm_memslots_persist::frame(b"TVMMIGR\0", 3, &serde_json::to_vec(&older).expect("JSON"));
    for (name, sent) in [
        (
            "crafted-ok",
            stream_with_state(&layout, &state_json(), STATE_VERSION),
        ),
        ("crafted-older-ok", stream_with_record(&layout, &older)),
    ] {
        let (mut destination, listen) = Vmm::receive(name, &[]);
        let mut stream = UnixStream::connect(&listen).expect("connect");
        stream.write_all(&sent).expect("send");
        destination.wait_for_vm();
        assert_eq!(
            destination.ok("GET", "/vm", None)["state"],
            "Paused",
            "{name}"
        );
        destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
        destination.wait(Duration::from_secs(180));
    }

    // A register block 8 bytes short.
    let mut short = state_json();
    let regs = short["vcpus"][0]["regs"]
        .as_array_mut()
        .expect("the registers' bytes");
    let size = regs.len();
    regs.truncate(size - 8);
    let stderr = receive_bytes(
        "short-regs",
        &stream_with_state(&layout, &short, STATE_VERSION),
    );
    // Named with both sizes (the State record's checks catch it before the decoding does).
    assert!(
        stderr.contains("regs")
            && stderr.contains(&format!("{} bytes", size - 8))
            && stderr.contains(&size.to_string()),
        "{stderr}"
    );

    // A State record, or a layout, from a newer version of the format: both versions named.
    let newer = STATE_VERSION + 1;
    let stderr = receive_bytes(
        "newer-state",
        &stream_with_state(&layout, &state_json(), newer),
    );
    let expected =
        format!("State record): format version {newer}; this build reads version {STATE_VERSION}");
    assert!(stderr.contains(&expected), "{stderr}");
    let newer_layout = MemoryLayout {
        version: LAYOUT_VERSION + 1,
        ..one_region_layout()
    };
    let stderr = receive_bytes(
        "newer-layout",
        &stream_with_state(&newer_layout, &state_json(), STATE_VERSION),
    );
    let expected = format!(
        "format version {}; this build reads version {LAYOUT_VERSION}",
        LAYOUT_VERSION + 1
    );
    assert!(stderr.contains(&expected), "{stderr}");

    // Pages outside the layout, with a valid checksum.
    let mut outside = hello();
    let mut payload = (2 * MIB).to_le_bytes().to_vec();
    payload.resize(8 + 4096, 0x5a);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[2]);
    crc.update(&(payload.len() as u32).to_le_bytes());
    crc.update(&payload);
    outside.extend_from_slice(&[2, 0, 0, 0]);
    outside.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    outside.extend_from_slice(&crc.finalize().to_le_bytes());
    outside.extend_from_slice(&payload);
    let stderr = receive_bytes("outside", &outside);
    assert!(
        stderr.contains("not whole pages inside one region of the layout"),
        "{stderr}"
    );
}

/// Sends a local-mode Hello and one Handover of region 1 of a two-region layout (the system
/// region and 2 MiB of shared memory), with `fds` beside it, to a fresh `tinyvmm receive`;
/// returns its stderr once it refused.
fn hand_over(name: &str, fds: &[std::os::fd::RawFd]) -> String {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let layout = MemoryLayout {
        version: LAYOUT_VERSION,
        regions: vec![
            region_layout(0, 0, 2 * MIB, LayoutBacking::Anonymous, 0),
            region_layout(1, AREA, 2 * MIB, LayoutBacking::Shared, 2 * MIB),
        ],
    };
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello_handing_over(&layout).expect("hello");
    writer.handover(&[(1, 0)]).expect("handover");
    let bytes = writer.get_ref().clone();
    let hello_len = 12 + u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) as usize;
    let (destination, listen) = Vmm::receive(name, &[]);
    let stream = UnixStream::connect(&listen).expect("connect");
    (&stream).write_all(&bytes[..hello_len]).expect("send");
    stream
        .send_with_fds(&[&bytes[hello_len..]], fds)
        .expect("send with fds");
    refusal(destination)
}

#[test]
fn kvm_files_handed_over_that_cannot_hold_the_region_are_refused() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_files_handed_over_that_cannot_hold_the_region_are_refused",
    ) {
        return;
    }
    let scratch = scratch();
    use std::os::fd::AsRawFd;
    let (reader, _writer) = std::io::pipe().expect("a pipe");
    let stderr = hand_over("handed-fifo", &[reader.as_raw_fd()]);
    assert!(stderr.contains("is a FIFO, not a regular file"), "{stderr}");
    let devnull = std::fs::File::open("/dev/null").expect("/dev/null");
    let stderr = hand_over("handed-device", &[devnull.as_raw_fd()]);
    assert!(
        stderr.contains("is a device, not a regular file"),
        "{stderr}"
    );
    // A file shorter than the region: the guest's access past its end would be a SIGBUS.
    let dir = scratch.dir().join("handed");
    std::fs::create_dir_all(&dir).expect("a folder");
    let file = |name: &str, size: u64| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))
            .expect("a file");
        file.set_len(size).expect("its size");
        file
    };
    let small = file("small", 4096);
    let stderr = hand_over("handed-small", &[small.as_raw_fd()]);
    assert!(stderr.contains("holds 0x1000 bytes: too few"), "{stderr}");
    // One file more than the Handover names.
    let (a, b) = (file("a", 2 * MIB), file("b", 2 * MIB));
    let stderr = hand_over("handed-stray", &[a.as_raw_fd(), b.as_raw_fd()]);
    assert!(
        stderr.contains("1 file descriptors came beside the stream that no Handover record names"),
        "{stderr}"
    );
}

/// `tinyvmm receive` started under an open-file limit of `soft` (hard limit `hard`).
fn receive_under_nofile(name: &str, soft: u64, hard: u64) -> (Vmm, PathBuf) {
    let listen = path(name, "mig");
    let _ = std::fs::remove_file(&listen);
    let vmm = Vmm::command(name)
        .args(["receive", "--listen", &format!("unix:{}", listen.display())])
        .nofile(soft, hard)
        .listening();
    (vmm, listen)
}

#[test]
fn kvm_a_local_migration_of_more_memfd_regions_than_the_soft_open_file_limit() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_local_migration_of_more_memfd_regions_than_the_soft_open_file_limit",
    ) {
        return;
    }
    let _scratch = scratch();
    // 1,100 memfd regions: a local migration hands a file over for each.
    let source = Vmm::serve("nofile", 2, 2, &[]);
    for _ in 0..1100 {
        source.ok(
            "PUT",
            "/memory/regions",
            Some(json!({"size": 65536, "backing": "memfd", "guest_check": false})),
        );
    }
    let regions = |vmm: &Vmm| {
        vmm.ok("GET", "/memory", None)["regions"]
            .as_array()
            .expect("regions")
            .len()
    };
    let before = regions(&source);
    assert!(before > 1100, "{before}");

    // A hard limit of 1,024 too: no room for them, and the destination says which limit.
    let (mut destination, listen) = receive_under_nofile("nofile-hard", 1024, 1024);
    let (status, answer) = migrate(&source, &listen, json!({"local": true}));
    assert_eq!(status, 204, "{answer}");
    let info = watch(&source, |i| phase(i) == "failed");
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("RLIMIT_NOFILE") && stderr.contains("soft limit 1024"),
        "{stderr}"
    );
    assert!(
        info["error"]
            .as_str()
            .is_some_and(|e| e.contains("RLIMIT_NOFILE")),
        "{info}"
    );
    assert_eq!(source.ok("GET", "/vm", None)["state"], "Running");

    // A soft limit of 1,024 under a higher hard one: raised at start, and the VM moves.
    let (mut destination, listen) = receive_under_nofile("nofile-soft", 1024, 4096);
    let (status, answer) = migrate(&source, &listen, json!({"local": true}));
    assert_eq!(status, 204, "{answer}");
    migrated_away(source);
    destination.wait_for_vm();
    assert_eq!(regions(&destination), before);
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("open-file limit (RLIMIT_NOFILE) raised from 1024 to 4096"),
        "{stderr}"
    );
}

#[test]
fn kvm_sigterm_ends_a_destination_whose_source_sends_nothing_at_once() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_sigterm_ends_a_destination_whose_source_sends_nothing_at_once",
    ) {
        return;
    }
    let (mut destination, listen) = Vmm::receive("mute-source", &[]);
    let _mute = UnixStream::connect(&listen).expect("connect");
    std::thread::sleep(Duration::from_millis(300));
    let signalled = Instant::now();
    destination.signal(libc::SIGTERM);
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(signalled.elapsed() < CUT_SHORT, "{stderr}");
    assert!(
        stderr.contains("waiting for the source's next record: stopped by a signal"),
        "{stderr}"
    );
}

/// Flips a bit of guest memory at `AREA + 1 MiB` (a page the guest wrote), as a destination
/// whose memory went wrong after the last page landed would have it.
fn flip_a_bit(memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>) {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    let ram = memory.handle().memory();
    let at = GuestAddress(AREA + MIB);
    let word: u64 = ram.read_obj(at).expect("received memory");
    ram.write_obj(word ^ 1, at).expect("received memory");
}

/// Zeros the page at `AREA + 3 MiB` (one the guest wrote), as if it never arrived.
fn drop_a_page(memory: &kvm_memslots::MemoryManager<kvm_memslots::KvmVm>) {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    memory
        .handle()
        .memory()
        .write_slice(&[0; 4096], GuestAddress(AREA + 3 * MIB))
        .expect("received memory");
}

#[test]
fn kvm_a_destination_whose_memory_is_not_what_was_sent_refuses_and_the_source_runs_on() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_destination_whose_memory_is_not_what_was_sent_refuses_and_the_source_runs_on",
    ) {
        return;
    }
    let _scratch = scratch();
    use tinyvmm::jobs::receive::{receive_in_background, ReceiveConfig, ReceiveError};
    // A guest that wrote every page of its area (so that the page dropped below held data
    // whatever the loop's first pass reached) and keeps writing.
    let source = Vmm::serve("damaged-dst", 64, 64, &[]);
    let end = area_end(&source);
    let wrote = source.ok("PUT", "/guest/command", Some(guest("write", AREA, end, 2)));
    assert_eq!(wrote["result"], "ok");
    source.ok(
        "PUT",
        "/guest/command",
        Some(guest("write_loop", AREA, end, 1)),
    );
    for (name, damage) in [
        ("flipped", flip_a_bit as fn(&_)),
        ("dropped", drop_a_page as fn(&_)),
    ] {
        let listen = path(name, "dmg-mig");
        let _ = std::fs::remove_file(&listen);
        let config = ReceiveConfig {
            after_landing: Some(damage),
            ..ReceiveConfig::new(
                tinyvmm::migration::Endpoint::Unix(listen.clone()),
                path(name, "dmg-api"),
            )
        };
        let destination = receive_in_background(config).expect("receive listens");
        // A budget the first round fits: stop-and-copy comes at once.
        let (status, answer) = migrate(&source, &listen, json!({"downtime_ms": 600000}));
        assert_eq!(status, 204, "{answer}");
        let info = watch(&source, |i| {
            !matches!(phase(i), "setup" | "pre_copy" | "stop_and_copy")
        });
        let refused = match destination.join().expect("no panic") {
            Err(ReceiveError::Migration(reason)) => reason,
            other => panic!("{name}: the destination ran the VM: {other:?}"),
        };
        // The region the area starts: the first one that differs, named on both sides.
        let named =
            format!("the memory here is not what the source sent: the region at guest {AREA:#x}");
        assert!(refused.starts_with(&named), "{name}: {refused}");
        assert_eq!(phase(&info), "failed", "{name}: {info}");
        let error = info["error"].as_str().expect("an error");
        assert!(
            error.starts_with(&format!("the destination refused: {named}")),
            "{name}: {error}"
        );
        // As on any refusal after the whole VM went out, the VM went on here.
        assert_eq!(source.ok("GET", "/vm", None)["state"], "Running");
        let _ = std::fs::remove_file(&listen);
    }
    // The write loop went on through both, and every page holds its last pass.
    stop_and_verify(&source, AREA, end);
}

#[test]
fn kvm_a_stream_with_valid_checksums_but_a_wrong_page_is_refused_by_its_digest() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_stream_with_valid_checksums_but_a_wrong_page_is_refused_by_its_digest",
    ) {
        return;
    }
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{MemoryManager, RegionSpec};
    use tinyvmm::snapshot::state::{STATE_MAGIC, STATE_VERSION};
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};
    // The stream of a paused one-vCPU VM whose memory holds one page of data at 1 MiB.
    let layout = one_region_layout();
    let memory = MemoryManager::new(FakeKvm::new(8, true));
    memory
        .add_region(RegionSpec::new(GuestAddress(0), 2 * MIB).with_slot_size(2 * MIB))
        .expect("the fake takes it");
    memory
        .handle()
        .memory()
        .write_slice(&[0x5a; 4096], GuestAddress(MIB))
        .expect("memory");
    let json = serde_json::to_vec(&state_json()).expect("JSON");
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).expect("hello");
    writer.send_all(&memory).expect("round 1");
    writer.end_round().expect("a round");
    writer
        .state(&kvm_memslots_persist::frame(
            STATE_MAGIC,
            STATE_VERSION,
            &json,
        ))
        .expect("state");
    writer.done().expect("done");
    let stream = writer.get_ref().clone();

    // As sent, it is taken: the VM is there (paused) and holds the page.
    let (mut destination, listen) = Vmm::receive("wrong-page-ok", &[]);
    let mut connection = UnixStream::connect(&listen).expect("connect");
    connection.write_all(&stream).expect("send");
    destination.wait_for_vm();
    assert_eq!(destination.ok("GET", "/vm", None)["state"], "Paused");
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    let output = destination.wait(Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("its memory checked against the source's digest"),
        "{stderr}"
    );

    // The same with one byte of the page changed and the record's checksum made valid again:
    // every record reads as valid, only the memory that arrived is wrong.
    let mut wrong = stream.clone();
    let hello_len = 12 + u32::from_le_bytes(wrong[4..8].try_into().expect("4 bytes")) as usize;
    assert_eq!(wrong[hello_len], 2, "the Pages record follows the Hello");
    let len = u32::from_le_bytes(
        wrong[hello_len + 4..hello_len + 8]
            .try_into()
            .expect("4 bytes"),
    );
    let payload = hello_len + 12;
    wrong[payload + 8 + 100] ^= 0x01;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[2]);
    crc.update(&len.to_le_bytes());
    crc.update(&wrong[payload..payload + len as usize]);
    wrong[hello_len + 8..hello_len + 12].copy_from_slice(&crc.finalize().to_le_bytes());
    let stderr = receive_bytes("wrong-page", &wrong);
    assert!(
        stderr.contains(
            "the memory here is not what the source sent: the region at guest 0x0 (0x200000 \
             bytes) holds 1 pages of data here"
        ),
        "{stderr}"
    );
}

/// `tinyvmm client migrate` of `source`'s VM to the Unix socket `listen`.
fn client_migrate(source: &Vmm, listen: &std::path::Path) -> Command {
    let mut client = Command::new(env!("CARGO_BIN_EXE_tinyvmm"));
    client
        .args(["client", "migrate"])
        .arg(format!("unix:{}", listen.display()))
        .arg("--api-sock")
        .arg(source.api())
        .env_remove(tinyvmm::jobs::client::API_SOCK_ENV)
        .stdin(Stdio::null());
    client
}

/// `tinyvmm client migrate` waits for the migration's outcome: it exits 0 once the VM runs on
/// the destination, with the last status `completed` (the source, which ends once the
/// destination runs the VM, stays until the client that followed the migration has read it),
/// not with `done (204)` as the migration starts; the destination then serves the VM, with
/// what the guest wrote.
#[test]
fn kvm_the_client_command_waits_until_the_vm_runs_on_the_destination() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_client_command_waits_until_the_vm_runs_on_the_destination",
    ) {
        return;
    }
    let mut source = Vmm::serve("client-waits", 8, 64, &[]);
    let end = area_end(&source);
    let wrote = source.ok("PUT", "/guest/command", Some(guest("write", AREA, end, 5)));
    assert_eq!(wrote["result"], "ok", "{wrote}");
    let (mut destination, listen) = Vmm::receive("client-waits", &[]);
    let output = client_migrate(&source, &listen)
        .output()
        .expect("tinyvmm client runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert_ne!(
        stdout, "done (204)\n",
        "it returned as the migration started"
    );
    assert!(stdout.contains("completed"), "{stdout}{stderr}");
    // The source goes; the destination runs the VM and its memory.
    assert!(source.wait(Duration::from_secs(180)).status.success());
    destination.wait_for_vm();
    let verified = destination.ok("PUT", "/guest/command", Some(guest("verify", AREA, end, 5)));
    assert_eq!(verified["result"], "ok", "{verified}");
    destination.ok("PUT", "/actions", Some(json!({"action_type": "Stop"})));
    assert!(destination.wait(Duration::from_secs(180)).status.success());
}

/// A source VMM that ends during a migration the client follows (killed here, as a crash
/// would end it) leaves the outcome unknown: `tinyvmm client migrate` exits 1 and says so,
/// where a source that ends because its VM moved on waits for the client to read `completed`.
#[test]
fn kvm_the_client_command_fails_when_the_source_ends_under_way() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_client_command_fails_when_the_source_ends_under_way",
    ) {
        return;
    }
    let _scratch = scratch();
    let mut source = Vmm::serve("client-source-ends", 8, 64, &[]);
    // A destination that takes the connection and never answers: the migration stays in
    // its setup until the source ends.
    let listen = path("client-source-ends", "silent.mig");
    let _ = std::fs::remove_file(&listen);
    let _silent = std::os::unix::net::UnixListener::bind(&listen).expect("bind");
    let client = client_migrate(&source, &listen)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tinyvmm client runs");
    let deadline = Instant::now() + Duration::from_secs(180);
    while source.call("GET", "/migrate", None).0 != 200 {
        assert!(Instant::now() < deadline, "the migration never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    source.kill();
    let output = client.wait_with_output().expect("the client ends");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("ended during the migration"), "{stderr}");
    let _ = std::fs::remove_file(&listen);
}
