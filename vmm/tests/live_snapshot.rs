//! Live Full snapshots on /dev/kvm: the test guest keeps writing passes over every slot while
//! its memory is copied in rounds; the memory file must hold exactly the memory of the pause
//! (pages the loop wrote before it with the pass under way, pages after it with the pass
//! before), consistent with the vCPU's registers in the state file; the VM goes on running;
//! the snapshot restores and its loop goes on; the chain's next Diff follows from the point; a
//! client's harvests run beside it; a cancel leaves nothing; bad requests are refused by name.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod support;
use support::merge_chain;
use support::vmm::Vmm;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;
const PAGE: u64 = 4096;
/// The write loop's first pass's seed; the pass before it (a plain write) has `SEED - 1`.
const SEED: u64 = 1000;

/// This binary's scratch folder (every test holds it: [`scratch`]).
fn dir() -> PathBuf {
    let dir = support::scratch::folder("live");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// A hold on [`dir`], which its last holder removes: each test's first local.
fn scratch() -> support::scratch::Scratch {
    support::scratch::Scratch::hold("live")
}

fn file(name: &str) -> PathBuf {
    dir().join(name)
}

/// `tinyvmm serve` with `slots` slots over 256 MiB, and `extra` arguments.
fn serve(name: &str, slots: usize, extra: &[&str]) -> Vmm {
    Vmm::serve(name, slots, 256, extra)
}

/// `tinyvmm restore` of `state` and `mem`, resumed.
fn restore(name: &str, state: &Path, mem: &Path) -> Vmm {
    let vmm = Vmm::restore(name, state, mem, &[]);
    vmm.set_state("Resumed");
    vmm
}

/// Stops vCPU 0's write loop and checks `[AREA, end)` holds its last pass; the passes and the
/// last pass's seed.
fn stop_and_verify(vmm: &Vmm, end: u64) -> (u64, u64) {
    support::stop_and_verify(vmm.api(), AREA, end)
}

/// The end of the test area.
fn area_end(vmm: &Vmm) -> u64 {
    support::area_end(vmm.api(), AREA)
}

/// The dirty pages a harvest's answer reports.
fn dirty_pages(harvest: &Value) -> u64 {
    harvest["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .map(|r| r["dirty_pages"].as_u64().expect("dirty_pages"))
        .sum()
}

/// Polls `GET /snapshot` until its phase is no longer under way; returns that answer.
fn wait_for_snapshot(vmm: &Vmm, during: impl Fn(&Value)) -> Value {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let info = vmm.ok("GET", "/snapshot", None);
        let phase = info["phase"].as_str().expect("a phase").to_owned();
        if !["setup", "pre_copy", "stop_and_copy"].contains(&phase.as_str()) {
            return info;
        }
        during(&info);
        assert!(
            Instant::now() < deadline,
            "the snapshot never ended: {info}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A state file's JSON (the frame: magic 8, version 4, length 8, JSON, CRC-32 4).
fn state_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).expect("a state file");
    serde_json::from_slice(&bytes[20..bytes.len() - 4]).expect("the state's JSON")
}

/// The u64 general register at `index` (rax 0, rbx 1, rcx 2, ... r11 11) of a saved vCPU.
fn register(vcpu: &Value, index: usize) -> u64 {
    let bytes: Vec<u8> = vcpu["regs"]
        .as_array()
        .expect("regs")
        .iter()
        .map(|b| b.as_u64().expect("a byte") as u8)
        .collect();
    u64::from_le_bytes(bytes[index * 8..index * 8 + 8].try_into().expect("8 bytes"))
}

/// The seed of every page of `[AREA, end)` in the memory file `mem` of the state `state`, by
/// guest address (the guest writes `seed ^ address` into each page's first u64).
fn page_seeds(state: &Value, mem: &Path, end: u64) -> Vec<(u64, u64)> {
    let regions = state["layout"]["regions"].as_array().expect("regions");
    let file = File::open(mem).expect("the memory file");
    let mut seeds = Vec::new();
    let mut word = [0u8; 8];
    for region in regions {
        let (gpa, size, offset) = (
            region["gpa"].as_u64().expect("gpa"),
            region["size"].as_u64().expect("size"),
            region["file_offset"].as_u64().expect("file_offset"),
        );
        if gpa < AREA || gpa >= end {
            continue;
        }
        for page in (0..size).step_by(PAGE as usize) {
            file.read_exact_at(&mut word, offset + page)
                .expect("a page");
            seeds.push((gpa + page, u64::from_le_bytes(word) ^ (gpa + page)));
        }
    }
    seeds.sort_unstable();
    assert_eq!(
        seeds.len() as u64,
        (end - AREA) / PAGE,
        "every page is in the file"
    );
    seeds
}

/// Reads the seed of every page of `[AREA, end)` from the memory file `mem` of the state
/// `state`, and checks they are the memory of one point of the write loop: pages below one
/// boundary hold the pass under way (seed `s`), the rest the pass before (`s - 1`), and the
/// vCPU's registers (`r11` the pass's seed, `rcx` the next address) agree. Returns `s`.
fn check_point(state: &Value, mem: &Path, end: u64) -> u64 {
    let seeds = page_seeds(state, mem, end);
    let newest = seeds.iter().map(|(_, s)| *s).max().expect("pages");
    let boundary = seeds.iter().position(|(_, s)| *s != newest);
    if let Some(at) = boundary {
        let older = &seeds[at..];
        assert!(
            older.iter().all(|(_, s)| *s + 1 == newest),
            "the pages after {:#x} are not all of the pass before {newest}: {:?}",
            seeds[at].0,
            older.iter().find(|(_, s)| *s + 1 != newest)
        );
    }
    assert!(newest >= SEED - 1, "seed {newest}");
    let vcpu = &state["vcpus"][0];
    let (rcx, r11) = (register(vcpu, 2), register(vcpu, 11));
    match boundary {
        // Mid-pass: the vCPU writes pass `newest`, and its next address is the boundary
        // (or the page it just wrote, before it moved on).
        Some(at) => {
            assert_eq!(r11, newest, "the vCPU's pass against the memory's");
            let first_old = seeds[at].0;
            assert!(
                rcx == first_old || rcx + PAGE == first_old,
                "the vCPU is at {rcx:#x}, the memory's pass ends at {first_old:#x}"
            );
        }
        // Between passes: the vCPU's seed is the last pass's or the next one's.
        None => assert!(
            r11 == newest || r11 == newest + 1,
            "the vCPU's seed {r11} against the memory's {newest}"
        ),
    }
    newest
}

/// A guest writing passes over `slots` slots is snapshotted live (with `extra` serve
/// arguments and `create` fields); checks the point, that the VM went on, that a client's
/// harvests ran beside the snapshot, that the snapshot restores and runs on, and that the
/// chain's Diff follows from the point.
fn live_snapshot_of_a_writing_guest(name: &str, slots: usize, extra: &[&str], create: Value) {
    let vmm = serve(name, slots, extra);
    let end = area_end(&vmm);
    // A pass before the loop, so every page holds data whatever the rounds catch.
    assert_eq!(vmm.guest("write", AREA, end, SEED - 1)["result"], "ok");
    assert_eq!(
        vmm.guest("write_loop", AREA, end, SEED)["result"],
        "started"
    );
    // A client logs too: its harvests run beside the snapshot's rounds.
    vmm.ok("PATCH", "/dirty-log", Some(json!({"enabled": true})));
    let (state, mem) = (file(&format!("{name}.state")), file(&format!("{name}.mem")));
    let mut body = json!({
        "snapshot_type": "Full",
        "snapshot_path": state,
        "mem_file_path": mem,
        "live": true,
    });
    for (k, v) in create.as_object().expect("an object") {
        body[k] = v.clone();
    }
    vmm.ok("PUT", "/snapshot/create", Some(body.clone()));
    let client_pages = std::cell::Cell::new(0u64);
    let refusals = std::cell::Cell::new(0u32);
    let info = wait_for_snapshot(&vmm, |_| {
        let harvest = vmm.ok("POST", "/dirty-log/harvest", None);
        client_pages.set(client_pages.get() + dirty_pages(&harvest));
        // What would change what is copied waits for the end.
        let (status, refused) = vmm.call("PATCH", "/vm", Some(json!({"state": "Paused"})));
        if status != 204 {
            assert_eq!(status, 409, "{refused}");
            let message = refused["fault_message"].as_str().expect("a message");
            assert!(
                message.contains("a live snapshot is under way"),
                "{message}"
            );
            refusals.set(refusals.get() + 1);
        } else {
            // The snapshot ended between the two requests.
            vmm.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
        }
    });
    assert_eq!(info["phase"], "completed", "{info}");
    let pause = info["pause_ms"].as_f64().expect("a pause");
    let id = info["snapshot_id"].as_str().expect("an id").to_owned();
    assert!(
        info["bytes_written"].as_u64().expect("bytes") >= end - AREA,
        "{info}"
    );
    let metrics = vmm.ok("GET", "/metrics", None);
    let metrics = metrics.as_str().expect("text");
    assert!(
        metrics
            .lines()
            .any(|l| l == "tinyvmm_live_snapshot_phase{state=\"completed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tinyvmm_live_snapshot_pause_seconds ")),
        "{metrics}"
    );
    eprintln!(
        "{name}: live snapshot in {} rounds, paused {pause:.1} ms, {} refusals and {} client \
         pages meanwhile",
        info["round"],
        refusals.get(),
        client_pages.get()
    );
    // The client's reader kept its pages: the loop dirties the area all along.
    let harvest = vmm.ok("POST", "/dirty-log/harvest", None);
    assert!(client_pages.get() + dirty_pages(&harvest) > 0, "{harvest}");

    let saved = state_json(&state);
    assert_eq!(saved["snapshot"]["id"], json!(id));
    let point = check_point(&saved, &mem, end);

    // A live Diff of the guest still writing: merged onto the Full, it is one point too.
    let (live_state, live_mem) = (
        file(&format!("{name}-live-diff.state")),
        file(&format!("{name}-live-diff.mem")),
    );
    body["snapshot_type"] = json!("Diff");
    body["snapshot_path"] = json!(live_state);
    body["mem_file_path"] = json!(live_mem);
    vmm.ok("PUT", "/snapshot/create", Some(body));
    let info = wait_for_snapshot(&vmm, |_| {});
    assert_eq!(info["phase"], "completed", "{info}");
    let live_diff = state_json(&live_state);
    assert_eq!(live_diff["snapshot"]["parent"], json!(id));
    assert_eq!(live_diff["snapshot"]["kind"], json!("Diff"), "{live_diff}");
    let live_id = live_diff["snapshot"]["id"].clone();
    let live_merged = file(&format!("{name}-live-merged.mem"));
    merge_chain(&live_merged, &[&state, &mem, &live_state, &live_mem]);
    let diff_point = check_point(&live_diff, &live_merged, end);
    assert!(
        diff_point >= point,
        "the Diff's pass {diff_point}, the Full's {point}"
    );
    eprintln!(
        "{name}: live Diff in {} rounds, paused {:.1} ms",
        info["round"],
        info["pause_ms"].as_f64().unwrap_or(f64::NAN)
    );

    // The VM went on: the loop has passed the points' passes, and the area holds its last one.
    let (_, last) = stop_and_verify(&vmm, end);
    assert!(
        last >= diff_point,
        "last pass {last}, the Diff's {diff_point}"
    );

    // The chain's next Diff follows the live one and carries what the guest wrote after its
    // point: the merged chain is memory as it is now.
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let (diff_state, diff_mem) = (
        file(&format!("{name}-diff.state")),
        file(&format!("{name}-diff.mem")),
    );
    vmm.ok(
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_type": "Diff", "snapshot_path": diff_state, "mem_file_path": diff_mem})),
    );
    assert_eq!(state_json(&diff_state)["snapshot"]["parent"], live_id);
    let output = vmm.stop();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let merged = file(&format!("{name}-merged.mem"));
    merge_chain(
        &merged,
        &[&state, &mem, &live_state, &live_mem, &diff_state, &diff_mem],
    );

    // The live snapshot restores, and its loop goes on from the point.
    let restored = restore(&format!("{name}-restored"), &state, &mem);
    let (passes, _) = stop_and_verify(&restored, end);
    assert!(passes > 0, "the restored loop ran");
    drop(restored);
    // The merged chain is the memory the source stopped with.
    let merged_vm = restore(&format!("{name}-merged"), &diff_state, &merged);
    let verified = merged_vm.guest("verify", AREA, end, last);
    assert_eq!(verified["result"], "ok", "{verified}");
    for path in [
        &state,
        &mem,
        &live_state,
        &live_mem,
        &live_merged,
        &diff_state,
        &diff_mem,
        &merged,
    ] {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn kvm_a_writing_guest_snapshots_live_with_bitmap_harvests() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_writing_guest_snapshots_live_with_bitmap_harvests",
    ) {
        return;
    }
    let _scratch = scratch();
    live_snapshot_of_a_writing_guest("bitmap", 4096, &[], json!({}));
}

#[test]
fn kvm_a_writing_guest_snapshots_live_with_ring_harvests() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_writing_guest_snapshots_live_with_ring_harvests",
    ) {
        return;
    }
    let _scratch = scratch();
    live_snapshot_of_a_writing_guest("ring", 4096, &["--dirty-ring", "4096"], json!({}));
}

#[test]
fn kvm_a_writing_guest_snapshots_live_at_kvms_slot_count() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_writing_guest_snapshots_live_at_kvms_slot_count",
    ) {
        return;
    }
    let _scratch = scratch();
    // The system region takes one slot; the area every other. Collecting and resetting a
    // pass's 65536 ring entries takes this host's KVM longer than a short pause: this test is
    // about every slot holding the point, so the budget fits it.
    let max = kvm_ioctls::Kvm::new().expect("/dev/kvm").get_nr_memslots();
    live_snapshot_of_a_writing_guest(
        "max",
        max - 1,
        &["--dirty-ring", "65536"],
        json!({"downtime_ms": 5000}),
    );
}

/// A live Diff writes what the chain's reader logged before it began (round 1), not only
/// what the guest dirties during its rounds; and a live Diff that is cancelled leaves its base,
/// and the next Diff carries every page it had taken.
#[test]
fn kvm_a_live_diff_carries_what_it_took_whether_it_ends_or_not() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_live_diff_carries_what_it_took_whether_it_ends_or_not",
    ) {
        return;
    }
    let _scratch = scratch();
    let name = "live-diff";
    let vmm = serve(name, 64, &[]);
    let end = area_end(&vmm);
    let mid = AREA + (end - AREA) / 2 / PAGE * PAGE;
    let snap = |tag: &str| {
        (
            file(&format!("{name}-{tag}.state")),
            file(&format!("{name}-{tag}.mem")),
        )
    };
    let create = |kind: &str, (state, mem): &(PathBuf, PathBuf), extra: Value| {
        let mut body = json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        vmm.ok("PUT", "/snapshot/create", Some(body));
    };
    assert_eq!(vmm.guest("write", AREA, end, 1)["result"], "ok");
    let full = snap("full");
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    create("Full", &full, json!({}));
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));

    // Written before the live Diff starts, by a guest idle during it: only round 1 has it.
    assert_eq!(vmm.guest("write", AREA, mid, 7)["result"], "ok");
    let first = snap("first");
    create("Diff", &first, json!({"live": true}));
    let info = wait_for_snapshot(&vmm, |_| {});
    assert_eq!(info["phase"], "completed", "{info}");
    let merged = file(&format!("{name}-merged-1.mem"));
    merge_chain(&merged, &[&full.0, &full.1, &first.0, &first.1]);
    let seeds = page_seeds(&state_json(&first.0), &merged, end);
    let wrong = seeds
        .iter()
        .find(|&&(gpa, seed)| seed != if gpa < mid { 7 } else { 1 });
    assert_eq!(wrong, None, "the Full and the live Diff merged");

    // Written before a live Diff that is then cancelled (its pause budget fits nothing and
    // its timeout cancels), while a loop writes the other half.
    assert_eq!(vmm.guest("write", mid, end, 8)["result"], "ok");
    assert_eq!(vmm.guest("write_loop", AREA, mid, 100)["result"], "started");
    let cancelled = snap("cancelled");
    create(
        "Diff",
        &cancelled,
        json!({"live": true, "downtime_ms": 0, "timeout_s": 1, "on_timeout": "cancel"}),
    );
    let info = wait_for_snapshot(&vmm, |_| {});
    assert_eq!(info["phase"], "cancelled", "{info}");
    assert!(
        !cancelled.0.exists() && !cancelled.1.exists(),
        "no file is left"
    );
    let (_, last) = support::stop_and_verify(vmm.api(), AREA, mid);
    // The next Diff follows the first and has what the cancelled one took.
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let next = snap("next");
    create("Diff", &next, json!({}));
    let next_state = state_json(&next.0);
    assert_eq!(
        next_state["snapshot"]["parent"],
        state_json(&first.0)["snapshot"]["id"]
    );
    let merged = file(&format!("{name}-merged-2.mem"));
    merge_chain(
        &merged,
        &[&full.0, &full.1, &first.0, &first.1, &next.0, &next.1],
    );
    let seeds = page_seeds(&next_state, &merged, end);
    let wrong = seeds
        .iter()
        .find(|&&(gpa, seed)| seed != if gpa < mid { last } else { 8 });
    assert_eq!(wrong, None, "the chain merged, the loop's last pass {last}");
    let output = vmm.stop();
    assert_eq!(output.status.code(), Some(0));
    // Some 1.2 GB of files: a passing run leaves none (a failing one leaves them to look at).
    for path in [&full.0, &full.1, &first.0, &first.1, &next.0, &next.1] {
        let _ = std::fs::remove_file(path);
    }
    for merged in ["merged-1", "merged-2"] {
        let _ = std::fs::remove_file(file(&format!("{name}-{merged}.mem")));
    }
}

#[test]
fn kvm_a_cancelled_live_snapshot_leaves_nothing_and_bad_requests_are_refused() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_cancelled_live_snapshot_leaves_nothing_and_bad_requests_are_refused",
    ) {
        return;
    }
    let _scratch = scratch();
    let vmm = serve("cancel", 512, &[]);
    let end = area_end(&vmm);
    assert_eq!(vmm.guest("write", AREA, end, SEED - 1)["result"], "ok");
    let (status, body) = vmm.call("GET", "/snapshot", None);
    assert_eq!(status, 404, "{body}");
    let (state, mem) = (file("cancel.state"), file("cancel.mem"));
    let create = |extra: Value| {
        let mut body =
            json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        vmm.call("PUT", "/snapshot/create", Some(body))
    };
    let refused = |extra: Value, names: &str| {
        let (status, body) = create(extra);
        assert_eq!(status, 400, "{body}");
        let message = body["fault_message"].as_str().expect("a message");
        assert!(message.contains(names), "{message}");
        assert!(!state.exists() && !mem.exists(), "{names}: no file is left");
    };
    refused(
        json!({"downtime_ms": 5}),
        "downtime_ms applies to live snapshots only",
    );
    refused(
        json!({"live": true, "snapshot_type": "Diff"}),
        "no snapshot to diff against: take a Full snapshot first",
    );
    refused(
        json!({"live": true, "timeout_s": 0}),
        "timeout_s must be at least 1",
    );
    refused(json!({}), "take a live snapshot");
    refused(
        json!({"live": true, "on_timeout": "later"}),
        "unknown variant `later`",
    );

    // A budget nothing fits keeps the rounds going until the cancel. Nothing logs before it;
    // the chain logs every region while it runs.
    let logging = |vmm: &Vmm| vmm.ok("GET", "/dirty-log", None)["logging_for"].clone();
    assert_eq!(logging(&vmm), json!({}));
    assert_eq!(
        vmm.guest("write_loop", AREA, end, SEED)["result"],
        "started"
    );
    let (status, body) =
        create(json!({"live": true, "downtime_ms": 0, "timeout_s": 600, "on_timeout": "cancel"}));
    assert_eq!(status, 204, "{body}");
    assert!(
        logging(&vmm)["snapshot_chain"].is_array(),
        "{}",
        logging(&vmm)
    );
    let (status, body) = create(json!({"live": true}));
    assert_eq!(status, 409, "a second snapshot waits: {body}");
    // So does a migration, and any change to the memory map.
    let (status, body) = vmm.call(
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", file("nobody.sock").display())})),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body["fault_message"]
            .as_str()
            .expect("a message")
            .contains("a live snapshot is under way"),
        "{body}"
    );
    let (status, body) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 2 * MIB, "guest_address": 8u64 << 30})),
    );
    assert_eq!(status, 409, "{body}");
    let (status, body) = vmm.call(
        "PUT",
        "/guest/command",
        Some(json!({"op": "stop_loop", "vcpu": 0})),
    );
    assert_eq!(status, 409, "{body}");
    vmm.ok("PUT", "/snapshot/cancel", None);
    let info = wait_for_snapshot(&vmm, |_| {});
    assert_eq!(info["phase"], "cancelled", "{info}");
    assert!(
        info["error"]
            .as_str()
            .expect("why")
            .contains("a client cancelled it"),
        "{info}"
    );
    assert!(
        !state.exists() && !mem.exists(),
        "a cancelled snapshot leaves no file"
    );
    // Nor any logging: KVM's slots log no more than before it.
    assert_eq!(logging(&vmm), json!({}));
    let (status, body) = vmm.call("PUT", "/snapshot/cancel", None);
    assert_eq!(status, 409, "{body}");
    // No base: a Diff is refused until a Full is written.
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
    let (status, body) = vmm.call(
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_type": "Diff", "snapshot_path": state, "mem_file_path": mem})),
    );
    assert_eq!(status, 400, "{body}");
    vmm.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
    // The VM went on, and a live snapshot of it now completes.
    let (status, body) = create(json!({"live": true, "downtime_ms": 50}));
    assert_eq!(status, 204, "{body}");
    let info = wait_for_snapshot(&vmm, |_| {});
    assert_eq!(info["phase"], "completed", "{info}");
    check_point(&state_json(&state), &mem, end);
    stop_and_verify(&vmm, end);
    let output = vmm.stop();
    assert_eq!(output.status.code(), Some(0));
    for path in [&state, &mem] {
        let _ = std::fs::remove_file(path);
    }

    // SIGTERM in the middle of one: the VMM ends within its usual time, leaving no file.
    let mut vmm = serve("sigterm", 512, &[]);
    let end = area_end(&vmm);
    assert_eq!(vmm.guest("write", AREA, end, SEED - 1)["result"], "ok");
    assert_eq!(
        vmm.guest("write_loop", AREA, end, SEED)["result"],
        "started"
    );
    let body = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem,
                      "live": true, "downtime_ms": 0, "timeout_s": 600});
    vmm.ok("PUT", "/snapshot/create", Some(body));
    let deadline = Instant::now() + Duration::from_secs(60);
    while vmm.ok("GET", "/snapshot", None)["phase"] != "pre_copy" {
        assert!(Instant::now() < deadline, "the rounds never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    vmm.signal(libc::SIGTERM);
    // Well before the 600 s timeout the live snapshot would otherwise run to.
    let output = vmm.wait(Duration::from_secs(300));
    assert!(
        output.status.code().is_some(),
        "it exits, not killed: {:?}",
        output.status
    );
    assert!(
        !state.exists() && !mem.exists(),
        "a live snapshot cut short by a signal leaves no file"
    );
}
