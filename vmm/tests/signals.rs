//! The `tinyvmm` binary as a user runs it: its exit status on SIGTERM, a long API request
//! stopped by one, snapshot files handed from one process to another.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tinyvmm::api::client::Client;

fn start_serve(name: &str) -> (Child, std::path::PathBuf) {
    start(name, &["serve", "--mem-mib", "0"])
}

/// Runs `tinyvmm ARGS --api-sock SOCKET` and waits for its socket.
fn start(name: &str, args: &[&str]) -> (Child, std::path::PathBuf) {
    let socket =
        std::env::temp_dir().join(format!("tinyvmm-test-{}-{name}.sock", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
        .args(args)
        .arg("--api-sock")
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tinyvmm starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    while Client::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "the API socket never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, socket)
}

fn terminate(child: &Child) {
    // SAFETY: kill(2) only sends a signal to the child's pid, which we have not reaped yet.
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0, "kill");
}

/// The child's virtual memory size in KiB: each region it maps adds its size.
fn mapped_kib(child: &Child) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", child.id()))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Kills the child if a test fails before it exits.
struct Reap(Option<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn kvm_serve_exits_130_on_sigterm() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_serve_exits_130_on_sigterm") {
        return;
    }
    let (child, socket) = start_serve("sigterm");
    terminate(&child);
    let output = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by a signal"), "{stderr}");
    assert!(!socket.exists(), "the socket is removed");
}

#[test]
fn kvm_a_signal_stops_a_long_plug_at_a_slot_boundary() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_a_signal_stops_a_long_plug_at_a_slot_boundary")
    {
        return;
    }
    let (child, socket) = start_serve("sigterm-plug");
    let mut child = Reap(Some(child));
    let pid = child.0.as_ref().expect("running");
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
    terminate(pid);
    let (status, body) = plug.join().expect("client thread");
    let output = child
        .0
        .take()
        .expect("running")
        .wait_with_output()
        .expect("wait");
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
    assert!(stderr.contains("no TVMSNAP magic"), "{stderr}");
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
    let (child, socket) = start("xproc", &["serve", "--slots", &slots, "--mem-mib", "128"]);
    let mut child = Reap(Some(child));
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
    let first = child
        .0
        .take()
        .expect("running")
        .wait_with_output()
        .expect("wait");
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
        let (child, socket) = start(
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
        let mut restored = Reap(Some(child));
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
        let ended = restored
            .0
            .take()
            .expect("running")
            .wait_with_output()
            .expect("wait");
        assert_eq!(ended.status.code(), Some(0), "{backend}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
