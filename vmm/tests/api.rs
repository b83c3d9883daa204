//! The API socket against a running test guest on real `/dev/kvm`: hotplugging memory up to the
//! slot limit, dirty logging through the socket, the hotplug area, and every kind of bad input,
//! each answered with the right 4xx and leaving memory, KVM and the guest as they were.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::{serve, ServeConfig};

mod support;
use support::vmm::InProcess as Vmm;

/// A VMM with `slots` slots over `mem_mib` MiB, on a socket named after `name`.
fn start(name: &str, slots: usize, mem_mib: u64) -> Vmm {
    start_with(name, |config| ServeConfig {
        slots,
        area_size: mem_mib << 20,
        ..config
    })
}

/// Starts a VMM on a socket named after `name`, with the defaults changed by `configure`.
fn start_with(name: &str, configure: impl FnOnce(ServeConfig) -> ServeConfig) -> Vmm {
    let socket =
        std::env::temp_dir().join(format!("tinyvmm-test-{}-{name}.sock", std::process::id()));
    Vmm::start(configure(ServeConfig::new(socket)))
}

fn memory_of(vmm: &Vmm) -> Value {
    let (status, body) = vmm.call("GET", "/memory", None);
    assert_eq!(status, 200);
    body
}

fn fault(response: &(u16, Value)) -> &str {
    response.1["fault_message"]
        .as_str()
        .unwrap_or_else(|| panic!("no fault message in {response:?}"))
}

fn region(gpa: u64, size: u64) -> Value {
    json!({"size": size, "guest_address": gpa})
}

const GIB: u64 = 1 << 30;

#[test]
fn kvm_hotplug_up_to_the_slot_limit_with_the_guest_checking_each_region() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_hotplug_up_to_the_slot_limit_with_the_guest_checking_each_region",
    ) {
        return;
    }
    let vmm = start("fill", 2, 4);
    let free = memory_of(&vmm)["slots"]["free"]
        .as_u64()
        .expect("free slots");
    let mut ids = Vec::new();
    for i in 0..free {
        let (status, body) = vmm.call(
            "PUT",
            "/memory/regions",
            Some(json!({"size": 4096, "guest_address": GIB + i * 8192})),
        );
        assert_eq!(status, 201, "region {i}: {body}");
        assert_eq!(body["guest_checked"], json!(true));
        ids.push(body["id"].as_u64().expect("an id"));
    }
    let memory = memory_of(&vmm);
    assert_eq!(memory["slots"]["free"], json!(0));
    let refused = vmm.call("PUT", "/memory/regions", Some(region(GIB - 8192, 4096)));
    assert_eq!(refused.0, 409);
    assert!(
        fault(&refused).starts_with("out of KVM memory slots: 1 needed, 0 of"),
        "{refused:?}"
    );
    assert_eq!(memory_of(&vmm), memory, "a refused add changed the memory");
    // The guest can still check any of them (here: the first and the last page it wrote).
    for gpa in [GIB, GIB + (free - 1) * 8192] {
        let (status, body) = vmm.call(
            "PUT",
            "/guest/command",
            Some(json!({"op": "write", "start": gpa, "end": gpa + 4096, "stride": 8, "seed": 3})),
        );
        assert_eq!((status, &body["result"]), (200, &json!("ok")));
        let (_, body) = vmm.call(
            "PUT",
            "/guest/command",
            Some(json!({"op": "verify", "start": gpa, "end": gpa + 4096, "stride": 8, "seed": 3})),
        );
        assert_eq!(body["result"], json!("ok"));
    }
    for id in ids {
        assert_eq!(
            vmm.call("DELETE", &format!("/memory/regions/{id}"), None).0,
            204
        );
    }
    assert_eq!(memory_of(&vmm)["slots"]["used"], json!(2));
    vmm.stop();
}

#[test]
fn kvm_dirty_logging_through_the_socket_reports_exactly_the_pages_written() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_dirty_logging_through_the_socket_reports_exactly_the_pages_written",
    ) {
        return;
    }
    dirty_logging_reports_exactly_the_pages_written(None);
}

#[test]
fn kvm_dirty_ring_through_the_socket_reports_exactly_the_pages_written() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_dirty_ring_through_the_socket_reports_exactly_the_pages_written",
    ) {
        return;
    }
    dirty_logging_reports_exactly_the_pages_written(Some(4096));
}

/// Logging on a region, the guest's writes, harvests: in bitmap mode, or in ring mode with
/// rings of `dirty_ring` entries.
fn dirty_logging_reports_exactly_the_pages_written(dirty_ring: Option<u32>) {
    let name = if dirty_ring.is_some() {
        "ring"
    } else {
        "dirty"
    };
    let vmm = start_with(name, |config| ServeConfig {
        area_size: 4 << 20,
        dirty_ring,
        ..config
    });
    let (status, body) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 1 << 20, "guest_address": GIB, "slot_size": 65536})),
    );
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_u64().expect("an id");
    assert_eq!(
        vmm.call(
            "PATCH",
            "/dirty-log",
            Some(json!({"enabled": true, "region": id}))
        )
        .0,
        204
    );
    // Logging starts with every page counted dirty (documented): take that first.
    let (_, first) = vmm.call("POST", "/dirty-log/harvest", Some(json!({"region": id})));
    assert_eq!(first["regions"][0]["dirty_pages"], json!(256));
    // The guest writes one u64 in every third page of the first 48 pages.
    let write = json!({"op": "write", "start": GIB + 16, "end": GIB + 48 * 4096, "stride": 3 * 4096, "seed": 9});
    assert_eq!(vmm.call("PUT", "/guest/command", Some(write)).0, 200);
    let (status, dirty) = vmm.call("POST", "/dirty-log/harvest", Some(json!({"region": id})));
    assert_eq!(status, 200);
    let expected: Vec<Value> = (0..16)
        .map(|i| json!([GIB + i * 3 * 4096, GIB + i * 3 * 4096 + 4096]))
        .collect();
    assert_eq!(dirty["regions"][0]["ranges"], Value::Array(expected));
    assert_eq!(dirty["regions"][0]["dirty_pages"], json!(16));
    assert_eq!(dirty["page_size"], json!(4096));
    let (_, again) = vmm.call("POST", "/dirty-log/harvest", Some(json!({"region": id})));
    assert_eq!(
        again["regions"][0]["dirty_pages"],
        json!(0),
        "a second harvest reports nothing new"
    );
    // The mode, what logs, and a dirty rate over the window between two harvests of all.
    let (_, info) = vmm.call("GET", "/dirty-log", None);
    assert_eq!(
        info["mode"],
        json!(if dirty_ring.is_some() {
            "ring"
        } else {
            "bitmap"
        })
    );
    assert_eq!(info["ring_entries"], json!(dirty_ring));
    assert_eq!(info["logging_regions"], json!([id]));
    assert_eq!(info["dirty_rate"], Value::Null, "no window yet");
    vmm.call("POST", "/dirty-log/harvest", None);
    let write =
        json!({"op": "write", "start": GIB, "end": GIB + 32 * 4096, "stride": 4096, "seed": 10});
    assert_eq!(vmm.call("PUT", "/guest/command", Some(write)).0, 200);
    vmm.call("POST", "/dirty-log/harvest", None);
    let (_, info) = vmm.call("GET", "/dirty-log", None);
    assert_eq!(info["harvests"], json!(2));
    let rate = &info["dirty_rate"];
    // The 32 pages the guest wrote, and the host's own writes to the command block.
    let pages = rate["pages"].as_u64().expect("pages");
    assert!((32..=34).contains(&pages), "{info}");
    assert!(
        rate["window_ms"].as_f64().expect("a window") > 0.0,
        "{info}"
    );
    assert!(
        rate["pages_per_second"].as_f64().expect("a rate") > 0.0,
        "{info}"
    );
    assert_eq!(
        vmm.call("PATCH", "/dirty-log", Some(json!({"enabled": false})))
            .0,
        204
    );
    vmm.stop();
}

#[test]
fn kvm_the_hotplug_area_plugs_and_unplugs_slots() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_the_hotplug_area_plugs_and_unplugs_slots") {
        return;
    }
    let vmm = start("hotplug", 2, 4);
    assert_eq!(vmm.call("GET", "/hotplug/memory", None).0, 404);
    let bad = vmm.call(
        "PUT",
        "/hotplug/memory",
        Some(json!({"total_size_mib": 64, "block_size_mib": 3})),
    );
    assert_eq!(
        (bad.0, fault(&bad)),
        (400, "block_size_mib 3 must be a power of two of at least 2")
    );
    let config = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    // The area's range is reserved: memory already there keeps it from being configured...
    let hotplug_gpa = 32 * GIB;
    let squatter = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 4096, "guest_address": hotplug_gpa + 60 * (1 << 20), "guest_check": false})),
    );
    assert_eq!(squatter.0, 201, "{squatter:?}");
    let refused = vmm.call("PUT", "/hotplug/memory", Some(config.clone()));
    assert_eq!(refused.0, 409, "{refused:?}");
    assert!(
        fault(&refused).contains("is inside the hotplug area"),
        "{refused:?}"
    );
    let squatter = squatter.1["id"].as_u64().expect("an id");
    assert_eq!(
        vmm.call("DELETE", &format!("/memory/regions/{squatter}"), None)
            .0,
        204
    );
    assert_eq!(vmm.call("PUT", "/hotplug/memory", Some(config)).0, 204);
    // ...and once configured, nothing else may go there, by adding or by moving.
    let before = memory_of(&vmm);
    for gpa in [
        hotplug_gpa,
        hotplug_gpa + 64 * (1 << 20) - 4096,
        hotplug_gpa - 4096,
    ] {
        let response = vmm.call(
            "PUT",
            "/memory/regions",
            Some(json!({"size": 8192, "guest_address": gpa, "guest_check": false})),
        );
        assert_eq!(response.0, 409, "{gpa:#x}: {response:?}");
        assert!(
            fault(&response).contains("reserved for PATCH /hotplug/memory"),
            "{response:?}"
        );
    }
    let mover = vmm.call(
        "PATCH",
        "/memory/regions/1",
        Some(json!({"guest_address": hotplug_gpa + 8 * (1 << 20)})),
    );
    assert_eq!(mover.0, 409, "{mover:?}");
    assert_eq!(memory_of(&vmm), before);
    let used = |vmm: &Vmm| memory_of(vmm)["slots"]["used"].as_u64().expect("used");
    assert_eq!(
        vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": 20}))
        )
        .0,
        204
    );
    assert_eq!(used(&vmm), 2 + 3, "20 MiB in 8 MiB slots maps three slots");
    let (_, state) = vmm.call("GET", "/hotplug/memory", None);
    assert_eq!(
        (
            state["plugged_size_mib"].clone(),
            state["mapped_slots"].clone()
        ),
        (json!(20), json!(3))
    );
    let base = state["guest_address"].as_u64().expect("base");
    let touch = json!({"op": "write", "start": base, "end": base + (20 << 20), "stride": 1 << 20, "seed": 1});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(touch)).1["result"],
        json!("ok")
    );
    // The third piece holds 4 of its 8 MiB: its slot ends there, and so does the memory.
    let no_memory = |from: u64| {
        let write = json!({"op": "write", "start": base + from, "end": base + from + (1 << 20), "stride": 4096, "seed": 1});
        vmm.call("PUT", "/guest/command", Some(write))
    };
    let past = no_memory(20 << 20);
    assert_eq!(past.0, 400, "unplugged blocks have no slot: {past:?}");
    // Plugging into that piece grows its slot, and the guest checks the new memory.
    assert_eq!(
        vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": 22}))
        )
        .0,
        204
    );
    assert_eq!(
        used(&vmm),
        2 + 3,
        "the piece's slot grew in place of a new one"
    );
    let grown = json!({"op": "write", "start": base + (20 << 20), "end": base + (22 << 20), "stride": 4096, "seed": 2});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(grown)).1["result"],
        json!("ok")
    );
    assert_eq!(no_memory(22 << 20).0, 400);
    let odd = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 5})),
    );
    assert_eq!(odd.0, 400, "{odd:?}");
    assert_eq!(
        vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": 6}))
        )
        .0,
        204
    );
    assert_eq!(used(&vmm), 2 + 1);
    for from in [6 << 20, 8 << 20] {
        let refused = no_memory(from);
        assert_eq!(
            refused.0, 400,
            "the unplugged range at +{from:#x}, in the first piece or past it, is no memory: {refused:?}"
        );
    }
    let kept = json!({"op": "verify", "start": base, "end": base + (6 << 20), "stride": 1 << 20, "seed": 1});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(kept)).1["result"],
        json!("ok"),
        "the blocks that stay keep what the guest wrote"
    );
    let first_slot = memory_of(&vmm)["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .find(|r| r["guest_address"] == json!(base))
        .map(|r| r["id"].clone())
        .expect("the area's first slot is a region");
    let owned = vmm.call("DELETE", &format!("/memory/regions/{first_slot}"), None);
    assert_eq!(owned.0, 409, "{owned:?}");
    assert_eq!(
        vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": 0}))
        )
        .0,
        204
    );
    assert_eq!(used(&vmm), 2);
    vmm.stop();
}

/// An area that is no whole number of slots: its last piece is what is left (as a Linux
/// guest's virtio-mem device allows, by the same rules), gets a KVM slot of its own size when
/// plugged, and the guest checks all of it; a refused configuration changes nothing.
#[test]
fn kvm_a_hotplug_area_with_a_partial_last_piece_plugs_all_of_it() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_hotplug_area_with_a_partial_last_piece_plugs_all_of_it",
    ) {
        return;
    }
    let vmm = start("partial-piece", 2, 4);
    let before = memory_of(&vmm);
    let odd = vmm.call(
        "PUT",
        "/hotplug/memory",
        Some(json!({"total_size_mib": 11, "block_size_mib": 2, "slot_size_mib": 4})),
    );
    assert_eq!(
        (odd.0, fault(&odd)),
        (
            400,
            "total_size_mib 11 must be a multiple of block_size_mib 2, non-zero and at most \
             1048576 MiB"
        )
    );
    assert_eq!(memory_of(&vmm), before, "a refused area changes nothing");
    assert_eq!(vmm.call("GET", "/hotplug/memory", None).0, 404);
    let area = json!({"total_size_mib": 10, "block_size_mib": 2, "slot_size_mib": 4});
    assert_eq!(vmm.call("PUT", "/hotplug/memory", Some(area)).0, 204);
    // All of it: pieces of 4, 4 and 2 MiB, each one slot, the guest checking what is plugged.
    let all = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 10})),
    );
    assert_eq!(all.0, 204, "{all:?}");
    let (_, state) = vmm.call("GET", "/hotplug/memory", None);
    assert_eq!(
        (
            state["total_size_mib"].clone(),
            state["slot_size_mib"].clone(),
            state["plugged_size_mib"].clone(),
            state["mapped_slots"].clone()
        ),
        (json!(10), json!(4), json!(10), json!(3)),
        "{state}"
    );
    let base = state["guest_address"].as_u64().expect("base");
    let memory = memory_of(&vmm);
    let sizes: Vec<(u64, u64)> = memory["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .map(|r| {
            (
                r["guest_address"].as_u64().expect("gpa"),
                r["size"].as_u64().expect("size"),
            )
        })
        .filter(|(gpa, _)| *gpa >= base)
        .collect();
    assert_eq!(
        sizes,
        vec![
            (base, 4 << 20),
            (base + (4 << 20), 4 << 20),
            (base + (8 << 20), 2 << 20)
        ],
        "{memory}"
    );
    assert_eq!(memory["slots"]["used"], json!(2 + 3), "{memory}");
    let write =
        json!({"op": "write", "start": base, "end": base + (10 << 20), "stride": 4096, "seed": 3});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(write)).1["result"],
        json!("ok")
    );
    let verify =
        json!({"op": "verify", "start": base, "end": base + (10 << 20), "stride": 4096, "seed": 3});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(verify)).1["result"],
        json!("ok")
    );
    let past = json!({"op": "write", "start": base + (10 << 20), "end": base + (11 << 20), "stride": 4096, "seed": 3});
    let past = vmm.call("PUT", "/guest/command", Some(past));
    assert_eq!(past.0, 400, "the area ends with its last piece: {past:?}");
    // Back down into the second piece, then to nothing.
    for (mib, used) in [(6, 2 + 2), (0, 2)] {
        let down = vmm.call(
            "PATCH",
            "/hotplug/memory",
            Some(json!({"requested_size_mib": mib})),
        );
        assert_eq!(down.0, 204, "{down:?}");
        assert_eq!(
            memory_of(&vmm)["slots"]["used"],
            json!(used),
            "{mib} MiB plugged"
        );
    }
    vmm.stop();
}

/// A valid region to add, 33 bytes long: what the framing cases would add if they were taken.
const ADD: &str = r#"{"size":4096,"guest_check":false}"#;

#[test]
fn kvm_bad_input_gets_the_right_4xx_and_changes_nothing() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_bad_input_gets_the_right_4xx_and_changes_nothing",
    ) {
        return;
    }
    let vmm = start("bad", 8, 4);
    let (status, body) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 65536, "guest_address": GIB, "slot_size": 16384})),
    );
    assert_eq!(status, 201, "{body}");
    let pattern = json!({"op": "write", "start": GIB, "end": GIB + 65536, "stride": 8, "seed": 77});
    assert_eq!(vmm.call("PUT", "/guest/command", Some(pattern)).0, 200);
    let before = memory_of(&vmm);
    let with = |method: &str, path: &str, body: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let raw = |body: &str| with("PUT", "/memory/regions", body);
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (raw("{\"size\": 4096,"), 400, "EOF while parsing"),
        (raw("{\"size\": 4096, \"colour\": 1}"), 400, "unknown field `colour`"),
        (raw("{\"size\": \"4096\"}"), 400, "invalid type: string"),
        (raw("{\"size\": -4096}"), 400, "invalid value: integer `-4096`, expected u64"),
        (raw("{\"size\": 1e400}"), 400, "invalid request body"),
        (raw("{\"size\": 18446744073709551616}"), 400, "invalid request body"),
        (raw("{\"size\": 4097, \"guest_address\": 2147483648}"), 400, "size 0x1001 is not a multiple of the page size"),
        (raw("{\"size\": 4096, \"guest_address\": 2147483649}"), 400, "guest address 0x80000001 is not a multiple of the page size"),
        (raw("{\"size\": 8192, \"guest_address\": 18446744073709547520}"), 400, "wraps around the address space"),
        (raw("{\"size\": 4096, \"guest_address\": 1073745920}"), 409, "overlaps region 2 at [0x40000000, 0x40004000)"),
        (raw("{\"size\": 65536, \"slot_size\": 24576}"), 400, "is not a multiple of slot_size"),
        (raw("{\"size\": 2147483648, \"slot_size\": 4096, \"guest_check\": false}"), 409, "out of KVM memory slots: 524288 needed"),
        (b"DELETE /memory/regions/99 HTTP/1.1\r\n\r\n".to_vec(), 404, "region 99 does not exist"),
        (with("PATCH", "/memory/regions/2", "{\"guest_address\": 268435456}"), 409, "overlaps region 1"),
        (with("PATCH", "/memory/regions/2", "{}"), 400, "nothing to change"),
        (b"DELETE /memory/regions/0 HTTP/1.1\r\n\r\n".to_vec(), 409, "holds the guest's code"),
        (b"PUT /memory/regions HTTP/1.1\r\nContent-Length: 9999999\r\n\r\n".to_vec(), 413, "too large"),
        (format!("GET /memory HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "x".repeat(9000)).into_bytes(), 431, "headers too large"),
        (b"PUT /memory/regions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(), 411, "send Content-Length"),
        (b"GET /nowhere HTTP/1.1\r\n\r\n".to_vec(), 404, "no resource at /nowhere"),
        (b"POST /vm HTTP/1.1\r\n\r\n".to_vec(), 405, "POST is not allowed on /vm"),
        (b"\x16\x03\x01 not http\r\n\r\n".to_vec(), 400, "malformed HTTP request"),
        (with("PUT", "/guest/command", "{\"op\":\"write\",\"start\":1073741824,\"end\":1073741840,\"stride\":8,\"seed\":1,\"vcpu\":5}"), 400, "vcpu 5 does not exist"),
        (with("PUT", "/guest/command", "{\"op\":\"write\",\"start\":4096,\"end\":8192,\"stride\":8,\"seed\":1}"), 400, "overlaps the system region"),
        (with("PUT", "/guest/command", "{\"op\":\"write\",\"start\":3221225472,\"end\":3221229568,\"stride\":8,\"seed\":1}"), 400, "is not all memory"),
        // Sizes no host can give: refused by the default limits before anything is allocated
        // (2^56 bytes used to abort the process, 16 TiB to be taken and OOM-killed later).
        (raw("{\"size\": 72057594037927936, \"guest_check\": false}"), 400, "over the limit max_region_size"),
        (raw("{\"size\": 17592186044416, \"guest_check\": false}"), 400, "over the limit max_region_size"),
        // Bodies that are not the documented object, on every kind of route.
        (with("PATCH", "/vm", "[\"Paused\"]"), 400, "must be a JSON object"),
        (with("PUT", "/actions", "[\"Stop\"]"), 400, "must be a JSON object"),
        (raw("[4096, 3221225472, \"anonymous\", 4096, false, false, false]"), 400, "must be a JSON object"),
        (with("POST", "/dirty-log/harvest", "[1]"), 400, "must be a JSON object"),
        (with("PATCH", "/dirty-log", "[true, 1]"), 400, "must be a JSON object"),
        // Framing that RFC 9112 §6.3 calls invalid: never a guess at where the body ends.
        (format!("PUT /memory/regions HTTP/1.1\r\nContent-Length: 10\r\nContent-Length: {}\r\n\r\n{ADD}", ADD.len()).into_bytes(), 400, "conflicting Content-Length headers: 10 and 33"),
        (format!("PUT /memory/regions HTTP/1.1\r\nContent-Length: {}\r\nContent-Length: 10\r\n\r\n{ADD}", ADD.len()).into_bytes(), 400, "conflicting Content-Length headers: 33 and 10"),
        (format!("PUT /memory/regions HTTP/1.1\r\nContent-Length: +{}\r\n\r\n{ADD}", ADD.len()).into_bytes(), 400, "invalid Content-Length header: \"+33\""),
    ];
    for (request, status, message) in &cases {
        let response = vmm.raw(request);
        assert_eq!(
            response.0,
            *status,
            "{}: {response:?}",
            String::from_utf8_lossy(request)
        );
        assert!(
            fault(&response).contains(message),
            "{}: {response:?}",
            String::from_utf8_lossy(request)
        );
        assert_eq!(
            memory_of(&vmm),
            before,
            "{} changed the memory",
            String::from_utf8_lossy(request)
        );
    }
    // A truncated request: the client stops sending half-way and closes its side.
    let mut client = Client::connect(vmm.socket()).expect("connect");
    client
        .send(b"PUT /memory/regions HTTP/1.1\r\nContent-Length: 40\r\n\r\n{\"size\":")
        .expect("send");
    client.finish_sending().expect("half-close");
    let truncated = client.read_response().expect("an answer");
    assert_eq!(truncated.0, 400);
    assert!(
        fault(&truncated).contains("request truncated"),
        "{truncated:?}"
    );
    // Many clients at once, each with a bad and a good request on one connection.
    let clients: Vec<_> = (0..32)
        .map(|_| {
            let socket = vmm.socket().to_owned();
            std::thread::spawn(move || {
                let mut client = Client::connect(&socket).expect("connect");
                let bad = client
                    .raw(
                        b"PUT /memory/regions HTTP/1.1\r\nContent-Length: 12\r\n\r\n{\"size\": -1}",
                    )
                    .expect("an answer");
                (
                    bad.0,
                    client.raw(b"GET /vm HTTP/1.1\r\n\r\n").expect("an answer"),
                )
            })
        })
        .collect();
    for client in clients {
        let (bad, (status, vm)) = client.join().expect("client");
        assert_eq!(
            (bad, status, vm["state"].as_str()),
            (400, 200, Some("Running"))
        );
    }
    assert_eq!(memory_of(&vmm), before);
    // Pausing stops the guest taking commands; the data it wrote is still there after.
    assert_eq!(
        vmm.call("PATCH", "/vm", Some(json!({"state": "Paused"}))).0,
        204
    );
    let check = json!({"op": "verify", "start": GIB, "end": GIB + 65536, "stride": 8, "seed": 77});
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(check.clone())).0,
        409
    );
    assert_eq!(
        vmm.call("PATCH", "/vm", Some(json!({"state": "Resumed"})))
            .0,
        204
    );
    assert_eq!(
        vmm.call("PUT", "/guest/command", Some(check)).1["result"],
        json!("ok")
    );
    vmm.stop();
}

#[test]
fn kvm_the_socket_is_private_and_never_replaces_a_file() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_the_socket_is_private_and_never_replaces_a_file",
    ) {
        return;
    }
    let file = std::env::temp_dir().join(format!("tinyvmm-test-{}-file", std::process::id()));
    std::fs::write(&file, b"keep me").expect("write");
    let config = ServeConfig {
        area_size: 0,
        ..ServeConfig::new(file.clone())
    };
    let err = serve(&config, || {}).expect_err("refused");
    assert_eq!(
        err.to_string(),
        format!(
            "{} exists and is not a socket: refusing to replace it",
            file.display()
        )
    );
    assert_eq!(std::fs::read(&file).expect("still there"), b"keep me");
    std::fs::remove_file(&file).expect("clean up");
    // A stale socket (nobody listening) is replaced; a live one is refused.
    let path = std::env::temp_dir().join(format!("tinyvmm-test-{}-perm.sock", std::process::id()));
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    let vmm = start("perm", 2, 0);
    let mode = std::fs::metadata(vmm.socket())
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let again = ServeConfig {
        area_size: 0,
        ..ServeConfig::new(vmm.socket().to_owned())
    };
    let err = serve(&again, || {}).expect_err("in use");
    assert!(
        err.to_string().ends_with("is in use by another process"),
        "{err}"
    );
    vmm.stop();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn kvm_idle_connections_are_closed_so_they_cannot_lock_clients_out() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_idle_connections_are_closed_so_they_cannot_lock_clients_out",
    ) {
        return;
    }
    let vmm = start_with("idle", |config| ServeConfig {
        area_size: 0,
        idle_timeout: std::time::Duration::from_millis(300),
        ..config
    });
    // Every connection slot taken by a client that sends nothing...
    let idle: Vec<Client> = (1..tinyvmm::api::server::MAX_CONNECTIONS)
        .map(|_| Client::connect(vmm.socket()).expect("connect"))
        .collect();
    // ...and one that sent half a request: idle too once it stops sending.
    let mut slow = Client::connect(vmm.socket()).expect("connect");
    slow.send(b"GET /memory HTTP/1.1\r\n").expect("send");
    // Each is told why and closed, and a new client is served again.
    for mut client in idle.into_iter().chain([slow]) {
        let (status, body) = client.read_response().expect("a 408 before the close");
        assert_eq!(status, 408, "{body}");
        assert!(
            fault(&(status, body.clone())).contains("idle for 0.3 s"),
            "{body}"
        );
    }
    assert_eq!(vmm.call("GET", "/vm", None).0, 200);
    vmm.stop();
}

#[test]
fn kvm_requests_over_the_limits_are_refused_and_the_vmm_survives() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_requests_over_the_limits_are_refused_and_the_vmm_survives",
    ) {
        return;
    }
    let limits = kvm_memslots::MemoryLimits {
        max_guest_memory: GIB,
        max_region_size: GIB / 2,
        max_metadata: 64 << 20,
        max_slots: u64::MAX,
    };
    let vmm = start_with("limits", |config| ServeConfig {
        area_size: 0,
        limits: Some(limits),
        ..config
    });
    let memory = memory_of(&vmm);
    assert_eq!(
        memory["limits"],
        json!({"max_guest_memory": GIB, "max_region_size": GIB / 2, "max_metadata": 64 << 20})
    );
    assert_eq!(
        memory["used"]["guest_memory"],
        json!(2 << 20),
        "the system region"
    );
    let add = |size: u64| {
        vmm.call(
            "PUT",
            "/memory/regions",
            Some(json!({"size": size, "guest_check": false})),
        )
    };
    let before = memory_of(&vmm);
    for shift in [40, 44, 52, 56, 63] {
        let response = add(1 << shift);
        assert_eq!(response.0, 400, "2^{shift}: {response:?}");
        assert!(
            fault(&response).contains("over the limit max_region_size"),
            "{response:?}"
        );
    }
    for size in [u64::MAX, u64::MAX - 4095] {
        let response = add(size);
        assert_eq!(response.0, 400, "{size:#x}: {response:?}");
    }
    assert_eq!(memory_of(&vmm), before, "refusals change nothing");
    assert_eq!(add(GIB / 2).0, 201);
    let response = add(GIB / 2);
    assert_eq!(response.0, 409, "{response:?}");
    assert!(
        fault(&response).contains("over the limit max_guest_memory = 0x40000000"),
        "{response:?}"
    );
    // The hotplug area is admitted whole when it is configured.
    let area = json!({"total_size_mib": 1024, "block_size_mib": 2});
    let response = vmm.call("PUT", "/hotplug/memory", Some(area));
    assert_eq!(response.0, 409, "{response:?}");
    assert!(
        fault(&response).contains("the hotplug area was not configured"),
        "{response:?}"
    );
    assert_eq!(vmm.call("GET", "/hotplug/memory", None).0, 404);
    let used = memory_of(&vmm)["used"]["guest_memory"].clone();
    assert_eq!(used, json!((2 << 20) + GIB / 2));
    vmm.stop();
}

#[test]
fn kvm_a_snapshot_restores_in_a_new_vm_and_diffs_merge_onto_it() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_snapshot_restores_in_a_new_vm_and_diffs_merge_onto_it",
    ) {
        return;
    }
    use kvm_memslots_persist::merge_snapshots;
    use tinyvmm::jobs::restore::RestoreFrom;
    use tinyvmm::test_guest::snapshot::SnapshotState;
    use tinyvmm::test_guest::vcpus::MemBackend;

    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-snap", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let file = |name: &str| dir.join(name);
    let vmm = start("snap", 2, 4);
    let (status, body) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 1 << 20, "guest_address": GIB, "slot_size": 65536})),
    );
    assert_eq!(status, 201, "{body}");
    let command = |op: &str, start: u64, end: u64, seed: u64| json!({"op": op, "start": start, "end": end, "stride": 4096, "seed": seed});
    let run = |vmm: &Vmm, c: Value| vmm.call("PUT", "/guest/command", Some(c));
    assert_eq!(run(&vmm, command("write", GIB, GIB + (1 << 20), 5)).0, 200);
    // A hotplug area with 10 MiB plugged: two 8 MiB slots mapped, the second one in part.
    let area = json!({"total_size_mib": 64, "block_size_mib": 2, "slot_size_mib": 8});
    assert_eq!(vmm.call("PUT", "/hotplug/memory", Some(area)).0, 204);
    let plug = json!({"requested_size_mib": 10});
    assert_eq!(vmm.call("PATCH", "/hotplug/memory", Some(plug)).0, 204);
    let (_, hotplug) = vmm.call("GET", "/hotplug/memory", None);
    let plugged = hotplug["guest_address"].as_u64().expect("base");
    assert_eq!(
        run(&vmm, command("write", plugged, plugged + (10 << 20), 8)).0,
        200
    );
    let create = |kind: &str, state: &str, mem: &str| json!({"snapshot_type": kind, "snapshot_path": file(state), "mem_file_path": file(mem)});
    // Only a paused VM is snapshotted.
    let running = vmm.call("PUT", "/snapshot/create", Some(create("Full", "s0", "m0")));
    assert_eq!(running.0, 400, "{running:?}");
    assert!(fault(&running).contains("pause it first"), "{running:?}");
    assert!(!file("s0").exists() && !file("m0").exists());
    let diff_first = vmm.call("PUT", "/snapshot/create", Some(create("Diff", "s0", "m0")));
    assert_eq!(diff_first.0, 400, "{diff_first:?}");
    let pause = |vmm: &Vmm, state: &str| vmm.call("PATCH", "/vm", Some(json!({"state": state})));
    assert_eq!(pause(&vmm, "Paused").0, 204);
    assert_eq!(
        vmm.call(
            "PUT",
            "/snapshot/create",
            Some(create("Full", "full.state", "full.mem"))
        )
        .0,
        204
    );
    let again = vmm.call(
        "PUT",
        "/snapshot/create",
        Some(create("Full", "full.state", "x")),
    );
    assert_eq!(again.0, 400, "{again:?}");
    assert!(fault(&again).contains("must not exist"), "{again:?}");
    assert!(!file("x").exists(), "a refused snapshot leaves no file");
    // The guest goes on, memory is hotplugged and removed, then a Diff of what changed.
    assert_eq!(pause(&vmm, "Resumed").0, 204);
    assert_eq!(run(&vmm, command("write", GIB, GIB + (1 << 19), 6)).0, 200);
    let added = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 1 << 20, "guest_address": 2 * GIB, "slot_size": 1 << 18})),
    );
    assert_eq!(added.0, 201, "{added:?}");
    assert_eq!(added.1["guest_checked"], json!(true));
    assert_eq!(
        run(&vmm, command("write", 2 * GIB, 2 * GIB + (1 << 20), 9)).0,
        200
    );
    // The test area at 256 MiB (region 1) goes.
    assert_eq!(vmm.call("DELETE", "/memory/regions/1", None).0, 204);
    assert_eq!(pause(&vmm, "Paused").0, 204);
    assert_eq!(
        vmm.call(
            "PUT",
            "/snapshot/create",
            Some(create("Diff", "diff.state", "diff.mem"))
        )
        .0,
        204
    );
    vmm.stop();
    let diff_size = std::fs::metadata(file("diff.mem")).expect("diff").blocks();
    let full_size = std::fs::metadata(file("full.mem")).expect("full").blocks();
    assert!(
        diff_size < full_size,
        "the diff holds fewer pages: {diff_size} / {full_size}"
    );

    // Restore the Full snapshot: the guest continues where it was and finds its data.
    let restored = |name: &str, state: &str, mem: &str, backend| {
        start_with(name, |config| ServeConfig {
            restore: Some(RestoreFrom {
                snapshot: file(state),
                mem_file: file(mem),
                backend,
                working_set: Default::default(),
                page_size: None,
            }),
            ..config
        })
    };
    // Copied in up front...
    let full = restored("restored-full", "full.state", "full.mem", MemBackend::Copy);
    assert_eq!(full.call("GET", "/vm", None).1["state"], json!("Paused"));
    assert_eq!(
        run(&full, command("verify", GIB, GIB + 4096, 5)).0,
        409,
        "paused"
    );
    assert_eq!(pause(&full, "Resumed").0, 204);
    let verify = run(&full, command("verify", GIB, GIB + (1 << 20), 5));
    assert_eq!(verify.1["result"], json!("ok"), "{verify:?}");
    // The hotplug area comes back as it was, plugged memory and all, and still unplugs.
    assert_eq!(full.call("GET", "/hotplug/memory", None).1, hotplug);
    let plugged_data = run(&full, command("verify", plugged, plugged + (10 << 20), 8));
    assert_eq!(plugged_data.1["result"], json!("ok"), "{plugged_data:?}");
    let unplug = json!({"requested_size_mib": 0});
    assert_eq!(full.call("PATCH", "/hotplug/memory", Some(unplug)).0, 204);
    assert_eq!(
        full.call("GET", "/hotplug/memory", None).1["mapped_slots"],
        json!(0)
    );
    // And runs new commands.
    assert_eq!(run(&full, command("write", GIB, GIB + (1 << 20), 7)).0, 200);
    assert_eq!(
        run(&full, command("verify", GIB, GIB + (1 << 20), 7)).1["result"],
        json!("ok")
    );
    full.stop();

    // The Full and the Diff merged, across the hotplug and the removal, is the VM at the
    // Diff's point.
    let layout = |name: &str| {
        SnapshotState::from_bytes(&std::fs::read(file(name)).expect("state"))
            .expect("a valid state file")
            .layout
    };
    let (full_layout, diff_layout) = (layout("full.state"), layout("diff.state"));
    let full_mem = std::fs::File::open(file("full.mem")).expect("the full memory");
    let diff_mem = std::fs::File::open(file("diff.mem")).expect("the diff");
    let out = std::fs::File::create_new(file("merged.mem")).expect("a new file");
    merge_snapshots(
        &[(&full_layout, &full_mem), (&diff_layout, &diff_mem)],
        &out,
    )
    .expect("merged");
    // ...or mapped from the file, loaded on touch.
    let merged = restored(
        "restored-merged",
        "diff.state",
        "merged.mem",
        MemBackend::File,
    );
    let regions = memory_of(&merged)["regions"].clone();
    let at = |gpa: u64| {
        regions
            .as_array()
            .expect("regions")
            .iter()
            .any(|r| r["guest_address"] == json!(gpa))
    };
    assert!(at(2 * GIB) && !at(256 << 20), "{regions}");
    assert_eq!(pause(&merged, "Resumed").0, 204);
    assert_eq!(
        run(&merged, command("verify", 2 * GIB, 2 * GIB + (1 << 20), 9)).1["result"],
        json!("ok"),
        "the hotplugged region's data"
    );
    assert_eq!(
        run(&merged, command("verify", GIB, GIB + (1 << 19), 6)).1["result"],
        json!("ok")
    );
    assert_eq!(
        run(
            &merged,
            command("verify", GIB + (1 << 19), GIB + (1 << 20), 5)
        )
        .1["result"],
        json!("ok")
    );
    merged.stop();
    // ...or filled page by page on first touch by a userfaultfd handler.
    let lazy = restored(
        "restored-uffd",
        "diff.state",
        "merged.mem",
        MemBackend::Uffd,
    );
    assert_eq!(pause(&lazy, "Resumed").0, 204);
    assert_eq!(
        run(&lazy, command("verify", GIB, GIB + (1 << 19), 6)).1["result"],
        json!("ok")
    );
    assert_eq!(
        run(
            &lazy,
            command("verify", GIB + (1 << 19), GIB + (1 << 20), 5)
        )
        .1["result"],
        json!("ok")
    );
    lazy.stop();

    // A state file with a byte flipped is refused before anything runs.
    let mut bytes = std::fs::read(file("diff.state")).expect("state");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(file("bad.state"), bytes).expect("write");
    let mut config = ServeConfig::new(std::env::temp_dir().join(format!(
        "tinyvmm-test-{}-bad-restore.sock",
        std::process::id()
    )));
    config.restore = Some(RestoreFrom {
        snapshot: file("bad.state"),
        mem_file: file("full.mem"),
        backend: MemBackend::File,
        working_set: Default::default(),
        page_size: None,
    });
    let err = serve(&config, || {}).expect_err("refused");
    assert!(err.to_string().contains("checksum"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tmpfs of `kib` KiB mounted on a new folder, unmounted on drop; `None` where mounting is
/// not allowed.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(name: &str, kib: u64) -> Option<SmallFs> {
        let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        mounted.then_some(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn kvm_a_diff_that_fails_keeps_every_page_for_the_next() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_diff_that_fails_keeps_every_page_for_the_next",
    ) {
        return;
    }
    let Some(small) = SmallFs::mount("smallfs", 256) else {
        eprintln!("SKIPPED: kvm_a_diff_that_fails_keeps_every_page_for_the_next: cannot mount a tmpfs (not root?)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("tinyvmm-test-{}-keep", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder");
    let vmm = start("keep", 2, 4);
    let (status, _) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 1 << 20, "guest_address": GIB, "guest_check": false})),
    );
    assert_eq!(status, 201);
    let pause = |state: &str| vmm.call("PATCH", "/vm", Some(json!({"state": state}))).0;
    let snapshot = |kind: &str, state: PathBuf, mem: PathBuf| {
        vmm.call(
            "PUT",
            "/snapshot/create",
            Some(json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem})),
        )
    };
    assert_eq!(pause("Paused"), 204);
    assert_eq!(snapshot("Full", dir.join("s0"), dir.join("m0")).0, 204);
    assert_eq!(pause("Resumed"), 204);
    // The guest dirties all 256 pages of the region: 1 MiB, more than the small fs holds.
    let write =
        json!({"op": "write", "start": GIB, "end": GIB + (1 << 20), "stride": 4096, "seed": 3});
    assert_eq!(vmm.call("PUT", "/guest/command", Some(write)).0, 200);
    assert_eq!(pause("Paused"), 204);
    let failed = snapshot("Diff", small.0.join("s1"), small.0.join("m1"));
    assert_eq!(failed.0, 500, "{failed:?}");
    assert!(fault(&failed).contains("the snapshot failed"), "{failed:?}");
    assert!(
        !small.0.join("m1").exists(),
        "a failed snapshot leaves no file"
    );
    // The next Diff has every page the failed one had harvested.
    assert_eq!(snapshot("Diff", dir.join("s2"), dir.join("m2")).0, 204);
    let data = std::fs::metadata(dir.join("m2")).expect("diff").blocks() * 512;
    assert!(
        data >= 1 << 20,
        "the diff holds the region's 256 pages: {data} bytes"
    );
    vmm.stop();
    drop(small);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 24's chain: a client that reads the dirty rate, or switches its logging off, between a
/// Full and a Diff snapshot must not take the Diff's pages: the merged chain restores the
/// guest's last writes, not the Full's.
fn a_client_between_full_and_diff_hides_no_page(variant: &str) {
    use kvm_memslots_persist::merge_snapshots;
    use tinyvmm::jobs::restore::RestoreFrom;
    use tinyvmm::test_guest::snapshot::SnapshotState;
    use tinyvmm::test_guest::vcpus::MemBackend;

    let dir = std::env::temp_dir().join(format!(
        "tinyvmm-test-{}-chain-{variant}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let file = |name: &str| dir.join(name);
    let vmm = start(&format!("chain-{variant}"), 2, 4);
    let (status, body) = vmm.call(
        "PUT",
        "/memory/regions",
        Some(json!({"size": 1 << 20, "guest_address": GIB, "slot_size": 65536})),
    );
    assert_eq!(status, 201, "{body}");
    let region = body["id"].as_u64().expect("an id");
    let command = |op: &str, seed: u64| json!({"op": op, "start": GIB, "end": GIB + (1 << 20), "stride": 4096, "seed": seed});
    let run = |vmm: &Vmm, c: Value| vmm.call("PUT", "/guest/command", Some(c));
    let state = |vmm: &Vmm, s: &str| vmm.call("PATCH", "/vm", Some(json!({"state": s}))).0;
    let create = |kind: &str, name: &str| json!({"snapshot_type": kind, "snapshot_path": file(&format!("{name}.state")), "mem_file_path": file(&format!("{name}.mem"))});
    assert_eq!(run(&vmm, command("write", 1)).0, 200);
    assert_eq!(state(&vmm, "Paused"), 204);
    assert_eq!(
        vmm.call("PUT", "/snapshot/create", Some(create("Full", "k1")))
            .0,
        204
    );
    assert_eq!(state(&vmm, "Resumed"), 204);
    assert_eq!(run(&vmm, command("write", 2)).0, 200);
    match variant {
        "harvest" => {
            let (status, body) = vmm.call(
                "POST",
                "/dirty-log/harvest",
                Some(json!({"region": region})),
            );
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["regions"][0]["dirty_pages"], json!(256), "{body}");
        }
        _ => {
            let off = vmm.call("PATCH", "/dirty-log", Some(json!({"enabled": false})));
            assert_eq!(off.0, 204, "{off:?}");
            // The chain keeps the region logging, and the API says so.
            let (_, log) = vmm.call("GET", "/dirty-log", None);
            assert!(log["logging_regions"]
                .as_array()
                .expect("regions")
                .contains(&json!(region)));
            assert!(
                log["logging_for"]["snapshot_chain"]
                    .as_array()
                    .expect("the chain's regions")
                    .contains(&json!(region)),
                "{log}"
            );
            assert!(log["logging_for"].get("client").is_none(), "{log}");
        }
    }
    assert_eq!(state(&vmm, "Paused"), 204);
    assert_eq!(
        vmm.call("PUT", "/snapshot/create", Some(create("Diff", "k2")))
            .0,
        204
    );
    vmm.stop();

    let layout = |name: &str| {
        SnapshotState::from_bytes(&std::fs::read(file(name)).expect("state"))
            .expect("a valid state file")
            .layout
    };
    let (k1, k2) = (layout("k1.state"), layout("k2.state"));
    let k1_mem = std::fs::File::open(file("k1.mem")).expect("k1");
    let k2_mem = std::fs::File::open(file("k2.mem")).expect("k2");
    let merged = std::fs::File::create_new(file("km.mem")).expect("a new file");
    merge_snapshots(&[(&k1, &k1_mem), (&k2, &k2_mem)], &merged).expect("merged");
    let restored = start_with(&format!("chain-{variant}-restored"), |config| ServeConfig {
        restore: Some(RestoreFrom {
            snapshot: file("k2.state"),
            mem_file: file("km.mem"),
            backend: MemBackend::Copy,
            working_set: Default::default(),
            page_size: None,
        }),
        ..config
    });
    assert_eq!(state(&restored, "Resumed"), 204);
    let verify = run(&restored, command("verify", 2));
    assert_eq!(verify.1["result"], json!("ok"), "{variant}: {verify:?}");
    restored.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kvm_a_client_harvest_between_full_and_diff_hides_no_page() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_client_harvest_between_full_and_diff_hides_no_page",
    ) {
        return;
    }
    a_client_between_full_and_diff_hides_no_page("harvest");
}

#[test]
fn kvm_a_client_logging_stop_between_full_and_diff_hides_no_page() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_client_logging_stop_between_full_and_diff_hides_no_page",
    ) {
        return;
    }
    a_client_between_full_and_diff_hides_no_page("logging-off");
}

#[test]
fn kvm_a_slot_budget_refuses_changes_past_it_and_get_memory_shows_it() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_a_slot_budget_refuses_changes_past_it_and_get_memory_shows_it",
    ) {
        return;
    }
    let limits = kvm_memslots::MemoryLimits {
        max_slots: 6,
        ..kvm_memslots::MemoryLimits::for_this_host()
    };
    let vmm = start_with("slot-budget", |config| ServeConfig {
        area_size: 0,
        limits: Some(limits),
        ..config
    });
    let memory = memory_of(&vmm);
    assert_eq!(memory["slots"]["budget"], json!(6));
    let used = memory["slots"]["used"].as_u64().expect("used");
    let add = |slots: u64| {
        vmm.call(
            "PUT",
            "/memory/regions",
            Some(json!({"size": slots << 20, "slot_size": 1 << 20, "guest_check": false})),
        )
    };
    let room = 6 - used;
    let response = add(room + 1);
    assert_eq!(response.0, 409, "{response:?}");
    assert!(
        fault(&response).contains("over the limit max_slots = 6"),
        "{response:?}"
    );
    assert_eq!(memory_of(&vmm), memory, "a refusal changes nothing");
    // A hotplug area is held to the budget too, when it is configured (not half-way through a
    // later plug): 2 pieces cannot fit in 1 slot left, 1 can.
    let area = |mib: u64| {
        vmm.call(
            "PUT",
            "/hotplug/memory",
            Some(json!({"total_size_mib": mib, "block_size_mib": 2, "slot_size_mib": 8})),
        )
    };
    assert_eq!(add(room - 1).0, 201);
    let refused = area(16);
    assert_eq!(refused.0, 409, "{refused:?}");
    assert!(
        fault(&refused)
            .contains("needs 2 KVM slots; 1 are free (in KVM and within the slot budget"),
        "{refused:?}"
    );
    assert_eq!(vmm.call("GET", "/hotplug/memory", None).0, 404);
    assert_eq!(area(8).0, 204);
    let plugged = vmm.call(
        "PATCH",
        "/hotplug/memory",
        Some(json!({"requested_size_mib": 8})),
    );
    assert_eq!(plugged.0, 204, "{plugged:?}");
    assert_eq!(memory_of(&vmm)["slots"]["used"], json!(6));
    vmm.stop();
}
