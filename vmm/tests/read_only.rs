//! Guest writes and read-only regions on real `/dev/kvm`: a write into a read-only region is
//! refused with a 409 naming the region (KVM would make each write an MMIO exit, which the VMM
//! drops as ROM does, so it used to answer `ok` with nothing written), and a region a vCPU
//! writes into cannot be made read-only under it. See `docs/decisions/read-only-writes.md`.

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::ServeConfig;

mod support;
use support::vmm::InProcess;

/// The initial memory: one region at 256 MiB.
const AREA: u64 = 256 << 20;

fn call(socket: &std::path::Path, method: &str, path: &str, body: Value) -> (u16, Value) {
    let body = (!body.is_null()).then_some(body);
    Client::connect(socket)
        .expect("connect")
        .call(method, path, body.as_ref())
        .expect("an answer")
}

fn command(op: &str, seed: u64) -> Value {
    json!({"op": op, "start": AREA, "end": AREA + (1 << 20), "stride": 4096, "seed": seed})
}

fn fault(answer: &(u16, Value)) -> String {
    answer.1["fault_message"]
        .as_str()
        .unwrap_or_else(|| panic!("no fault message in {answer:?}"))
        .to_owned()
}

#[test]
fn kvm_a_write_into_a_read_only_region_is_refused_naming_it() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_write_into_a_read_only_region_is_refused_naming_it",
    ) {
        return;
    }
    let socket = std::env::temp_dir().join(format!("tinyvmm-ro-{}.sock", std::process::id()));
    let vmm = InProcess::start(ServeConfig::new(socket));
    let s = vmm.socket();
    let region = "/memory/regions/1";
    assert_eq!(call(s, "GET", region, Value::Null).1["guest_address"], AREA);
    assert_eq!(call(s, "PUT", "/guest/command", command("write", 7)).0, 200);
    assert_eq!(call(s, "PATCH", region, json!({"read_only": true})).0, 204);

    // A write and a write loop into it are refused, naming the region and the way out; the
    // memory keeps what was written before.
    for op in ["write", "write_loop"] {
        let refused = call(s, "PUT", "/guest/command", command(op, 9));
        assert_eq!(refused.0, 409, "{op}: {refused:?}");
        let message = fault(&refused);
        assert!(
            message.starts_with("region 1 [0x10000000, 0x20000000) is read-only")
                && message.contains(r#"PATCH /memory/regions/1 {"read_only": false}"#),
            "{message}"
        );
    }
    let verified = call(s, "PUT", "/guest/command", command("verify", 7));
    assert_eq!(verified, (200, json!({"result": "ok"})));

    // A write loop into a writable region keeps it writable until the loop ends.
    assert_eq!(call(s, "PATCH", region, json!({"read_only": false})).0, 204);
    let started = call(s, "PUT", "/guest/command", command("write_loop", 20));
    assert_eq!(started, (200, json!({"result": "started"})));
    let refused = call(s, "PATCH", region, json!({"read_only": true}));
    assert_eq!(refused.0, 409, "{refused:?}");
    assert!(
        fault(&refused).starts_with("vCPU 0 runs a WriteLoop command that writes into region 1"),
        "{refused:?}"
    );
    let info = call(s, "GET", region, Value::Null);
    assert_eq!(info.1["read_only"], false, "the refusal changed nothing");
    let stopped = call(s, "PUT", "/guest/command", json!({"op": "stop_loop"}));
    assert_eq!(stopped.1["result"], "stopped", "{stopped:?}");
    let last_seed = stopped.1["last_seed"].as_u64().expect("at least one pass");
    assert_eq!(call(s, "PATCH", region, json!({"read_only": true})).0, 204);
    let verified = call(s, "PUT", "/guest/command", command("verify", last_seed));
    assert_eq!(verified, (200, json!({"result": "ok"})));
    // No guest write ever went to the read-only region (the exit loop would have dropped and
    // counted it).
    let metrics = call(s, "GET", "/metrics", Value::Null).1;
    let metrics = metrics.as_str().expect("text");
    let dropped = "tinyvmm_vcpu_exits_handled_total{how=\"read_only_write\"} 0";
    assert!(metrics.lines().any(|l| l == dropped), "{metrics}");

    vmm.stop();
}

/// A region a vCPU's command reaches into cannot be removed or moved under it, nor hotplug
/// blocks unplugged: a 409 naming the vCPU, and nothing changes; the command goes on and the
/// guest lives. (All three were answered 204 and the command's next access found no memory:
/// the guest failed for good.)
#[test]
fn kvm_a_region_a_command_reaches_cannot_be_removed_or_moved_under_it() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_region_a_command_reaches_cannot_be_removed_or_moved_under_it",
    ) {
        return;
    }
    let socket = std::env::temp_dir().join(format!("tinyvmm-rm-{}.sock", std::process::id()));
    let vmm = InProcess::start(ServeConfig::new(socket));
    let s = vmm.socket();
    // A 2 MiB region of its own at 1 GiB, written, then a write loop over it.
    let added = call(
        s,
        "PUT",
        "/memory/regions",
        json!({"size": 2 << 20, "guest_address": 1u64 << 30}),
    );
    assert_eq!(added.0, 201, "{added:?}");
    let id = added.1["id"].as_u64().expect("an id");
    let region = format!("/memory/regions/{id}");
    let over = |op: &str, seed: u64| {
        json!({"op": op, "start": 1u64 << 30, "end": (1u64 << 30) + (2 << 20), "stride": 4096,
               "seed": seed})
    };
    let started = call(s, "PUT", "/guest/command", over("write_loop", 30));
    assert_eq!(started, (200, json!({"result": "started"})));
    for (method, body, what) in [
        ("DELETE", Value::Null, "whose memory would be gone under it"),
        (
            "PATCH",
            json!({"guest_address": 2u64 << 30}),
            "whose memory would move under it",
        ),
    ] {
        let refused = call(s, method, &region, body);
        assert_eq!(refused.0, 409, "{method}: {refused:?}");
        let message = fault(&refused);
        assert!(
            message.starts_with(&format!(
                "vCPU 0 runs a WriteLoop command that reaches into region {id}"
            )) && message.contains(what)
                && message.contains("op stop_loop"),
            "{message}"
        );
        let info = call(s, "GET", &region, Value::Null);
        assert_eq!(info.1["guest_address"], 1u64 << 30, "nothing changed");
    }
    let stopped = call(s, "PUT", "/guest/command", json!({"op": "stop_loop"}));
    assert_eq!(stopped.1["result"], "stopped", "{stopped:?}");
    let last_seed = stopped.1["last_seed"].as_u64().expect("at least one pass");
    assert_eq!(call(s, "GET", "/vm", Value::Null).1["state"], "Running");
    // Once the loop ended both go through, and the moved memory went with it.
    let moved = call(s, "PATCH", &region, json!({"guest_address": 2u64 << 30}));
    assert_eq!(moved.0, 204, "{moved:?}");
    let verify = json!({"op": "verify", "start": 2u64 << 30, "end": (2u64 << 30) + (2 << 20),
                        "stride": 4096, "seed": last_seed ^ (1u64 << 30) ^ (2u64 << 30)});
    assert_eq!(
        call(s, "PUT", "/guest/command", verify),
        (200, json!({"result": "ok"}))
    );
    assert_eq!(call(s, "DELETE", &region, Value::Null).0, 204);

    // Nor can the hotplug area's blocks under a command be unplugged.
    let area = json!({"total_size_mib": 8, "block_size_mib": 2, "slot_size_mib": 8});
    assert_eq!(call(s, "PUT", "/hotplug/memory", area).0, 204);
    let plug = |mib: u64| {
        call(
            s,
            "PATCH",
            "/hotplug/memory",
            json!({"requested_size_mib": mib}),
        )
    };
    assert_eq!(plug(4).0, 204);
    let base = call(s, "GET", "/hotplug/memory", Value::Null).1["guest_address"]
        .as_u64()
        .expect("the area's address");
    let second = json!({"op": "write_loop", "start": base + (2 << 20), "end": base + (4 << 20),
                        "stride": 4096, "seed": 40});
    assert_eq!(
        call(s, "PUT", "/guest/command", second).1["result"],
        "started"
    );
    let refused = plug(2);
    assert_eq!(refused.0, 409, "{refused:?}");
    assert!(
        fault(&refused).starts_with(
            "vCPU 0 runs a WriteLoop command that reaches into the hotplug area's blocks this \
             would unplug"
        ),
        "{refused:?}"
    );
    let area = call(s, "GET", "/hotplug/memory", Value::Null).1;
    assert_eq!(area["plugged_size_mib"], 4, "nothing unplugged: {area}");
    let stopped = call(s, "PUT", "/guest/command", json!({"op": "stop_loop"}));
    assert_eq!(stopped.1["result"], "stopped", "{stopped:?}");
    assert_eq!(plug(2).0, 204, "once the loop ended");
    assert_eq!(call(s, "GET", "/vm", Value::Null).1["state"], "Running");
    vmm.stop();
}
