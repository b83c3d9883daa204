//! A migration's destination answers its API socket while it waits (`GET /vm`: `Waiting`, then
//! `Receiving`; other requests a 409 naming why), and then serves the VM it received on the
//! same socket: a real migration between two VMMs on `/dev/kvm`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::jobs::receive::{receive_in_background, ReceiveConfig, ReceiveEnding};
use tinyvmm::jobs::serve::ServeConfig;
use tinyvmm::lifecycle::Ending;

mod support;
use support::vmm::InProcess;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;

fn temp(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tinyvmm-receive-api-{}.{what}", std::process::id()))
}

/// One request on a connection of its own; `None` when the socket took it but closed
/// without an answer (the waiting server handing the socket over).
fn try_call(socket: &Path, method: &str, path: &str, body: Option<Value>) -> Option<(u16, Value)> {
    Client::connect(socket)
        .ok()?
        .call(method, path, body.as_ref())
        .ok()
}

fn call(socket: &Path, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    try_call(socket, method, path, body).expect("an answer")
}

fn pattern(op: &str, seed: u64) -> Value {
    json!({"op": op, "start": AREA, "end": AREA + 64 * MIB, "stride": 4096, "seed": seed})
}

#[test]
fn kvm_a_destination_answers_while_it_waits_then_serves_the_vm_it_received() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_destination_answers_while_it_waits_then_serves_the_vm_it_received",
    ) {
        return;
    }
    let (listen, dst) = (temp("mig"), temp("dst.sock"));
    let _ = std::fs::remove_file(&listen);
    let config = ReceiveConfig::new(
        tinyvmm::migration::Endpoint::Unix(listen.clone()),
        dst.clone(),
    );
    let destination = receive_in_background(config).expect("receive listens");

    // Waiting: the socket answers at once.
    assert_eq!(
        call(&dst, "GET", "/vm", None),
        (200, json!({"state": "Waiting", "vcpus": 0}))
    );
    assert_eq!(call(&dst, "GET", "/", None).0, 200);
    let refused = call(&dst, "PUT", "/guest/command", Some(pattern("verify", 3)));
    assert_eq!(refused.0, 409, "{refused:?}");
    let message = refused.1["fault_message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("no VM here yet: this VMM waits for a migration on unix:"),
        "{message}"
    );

    // A source with a pattern in its memory.
    let src = temp("src.sock");
    let source = InProcess::start(ServeConfig {
        area_size: 64 * MIB,
        ..ServeConfig::new(src.clone())
    });
    let wrote = call(&src, "PUT", "/guest/command", Some(pattern("write", 3)));
    assert_eq!(wrote, (200, json!({"result": "ok"})));

    // Watch the destination's state while the VM moves.
    let watched = dst.clone();
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut states: Vec<String> = Vec::new();
        let mut handovers = 0;
        loop {
            assert!(
                Instant::now() < deadline,
                "the VM never arrived: {states:?}"
            );
            let Some((status, vm)) = try_call(&watched, "GET", "/vm", None) else {
                handovers += 1;
                continue;
            };
            assert_eq!(status, 200, "{vm}");
            let state = vm["state"].as_str().expect("a state").to_owned();
            if states.last() != Some(&state) {
                states.push(state.clone());
            }
            if state == "Running" {
                return (states, handovers);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    let started = call(
        &src,
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", listen.display())})),
    );
    assert_eq!(started.0, 204, "{started:?}");
    let left = source.ended().expect("the source ends cleanly");
    assert_eq!(left, Ending::Finished, "the VM migrated away");
    let (states, handovers) = watcher.join().expect("no panic");
    eprintln!("the destination's states: {states:?}; unanswered at the hand-over: {handovers}");
    // In order, each seen or not (a short stream may pass unseen): never back.
    let order = ["Waiting", "Receiving", "Running"];
    let ranks: Vec<usize> = states
        .iter()
        .map(|s| order.iter().position(|o| o == s).expect("a known state"))
        .collect();
    assert!(ranks.windows(2).all(|w| w[0] < w[1]), "{states:?}");
    assert_eq!(states.last().map(String::as_str), Some("Running"));
    // At most the connection open at the hand-over is closed unanswered.
    assert!(handovers <= 1, "{handovers} requests went unanswered");

    // The same socket serves the VM now, with the memory the source wrote.
    assert_eq!(
        call(&dst, "GET", "/vm", None),
        (200, json!({"state": "Running", "vcpus": 1}))
    );
    let verified = call(&dst, "PUT", "/guest/command", Some(pattern("verify", 3)));
    assert_eq!(verified, (200, json!({"result": "ok"})));
    assert_eq!(
        call(
            &dst,
            "PUT",
            "/actions",
            Some(json!({"action_type": "Stop"}))
        )
        .0,
        204
    );
    let ended = destination.join().expect("no panic").expect("served");
    assert!(
        matches!(ended, ReceiveEnding::TestGuest(Ending::Finished)),
        "{ended:?}"
    );
    assert!(!dst.exists(), "the API socket is removed at the end");
}
