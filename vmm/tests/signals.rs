//! The `tinyvmm` binary as a user runs it: its exit status on SIGTERM, a long API request
//! stopped by one, long guest commands (reads answered meanwhile; cancel, a pause, Stop and
//! SIGTERM cutting them short), a guest that dies (`Failed`, exit status 4), snapshot files
//! handed from one process to another.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use tinyvmm::api::client::Client;

mod support;
use support::vmm::Vmm;

/// How long a VMM asked to exit may take: a guard against a hang only.
const EXIT_LIMIT: Duration = Duration::from_secs(120);

fn start_serve(name: &str) -> (Vmm, std::path::PathBuf) {
    start(name, &["serve", "--mem-mib", "0"])
}

/// Runs `tinyvmm ARGS --api-sock SOCKET` and waits until it serves.
fn start(name: &str, args: &[&str]) -> (Vmm, std::path::PathBuf) {
    let vmm = Vmm::command(name).args(args).serving();
    let socket = vmm.api().to_owned();
    (vmm, socket)
}

/// The process's virtual memory size in KiB: each region it maps adds its size.
fn mapped_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

#[test]
fn kvm_serve_exits_130_on_sigterm() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_serve_exits_130_on_sigterm") {
        return;
    }
    let (mut vmm, socket) = start_serve("sigterm");
    vmm.signal(libc::SIGTERM);
    let output = vmm.wait(EXIT_LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by a signal"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
}

/// A SIGTERM that comes while `serve` still starts (its socket is there, for a client to find,
/// before its memory and vCPUs are) ends it as one that comes later does: exit status 130,
/// "stopped by a signal", the socket removed. Never the signal's default action (no exit
/// status), nor a failure (1). Several rounds, each signalled as soon as the socket's file
/// appears, and a start made long by many slots over much memory, so that the signal lands
/// at different points of the start-up.
#[test]
fn kvm_serve_exits_130_on_a_sigterm_during_start_up() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_serve_exits_130_on_a_sigterm_during_start_up") {
        return;
    }
    for round in 0..4 {
        let mut vmm = Vmm::command(&format!("sigterm-start-{round}"))
            .args([
                "serve",
                "--slots",
                "16384",
                "--mem-mib",
                "16384",
                "--vcpus",
                "15",
            ])
            .spawn();
        let socket = vmm.api().to_owned();
        vmm.wait_for_socket_file();
        vmm.signal(libc::SIGTERM);
        let output = vmm.wait(EXIT_LIMIT);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(130), "round {round}: {stderr}");
        assert!(
            stderr.contains("stopped by a signal"),
            "round {round}: {stderr}"
        );
        assert!(!socket.exists(), "round {round}: the socket is removed");
    }
}

/// A JSON value (the API's bodies).
type Json = serde_json::Value;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;
/// The long command's range: 4 GiB of initial memory, one u64 a page (each page's first touch
/// is what takes the time: seconds in all).
const LONG: u64 = 4096 * MIB;
const PAGE: u64 = 4096;

/// `tinyvmm serve` with `mem_mib` MiB of initial memory, killed if the test fails first.
fn serve_mib(name: &str, mem_mib: u64) -> (Vmm, std::path::PathBuf) {
    start(name, &["serve", "--mem-mib", &mem_mib.to_string()])
}

/// One request on a connection of its own.
fn ask(socket: &Path, method: &str, path: &str, body: Json) -> (u16, Json) {
    let body = (!body.is_null()).then_some(body);
    Client::connect(socket)
        .expect("connect")
        .call(method, path, body.as_ref())
        .expect("an answer")
}

/// Sends `PUT /guest/command` with `body` on a connection of its own, without waiting for the
/// answer.
fn start_command(socket: &Path, body: &Json) -> Client {
    let mut client = Client::connect(socket).expect("connect");
    let body = body.to_string();
    let request = format!(
        "PUT /guest/command HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    client.send(request.as_bytes()).expect("send");
    client
}

/// Waits for the VMM to exit (it was asked to) and checks its status; returns its stderr.
fn exits_with(mut vmm: Vmm, socket: &Path, status: i32) -> String {
    let output = vmm.wait(EXIT_LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(status), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
    stderr
}

fn stop(socket: &Path) {
    let stop = ask(socket, "PUT", "/actions", json!({"action_type": "Stop"}));
    assert_eq!(stop.0, 204, "{stop:?}");
}

fn write(start: u64, end: u64, seed: u64) -> Json {
    json!({"op": "write", "start": start, "end": end, "stride": PAGE, "seed": seed})
}

fn verify(start: u64, end: u64, seed: u64) -> Json {
    json!({"op": "verify", "start": start, "end": end, "stride": PAGE, "seed": seed})
}

/// Checks that `answer` is a write of `[AREA, AREA + LONG)` with `seed` cut short, and that
/// the guest wrote every page below where it says it stopped and not the one there.
fn cut_short(socket: &Path, answer: &(u16, Json), seed: u64) {
    let (status, body) = answer;
    assert_eq!(*status, 200, "{body}");
    assert_eq!(body["result"], "cancelled", "{body}");
    let address = body["address"].as_u64().expect("an address");
    let done = body["done_bytes"].as_u64().expect("done_bytes");
    assert_eq!(address, AREA + done, "{body}");
    assert!(done < LONG && done.is_multiple_of(PAGE), "{body}");
    if done > 0 {
        let below = ask(socket, "PUT", "/guest/command", verify(AREA, address, seed));
        assert_eq!(below.1["result"], "ok", "{below:?}");
    }
    let there = verify(address, address + PAGE, seed);
    let there = ask(socket, "PUT", "/guest/command", there);
    assert_eq!(there.1["result"], "mismatch", "{there:?}");
}

#[test]
fn kvm_reads_are_answered_during_a_long_write_and_cancel_cuts_it_short() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_reads_are_answered_during_a_long_write_and_cancel_cuts_it_short",
    ) {
        return;
    }
    let (vmm, socket) = serve_mib("reads", LONG / MIB);
    let mut writer = start_command(&socket, &write(AREA, AREA + LONG, 7));
    // A request behind the write on its connection is answered after it.
    writer
        .send(b"GET /vm HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        .expect("send");
    // The write came first (its bytes were there before the next client connected): every
    // read is answered while it runs.
    let (status, state) = ask(&socket, "GET", "/vm", Json::Null);
    assert_eq!(
        (status, &state["state"]),
        (200, &json!("Running")),
        "{state}"
    );
    assert_eq!(ask(&socket, "GET", "/memory", Json::Null).0, 200);
    assert_eq!(ask(&socket, "GET", "/dirty-log", Json::Null).0, 200);
    assert_eq!(ask(&socket, "GET", "/migrate", Json::Null).0, 404, "none");
    assert!(
        !writer.answer_waiting().expect("poll"),
        "the write answered before the reads"
    );
    // What needs the vCPU waits its turn, and says why.
    let busy = ask(
        &socket,
        "PUT",
        "/guest/command",
        write(AREA, AREA + PAGE, 1),
    );
    assert_eq!(busy.0, 409, "{busy:?}");
    let region = json!({"size": 2 * MIB, "guest_address": 8192 * MIB});
    let check = ask(&socket, "PUT", "/memory/regions", region);
    assert_eq!(check.0, 409, "{check:?}");
    assert!(
        check.1["fault_message"]
            .as_str()
            .is_some_and(|m| m.contains("op cancel")),
        "{check:?}"
    );

    let cancel = ask(&socket, "PUT", "/guest/command", json!({"op": "cancel"}));
    let answer = writer.read_response().expect("the write's answer");
    assert_eq!(cancel, answer, "cancel answers what the command answers");
    let behind = writer.read_response().expect("the next answer");
    assert_eq!(behind.1["state"], "Running", "{behind:?}");
    cut_short(&socket, &answer, 7);
    let nothing = ask(&socket, "PUT", "/guest/command", json!({"op": "cancel"}));
    assert_eq!(nothing.0, 409, "{nothing:?}");
    stop(&socket);
    exits_with(vmm, &socket, 0);
}

#[test]
fn kvm_a_pause_and_a_stop_cut_a_long_write_short() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_pause_and_a_stop_cut_a_long_write_short") {
        return;
    }
    let (vmm, socket) = serve_mib("pause-stop", LONG / MIB);
    let mut writer = start_command(&socket, &write(AREA, AREA + LONG, 8));
    let paused = ask(&socket, "PATCH", "/vm", json!({"state": "Paused"}));
    assert_eq!(paused.0, 204, "{paused:?}");
    // The pause answers once the command has ended: its answer is there.
    assert!(writer.answer_waiting().expect("poll"));
    let answer = writer.read_response().expect("the write's answer");
    assert_eq!(ask(&socket, "GET", "/vm", Json::Null).1["state"], "Paused");
    let resumed = ask(&socket, "PATCH", "/vm", json!({"state": "Resumed"}));
    assert_eq!(resumed.0, 204);
    cut_short(&socket, &answer, 8);

    let mut writer = start_command(&socket, &write(AREA, AREA + LONG, 9));
    assert_eq!(ask(&socket, "GET", "/vm", Json::Null).0, 200);
    stop(&socket);
    let answer = writer.read_response().expect("the write's answer");
    assert_eq!(answer.1["result"], "cancelled", "{answer:?}");
    assert!(answer.1["done_bytes"].as_u64() < Some(LONG), "{answer:?}");
    exits_with(vmm, &socket, 0);
}

#[test]
fn kvm_sigterm_cuts_a_long_write_short_and_exits_130() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_sigterm_cuts_a_long_write_short_and_exits_130")
    {
        return;
    }
    let (vmm, socket) = serve_mib("sigterm-write", LONG / MIB);
    let mut writer = start_command(&socket, &write(AREA, AREA + LONG, 10));
    assert_eq!(ask(&socket, "GET", "/vm", Json::Null).0, 200);
    vmm.signal(libc::SIGTERM);
    let answer = writer.read_response().expect("the write's answer");
    assert_eq!(answer.1["result"], "cancelled", "{answer:?}");
    exits_with(vmm, &socket, 130);
}

#[test]
fn kvm_a_dead_guest_is_failed_refuses_commands_and_exits_4() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_dead_guest_is_failed_refuses_commands_and_exits_4",
    ) {
        return;
    }
    // The guest dies of its memory going under it: a file-backed restore whose memory file
    // is cut while the guest writes (removing, moving or unplugging memory under a guest
    // command is refused, so no client can do this to a guest).
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-dead", std::process::id()));
    let (vmm, socket, mem) = restored_from_a_file(&dir, "dead");
    let write_loop =
        json!({"op": "write_loop", "start": AREA, "end": AREA + 8 * MIB, "stride": PAGE});
    let started = ask(&socket, "PUT", "/guest/command", write_loop);
    assert_eq!(started.1["result"], "started", "{started:?}");
    cut_to_nothing(&mem);
    let deadline = Instant::now() + Duration::from_secs(60);
    let state = loop {
        let (status, state) = ask(&socket, "GET", "/vm", Json::Null);
        assert_eq!(status, 200);
        if state["state"] == "Failed" {
            break state;
        }
        assert_eq!(state["state"], "Running", "{state}");
        assert!(Instant::now() < deadline, "the guest never failed: {state}");
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = std::fs::remove_dir_all(&dir);
    let failure = &state["failure"];
    assert_eq!(failure["vcpu"], 0, "{state}");
    // However KVM reports the guest's access to a page its file lost (a triple fault on
    // kvm_pvm, KVM_RUN's EFAULT elsewhere), the failure names the file and where the guest
    // memory it took is (it used to say only "triple fault" or "Bad address").
    assert_eq!(failure["reason"], "error", "{state}");
    let message = failure["message"].as_str().expect("a message");
    assert!(
        message.contains("is gone")
            && message.contains(&mem.display().to_string())
            && message.contains("guest address 0x"),
        "{message}"
    );
    // What needs a running guest is refused, naming the failure; reads go on.
    for (method, path, body) in [
        ("PUT", "/guest/command", write(AREA, AREA + PAGE, 1)),
        ("PUT", "/guest/command", json!({"op": "stop_loop"})),
        ("PUT", "/guest/command", json!({"op": "cancel"})),
        ("PATCH", "/vm", json!({"state": "Paused"})),
        ("PATCH", "/vm", json!({"state": "Resumed"})),
    ] {
        let (status, refusal) = ask(&socket, method, path, body.clone());
        assert_eq!(status, 409, "{method} {path} {body}: {refusal}");
        let fault = refusal["fault_message"].as_str().unwrap_or_default();
        assert!(
            fault.contains("the guest failed") && fault.contains(message),
            "{fault}"
        );
    }
    assert_eq!(ask(&socket, "GET", "/memory", Json::Null).0, 200);
    let again = ask(&socket, "GET", "/vm", Json::Null).1;
    assert_eq!(again, state, "the failure stays");
    stop(&socket);
    let stderr = exits_with(vmm, &socket, 4);
    let said = stderr
        .lines()
        .filter(|l| l.contains("the guest failed"))
        .count();
    assert_eq!(said, 1, "said once, when it happened: {stderr}");
}

#[test]
fn kvm_a_signal_stops_a_long_plug_at_a_slot_boundary() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_signal_stops_a_long_plug_at_a_slot_boundary")
    {
        return;
    }
    let (mut vmm, socket) = start_serve("sigterm-plug");
    let pid = vmm.pid();
    let mut client = Client::connect(&socket).expect("connect");
    let area = json!({"total_size_mib": 32768, "block_size_mib": 2});
    assert_eq!(
        client
            .call("PUT", "/hotplug/memory", Some(&area))
            .expect("configure")
            .0,
        204
    );
    let before = mapped_kib(pid);
    let plug = std::thread::spawn(move || {
        client
            .call(
                "PATCH",
                "/hotplug/memory",
                Some(&json!({"requested_size_mib": 32768})),
            )
            .expect("an answer before the VMM exits")
    });
    // Once the plug is under way (8 slots of 2 MiB mapped), ask the VMM to stop.
    let deadline = Instant::now() + Duration::from_secs(120);
    while mapped_kib(pid) < before + 8 * 2048 {
        assert!(Instant::now() < deadline, "the plug never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    vmm.signal(libc::SIGTERM);
    let (status, body) = plug.join().expect("client thread");
    let output = vmm.wait(EXIT_LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(status, 503, "{body}");
    let message = body["fault_message"].as_str().unwrap_or_default();
    assert!(
        message.contains("the request stopped after") && message.contains("of 16384 slots"),
        "{message}"
    );
    assert_eq!(output.status.code(), Some(130), "{stderr}");
}

#[test]
fn snapshot_merge_names_a_bad_state_file_and_changes_nothing() {
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-merge", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let (state, base, diff) = (dir.join("state"), dir.join("base"), dir.join("diff"));
    std::fs::write(&state, b"not a snapshot at all, but long enough").expect("write");
    std::fs::write(&base, vec![7u8; 8192]).expect("write");
    std::fs::write(&diff, vec![9u8; 8192]).expect("write");
    let merged = dir.join("merged");
    let output = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(["snapshot-merge", "--out"])
        .arg(&merged)
        .arg(&state)
        .arg(&base)
        .arg(&state)
        .arg(&diff)
        .output()
        .expect("tinyvmm runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no TVMSTATE magic"), "{stderr}");
    assert!(!merged.exists(), "nothing is written");
    assert_eq!(
        std::fs::read(&base).expect("read"),
        vec![7u8; 8192],
        "the base is untouched"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kvm_a_snapshot_of_the_maximum_slots_restores_in_a_new_process() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_snapshot_of_the_maximum_slots_restores_in_a_new_process",
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-xproc", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let (state, mem) = (dir.join("vm.state"), dir.join("vm.mem"));
    let max = kvm_ioctls::Kvm::new().expect("kvm").get_nr_memslots();
    let slots = max.to_string();
    // 128 MiB at 256 MiB over all but the system slot: 4 KiB a slot at 32764 slots.
    let (mut vmm, socket) = start("xproc", &["serve", "--slots", &slots, "--mem-mib", "128"]);
    let mut client = Client::connect(&socket).expect("connect");
    let memory = client.call("GET", "/memory", None).expect("memory").1;
    let area = &memory["regions"][1];
    let (base, size) = (
        area["guest_address"].as_u64().expect("base"),
        area["size"].as_u64().expect("size"),
    );
    assert_eq!(area["slots"].as_u64(), Some(max as u64 - 1));
    let slot = area["size"].as_u64().expect("size") / (max as u64 - 1);
    // One u64 in every slot.
    let command = |op: &str, seed: u64| json!({"op": op, "start": base, "end": base + size, "stride": slot, "seed": seed});
    let call = |client: &mut Client, method: &str, path: &str, body: serde_json::Value| {
        client.call(method, path, Some(&body)).expect("an answer")
    };
    assert_eq!(
        call(&mut client, "PUT", "/guest/command", command("write", 41)).0,
        200
    );
    assert_eq!(
        call(&mut client, "PATCH", "/vm", json!({"state": "Paused"})).0,
        204
    );
    let create = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
    let saved = call(&mut client, "PUT", "/snapshot/create", create);
    assert_eq!(saved.0, 204, "{saved:?}");
    assert_eq!(
        call(
            &mut client,
            "PUT",
            "/actions",
            json!({"action_type": "Stop"})
        )
        .0,
        204
    );
    let first = vmm.wait(EXIT_LIMIT);
    assert_eq!(
        first.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );

    // A new process per restore backend: every slot back, every value where the guest wrote
    // it.
    let (state_arg, mem_arg) = (state.to_str().expect("utf-8"), mem.to_str().expect("utf-8"));
    for backend in ["file", "copy", "uffd"] {
        let (mut restored, socket) = start(
            &format!("xproc-restored-{backend}"),
            &[
                "restore",
                "--snapshot",
                state_arg,
                "--mem-file",
                mem_arg,
                "--mem-backend",
                backend,
            ],
        );
        let mut client = Client::connect(&socket).expect("connect");
        let memory = client.call("GET", "/memory", None).expect("memory").1;
        assert_eq!(
            memory["slots"]["used"].as_u64(),
            Some(max as u64),
            "{backend}"
        );
        assert_eq!(
            call(&mut client, "PATCH", "/vm", json!({"state": "Resumed"})).0,
            204
        );
        let verified = call(&mut client, "PUT", "/guest/command", command("verify", 41));
        assert_eq!(verified.1["result"], json!("ok"), "{backend}: {verified:?}");
        let stop = json!({"action_type": "Stop"});
        assert_eq!(call(&mut client, "PUT", "/actions", stop).0, 204);
        let ended = restored.wait(EXIT_LIMIT);
        assert_eq!(ended.status.code(), Some(0), "{backend}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file-backed restore whose memory file is truncated under it: the access that finds its
/// page gone does not kill the process without a word; the VM stops, `GET /vm` says Failed
/// and names the file and the guest address, and stopping the VMM exits 4.
#[test]
fn kvm_a_memory_file_truncated_under_a_restore_stops_the_vm_with_a_reason() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_memory_file_truncated_under_a_restore_stops_the_vm_with_a_reason",
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-gone", std::process::id()));
    let (restored, socket, mem) = restored_from_a_file(&dir, "gone");
    // As `cp new.mem old.mem` would: the file is cut to nothing under the mapping.
    cut_to_nothing(&mem);
    let verified = ask(
        &socket,
        "PUT",
        "/guest/command",
        verify(AREA, AREA + 8 * MIB, 5),
    );
    assert!(verified.0 >= 400, "{verified:?}");
    let (status, vm) = ask(&socket, "GET", "/vm", Json::Null);
    assert_eq!((status, &vm["state"]), (200, &json!("Failed")), "{vm}");
    let message = vm["failure"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("is gone") && message.contains(&mem.display().to_string()),
        "{vm}"
    );
    assert!(message.contains("guest address"), "{vm}");
    stop(&socket);
    let stderr = exits_with(restored, &socket, 4);
    assert!(stderr.contains("truncated or replaced"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `SIGBUS` that another process sends (kill(2): no fault, no address in guest memory) is not
/// taken for a memory file cut under the VM: the guard patches nothing and the signal ends the
/// process as it would without one. (The guard used to map a zero page at an address made of
/// the sender's pid and call the VM's file truncated.)
#[test]
fn kvm_a_sigbus_sent_from_outside_ends_the_vmm_as_before() {
    use std::os::unix::process::ExitStatusExt;
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_sigbus_sent_from_outside_ends_the_vmm_as_before",
    ) {
        return;
    }
    let (mut vmm, socket) = serve_mib("outside-bus", 8);
    vmm.signal(libc::SIGBUS);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(output) = vmm.try_exited() {
            break output.status;
        }
        assert!(
            Instant::now() < deadline,
            "the VMM runs on after a SIGBUS from outside: {:?}",
            ask(&socket, "GET", "/vm", Json::Null)
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
    let _ = std::fs::remove_file(&socket);
}

/// Truncates the memory file `mem` to nothing under the VM that maps it.
fn cut_to_nothing(mem: &Path) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(mem)
        .expect("the memory file")
        .set_len(0)
        .expect("truncated");
}

/// A `serve` VM whose 8 MiB at `AREA` were written (seed 5), paused, snapshotted (Full) into
/// `dir` and stopped, then restored file-backed (the memory file mapped) in a new process
/// `name`, resumed: the process, its API socket and the memory file it maps.
fn restored_from_a_file(dir: &Path, name: &str) -> (Vmm, std::path::PathBuf, std::path::PathBuf) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a folder");
    let (state, mem) = (dir.join("t.state"), dir.join("t.mem"));
    let (template, socket) = serve_mib(&format!("{name}-template"), 8);
    let written = ask(
        &socket,
        "PUT",
        "/guest/command",
        write(AREA, AREA + 8 * MIB, 5),
    );
    assert_eq!(written.0, 200, "{written:?}");
    let paused = ask(&socket, "PATCH", "/vm", json!({"state": "Paused"}));
    assert_eq!(paused.0, 204, "{paused:?}");
    let snapshot = json!({"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem});
    let saved = ask(&socket, "PUT", "/snapshot/create", snapshot);
    assert_eq!(saved.0, 204, "{saved:?}");
    stop(&socket);
    exits_with(template, &socket, 0);
    let (restored, socket) = start(
        &format!("{name}-restored"),
        &[
            "restore",
            "--snapshot",
            state.to_str().expect("utf-8"),
            "--mem-file",
            mem.to_str().expect("utf-8"),
        ],
    );
    let resumed = ask(&socket, "PATCH", "/vm", json!({"state": "Resumed"}));
    assert_eq!(resumed.0, 204, "{resumed:?}");
    (restored, socket, mem)
}
