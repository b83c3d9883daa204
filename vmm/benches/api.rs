//! Latency of one add and one remove of a 4 KiB region through the API socket, against the same
//! operations called directly on kvm-memslots, with 1 (the system region), 4096 and 32763 KVM
//! slots in use before each add: the socket's overhead (HTTP, JSON, the controller).
//!
//! `cargo bench -p tinyvmm --bench api -- [--iterations N] [--json PATH]`
//!
//! Both sides run on real KVM in this process; the API side is `tinyvmm serve` on a socket in
//! the temporary directory, driven over one kept-alive connection, with `guest_check: false` so
//! that both sides do the same memory work. Prints medians and writes JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use kvm_memslots::{KvmVm, MemoryManager, RegionSpec};
use serde_json::json;
use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::{serve_in_background, ServeConfig};
use vm_memory::GuestAddress;

const FILLS: [usize; 3] = [1, 4096, 32763];
const PAGE: u64 = 4096;
const TARGET_GPA: u64 = 4 << 30;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn direct(kvm: &Kvm, fill: usize, iterations: usize) -> (Duration, Duration) {
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let m = MemoryManager::new(KvmVm::new(kvm, vm).expect("KVM"));
    m.add_region(RegionSpec::new(GuestAddress(0), 2 << 20))
        .expect("system region");
    if fill > 1 {
        let filler =
            RegionSpec::new(GuestAddress(256 << 20), (fill as u64 - 1) * PAGE).with_slot_size(PAGE);
        m.add_region(filler).expect("filler");
    }
    let (mut adds, mut removes) = (Vec::new(), Vec::new());
    for _ in 0..iterations {
        let start = Instant::now();
        let id = m
            .add_region(RegionSpec::new(GuestAddress(TARGET_GPA), PAGE))
            .expect("add");
        let added = Instant::now();
        m.remove_region(id).expect("remove");
        adds.push(added - start);
        removes.push(added.elapsed());
    }
    (median(adds), median(removes))
}

fn through_socket(fill: usize, iterations: usize) -> (Duration, Duration) {
    let socket = std::env::temp_dir().join(format!("tinyvmm-bench-{}.sock", std::process::id()));
    let config = ServeConfig {
        api_sock: socket.clone(),
        slots: fill,
        area_size: (fill as u64).saturating_sub(1) * PAGE,
        vcpus: 1,
        ..ServeConfig::new(std::path::PathBuf::new())
    };
    let server = serve_in_background(config).expect("the VMM starts");
    let mut client = Client::connect(&socket).expect("connect");
    let add = json!({"size": PAGE, "guest_address": TARGET_GPA, "guest_check": false});
    let (mut adds, mut removes) = (Vec::new(), Vec::new());
    for _ in 0..iterations {
        let start = Instant::now();
        let (status, body) = client
            .call("PUT", "/memory/regions", Some(&add))
            .expect("add");
        let added = Instant::now();
        assert_eq!(status, 201, "{body}");
        let path = format!("/memory/regions/{}", body["id"]);
        let (status, body) = client.call("DELETE", &path, None).expect("remove");
        assert_eq!(status, 204, "{body}");
        adds.push(added - start);
        removes.push(added.elapsed());
    }
    let used = client.call("GET", "/memory", None).expect("memory").1["slots"]["used"].clone();
    assert_eq!(used, json!(fill), "the fill level");
    client
        .call("PUT", "/actions", Some(&json!({"action_type": "Stop"})))
        .expect("stop");
    server.join().expect("no panic").expect("clean stop");
    (median(adds), median(removes))
}

fn main() {
    let mut iterations = 200;
    let mut json_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/bench/tinyvmm-api.json"
    )
    .to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--iterations" => {
                iterations = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--iterations N")
            }
            "--json" => json_path = args.next().expect("--json PATH"),
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
    let kvm = match Kvm::new() {
        Ok(kvm) => kvm,
        Err(e) => {
            eprintln!("SKIPPED: cannot open /dev/kvm ({e}); nothing measured");
            return;
        }
    };
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("| slots in use | direct add | socket add | socket overhead | direct remove | socket remove | socket overhead |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for fill in FILLS {
        eprintln!("{fill} slots in use: {iterations} adds and removes each way...");
        let (direct_add, direct_remove) = direct(&kvm, fill, iterations);
        let (socket_add, socket_remove) = through_socket(fill, iterations);
        println!(
            "| {fill} | {:.1} µs | {:.1} µs | {:+.1} µs | {:.1} µs | {:.1} µs | {:+.1} µs |",
            us(direct_add),
            us(socket_add),
            us(socket_add) - us(direct_add),
            us(direct_remove),
            us(socket_remove),
            us(socket_remove) - us(direct_remove)
        );
        rows.push(json!({
            "slots_in_use": fill,
            "direct_add_us": us(direct_add), "socket_add_us": us(socket_add),
            "direct_remove_us": us(direct_remove), "socket_remove_us": us(socket_remove),
        }));
    }
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir).expect("create the JSON directory");
    }
    let doc = json!({ "iterations": iterations, "rows": rows });
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&doc).expect("JSON"),
    )
    .expect("write JSON");
    eprintln!("wrote {json_path}");
}
